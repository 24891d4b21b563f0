"""The PyTorch side of the peer benchmarks: the ports' block, their checkpoint, Accelerate.

``peers.py`` and ``decode.py`` run this library's toy transformer and GPT against a
PyTorch port of the same model with the same weights, loaded whole and through
Hugging Face Accelerate's documented disk offload. Neither torch nor accelerate is a
dependency of this library: `versions` says which of them can be imported, and only
the functions that run them import them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from typing import Any

from _measure import Peaks, drop_page_cache, io_bytes, timed_load

LN_EPS = 1e-6  # flax's LayerNorm default (torch's is 1e-5)


def versions(names: Iterable[str]) -> tuple[dict[str, str], list[str]]:
  """The installed versions of the packages ``names`` that can be imported, and the
  names of those that cannot (looked up, not imported)."""
  import importlib.metadata
  import importlib.util

  found, missing = {}, []
  for name in names:
    if importlib.util.find_spec(name) is None:
      missing.append(name)
    else:
      found[name] = importlib.metadata.version(name)
  return found, missing


def peer_versions(accelerate_version: str = "1.16.0") -> tuple[dict | None, str]:
  """torch's, accelerate's and safetensors' installed versions; or ``None`` and why the
  peer rows cannot run (one of them is not installed: none is a jax_residency dependency).

  Only the children that run the peers import them; this process looks them up.
  """
  found, missing = versions(("torch", "accelerate", "safetensors"))
  if missing:
    return None, (
      f"{missing[0]} cannot be imported (not a jax_residency dependency; to run them: "
      f"pip install torch==2.13.0 (the CPU-only build), then pip install "
      f"accelerate=={accelerate_version} safetensors)"
    )
  return found, ""


def block(cfg, *, proj: str):
  """The block of the toy transformer and of the GPT in PyTorch (pre-norm attention, then
  a tanh-GELU MLP), its modules named as the NNX model's (``proj``: the attention's
  output projection).

  ``block(x, k_cache, v_cache, pos)`` runs ``x`` ``(batch, t, d)`` at positions ``pos ..
  pos+t-1`` after the keys and values of the cache (``(batch, heads, pos, head_dim)``),
  causally; without a cache, from position 0. It returns ``x`` and the keys and values
  with the new positions appended.
  """
  import torch
  import torch.nn.functional as F
  from torch import nn

  class Block(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      d = cfg.d_model
      self.heads = cfg.n_heads
      self.norm1 = nn.LayerNorm(d, eps=LN_EPS)
      self.qkv = nn.Linear(d, 3 * d)
      self.add_module(proj, nn.Linear(d, d))
      self.norm2 = nn.LayerNorm(d, eps=LN_EPS)
      self.up = nn.Linear(d, cfg.d_ff)
      self.down = nn.Linear(cfg.d_ff, d)

    def forward(self, x, k_cache=None, v_cache=None, pos: int = 0):
      b, t, d = x.shape
      q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
      q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
      if k_cache is None:
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      else:
        k, v = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
        # Query at position pos+i sees keys at positions <= pos+i (all of them when t == 1).
        mask = None
        if t > 1:
          mask = torch.arange(pos + t)[None, :] <= (pos + torch.arange(t))[:, None]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
      x = x + getattr(self, proj)(att.transpose(1, 2).reshape(b, t, d))
      x = x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))
      return x, k, v

  return Block


def state_dict(params: dict, n_layers: int) -> dict:
  """NNX parameters (a nested dict of arrays, the layers stacked under ``"layers"``) ->
  the torch port's state dict, as float32 numpy: an ``nnx.Linear`` (``kernel``, ``bias``)
  becomes ``weight`` (transposed: torch keeps ``(out, in)``) and ``bias``, a LayerNorm
  (``scale``, ``bias``) ``weight`` and ``bias``, an embedding its table as ``weight``."""
  import numpy as np

  def module(p: dict, prefix: str, i: int | None = None) -> dict:
    at = (lambda a: a) if i is None else (lambda a: a[i])
    if "embedding" in p:
      return {f"{prefix}.weight": np.asarray(at(p["embedding"]))}
    weight = np.asarray(at(p["kernel"])).T if "kernel" in p else np.asarray(at(p["scale"]))
    return {f"{prefix}.weight": weight, f"{prefix}.bias": np.asarray(at(p["bias"]))}

  out: dict = {}
  for name, p in params.items():
    if name == "layers":
      for i in range(n_layers):
        for sub, q in p.items():
          out |= module(q, f"layers.{i}.{sub}", i)
    else:
      out |= module(p, name)
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def save_checkpoint(state: dict, path: str) -> None:
  """``state`` (:func:`state_dict`) as the safetensors checkpoint ``path``, whole or not
  at all (written beside it, then renamed)."""
  from safetensors.numpy import save_file

  os.makedirs(os.path.dirname(path), exist_ok=True)
  save_file(state, path + ".tmp", metadata={"format": "pt"})
  os.replace(path + ".tmp", path)


def accelerate_load(load: Callable[[], Any], peaks: Peaks) -> tuple[Any, dict]:
  """``load()``'s model, in eval mode, and the load's figures (`_measure.timed_load`'s,
  and the bytes it wrote: Accelerate's offload folder)."""
  written = io_bytes()[1]
  model, out = timed_load(load, peaks)
  out["load_written_bytes"] = io_bytes()[1] - written
  model.eval()
  return model, out


def disk_offload(
  make_model: Callable[[], Any], checkpoint: str, device_map: dict, offload: str, peaks: Peaks
) -> tuple[Any, dict]:
  """Accelerate's documented disk offload: the model built on the ``meta`` device
  (``init_empty_weights``), then ``load_checkpoint_and_dispatch`` into a new
  ``offload`` folder with ``device_map``, the checkpoint's pages dropped first
  (:func:`accelerate_load`'s model and figures)."""
  import logging

  from accelerate import init_empty_weights, load_checkpoint_and_dispatch

  logging.getLogger("accelerate").setLevel(logging.ERROR)
  shutil.rmtree(offload, ignore_errors=True)
  with init_empty_weights():
    model = make_model()
  drop_page_cache(checkpoint)
  return accelerate_load(
    lambda: load_checkpoint_and_dispatch(
      model, checkpoint, device_map=device_map, offload_folder=offload
    ),
    peaks,
  )
