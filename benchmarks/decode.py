"""Greedy decoding from disk: DenseDiskStream against Hugging Face Accelerate's disk offload.

The workload is the GPT decoder of ``jax_residency.models`` (by default d_model
2048, 12 layers, 16 heads, d_ff 8192, vocab 32000, float32: units of ~201 MB,
2.42 GB of units; ``--tie-head`` ties the output head to the token embedding as
GPT-2 does). One generation is a 128-token prompt (the prefill), then 16 greedy
one-token decode steps over a KV cache. The weights are written once under
``--dir`` (a jax_residency store with ``jr.save``, a ``model.safetensors`` for a
PyTorch port of the same decoder) and reused by later runs. ``--quantize
int8,int4`` (repeatable, or a comma list) also writes one store per scheme next
to the float one (``jr-store-int8/``: ``jr.save(model, path, quantize=...)``,
int4 in groups of 64) and adds its rows; where ``jr.save`` takes no
``quantize=`` those rows are skipped with a message.

Each row below runs in a fresh process (``--child``, one JSON object on
stdout). It places or loads the model, runs one warm-up generation of a
different prompt (prefill + one decode step: XLA compiles here, torch warms
up), then times one generation in each of two regimes, clearing the policy's
caches (``placed.clear_caches()``) before each:

* ``page-cache``: the weights' files (the store; Accelerate's offload folder
  and checkpoint) are read into the page cache first, and nothing is dropped.
* ``disk``: every file of the weights (the store directory walked; Accelerate's
  ``offload_folder`` files and its checkpoint) is dropped from the page cache
  (``posix_fadvise(POSIX_FADV_DONTNEED)``) before the prefill and before every
  decode step. The drops are outside the timed region: each step is timed on
  its own and only the step times are summed. The kernel drops no page a
  process has mapped, so the pages this process holds mapped right after each
  drop (from ``/proc/self/smaps``) are measured and reported as "held mapped":
  on CPU a dense stream maps its units, and the last two units of a pass (its
  device window) and a host cache of mapped units stay in memory.

The rows:

* ``jr host 0``, ``jr host 2 units``, ``jr host all``: ``DenseDiskStream`` with
  a host cache of 0 bytes (disk straight to device), 2 units, or every unit,
  and a device budget of the static parameters + 2 units.
* ``jr resident``: ``FullyResident`` from the same store (the resident decode step).
* ``jr int8 host 0``, ``jr int8 host 2 units``, ``jr int8 host all`` (and the
  same for int4): the rows above with the scheme's store; host budgets in its
  units, the float rows' device budget.
* ``accelerate``: the PyTorch port built with ``init_empty_weights`` and
  loaded with ``load_checkpoint_and_dispatch``, every block on ``"disk"``
  (embeddings, final norm and head on ``"cpu"``), an ``offload_folder`` and the
  CPU as execution device: Accelerate's documented disk-offload recipe. Its
  greedy loop carries a KV cache and does the same work as the JAX one
  (prefill, then one-token steps), without ``generate``.
* ``torch``: the port loaded whole, for the parity gate (and a resident torch
  decode, for context).
* ``bandwidth``: the store's files read with 1, 2, 4 and 8 threads while they
  are in the page cache; the best is the warm-read bandwidth.

Figures per row and regime: the prefill's time, the decode step (the median
over the steps), decode tokens/s (16 / the steps' total), bytes read per step
from the weights (``placed.report()``'s decode bytes; for Accelerate its
offloaded blocks) and from storage (``/proc/self/io`` ``read_bytes`` around
each step, the median), and in the disk regime the pages held mapped. Per row:
the load time, the first prefill (the warm-up's, with compilation), peak RSS
growth over the baseline taken before loading (load, warm-up and both
generations), and from the RSS right after the load: the peak RSS growth over
the timed generations (``VmHWM``) against the plan (``placed.metadata``'s
memory items: ``planned_process_bytes``), and the peak anonymous-memory growth
(``RssAnon``, sampled every 5 ms by a thread).

The drops are checked: a disk-regime step's ``read_bytes`` must be at least
0.75x the bytes it read from its weights less those held mapped, and at most
1.33x all of them; a page-cache step's at most 5% of them (rows that read
nothing per step, such as ``host all`` and ``resident``, are not checked). A
failed check counts as a missed target.

Parity: before timing anything the torch port is run whole, fed the plain JAX
model's greedy tokens, and its logits at every step must match the JAX model's
within 1e-3 of the logit scale (``benchmarks/peers.py``'s gate), or the script
refuses to report timings. Afterwards every float32 row's greedy tokens (both
regimes) are compared with the plain model's (and Accelerate's with the torch
port's), and its logits with the same tolerance over the steps whose inputs
agree. Quantized rows are compared with the float32 plain model and reported,
not gated: the fraction of tokens that agree, and the logits' max and mean
error relative to the logit scale over the steps whose inputs agree.

Targets (docs/benchmarks.md), evaluated on the medians over ``--repeat`` runs:

* each float32 ``DenseDiskStream`` row: page-cache decode tokens/s >= 3x
  Accelerate's (page cache), with peak RSS growth <= Accelerate's;
* page-cache decode step (host 0 / 2 units) within 1.25x of the larger of the
  resident decode step and the unit bytes divided by the warm-read bandwidth;
* ``FullyResident``'s page-cache decode step <= the dense stream's with every
  unit cached (``jr host all``);
* at host 0, the quantized decode step against the float32 one: int8 <= 0.6x
  (page cache) and <= 0.35x (disk); int4 <= 0.45x and <= 0.25x;
* each int8 row: disk decode tokens/s >= 10x Accelerate's (disk), with
  anonymous-memory growth after the load <= Accelerate's and peak RSS growth
  after the load <= the plan.

The script prints each target as met or MISSED and exits 1 if any was missed
(or a drop check failed, or a quantized row failed to run).

Run it (torch and accelerate are not jax_residency dependencies; on this
project's machines ``torch==2.13.0`` resolves to a CPU-only wheel)::

    pip install torch==2.13.0
    pip install accelerate==1.16.0 safetensors
    python benchmarks/decode.py                  # table; about 8 GB under --dir
    python benchmarks/decode.py --quantize int8,int4  # also the quantized rows
    python benchmarks/decode.py --tie-head       # GPT-2 style tied head
    python benchmarks/decode.py --json           # one JSON object
    python benchmarks/decode.py --d-model 256 --d-ff 1024 --layers 4 --vocab 1000  # quick

The first run writes the store, the checkpoint and the reference generation;
at the default size that run, build included, took 13 minutes on a busy 2-core
VM (before the disk regime, which reads the units from disk at every step).
``--repeat N`` runs every row N times; figures are medians and the targets
are checked on them (``--json`` prints every run; each run also leaves its
result in ``result.json`` next to the store).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _measure import (  # benchmarks/ is on sys.path when a script here runs
  AnonPeak,
  drop_page_cache,
  files_under,
  mapped_bytes,
  rss_anon_bytes,
  rss_bytes,
)
from dense_stream import _parallel_read
from peers import (
  LN_EPS,
  PARITY_RTOL,
  Peaks,
  check_peers_installed,
  fmt_bytes,
  io_bytes,
  parity_of,
  refuse,
)

ACCELERATE_VERSION = "1.16.0"
DECODE_OVER_ACCELERATE = 3.0  # target: page-cache decode tokens/s >= 3x Accelerate's
PAGE_CACHE_SLACK = 1.25  # target: page-cache decode step <= 1.25x max(resident, bytes / bw)
INT8_DISK_OVER_ACCELERATE = 10.0  # target: int8 disk-regime decode tokens/s >= 10x Accelerate's
#: Targets at host 0: a quantized decode step against the float32 one, per regime.
QUANT_STEP_RATIO = {
  "int8": {"page-cache": 0.6, "disk": 0.35},
  "int4": {"page-cache": 0.45, "disk": 0.25},
}
READ_THREADS = (1, 2, 4, 8)
SCHEMES = ("int8", "int4")  # quantized stores: jr.save(..., quantize=scheme)
TIERS = ("host0", "host2", "all")  # DenseDiskStream host budgets: 0, 2 units, every unit
TIER_LABELS = {
  "host0": "host 0",
  "host2": "host 2 units",
  "all": "host all",
  "resident": "FullyResident",
}
JR_ROWS = tuple(f"jr-{tier}" for tier in TIERS)  # the float32 DenseDiskStream rows
PC_FLOOR_ROWS = ("jr-host0", "jr-host2")  # page-cache step held to the floor
#: "page-cache": the store read into the page cache first, no drops; "disk": its
#: pages dropped before the prefill and before every decode step (outside the timing).
REGIMES = ("page-cache", "disk")
#: A disk-regime step counts as read from disk when /proc/self/io's read_bytes
#: per step is at least DISK_READ_RANGE[0] of the bytes it read from the store
#: less those held mapped across the drop, and at most DISK_READ_RANGE[1] of
#: them all; a page-cache step when it reads below PC_READ_SLACK of them.
DISK_READ_RANGE = (0.75, 1.33)
PC_READ_SLACK = 0.05


def quant_rows(scheme: str) -> tuple[str, ...]:
  return tuple(f"jr-{scheme}-{tier}" for tier in TIERS)


def row_of(name: str) -> tuple[str, str]:
  """``(scheme, tier)`` of a jax_residency row: ``"jr-int8-host0"`` -> ``("int8", "host0")``."""
  parts = name.split("-")[1:]
  return (parts[0], parts[1]) if len(parts) == 2 else ("float32", parts[0])


def label(name: str) -> str:
  if name == "accelerate":
    return "accelerate disk offload"
  scheme, tier = row_of(name)
  return "jr " + ("" if scheme == "float32" else f"{scheme} ") + TIER_LABELS[tier]


# ---------------------------------------------------------------------------- model and paths


def gpt_config(args: argparse.Namespace):
  """The benchmark's :class:`GPTConfig`; it holds the prompt and every decode step."""
  from jax_residency import models

  return models.GPTConfig(
    vocab_size=args.vocab,
    d_model=args.d_model,
    n_heads=args.heads,
    d_ff=args.d_ff,
    n_layers=args.layers,
    max_len=args.prompt_len + args.steps,
    tie_head=args.tie_head,
  )


