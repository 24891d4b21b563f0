"""Where a :class:`~jax_residency._src.models.t5.T5`'s weights come from: a Hugging Face
``T5ForConditionalGeneration`` safetensors checkpoint, or seeded random draws.

Hugging Face names layer ``N``'s tensors ``encoder.block.<N>.layer.<i>.<name>``
(``decoder.block...``); the model here keeps each stack in one module, so layer
``N``'s tensor becomes row ``N`` of the stacked parameter. ``torch.nn.Linear``
stores ``weight`` as ``(out, in)`` and ``nnx.Linear``'s ``kernel`` is
``(in, out)``, so Linear weights are transposed. The relative-position tables,
held by layer 0 of each stack, are static parameters of the model. Copies of
``shared.weight`` (``encoder.embed_tokens``, ``decoder.embed_tokens``, a tied
``lm_head``) and the unused bias table of the decoder's first cross-attention
are not read.

``safetensors`` is an optional dependency (``pip install 'jax-residency[models]'``).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_residency._src.models.hf import (
  expected_shapes,
  raise_checkpoint_problems,
  read_config,
  read_safetensors,
)
from jax_residency._src.models.init import seeded_weights
from jax_residency._src.models.t5 import T5
from jax_residency._src.models.t5_config import T5Config
from jax_residency._src.plan.split import normalise_path
from jax_residency._src.typing import ParamPath, path_str

#: Our static parameter path → Hugging Face tensor name (``lm_head`` only when untied).
STATIC_NAMES: dict[ParamPath, str] = {
  ("shared", "embedding"): "shared.weight",
  ("encoder_relative_bias", "embedding"): (
    "encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
  ),
  ("encoder_norm", "scale"): "encoder.final_layer_norm.weight",
  ("decoder_relative_bias", "embedding"): (
    "decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
  ),
  ("decoder_norm", "scale"): "decoder.final_layer_norm.weight",
  ("lm_head", "kernel"): "lm_head.weight",
}

_ATTENTION = ("q", "k", "v", "o")
_MLP = ("wi", "wi_0", "wi_1", "wo")


def _layer_names(parts: Mapping[str, str], mlp: str) -> dict[ParamPath, tuple[str, bool]]:
  names: dict[ParamPath, tuple[str, bool]] = {}
  for ours, hf in parts.items():
    if ours.endswith("attention"):
      for p in _ATTENTION:
        names[(ours, p, "kernel")] = (f"{hf}.{p}.weight", True)
  for p in _MLP:
    names[("mlp", p, "kernel")] = (f"{mlp}.DenseReluDense.{p}.weight", True)
  for ours, hf in parts.items():
    names[(f"{ours}_norm", "scale")] = (f"{hf.rsplit('.', 1)[0]}.layer_norm.weight", False)
  names[("mlp_norm", "scale")] = (f"{mlp}.layer_norm.weight", False)
  return names


#: Path inside one layer → (Hugging Face name inside ``<stack>.block.<N>``, transpose?).
#: Feed-forward names of both variants are listed; the config picks which exist.
ENCODER_LAYER_NAMES = _layer_names({"attention": "layer.0.SelfAttention"}, "layer.1")
DECODER_LAYER_NAMES = _layer_names(
  {"self_attention": "layer.0.SelfAttention", "cross_attention": "layer.1.EncDecAttention"},
  "layer.2",
)

#: Tensors of a checkpoint the model does not read.
IGNORED = re.compile(
  r"^((encoder|decoder)\.embed_tokens\.weight"
  r"|decoder\.block\.0\.layer\.1\.EncDecAttention\.relative_attention_bias\.weight)$"
)
_LAYER_KEY = re.compile(r"^(encoder|decoder)\.block\.(\d+)\.(.+)$")
_BIAS_TABLE = re.compile(r"^layer\.0\.SelfAttention\.relative_attention_bias\.weight$")


def read_t5_config(path: str | Path, *, dtype: str = "float32") -> T5Config:
  """The :class:`T5Config` of the ``config.json`` in (or beside) ``path``."""
  return T5Config.from_hf(read_config(path, "T5Config"), dtype=dtype)


def _abstract(cfg: T5Config) -> T5:
  return nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(0)))


def _expected_shapes(cfg: T5Config) -> dict[ParamPath, tuple[int, ...]]:
  return expected_shapes(_abstract(cfg))


def t5_params_from_hf(
  tensors: Mapping[str, np.ndarray], cfg: T5Config, *, strict: bool = True
) -> dict[ParamPath, np.ndarray]:
  """Maps ``T5ForConditionalGeneration`` tensors to the model's parameter paths.

  Layer tensors are stacked on axis 0 (``encoder_layers.<path>`` holds every
  encoder layer's copy); Linear weights are transposed to ``(in, out)``.

  Args:
    tensors: name → array, as read from the checkpoint.
    cfg: the model's sizes; every tensor's shape is checked against them.
    strict: reject tensors that map to nothing (other than the copies and the
      unused table listed in the module docstring).

  Returns:
    Parameter path (as in ``nnx.state(model)``) → array in ``cfg.dtype``.

  Raises:
    MissingCheckpointParametersError: tensors the model needs are absent.
    UnexpectedCheckpointParametersError: with ``strict``, unknown tensors.
    CheckpointShapeMismatchError: a tensor has the wrong shape.
  """
  expected = _expected_shapes(cfg)
  stacks = {
    "encoder": ("encoder_layers", cfg.num_layers, ENCODER_LAYER_NAMES),
    "decoder": ("decoder_layers", cfg.num_decoder_layers, DECODER_LAYER_NAMES),
  }
  static = {p: n for p, n in STATIC_NAMES.items() if p in expected}
  layers: dict[tuple[str, int], dict[str, np.ndarray]] = {}
  unexpected = []
  for name, value in tensors.items():
    m = _LAYER_KEY.match(name)
    if m and int(m[2]) < stacks[m[1]][1] and not _BIAS_TABLE.match(m[3]):
      layers.setdefault((m[1], int(m[2])), {})[m[3]] = value
    elif name not in static.values() and not IGNORED.match(name):
      if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
        unexpected.append(name)
  dtype = np.dtype(cfg.dtype)
  out: dict[ParamPath, np.ndarray] = {}
  missing: list[str] = []
  bad: list[str] = []

  def take(path: ParamPath, label: str, value: np.ndarray, want: tuple[int, ...]) -> bool:
    if value.shape != want:
      bad.append(f"{label} {value.shape} → {path_str(path)}: expected {want}")
    return value.shape == want

  for path, name in static.items():
    transpose = path == ("lm_head", "kernel")
    if name not in tensors:
      missing.append(name)
    elif take(path, name, tensors[name].T if transpose else tensors[name], expected[path]):
      out[path] = np.asarray(tensors[name].T if transpose else tensors[name], dtype)
  for stack, (prefix, count, names) in stacks.items():
    known = {name for name, _ in names.values()}
    for (which, n), found_names in layers.items():
      if which == stack:
        unexpected += [f"{stack}.block.{n}.{x}" for x in found_names if x not in known]
    for sub, (name, transpose) in names.items():
      path = (prefix, *sub)
      if path not in expected:  # the other feed-forward variant
        for n in range(count):
          if name in layers.get((stack, n), {}):
            unexpected.append(f"{stack}.block.{n}.{name}")
        continue
      rows = []
      for n in range(count):
        found = layers.get((stack, n), {}).get(name)
        label = f"{stack}.block.{n}.{name}"
        if found is None:
          missing.append(label)
        elif take(path, label, found.T if transpose else found, expected[path][1:]):
          rows.append(found.T if transpose else found)
      if len(rows) == count:
        out[path] = np.stack(rows).astype(dtype)
  raise_checkpoint_problems(
    unexpected=unexpected if strict else [],
    missing=missing,
    bad=bad,
    unused_note=(
      f"a T5 of this config does not use ({cfg.num_layers} encoder / "
      f"{cfg.num_decoder_layers} decoder layers, feed_forward_proj={cfg.feed_forward_proj!r})"
    ),
    missing_note=(
      "a T5 of this config needs; is it a T5ForConditionalGeneration checkpoint of this config?"
    ),
    config=cfg,
  )
  return out


def _has_own_head(tensors: Mapping[str, np.ndarray]) -> bool:
  head, shared = tensors.get("lm_head.weight"), tensors.get("shared.weight")
  return head is not None and (
    shared is None or head.shape != shared.shape or not np.array_equal(head, shared)
  )


def load_t5(
  path: str | Path,
  *,
  config: T5Config | None = None,
  strict: bool = True,
  dtype: str = "float32",
) -> T5:
  """Builds a :class:`T5` holding a Hugging Face ``T5ForConditionalGeneration`` checkpoint.

  A config that ties the head while the checkpoint holds an ``lm_head.weight``
  with other values than ``shared.weight`` gets an untied head, as transformers
  does (transformers 5 writes ``tie_word_embeddings: true`` for every T5, and
  ``scale_decoder_outputs`` says whether to scale).

  Args:
    path: a ``.safetensors`` file, or a directory with ``model.safetensors`` or
      a sharded ``model.safetensors.index.json``.
    config: the model's sizes; default: the ``config.json`` in (or beside) ``path``.
    strict: reject tensors the model does not use (see :func:`t5_params_from_hf`).
    dtype: parameter and compute dtype, with the default config.

  Returns:
    The model; nothing is compiled to build it.

  Example:
    >>> from jax_residency.models import load_t5
    >>> model = load_t5("tests/fixtures/t5_tiny_gated")  # doctest: +SKIP
  """
  cfg = read_t5_config(path, dtype=dtype) if config is None else config
  tensors = read_safetensors(path)
  if cfg.tie_word_embeddings and _has_own_head(tensors):
    cfg = dataclasses.replace(
      cfg, tie_word_embeddings=False, scale_decoder_outputs=cfg.scales_output
    )
  params = t5_params_from_hf(tensors, cfg, strict=strict)
  graphdef, state = nnx.split(_abstract(cfg))
  filled = jax.tree_util.tree_map_with_path(
    lambda p, _: jnp.asarray(params[normalise_path(p)]), state
  )
  return nnx.merge(graphdef, filled)


def init_t5(cfg: T5Config, seed: int = 0) -> T5:
  """A :class:`T5` with seeded random weights, drawn host-side so nothing compiles.

  Linear kernels ``normal(0, 1/sqrt(fan_in))``, embeddings and bias tables
  ``normal(0, 1)``, unit norm scales.

  Example:
    >>> cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
    ...                num_decoder_layers=3, num_heads=2, relative_attention_num_buckets=8)
    >>> init_t5(cfg).decoder_layers.mlp.wo.kernel.shape
    (3, 32, 16)
  """
  return seeded_weights(_abstract(cfg), seed)