def sizes(args: argparse.Namespace) -> dict[str, int]:
  """Bytes of one unit and of the static parameters, from the abstract model."""
  import jax
  from flax import nnx

  from jax_residency import models

  cfg = gpt_config(args)
  params = nnx.state(nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0))), nnx.Param)

  def nbytes(tree) -> int:
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(tree))

  units = nbytes(params["layers"])
  return {"unit_bytes": units // cfg.n_layers, "static_bytes": nbytes(params) - units}


def paths(args: argparse.Namespace) -> dict[str, str]:
  name = f"gpt-{args.layers}x{args.d_model}x{args.d_ff}-h{args.heads}-v{args.vocab}"
  name += f"-len{args.prompt_len + args.steps}" + ("-tied" if args.tie_head else "")
  base = os.path.join(args.dir, name)
  return {
    "base": base,
    "store": os.path.join(base, "jr-store"),
    **{f"store-{q}": os.path.join(base, f"jr-store-{q}") for q in SCHEMES},
    **{f"store-{q}-info": os.path.join(base, f"jr-store-{q}.json") for q in SCHEMES},
    "checkpoint": os.path.join(base, "torch", "model.safetensors"),
    "offload": os.path.join(base, "accelerate-offload"),
    "reference": os.path.join(base, "reference.npz"),
  }


def store_of(args: argparse.Namespace, scheme: str) -> str:
  return paths(args)["store" if scheme == "float32" else f"store-{scheme}"]


def store_sizes(args: argparse.Namespace, scheme: str) -> dict[str, int]:
  """Bytes of one unit and of the static parameters as ``scheme``'s store holds them."""
  if scheme == "float32":
    return sizes(args)
  with open(paths(args)[f"store-{scheme}-info"]) as f:
    return json.load(f)


def reference(args: argparse.Namespace) -> dict:
  """The prompts and the plain JAX model's greedy tokens and per-step logits."""
  import numpy as np

  with np.load(paths(args)["reference"]) as ref:
    return {k: ref[k] for k in ref.files}


def save_run(args: argparse.Namespace, name: str, run: dict) -> None:
  import numpy as np

  np.savez(os.path.join(paths(args)["base"], f"run-{name}.npz"), **run)


def load_run(args: argparse.Namespace, name: str) -> dict:
  import numpy as np

  with np.load(os.path.join(paths(args)["base"], f"run-{name}.npz")) as run:
    return {k: run[k] for k in run.files}


# ---------------------------------------------------------------------------- greedy loops


def greedy(step, prompt, steps: int, force=None, before=None) -> dict:
  """A prefill over ``prompt``, then ``steps`` one-token steps, each timed on its own.

  Args:
    step: ``step(tokens, cache, pos) -> (last-position logits as numpy, cache)``
      with ``tokens`` a numpy ``(1, t)`` int array and ``cache`` ``None`` for
      the prefill; it returns once the logits are computed.
    prompt: ``(1, t)`` token ids.
    steps: decode steps after the prefill.
    force: feed these tokens instead of the argmax (teacher forcing), so the
      logits can be compared step by step with another model's.
    before: called before the prefill and before every decode step, outside
      the timed region (the disk regime drops the weights' pages here).

  Returns:
    ``tokens`` ``(1 + steps,)`` (each step's argmax), ``logits``
    ``(1 + steps, vocab)``, ``prefill_s`` and ``step_s`` (one time per decode
    step), ``prefill_read_bytes`` and ``step_read_bytes`` (``/proc/self/io``
    read_bytes during the prefill and during each step).
  """
  import numpy as np

  def timed(tokens, cache, pos):
    if before is not None:
      before()
    io0 = io_bytes()[0]
    start = time.perf_counter()
    logits, cache = step(tokens, cache, pos)
    elapsed = time.perf_counter() - start
    return logits, cache, elapsed, io_bytes()[0] - io0

  logits, cache, prefill_s, prefill_read = timed(prompt, None, 0)
  all_logits, step_s, step_read = [logits], [], []
  for i in range(steps):
    token = int(np.argmax(all_logits[-1])) if force is None else int(force[i])
    logits, cache, elapsed, read = timed(np.array([[token]], np.int32), cache, prompt.shape[1] + i)
    step_s.append(elapsed)
    step_read.append(read)
    all_logits.append(logits)
  stacked = np.stack(all_logits)
  return {
    "tokens": np.argmax(stacked, axis=-1).astype(np.int32),
    "logits": stacked,
    "prefill_s": prefill_s,
    "step_s": np.array(step_s),
    "prefill_read_bytes": prefill_read,
    "step_read_bytes": np.array(step_read),
  }


def jax_step(forward):
  """A :func:`greedy` step for a plain (jitted) or placed GPT ``forward(tokens, cache, pos)``."""
  import jax.numpy as jnp
  import numpy as np

  def step(tokens, cache, pos):
    # pos as an int32 array: every decode step shares one compiled program.
    logits, cache = forward(jnp.asarray(tokens), cache, jnp.asarray(pos, jnp.int32))
    return np.asarray(logits[0, -1]), cache

  return step


# ---------------------------------------------------------------------------- the torch port


def torch_gpt(cfg):
  """The GPT decoder of ``jax_residency.models`` in PyTorch, with a growing KV cache.

  ``model(tokens, cache, pos)`` runs ``tokens`` ``(1, t)`` at positions
  ``pos .. pos+t-1``; ``cache`` is one ``(k, v)`` pair per layer holding the
  earlier positions (``(batch, heads, pos, head_dim)``), ``None`` for a fresh
  one. It returns the logits and the cache with the new positions appended.
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
      self.proj = nn.Linear(d, d)
      self.norm2 = nn.LayerNorm(d, eps=LN_EPS)
      self.up = nn.Linear(d, cfg.d_ff)
      self.down = nn.Linear(cfg.d_ff, d)

    def forward(self, x, k_cache, v_cache, pos: int):
      b, t, d = x.shape
      q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
      q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
      k, v = torch.cat([k_cache, k], dim=2), torch.cat([v_cache, v], dim=2)
      # Query at position pos+i sees keys at positions <= pos+i (all of them when t == 1).
      mask = None
      if t > 1:
        mask = torch.arange(pos + t)[None, :] <= (pos + torch.arange(t))[:, None]
      att = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
      x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
      x = x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))
      return x, k, v

  class GPT(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
      self.pos_embed = nn.Embedding(cfg.max_len, cfg.d_model)
      self.layers = nn.ModuleList(Block() for _ in range(cfg.n_layers))
      self.norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
      if not cfg.tie_head:
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, tokens, cache, pos: int):
      b, t = tokens.shape
      if cache is None:
        empty = torch.zeros(b, cfg.n_heads, 0, cfg.head_dim)
        cache = [(empty, empty)] * cfg.n_layers
      x = self.embed(tokens) + self.pos_embed(torch.arange(pos, pos + t))[None]
      new = []
      for block, (k, v) in zip(self.layers, cache, strict=True):
        x, k, v = block(x, k, v, pos)
        new.append((k, v))
      x = self.norm(x)
      logits = F.linear(x, self.embed.weight) if cfg.tie_head else self.head(x)
      return logits, new

  return GPT


def torch_step(model):
  """A :func:`greedy` step for the torch port (loaded whole or dispatched by Accelerate)."""
  import torch

  def step(tokens, cache, pos):
    logits, cache = model(torch.from_numpy(tokens).long(), cache, pos)
    return logits[0, -1].numpy(), cache

  return step


def torch_state_dict(params: dict, cfg) -> dict:
  """NNX parameters (a nested dict of arrays) -> the torch port's state dict, as numpy."""
  import numpy as np

  def linear(p: dict, prefix: str, i: int | None = None) -> dict:
    kernel, bias = (p["kernel"], p["bias"]) if i is None else (p["kernel"][i], p["bias"][i])
    # nnx.Linear keeps (in, out); torch.nn.Linear keeps (out, in).
    return {f"{prefix}.weight": np.asarray(kernel).T, f"{prefix}.bias": np.asarray(bias)}

  def norm(p: dict, prefix: str, i: int | None = None) -> dict:
    scale, bias = (p["scale"], p["bias"]) if i is None else (p["scale"][i], p["bias"][i])
    return {f"{prefix}.weight": np.asarray(scale), f"{prefix}.bias": np.asarray(bias)}

  out = {
    "embed.weight": np.asarray(params["embed"]["embedding"]),
    "pos_embed.weight": np.asarray(params["pos_embed"]["embedding"]),
  }
  layers = params["layers"]
  for i in range(cfg.n_layers):
    for name in ("norm1", "norm2"):
      out |= norm(layers[name], f"layers.{i}.{name}", i)
    for name in ("qkv", "proj", "up", "down"):
      out |= linear(layers[name], f"layers.{i}.{name}", i)
  out |= norm(params["norm"], "norm")
  if not cfg.tie_head:
    out |= linear(params["head"], "head")
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


# ---------------------------------------------------------------------------- children


def build(args: argparse.Namespace) -> dict:
  """Model -> jax_residency store, torch checkpoint, prompts and the reference generation."""
  import numpy as np
  from flax import nnx
  from safetensors.numpy import save_file

  import jax_residency as jr
  from jax_residency import models

  p = paths(args)
  cfg = gpt_config(args)
  model = models.init_gpt(cfg, seed=0)
  rng = np.random.default_rng(1)
  prompt = rng.integers(0, cfg.vocab_size, (1, args.prompt_len), dtype=np.int32)
  warmup = rng.integers(0, cfg.vocab_size, (1, args.prompt_len), dtype=np.int32)
  forward = nnx.jit(lambda m, t, c, pos: m(t, c, pos))
  run = greedy(jax_step(functools.partial(forward, model)), prompt, args.steps)
  jr.save(model, p["store"], progress=False, overwrite=True)
  state = torch_state_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg)
  del model
  os.makedirs(os.path.dirname(p["checkpoint"]), exist_ok=True)
  save_file(state, p["checkpoint"] + ".tmp", metadata={"format": "pt"})
  os.replace(p["checkpoint"] + ".tmp", p["checkpoint"])
  np.savez(
    p["reference"] + ".tmp.npz",
    prompt=prompt,
    warmup=warmup,
    tokens=run["tokens"],
    logits=run["logits"],
  )
  os.replace(p["reference"] + ".tmp.npz", p["reference"])
  return {}


def build_quantized(args: argparse.Namespace) -> dict:
  """The same model (seed 0) -> a quantized jax_residency store, and its sizes as JSON."""
  import jax_residency as jr
  from jax_residency import models

  scheme = args.child.removeprefix("build-")
  p = paths(args)
  model = models.init_gpt(gpt_config(args), seed=0)
  info = jr.save(model, p[f"store-{scheme}"], progress=False, overwrite=True, quantize=scheme)
  out = {
    "unit_bytes": info.unit_nbytes,
    "static_bytes": info.static_nbytes,
    "unit_count": info.unit_count,
  }
  with open(p[f"store-{scheme}-info"] + ".tmp", "w") as f:
    json.dump(out, f)
  os.replace(p[f"store-{scheme}-info"] + ".tmp", p[f"store-{scheme}-info"])
  return out


def timed_generation(
  args: argparse.Namespace, step, prepare, peaks: Peaks, *, before=None, report=None
) -> dict:
  """Warm-up already done: ``prepare()`` (drop or fill caches), then the timed generation.

  ``before`` runs before the prefill and every decode step, outside the timing
  (:func:`greedy`). ``report`` returns the placed model's report (jax_residency)
  for the bytes it read from the store.
  """
  import numpy as np

  ref = reference(args)
  prepare()
  out: dict = {"rss_before_bytes": rss_bytes()}
  before_report = report() if report else None
  peaks.reset()
  io0 = io_bytes()
  with AnonPeak() as anon:
    run = greedy(step, ref["prompt"], args.steps, before=before)
  out["disk_read_bytes"] = io_bytes()[0] - io0[0]  # drops included: they read nothing
  out["generation_peak_rss_bytes"] = peaks.read()
  out["generation_peak_anon_bytes"] = anon.peak
  out["prefill_s"] = run["prefill_s"]
  out["decode_s"] = float(run["step_s"].sum())
  out["decode_step_s"] = float(np.median(run["step_s"]))
  out["step_s"] = run["step_s"].tolist()
  out["prefill_io_read_bytes"] = int(run["prefill_read_bytes"])
  out["io_read_per_step_bytes"] = float(np.median(run["step_read_bytes"]))
  out["step_io_read_bytes"] = run["step_read_bytes"].tolist()
  if report:
    after = report()
    out["prefill_bytes_read"] = after.prefill.bytes_read - before_report.prefill.bytes_read
    out["decode_bytes_read"] = after.decode.bytes_read - before_report.decode.bytes_read
    out["store_read_per_step_bytes"] = out["decode_bytes_read"] / args.steps
    out["stalls"] = after.total.stalls - before_report.total.stalls
    # The library's own peaks over the placement's life (what its caches held).
    out["peak_device_bytes"] = after.total.peak_device_bytes
    out["peak_host_bytes"] = after.total.peak_host_bytes
  return out | {"_run": run}


def warm_up(args: argparse.Namespace, step) -> dict:
  """Prefill + one decode step on a different prompt: compiles (XLA) or warms up (torch)."""
  run = greedy(step, reference(args)["warmup"], 1)
  return {"first_prefill_s": run["prefill_s"], "first_decode_step_s": float(run["step_s"][0])}


def regimes(args: argparse.Namespace, name: str, step, files, peaks, clear, report=None) -> dict:
  """Both regimes' timed generations of one row; each run's tokens and logits saved.

  ``files``: what the row reads its weights from (dropped from / read into the
  page cache); ``clear()`` empties the row's own caches first. In the disk
  regime, the pages of ``files`` that this process holds mapped survive each
  drop (the kernel drops no mapped page); they are measured after every drop.
  """
  held: list[int] = []

  def page_cache() -> None:
    clear()
    _parallel_read([f for path in files for f in files_under(path)], threads=4)

  def drop() -> None:
    drop_page_cache(*files)
    held.append(mapped_bytes(*files))

  out = {}
  for regime in REGIMES:
    held.clear()
    if regime == "page-cache":
      fig = timed_generation(args, step, page_cache, peaks, report=report)
    else:
      fig = timed_generation(args, step, clear, peaks, before=drop, report=report)
      # held[0] was measured before the prefill, held[1:] before each decode step.
      fig["prefill_held_mapped_bytes"] = held[0]
      fig["held_mapped_per_step_bytes"] = statistics.median(held[1:])
    save_run(args, f"{name}@{regime}", fig.pop("_run"))
    out[regime] = fig
  return out


def jr_child(args: argparse.Namespace) -> dict:
  """One jax_residency row: DenseDiskStream at a host budget (float32 or a quantized
  store), or FullyResident; both regimes."""
  import jax
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  scheme, tier = row_of(args.child)
  store = store_of(args, scheme)
  cfg = gpt_config(args)
  size = store_sizes(args, scheme)
  unit = size["unit_bytes"]
  jax.numpy.zeros(()).block_until_ready()  # backend initialised before the baseline
  if tier == "resident":
    policy = jr.FullyResident()
  else:
    host = {"host0": 0, "host2": 2 * unit, "all": cfg.n_layers * unit}[tier]
    depth = 0 if host == 0 else 2
    float_size = sizes(args)  # one device budget for every row: float32 static + 2 units
    policy = jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(
        device_budget_bytes=float_size["static_bytes"] + 2 * float_size["unit_bytes"],
        host_budget_bytes=host,
        host_lookahead=depth,
        background_queue_capacity=depth,
      )
    )
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  peaks = Peaks()
  baseline = rss_bytes()
  drop_page_cache(store)
  peaks.reset()
  io0 = io_bytes()
  start = time.perf_counter()
  placed = jr.place(abstract, policy, store=store, mesh=mesh)
  out: dict = {
    "load_s": time.perf_counter() - start,
    "load_read_bytes": io_bytes()[0] - io0[0],
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": peaks.read(),
    "rss_after_load_bytes": rss_bytes(),
    "anon_after_load_bytes": rss_anon_bytes(),
    "unit_bytes": unit,
    "static_bytes": size["static_bytes"],
    "plan_bytes": placed.metadata.planned_process_bytes,
  }
  if isinstance(policy, jr.DenseDiskStream):
    out["host_budget_bytes"] = policy.options.host_budget_bytes
    out["device_budget_bytes"] = policy.options.device_budget_bytes
  with placed:
    step = jax_step(placed)
    out |= warm_up(args, step)
    out["regimes"] = regimes(
      args, args.child, step, [store], peaks, placed.clear_caches, placed.report
    )
  out["peak_rss_bytes"] = peaks.process  # load, warm-up and both generations
  return out


def accelerate_child(args: argparse.Namespace) -> dict:
  """Accelerate's documented disk offload: meta model, ``load_checkpoint_and_dispatch``."""
  import logging

  import torch
  from accelerate import init_empty_weights, load_checkpoint_and_dispatch

  logging.getLogger("accelerate").setLevel(logging.ERROR)
  p = paths(args)
  cfg = gpt_config(args)
  shutil.rmtree(p["offload"], ignore_errors=True)
  with init_empty_weights():
    model = torch_gpt(cfg)()
  device_map = {"embed": "cpu", "pos_embed": "cpu", "norm": "cpu"}
  device_map |= {} if cfg.tie_head else {"head": "cpu"}
  device_map |= {f"layers.{i}": "disk" for i in range(cfg.n_layers)}
  peaks = Peaks()
  baseline = rss_bytes()
  drop_page_cache(p["checkpoint"])
  peaks.reset()
  io0 = io_bytes()
  start = time.perf_counter()
  model = load_checkpoint_and_dispatch(
    model, p["checkpoint"], device_map=device_map, offload_folder=p["offload"]
  )
  load_s = time.perf_counter() - start
  io1 = io_bytes()
  model.eval()
  out: dict = {
    "load_s": load_s,
    "load_read_bytes": io1[0] - io0[0],
    "load_written_bytes": io1[1] - io0[1],
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": peaks.read(),
    "rss_after_load_bytes": rss_bytes(),
    "anon_after_load_bytes": rss_anon_bytes(),
    "threads": torch.get_num_threads(),
    "offload_bytes": sum(os.path.getsize(f) for f in files_under(p["offload"])),
  }
  step = torch_step(model)
  with torch.inference_mode():
    out |= warm_up(args, step)
    # Its offload folder's files (the blocks' .dat files) and the checkpoint.
    files = [p["offload"], p["checkpoint"]]
    out["regimes"] = regimes(args, "accelerate", step, files, peaks, lambda: None)
  out["peak_rss_bytes"] = peaks.process
  return out


def torch_child(args: argparse.Namespace) -> dict:
  """The torch port loaded whole: teacher-forced logits for the gate, a resident decode."""
  import torch
  from safetensors.torch import load_file

  ref = reference(args)
  model = torch_gpt(gpt_config(args))()
  model.load_state_dict(load_file(paths(args)["checkpoint"]))
  model.eval()
  step = torch_step(model)
  with torch.inference_mode():
    forced = greedy(step, ref["prompt"], args.steps, force=ref["tokens"])
    run = greedy(step, ref["prompt"], args.steps)
  save_run(args, "torch-forced", forced)
  save_run(args, "torch", run)
  return {
    "prefill_s": run["prefill_s"],
    "decode_s": float(run["step_s"].sum()),
    "threads": torch.get_num_threads(),
  }


def bandwidth_child(args: argparse.Namespace) -> dict:
  """The store's files read while they are in the page cache, with several thread counts."""
  files = files_under(paths(args)["store"])
  _parallel_read(files, threads=4)  # into the page cache
  out: dict = {"threads": {}}
  for threads in READ_THREADS:
    start = time.perf_counter()
    n = _parallel_read(files, threads=threads)
    out["threads"][str(threads)] = n / (time.perf_counter() - start)
  out["bytes"] = n
  out["best_threads"] = max(out["threads"], key=out["threads"].get)
  out["bytes_per_s"] = out["threads"][out["best_threads"]]
  return out


CHILDREN = {
  "build": build,
  **{f"build-{q}": build_quantized for q in SCHEMES},
  "torch": torch_child,
  "accelerate": accelerate_child,
  "bandwidth": bandwidth_child,
  **{name: jr_child for name in (*JR_ROWS, "jr-resident")},
  **{name: jr_child for q in SCHEMES for name in quant_rows(q)},
}


# ---------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, which: str, *, may_fail: bool = False) -> dict:
  """One child's JSON; on failure, exits (or with ``may_fail``, returns ``{"error": ...}``)."""
  cmd = [sys.executable, __file__, "--child", which, "--dir", args.dir]
  cmd += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--d-ff", str(args.d_ff)]
  cmd += ["--vocab", str(args.vocab), "--heads", str(args.heads)]
  cmd += ["--prompt-len", str(args.prompt_len), "--steps", str(args.steps)]
  cmd += ["--tie-head"] if args.tie_head else []
  # stderr (Accelerate's progress bars, warnings) is shown only if the child fails.
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    sys.stderr.write(done.stderr)
    if may_fail:
      tail = done.stderr.strip().splitlines()[-1:] or [""]
      return {"error": f"exit {done.returncode}: {tail[0]}"}
    raise SystemExit(f"{which} failed (exit {done.returncode})")
  out = done.stdout.strip()
  return json.loads(out.splitlines()[-1]) if out else {}


def common_prefix(a, b) -> int:
  """How many leading tokens ``a`` and ``b`` share."""
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def run_names(names: list[str]) -> list[str]:
  """The saved generations of rows: one per regime (``"jr-host0@disk"``)."""
  return [f"{name}@{regime}" for name in names for regime in REGIMES]


def check_parity(args: argparse.Namespace, names: list[str]) -> dict:
  """Tokens of every float32 run against the plain model's; logits within the gate's tolerance.

  Logits are compared over the steps whose inputs every run shares (all of
  them, unless a float difference flipped a greedy token somewhere); the torch
  port is also compared teacher-forced, over every step.
  """
  ref = reference(args)
  runs = {name: load_run(args, name) for name in ["torch", *run_names(names)]}
  forced = load_run(args, "torch-forced")
  gate = parity_of(ref["logits"], {"torch": forced["logits"]}, torch=forced["logits"])
  # Step i's input is token i-1, so its logits are comparable while the tokens before it agree.
  steps = min(1 + common_prefix(run["tokens"], ref["tokens"]) for run in runs.values())
  steps = min(steps, len(ref["tokens"]))
  out = parity_of(
    ref["logits"][:steps],
    {name: run["logits"][:steps] for name, run in runs.items()},
    torch=runs["torch"]["logits"][:steps],
  )
  out["max_abs_diff"]["torch vs jax (teacher-forced)"] = gate["max_abs_diff"]["torch vs jax"]
  out["ok"] = out["ok"] and gate["ok"]
  out["steps_compared"] = steps
  out["tokens_match_jax"] = {
    name: bool((run["tokens"] == ref["tokens"]).all()) for name, run in runs.items()
  }
  for regime in REGIMES:
    if f"accelerate@{regime}" in runs:
      out[f"accelerate@{regime}_tokens_match_torch"] = bool(
        (runs[f"accelerate@{regime}"]["tokens"] == runs["torch"]["tokens"]).all()
      )
  # A float32 row of jax_residency must generate the plain model's tokens exactly.
  out["ok"] = out["ok"] and all(v for n, v in out["tokens_match_jax"].items() if n[:2] == "jr")
  return out


def quant_parity(args: argparse.Namespace, names: list[str]) -> dict:
  """Each quantized run against the float32 plain model: reported, not gated.

  ``token_agreement``: the fraction of the generated tokens equal to the
  plain model's at the same position; ``prefix``: how many lead before the
  first difference. Logit errors are relative to the logit scale (max |logit|
  of the plain model) over the steps whose inputs agree (the prefix + 1).
  """
  import numpy as np

  ref = reference(args)
  scale = float(np.abs(ref["logits"]).max())
  out: dict = {}
  for name in run_names(names):
    run = load_run(args, name)
    prefix = common_prefix(run["tokens"], ref["tokens"])
    steps = min(prefix + 1, len(ref["tokens"]))
    rel = np.abs(run["logits"][:steps] - ref["logits"][:steps]) / scale
    out[name] = {
      "token_agreement": float((run["tokens"] == ref["tokens"]).mean()),
      "prefix": prefix,
      "steps_compared": steps,
      "logits_max_rel": float(rel.max()),
      "logits_mean_rel": float(rel.mean()),
    }
  return out


def fmt_read(n: float) -> str:
  """Bytes read per step: MiB with a decimal below 1 GiB."""
  return fmt_bytes(n) if abs(n) >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


def drop_check(fig: dict, weights: float) -> dict:
  """Whether /proc/self/io saw the reads the drops call for.

  A disk-regime step reads from its weights ``weights`` bytes: at least those
  not held mapped across the drop should come from the disk, and no more than
  all of them (1.33x for readahead). A page-cache step should read ~0.
  """
  disk = fig["regimes"]["disk"]
  io, held = disk["io_read_per_step_bytes"], disk["held_mapped_per_step_bytes"]
  warm = fig["regimes"]["page-cache"]["io_read_per_step_bytes"]
  lo, hi = DISK_READ_RANGE
  ok = lo * max(weights - held, 0) <= io <= hi * weights and warm <= PC_READ_SLACK * weights
  return {
    "ok": ok,
    "text": (
      f"{label(fig['name'])}: /proc/self/io reads {fmt_read(io)} per disk step for "
      f"{fmt_read(weights)} read from the weights, {fmt_read(held)} of their pages held "
      f"mapped (want {lo:g}x the rest to {hi:g}x all), {fmt_read(warm)} per page-cache "
      f"step (want <= {PC_READ_SLACK:g}x)"
    ),
  }


def derive(run: dict, args: argparse.Namespace, unit_bytes_total: int) -> dict:
  """Rates, RSS growths, checks of the targets and ratios of one run of every row.

  Returns the targets: figures, and ``checks`` (name -> ``ok`` and ``text``).
  """
  rows = [name for name in run if name == "accelerate" or name.startswith("jr")]
  for name in rows:
    fig = run[name]
    if "error" in fig:
      continue
    fig["name"] = name
    for reg in fig["regimes"].values():
      reg["decode_tokens_per_s"] = args.steps / reg["decode_s"]
    fig["peak_rss_growth_bytes"] = fig["peak_rss_bytes"] - fig["baseline_rss_bytes"]
    gens = fig["regimes"].values()
    fig["rss_growth_after_load_bytes"] = (
      max(g["generation_peak_rss_bytes"] for g in gens) - fig["rss_after_load_bytes"]
    )
    fig["anon_growth_after_load_bytes"] = (
      max(g["generation_peak_anon_bytes"] for g in gens) - fig["anon_after_load_bytes"]
    )
  acc = run["accelerate"]["regimes"]
  resident_step = run["jr-resident"]["regimes"]["page-cache"]["decode_step_s"]
  read_step = unit_bytes_total / run["bandwidth"]["bytes_per_s"]
  floor = max(resident_step, read_step)
  targets: dict = {"floor_step_s": floor, "resident_step_s": resident_step}
  targets["read_step_s"] = read_step
  checks: dict = {}

  def check(key: str, ok: bool, text: str) -> None:
    checks[key] = {"ok": bool(ok), "text": text}

  # float32: decode >= 3x Accelerate with the weights in the page cache, peak RSS <= its.
  acc_rss = run["accelerate"]["peak_rss_growth_bytes"]
  for name in JR_ROWS:
    fig = run[name]
    speed = fig["regimes"]["page-cache"]["decode_tokens_per_s"]
    speed /= acc["page-cache"]["decode_tokens_per_s"]
    rss = fig["peak_rss_growth_bytes"] / acc_rss
    disk = fig["regimes"]["disk"]["decode_tokens_per_s"] / acc["disk"]["decode_tokens_per_s"]
    targets[f"{name} disk decode vs accelerate"] = disk  # context, no target
    check(
      f"{name} decode+rss",
      speed >= DECODE_OVER_ACCELERATE and rss <= 1.0,
      f"{label(name)}: page-cache decode {speed:.2f}x accelerate's "
      f"(>= {DECODE_OVER_ACCELERATE:g}x), peak RSS growth {rss:.2f}x (<= 1)",
    )
  for name in PC_FLOOR_ROWS:
    step = run[name]["regimes"]["page-cache"]["decode_step_s"]
    check(
      f"{name} pc step",
      step / floor <= PAGE_CACHE_SLACK,
      f"{label(name)}: page-cache decode step {step:.4f} s = {step / floor:.2f}x floor "
      f"(<= {PAGE_CACHE_SLACK:g}x); {step / read_step:.2f}x the read term alone",
    )

  # FullyResident, every weight resident, against the dense stream with every unit cached.
  all_step = run["jr-all"]["regimes"]["page-cache"]["decode_step_s"]
  check(
    "resident step",
    resident_step <= all_step,
    f"jr FullyResident: page-cache decode step {resident_step:.4f} s (<= jr host all's "
    f"{all_step:.4f} s)",
  )

  # Quantized rows: the step against float32's at host 0, per regime; int8 against Accelerate.
  for scheme in SCHEMES:
    names = [n for n in quant_rows(scheme) if n in run]
    if not names:
      continue
    for name in names:
      if "error" in run[name]:
        check(f"{name} ran", False, f"{label(name)}: FAILED ({run[name]['error']})")
    fig = run[f"jr-{scheme}-host0"]
    if "error" in fig:
      continue
    for regime, limit in QUANT_STEP_RATIO[scheme].items():
      ratio = fig["regimes"][regime]["decode_step_s"]
      ratio /= run["jr-host0"]["regimes"][regime]["decode_step_s"]
      check(
        f"{scheme} host0 {regime} step",
        ratio <= limit,
        f"{label(fig['name'])}: {regime} decode step {ratio:.2f}x float32's (<= {limit:g}x)",
      )
    if scheme != "int8":
      continue
    for name in names:
      fig = run[name]
      if "error" in fig:
        continue
      speed = fig["regimes"]["disk"]["decode_tokens_per_s"] / acc["disk"]["decode_tokens_per_s"]
      anon = fig["anon_growth_after_load_bytes"]
      acc_anon = run["accelerate"]["anon_growth_after_load_bytes"]
      growth, plan = fig["rss_growth_after_load_bytes"], fig["plan_bytes"]
      check(
        f"{name} disk decode+memory",
        speed >= INT8_DISK_OVER_ACCELERATE and anon <= acc_anon and growth <= plan,
        f"{label(name)}: disk decode {speed:.2f}x accelerate's "
        f"(>= {INT8_DISK_OVER_ACCELERATE:g}x), RssAnon growth {fmt_bytes(anon)} (<= "
        f"accelerate's {fmt_bytes(acc_anon)}), peak RSS growth {fmt_bytes(growth)} "
        f"(<= plan {fmt_bytes(plan)})",
      )

  # The drops: reads per step that the page cache served, or the disk.
  for name in rows:
    fig = run[name]
    if "error" in fig:
      continue
    expected = (
      unit_bytes_total
      if name == "accelerate"
      else fig["regimes"]["disk"].get("store_read_per_step_bytes", 0)
    )
    if expected > 0:
      checks[f"{name} drops"] = drop_check(fig, expected)
  targets["checks"] = checks
  return targets


def measure(args: argparse.Namespace, unit_bytes_total: int, quant: list[str]) -> dict:
  float_rows = [*JR_ROWS, "jr-resident"]
  run = {name: run_child(args, name) for name in float_rows}
  q_rows = [name for scheme in quant for name in quant_rows(scheme)]
  run |= {name: run_child(args, name, may_fail=True) for name in q_rows}
  run["accelerate"] = run_child(args, "accelerate")
  run["bandwidth"] = run_child(args, "bandwidth")
  run["parity"] = check_parity(args, ["accelerate", *float_rows])
  run["quant_parity"] = quant_parity(args, [n for n in q_rows if "error" not in run[n]])
  run["targets"] = derive(run, args, unit_bytes_total)  # this run's own
  return run


def median_run(runs: list[dict]) -> dict:
  """Every numeric figure's median over runs (the last run's for anything else)."""

  def merge(values: list):
    if isinstance(values[0], dict):
      return {k: merge([v[k] for v in values]) for k in values[0]}
    if isinstance(values[0], bool) or not isinstance(values[0], int | float):
      return values[-1]
    return statistics.median(values)

  return merge(runs)


def print_table(result: dict, args: argparse.Namespace) -> None:
  med = result["median"]
  acc, tg = med["accelerate"], med["targets"]
  size = result["sizes"]
  unit = size["unit_bytes"]
  names = [n for n in med if n.startswith("jr") and "error" not in med[n]] + ["accelerate"]

  def table(rows: list[tuple]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
      print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())

  cfg = result["config"]
  runs_note = f"; medians of {args.repeat} runs" if args.repeat > 1 else ""
  print(
    f"model: GPT d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, "
    f"d_ff {cfg['d_ff']}, vocab {cfg['vocab_size']}, float32"
    + (", head tied to the embedding" if cfg["tie_head"] else "")
    + f"; units {fmt_read(unit)} each, {fmt_read(unit * cfg['n_layers'])} in all; "
    f"static {fmt_read(size['static_bytes'])}"
  )
  if not result["quantized"]:
    print("quantized rows: not run (--quantize int8,int4 adds them)")
  for scheme, q in result["quantized"].items():
    print(
      f"{scheme} store: units {fmt_read(q['unit_bytes'])} each, static "
      f"{fmt_read(q['static_bytes'])}"
      if isinstance(q, dict)
      else f"{scheme} rows: {q}"
    )
  print(
    f"run: {args.prompt_len}-token prompt, then {args.steps} greedy decode steps{runs_note}; "
    f"device budget static + 2 units = {fmt_bytes(size['static_bytes'] + 2 * unit)}; "
    f"accelerate {result['versions']['accelerate']}, torch {result['versions']['torch']} "
    f"({acc['threads']} threads)"
  )
  print(
    'regimes: "page cache": the weights read into the page cache first, no drops; '
    '"disk": their pages dropped before the prefill and every step (not timed)'
  )
  print()
  rows = [
    (
      "row",
      "regime",
      "prefill",
      "s/step (median)",
      "decode tok/s",
      "read/step: weights",
      "held mapped",
      "/proc/self/io",
    )
  ]
  for name in names:
    for regime in REGIMES:
      reg = med[name]["regimes"][regime]
      weights = reg.get("store_read_per_step_bytes", 0)
      if name == "accelerate":
        weights = size["unit_bytes_total"]
      held = reg.get("held_mapped_per_step_bytes")
      rows.append(
        (
          label(name) if regime == REGIMES[0] else "",
          regime,
          f"{reg['prefill_s']:.3f} s",
          f"{reg['decode_step_s']:.4f}",
          f"{reg['decode_tokens_per_s']:.2f}",
          fmt_read(weights),
          "" if held is None else fmt_read(held),
          fmt_read(reg["io_read_per_step_bytes"]),
        )
      )
  table(rows)
  print()
  rows = [
    (
      "row",
      "load",
      "1st prefill",
      "peak RSS growth",
      "after load: peak RSS growth",
      "plan",
      "RssAnon growth",
    )
  ]
  for name in names:
    fig = med[name]
    rows.append(
      (
        label(name),
        f"{fig['load_s']:.2f} s",
        f"{fig['first_prefill_s']:.2f} s",
        fmt_bytes(fig["peak_rss_growth_bytes"]),
        fmt_bytes(fig["rss_growth_after_load_bytes"]),
        fmt_bytes(fig["plan_bytes"]) if "plan_bytes" in fig else "-",
        fmt_bytes(fig["anon_growth_after_load_bytes"]),
      )
    )
  table(rows)
  print()
  bw = med["bandwidth"]
  print(
    f"warm-read bandwidth (store in the page cache, best of {', '.join(bw['threads'])} "
    f"threads: {bw['best_threads']}): {bw['bytes_per_s'] / 1e9:.2f} GB/s; "
    f"unit bytes / bandwidth = {tg['read_step_s']:.4f} s; resident decode step "
    f"{tg['resident_step_s']:.4f} s; floor = max = {tg['floor_step_s']:.4f} s"
  )
  print(
    f"accelerate: load {acc['load_s']:.2f} s reads {fmt_bytes(acc['load_read_bytes'])}, "
    f"writes {fmt_bytes(acc['load_written_bytes'])}; torch resident (context): "
    f"{args.steps / med['torch']['decode_s']:.2f} tok/s, prefill {med['torch']['prefill_s']:.2f} s"
  )
  ctx = [f"{label(n)} {tg[f'{n} disk decode vs accelerate']:.2f}x" for n in JR_ROWS]
  print(f"float32 disk-regime decode vs accelerate's (context): {', '.join(ctx)}")
  print()
  print("targets and checks:")
  for c in tg["checks"].values():
    print(f"  {c['text']}: {'met' if c['ok'] else 'MISSED'}")
  for scheme in SCHEMES:
    why = result["quantized"].get(scheme, "no --quantize")
    if not isinstance(why, dict):
      print(f"  {scheme} targets: not checked ({why})")
  par = result["parity"]
  diff = par["max_abs_diff"]
  jr_vs = {
    against: max(v for k, v in diff.items() if k.startswith("jr") and k.endswith(against))
    for against in ("vs jax", "vs torch")
  }
  print()
  print(
    f"parity (max |logit diff| over {par['steps_compared']} steps; logit scale "
    f"{par['logit_scale']:.1f}, limit {PARITY_RTOL:g}x that): torch port vs JAX "
    f"{diff['torch vs jax (teacher-forced)']:.1e} teacher-forced, {diff['torch vs jax']:.1e} "
    f"greedy; accelerate vs torch "
    f"{max(v for k, v in diff.items() if k.startswith('accelerate') and k.endswith('torch')):.1e}"
    f"; float32 jax_residency rows vs JAX {jr_vs['vs jax']:.1e}, vs torch {jr_vs['vs torch']:.1e}"
  )
  same = [n for n, ok in par["tokens_match_jax"].items() if ok]
  differ = [n for n, ok in par["tokens_match_jax"].items() if not ok]
  acc_same = all(par[f"accelerate@{r}_tokens_match_torch"] for r in REGIMES)
  print(
    f"greedy tokens = the plain JAX model's: {', '.join(same) or 'none'}"
    + (f"; DIFFER: {', '.join(differ)}" if differ else "")
    + f"; accelerate = torch port: {acc_same}"
  )
  if result["quant_parity"]:
    print("quantized rows against the float32 plain model (reported, not gated):")
    for name, q in result["quant_parity"].items():
      print(
        f"  {name}: tokens agree {q['token_agreement']:.2f} (first {q['prefix']} equal); "
        f"logits error / logit scale over {q['steps_compared']} steps: max "
        f"{q['logits_max_rel']:.2e}, mean {q['logits_mean_rel']:.2e}"
      )
  print(f"{result['wall_s']:.0f} s wall")


def parse_schemes(values: list[str] | None) -> list[str]:
  schemes = [q.strip() for v in values or [] for q in v.split(",") if q.strip()]
  bad = sorted(set(schemes) - set(SCHEMES))
  if bad:
    raise SystemExit(f"--quantize {','.join(bad)}: not a scheme; use {', '.join(SCHEMES)}")
  return list(dict.fromkeys(schemes))


def quantize_supported() -> bool:
  import inspect

  import jax_residency as jr

  return "quantize" in inspect.signature(jr.save).parameters


def prepare_quantized(args: argparse.Namespace, schemes: list[str]) -> tuple[list[str], dict]:
  """The schemes whose rows run, and each requested scheme's store sizes (or why it is skipped).

  Writes a scheme's store on first use; skips every scheme, with a message,
  when this jax_residency's ``jr.save`` takes no ``quantize=``.
  """
  p = paths(args)
  if schemes and not quantize_supported():
    why = "skipped: this jax_residency's jr.save takes no quantize= yet"
    print(f"{', '.join(schemes)} rows {why}", file=sys.stderr)
    return [], dict.fromkeys(schemes, why)
  quantized = {}
  for scheme in schemes:
    if not os.path.exists(p[f"store-{scheme}-info"]):
      print(f"writing the {scheme} store under {p['base']} ...", file=sys.stderr)
      run_child(args, f"build-{scheme}")
    quantized[scheme] = store_sizes(args, scheme)
  return schemes, quantized


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "jax_residency_decode"))
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--d-model", type=int, default=2048)
  parser.add_argument("--d-ff", type=int, default=8192)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--tie-head", action="store_true", help="logits from the embedding (GPT-2)")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
  parser.add_argument(
    "--quantize",
    action="append",
    metavar="SCHEMES",
    help="also rows from quantized stores: int8, int4 (repeat, or a comma list)",
  )
  parser.add_argument("--repeat", type=int, default=1, help="runs; figures are medians")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.dir = os.path.abspath(args.dir)
  if args.child:
    print(json.dumps(CHILDREN[args.child](args)))
    return

  started = time.perf_counter()
  versions = check_peers_installed(ACCELERATE_VERSION)
  schemes = parse_schemes(args.quantize)
  p = paths(args)
  if not os.path.exists(p["reference"]):
    os.makedirs(p["base"], exist_ok=True)
    print(f"building the model, its store and checkpoint under {p['base']} ...", file=sys.stderr)
    run_child(args, "build")
  schemes, quantized = prepare_quantized(args, schemes)
  size = sizes(args)
  cfg = gpt_config(args)
  unit_bytes_total = cfg.n_layers * size["unit_bytes"]
  result: dict = {
    "versions": versions,
    "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    "sizes": size | {"unit_bytes_total": unit_bytes_total},
    "quantized": quantized,
    "prompt_len": args.prompt_len,
    "steps": args.steps,
  }

  # The gate first: the torch port, fed the plain model's tokens, against its logits.
  result["torch"] = run_child(args, "torch")
  result["parity"] = check_parity(args, [])
  if not result["parity"]["ok"]:
    refuse(result, args)

  runs = []
  for i in range(args.repeat):
    print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr)
    run = measure(args, unit_bytes_total, schemes)
    result["parity"] = run.pop("parity")
    result["quant_parity"] = run.pop("quant_parity")
    if not result["parity"]["ok"]:
      refuse(result, args)
    runs.append(run)
  result["runs"] = runs
  # Figures are medians over runs; the targets are checked on the medians.
  med = result["median"] = median_run(runs) | {"torch": result["torch"]}
  med["targets"] = derive(med, args, unit_bytes_total)
  checks = med["targets"]["checks"]
  result["targets_met"] = {k: c["ok"] for k, c in checks.items()}
  result["wall_s"] = time.perf_counter() - started
  with open(os.path.join(p["base"], "result.json"), "w") as f:  # the last run's, in full
    json.dump(result, f)
  if args.json:
    print(json.dumps(result))
  else:
    print_table(result, args)
  missed = [c["text"] for c in checks.values() if not c["ok"]]
  if missed:
    print(f"{len(missed)} target(s) MISSED:", file=sys.stderr)
    for text in missed:
      print(f"  {text}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  main()
