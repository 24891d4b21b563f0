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
* ``jr plain``: the plain model (the same weights, built in memory) under ``jax.jit``
  (`_measure.plain_jitted`): the absolute anchor ``FullyResident`` is held to.
* ``jr int8 host 0``, ``jr int8 host 2 units``, ``jr int8 host all`` (and the
  same for int4): the rows above with the scheme's store; host budgets in its
  units, the float rows' device budget.
* ``accelerate``: the PyTorch port built with ``init_empty_weights`` and
  loaded with ``load_checkpoint_and_dispatch``, every block on ``"disk"``
  (embeddings, final norm and head on ``"cpu"``), an ``offload_folder`` and the
  CPU as execution device: Accelerate's documented disk-offload recipe. Its
  greedy loop carries a KV cache and does the same work as the JAX one
  (prefill, then one-token steps), without ``generate``. This load writes
  every block to the offload folder.
* ``accelerate-reuse``: the same model with the folder that row wrote reused,
  Accelerate's leanest load: the CPU blocks read from the checkpoint, then
  ``dispatch_model(..., offload_dir=...)``, which finds the folder's index and
  writes nothing. Targets compare with whichever of the two grew its peak RSS
  less after the load.
* ``torch``: the port loaded whole, for the parity gate (and a resident torch
  decode, for context).
* ``bandwidth``: the store's files read with 1, 2, 4 and 8 threads while they
  are in the page cache; the best is the warm-read bandwidth. Then read once
  from disk by 4 threads (pages dropped first): the raw-read bandwidth.

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
nothing per step, such as ``host all`` and ``resident``, are not checked). They
check the measurement, not the library, and are recorded as targets (page-cache
effects at a toy size mean little, so ``--quick`` reports them unchecked).

Parity gates: before timing anything the torch port is run whole, fed the
plain JAX model's greedy tokens, and its logits at every step must match the
JAX model's within 1e-3 of the logit scale (``benchmarks/peers.py``'s gate).
Afterwards every float32 jax_residency row's greedy tokens (both regimes) must
equal the plain model's, and each row's logits (Accelerate's and the torch
port's greedy run's too) must match the plain model's and the torch port's
with the same tolerance over the steps whose inputs agree. A failed gate fails
the run and no timings are reported. Accelerate's tokens are compared with
the torch port's and reported. Quantized rows are compared with the float32
plain model and reported, not gated: the fraction of tokens that agree, and
the logits' max and mean error relative to the logit scale over the steps
whose inputs agree; a quantized row that fails to run fails the run.

Without torch, accelerate or safetensors (none is a jax_residency dependency)
the script says which cannot be imported and skips the ``accelerate`` and
``torch`` rows, the torch port's gate and the targets measured against
Accelerate; the other rows run and are gated on the plain JAX model.

Targets (docs/benchmarks.md), evaluated on the medians over ``--repeat`` runs:

* each float32 ``DenseDiskStream`` row: page-cache decode tokens/s >= 3x
  Accelerate's (page cache), with anonymous-memory growth after the load <=
  Accelerate's (mapped store pages are reclaimable, anonymous memory is not) and
  peak RSS growth after the load <= the plan;
* float32 host 0: page-cache decode tokens/s >= 4.5x Accelerate's; disk-regime
  decode tokens/s >= 1.5x Accelerate's, and its step <= 1.1x the unit bytes
  over the 4-thread raw-read bandwidth;
* page-cache decode step (host 0 / 2 units) within 1.25x of the larger of the
  resident decode step and the unit bytes divided by the warm-read bandwidth;
* ``FullyResident``'s page-cache decode tokens/s >= 1.0x the plain jitted model's;
* ``FullyResident``'s page-cache decode step within 1.25x of the dense stream's
  with every unit cached (``jr host all``): on one CPU device the two run the
  same steps over the same bytes in memory, so this bounds what FullyResident
  adds, up to this machine's run-to-run noise (the floor target's slack);
* at host 0, the quantized decode step against the float32 one: int8 <= 0.6x
  (page cache) and <= 0.35x (disk); int4 <= 0.45x and <= 0.25x;
* each int8 row: decode tokens/s >= 10x Accelerate's in each regime, with
  anonymous-memory growth after the load <= Accelerate's and peak RSS growth
  after the load <= the plan. The disk regime's check also prints the read
  bandwidth 10x would take (the row's disk reads a step in a tenth of
  Accelerate's step) beside the 4-thread raw read from disk measured here.

The script prints every check with its measured value and exits 1 when a
parity gate fails or a target is missed (``--quick``: parity gates only).
A full run writes its result to ``benchmarks/results/decode.json``
(``--no-checksums``: ``decode-no-checksums.json``; ``--result PATH``
elsewhere; ``--quick`` writes only there).

``--quick``: the same children at a toy size (d_model 256, d_ff 1024, 4
layers, 4 heads, vocab 1000; a 16-token prompt, 4 decode steps; one run), in
a fresh temporary directory unless ``--dir`` is given, with the int8 and
int4 stores; of the rows, ``jr host 0``, ``jr host all``, ``jr resident``,
``jr int8 host 0`` and ``jr int4 host 0`` (the others are listed as left
out), both regimes, and the peers where they import.

``--no-checksums``: the stores are written without chunk checksums (``jr.save``
writes a CRC-32C after every chunk and has no option to leave it out, so the
script turns off ``jax_residency._src.store.writer.WRITE_CHECKSUMS`` while it
writes them, as ``benchmarks/checksum_step.py`` does), under their own names
(``jr-store-nocrc``, ``jr-store-int8-nocrc``, ...) next to the checksummed
ones, so that a run with the flag and one without compare the two.

Run it (torch and accelerate are not jax_residency dependencies; on this
project's machines ``torch==2.13.0`` resolves to a CPU-only wheel)::

    pip install torch==2.13.0
    pip install accelerate==1.16.0 safetensors
    python benchmarks/decode.py                  # table; about 8 GB under --dir
    python benchmarks/decode.py --quantize int8,int4  # also the quantized rows
    python benchmarks/decode.py --tie-head       # GPT-2 style tied head
    python benchmarks/decode.py --json           # one JSON object
    python benchmarks/decode.py --no-checksums   # stores without chunk checksums
    python benchmarks/decode.py --quick          # toy size: the parity gates, seconds

The first run writes the store, the checkpoint and the reference generation;
at the default size that run, build included, took 13 minutes on a busy 2-core
VM (before the disk regime, which reads the units from disk at every step).
``--repeat N`` runs every row N times; figures are medians and the targets
are checked on them (the result holds every run).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules

import _child  # noqa: E402
import _measure  # noqa: E402
import _parity  # noqa: E402
import _result  # noqa: E402
import _torch_peer  # noqa: E402
from _decoding import REGIMES, gpt_step, greedy  # noqa: E402
from _measure import (  # noqa: E402
  AnonPeak,
  Peaks,
  drop_page_cache,
  files_under,
  fmt_bytes,
  io_bytes,
  mapped_bytes,
  parallel_read,
  plain_jitted,
  rss_anon_bytes,
  rss_bytes,
)
from _parity import PARITY_RTOL, parity_of  # noqa: E402

ACCELERATE_VERSION = "1.16.0"
DECODE_OVER_ACCELERATE = 3.0  # target: page-cache decode tokens/s >= 3x Accelerate's
#: float32 host 0 against Accelerate's tok/s, per regime (targets).
HOST0_OVER_ACCELERATE = {"page-cache": 4.5, "disk": 1.5}
DISK_OVER_RAW_READ = 1.1  # target: host 0 disk step <= 1.1x the units' 4-thread raw read
PAGE_CACHE_SLACK = 1.25  # target: page-cache decode step <= 1.25x max(resident, bytes / bw)
RESIDENT_OVER_PLAIN = 1.0  # target: FullyResident's page-cache tok/s over the plain jitted model's
INT8_OVER_ACCELERATE = 10.0  # target: int8 decode tokens/s >= 10x Accelerate's, both regimes
#: Targets at host 0: a quantized decode step against the float32 one, per regime.
QUANT_STEP_RATIO = {
  "int8": {"page-cache": 0.6, "disk": 0.35},
  "int4": {"page-cache": 0.45, "disk": 0.25},
}
READ_THREADS = (1, 2, 4, 8)
COLD_READ_THREADS = 4  # the raw read from disk the disk-regime step is held to
SCHEMES = ("int8", "int4")  # quantized stores: jr.save(..., quantize=scheme)
TIERS = ("host0", "host2", "all")  # DenseDiskStream host budgets: 0, 2 units, every unit
TIER_LABELS = {
  "host0": "host 0",
  "host2": "host 2 units",
  "all": "host all",
  "resident": "FullyResident",
  "plain": "plain model, jax.jit",
}
JR_ROWS = tuple(f"jr-{tier}" for tier in TIERS)  # the float32 DenseDiskStream rows
PC_FLOOR_ROWS = ("jr-host0", "jr-host2")  # page-cache step held to the floor
#: Accelerate loaded as documented (its offload files written at the load) and reusing
#: the folder that load wrote; targets compare with the leaner of the two.
ACCELERATE_ROWS = ("accelerate", "accelerate-reuse")
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
  if name == "accelerate-reuse":
    return "accelerate, offload folder reused"
  if name == "torch":
    return "torch port (loaded whole)"
  scheme, tier = row_of(name)
  return "jr " + ("" if scheme == "float32" else f"{scheme} ") + TIER_LABELS[tier]


# ---------------------------------------------------------------------------- model and paths


def gpt_config(args: argparse.Namespace):
  """The benchmark's :class:`GPTConfig`; it holds the prompt and every decode step."""
  return _measure.gpt_config(args, args.prompt_len + args.steps, tie_head=args.tie_head)


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
  crc = "-nocrc" if args.no_checksums else ""  # stores written without chunk checksums
  return {
    "base": base,
    "store": os.path.join(base, f"jr-store{crc}"),
    **{f"store-{q}": os.path.join(base, f"jr-store-{q}{crc}") for q in SCHEMES},
    **{f"store-{q}-info": os.path.join(base, f"jr-store-{q}{crc}.json") for q in SCHEMES},
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

  Block = _torch_peer.block(cfg, proj="proj")

  class GPT(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
      self.pos_embed = nn.Embedding(cfg.max_len, cfg.d_model)
      self.layers = nn.ModuleList(Block() for _ in range(cfg.n_layers))
      self.norm = nn.LayerNorm(cfg.d_model, eps=_torch_peer.LN_EPS)
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


# ---------------------------------------------------------------------------- children


def write_checksums(args: argparse.Namespace) -> None:
  """Stores are written with chunk checksums (as ``jr.save`` writes them) unless
  ``--no-checksums``: ``jr.save`` takes no option for it, so this turns off the writer's
  module switch (as ``benchmarks/checksum_step.py`` does)."""
  from jax_residency._src.store import writer

  writer.WRITE_CHECKSUMS = not args.no_checksums


def build(args: argparse.Namespace) -> dict:
  """Model (seed 0) -> jax_residency store, prompts and the reference generation; the
  quantized stores of ``--quantize`` (each with its sizes as JSON), and with
  ``--with-checkpoint`` the torch port's checkpoint: whichever is not written yet."""
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  p = paths(args)
  os.makedirs(p["base"], exist_ok=True)
  cfg = gpt_config(args)
  model = models.init_gpt(cfg, seed=0)
  if not os.path.exists(p["reference"]):
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, cfg.vocab_size, (1, args.prompt_len), dtype=np.int32)
    warmup = rng.integers(0, cfg.vocab_size, (1, args.prompt_len), dtype=np.int32)
    run = greedy(gpt_step(plain_jitted(model)), prompt, args.steps)
    np.savez(
      p["reference"] + ".tmp.npz",
      prompt=prompt,
      warmup=warmup,
      tokens=run["tokens"],
      logits=run["logits"],
    )
    os.replace(p["reference"] + ".tmp.npz", p["reference"])
  write_checksums(args)
  if not os.path.exists(p["store"]):
    jr.save(model, p["store"], progress=False, overwrite=True)
  for scheme in parse_schemes(args.quantize):
    info_path = p[f"store-{scheme}-info"]
    if os.path.exists(info_path):
      continue
    info = jr.save(model, p[f"store-{scheme}"], progress=False, overwrite=True, quantize=scheme)
    with open(info_path + ".tmp", "w") as f:
      json.dump(
        {
          "unit_bytes": info.unit_nbytes,
          "static_bytes": info.static_nbytes,
          "unit_count": info.unit_count,
        },
        f,
      )
    os.replace(info_path + ".tmp", info_path)
  if args.with_checkpoint and not os.path.exists(p["checkpoint"]):
    state = _torch_peer.state_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg.n_layers)
    del model
    _torch_peer.save_checkpoint(state, p["checkpoint"])
  return {}


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
    parallel_read([f for path in files for f in files_under(path)], threads=4)

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


def timed_load(load, peaks: Peaks) -> tuple:
  """``load()``'s result and the load figures every row reports: its time and the bytes it
  read, and the RSS before it (the baseline), at its peak and after it."""
  loaded, out = _measure.timed_load(load, peaks)
  return loaded, out | after_load()


def after_load() -> dict:
  """RSS and anonymous RSS once a row's model is loaded."""
  return {"rss_after_load_bytes": rss_bytes(), "anon_after_load_bytes": rss_anon_bytes()}


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
  drop_page_cache(store)
  placed, out = timed_load(lambda: jr.place(abstract, policy, store=store, mesh=mesh), peaks)
  out |= {
    "unit_bytes": unit,
    "static_bytes": size["static_bytes"],
    "plan_bytes": placed.metadata.planned_process_bytes,
  }
  if isinstance(policy, jr.DenseDiskStream):
    out["host_budget_bytes"] = policy.options.host_budget_bytes
    out["device_budget_bytes"] = policy.options.device_budget_bytes
  with placed:
    step = gpt_step(placed)
    out |= warm_up(args, step)
    out["regimes"] = regimes(
      args, args.child, step, [store], peaks, placed.clear_caches, placed.report
    )
  out["peak_rss_bytes"] = peaks.process  # load, warm-up and both generations
  return out


def plain_child(args: argparse.Namespace) -> dict:
  """The plain model (seed 0, the stores' weights) under ``jax.jit``, built in memory: the
  anchor of ``FullyResident``'s speed. Its weights are arrays of this process, so the two
  regimes differ only in what the page cache holds of the store it never reads."""
  import jax

  from jax_residency import models

  cfg = gpt_config(args)
  store = store_of(args, "float32")
  size = sizes(args)
  jax.numpy.zeros(()).block_until_ready()  # backend initialised before the baseline
  peaks = Peaks()
  forward, out = timed_load(lambda: plain_jitted(models.init_gpt(cfg, seed=0)), peaks)
  out |= {"unit_bytes": size["unit_bytes"], "static_bytes": size["static_bytes"]}
  step = gpt_step(forward)
  out |= warm_up(args, step)
  out["regimes"] = regimes(args, args.child, step, [store], peaks, lambda: None)
  out["peak_rss_bytes"] = peaks.process
  return out


def accelerate_child(args: argparse.Namespace) -> dict:
  """Accelerate's documented disk offload: meta model, ``load_checkpoint_and_dispatch``."""
  p = paths(args)
  cfg = gpt_config(args)
  peaks = Peaks()
  loaded = _torch_peer.disk_offload(
    torch_gpt(cfg), p["checkpoint"], accelerate_device_map(cfg), p["offload"], peaks
  )
  return accelerate_row(args, "accelerate", loaded, peaks)


def accelerate_reuse_child(args: argparse.Namespace) -> dict:
  """Accelerate's leanest load: the offload folder the documented row wrote is reused
  (``dispatch_model(..., offload_dir=...)`` finds its ``index.json`` and writes nothing);
  the blocks kept on the CPU (embeddings, final norm, head) are read from the checkpoint."""
  import logging

  from accelerate import dispatch_model, init_empty_weights
  from accelerate.utils import set_module_tensor_to_device
  from safetensors import safe_open

  logging.getLogger("accelerate").setLevel(logging.ERROR)
  p = paths(args)
  cfg = gpt_config(args)
  if not os.path.isfile(os.path.join(p["offload"], "index.json")):
    raise SystemExit(f"{p['offload']}: no offload folder to reuse (the accelerate row writes it)")
  with init_empty_weights():
    model = torch_gpt(cfg)()
  peaks = Peaks()
  drop_page_cache(p["checkpoint"])

  def load():
    with safe_open(p["checkpoint"], framework="pt") as f:
      for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
        if not key.startswith("layers."):
          set_module_tensor_to_device(model, key, "cpu", value=f.get_tensor(key))
    return dispatch_model(model, device_map=accelerate_device_map(cfg), offload_dir=p["offload"])

  loaded = _torch_peer.accelerate_load(load, peaks)
  return accelerate_row(args, "accelerate-reuse", loaded, peaks)


def accelerate_row(args: argparse.Namespace, name: str, loaded: tuple, peaks: Peaks) -> dict:
  """One Accelerate row from its load on (``loaded``: the model and the load's figures):
  the warm-up, both regimes (the offload folder's block files and the checkpoint are its
  weights' files)."""
  import torch

  p = paths(args)
  model, out = loaded
  out |= after_load() | {
    "threads": torch.get_num_threads(),
    "offload_bytes": sum(os.path.getsize(f) for f in files_under(p["offload"])),
  }
  step = torch_step(model)
  with torch.inference_mode():
    out |= warm_up(args, step)
    files = [p["offload"], p["checkpoint"]]
    out["regimes"] = regimes(args, name, step, files, peaks, lambda: None)
  out["peak_rss_bytes"] = peaks.process
  return out


def accelerate_device_map(cfg) -> dict[str, str]:
  """Every block on ``"disk"``; embeddings, final norm and an untied head on the CPU."""
  device_map = {"embed": "cpu", "pos_embed": "cpu", "norm": "cpu"}
  device_map |= {} if cfg.tie_head else {"head": "cpu"}
  return device_map | {f"layers.{i}": "disk" for i in range(cfg.n_layers)}


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
  parallel_read(files, threads=4)  # into the page cache
  out: dict = {"threads": {}}
  for threads in READ_THREADS:
    start = time.perf_counter()
    n = parallel_read(files, threads=threads)
    out["threads"][str(threads)] = n / (time.perf_counter() - start)
  out["bytes"] = n
  out["best_threads"] = max(out["threads"], key=out["threads"].get)
  out["bytes_per_s"] = out["threads"][out["best_threads"]]
  # From disk: the store's pages dropped, then read once by 4 threads.
  drop_page_cache(paths(args)["store"])
  start = time.perf_counter()
  n = parallel_read(files, threads=COLD_READ_THREADS)
  out["cold_bytes_per_s"] = n / (time.perf_counter() - start)
  return out


CHILDREN = {
  "build": build,
  "torch": torch_child,
  "accelerate": accelerate_child,
  "accelerate-reuse": accelerate_reuse_child,
  "bandwidth": bandwidth_child,
  **{name: jr_child for name in (*JR_ROWS, "jr-resident")},
  "jr-plain": plain_child,
  **{name: jr_child for q in SCHEMES for name in quant_rows(q)},
}


# ---------------------------------------------------------------------------- parent


#: The options a child takes from the run: the model, the generation, how the stores are written.
CHILD_ARGS = (
  *("layers", "d_model", "d_ff", "vocab", "heads", "prompt_len", "steps"),
  *("tie_head", "no_checksums"),
)


def run_child(
  args: argparse.Namespace, which: str, *, may_fail: bool = False, extra: tuple[str, ...] = ()
) -> dict:
  """One child's JSON; on failure, exits (or with ``may_fail``, returns ``{"error": ...}``)."""
  argv = ["--child", which, "--dir", args.dir, *extra, *_child.flags(args, CHILD_ARGS)]
  return _child.run(__file__, *argv, what=which, may_fail=may_fail)


def common_prefix(a, b) -> int:
  """How many leading tokens ``a`` and ``b`` share."""
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def run_names(names: list[str]) -> list[str]:
  """The saved generations of rows: one per regime (``"jr-host0@disk"``)."""
  return [f"{name}@{regime}" for name in names for regime in REGIMES]


def check_parity(args: argparse.Namespace, names: list[str], peers: bool) -> dict:
  """Tokens of every float32 run against the plain model's; logits within the gate's tolerance.

  Logits are compared over the steps whose inputs every run shares (all of
  them, unless a float difference flipped a greedy token somewhere); with the
  peers (``peers``), also against the torch port's, and the torch port is
  compared teacher-forced, over every step.
  """
  ref = reference(args)
  runs = {name: load_run(args, name) for name in ["torch"] * peers + run_names(names)}
  # Step i's input is token i-1, so its logits are comparable while the tokens before it agree.
  steps = min(
    [1 + common_prefix(run["tokens"], ref["tokens"]) for run in runs.values()],
    default=len(ref["tokens"]),
  )
  steps = min(steps, len(ref["tokens"]))
  out = parity_of(
    ref["logits"][:steps],
    {name: run["logits"][:steps] for name, run in runs.items()},
    torch=runs["torch"]["logits"][:steps] if peers else None,
  )
  if peers:
    forced = load_run(args, "torch-forced")
    gate = parity_of(ref["logits"], {"torch": forced["logits"]})
    out["max_abs_diff"]["torch vs jax (teacher-forced)"] = gate["max_abs_diff"]["torch vs jax"]
    out["forced_logit_scale"] = gate["logit_scale"]
    out["ok"] = out["ok"] and gate["ok"]
  out["steps_compared"] = steps
  out["tokens_match_jax"] = {
    name: bool((run["tokens"] == ref["tokens"]).all()) for name, run in runs.items()
  }
  for row in ACCELERATE_ROWS:
    for regime in REGIMES:
      if f"{row}@{regime}" in runs:
        out[f"{row}@{regime}_tokens_match_torch"] = bool(
          (runs[f"{row}@{regime}"]["tokens"] == runs["torch"]["tokens"]).all()
        )
  # A float32 row of jax_residency must generate the plain model's tokens exactly.
  out["ok"] = out["ok"] and all(v for n, v in out["tokens_match_jax"].items() if n[:2] == "jr")
  return out


def parity_checks(checks: list[dict], par: dict) -> None:
  """The parity gates of :func:`check_parity`'s result, one per row: its logits (both
  regimes) within ``PARITY_RTOL`` of the logit scale, and a jax_residency row's greedy
  tokens equal to the plain JAX model's; the torch port teacher-forced on its own."""
  limit = PARITY_RTOL * par["logit_scale"]
  diffs = dict(par["max_abs_diff"])
  forced = diffs.pop("torch vs jax (teacher-forced)", None)
  if forced is not None:
    forced_limit = PARITY_RTOL * par["forced_logit_scale"]
    _result.check(
      checks,
      f"torch port fed the plain JAX model's tokens: logits within {PARITY_RTOL:g} x logit "
      "scale of the plain JAX model's at every step",
      forced <= forced_limit,
      f"max |diff| {forced:.2e}; limit {forced_limit:.2e}",
      _result.PARITY,
    )
  for row, worst in _parity.by_run(diffs, lambda run: run.partition("@")[0]).items():
    who = " and the torch port's" if "torch" in worst else ""
    where = "" if row == "torch" else ", both regimes"
    _result.check(
      checks,
      f"{label(row)}: logits within {PARITY_RTOL:g} x logit scale of the plain JAX model's"
      f"{who}{where}, over the steps whose inputs agree",
      all(d <= limit for d in worst.values()),
      ", ".join(f"max |diff| vs {k} {d:.2e}" for k, d in worst.items())
      + f"; limit {limit:.2e}; {par['steps_compared']} steps",
      _result.PARITY,
    )
  tokens: dict[str, dict[str, bool]] = {}
  for run, same in par["tokens_match_jax"].items():
    row, _, regime = run.partition("@")
    if row.startswith("jr"):
      tokens.setdefault(row, {})[regime] = same
  for row, same in tokens.items():
    _result.check(
      checks,
      f"{label(row)}: greedy tokens = the plain JAX model's, both regimes",
      all(same.values()),
      ", ".join(f"{r}: {'equal' if v else 'DIFFER'}" for r, v in same.items()),
      _result.PARITY,
    )


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


def drop_check(checks: list[dict], fig: dict, weights: float) -> None:
  """Whether /proc/self/io saw the reads the drops call for (a target: a check of the
  measurement, which toy sizes do not make reliable).

  A disk-regime step reads from its weights ``weights`` bytes: at least those
  not held mapped across the drop should come from the disk, and no more than
  all of them (1.33x for readahead). A page-cache step should read ~0.
  """
  disk = fig["regimes"]["disk"]
  io, held = disk["io_read_per_step_bytes"], disk["held_mapped_per_step_bytes"]
  warm = fig["regimes"]["page-cache"]["io_read_per_step_bytes"]
  lo, hi = DISK_READ_RANGE
  _result.check(
    checks,
    f"{label(fig['name'])}: a disk-regime step's read_bytes in [{lo:g}x (weights read - held "
    f"mapped), {hi:g}x weights read], a page-cache step's <= {PC_READ_SLACK:g}x weights read",
    lo * max(weights - held, 0) <= io <= hi * weights and warm <= PC_READ_SLACK * weights,
    f"/proc/self/io reads {fmt_read(io)} per disk step for {fmt_read(weights)} read from the "
    f"weights, {fmt_read(held)} of their pages held mapped; {fmt_read(warm)} per page-cache step",
    _result.TARGET,
  )


def _disk_bound(mine: dict, theirs: dict, bandwidth: dict) -> str:
  """What 10x Accelerate's disk-regime step takes of the disk: the row's reads a step
  (``/proc/self/io``) in a tenth of Accelerate's step, against the raw read from disk."""
  need = mine["io_read_per_step_bytes"] / (theirs["decode_step_s"] / INT8_OVER_ACCELERATE)
  return (
    f"; {INT8_OVER_ACCELERATE:g}x takes {fmt_bytes(mine['io_read_per_step_bytes'])} a step "
    f"at {need / 1e9:.2f} GB/s, the raw read from disk here "
    f"{bandwidth['cold_bytes_per_s'] / 1e9:.2f} GB/s"
  )


def derive(run: dict, args: argparse.Namespace, unit_bytes_total: int) -> dict:
  """Rates, RSS growths, checks of the targets and ratios of one run of the rows it has.

  Returns the targets: figures, ``checks`` (:func:`_result.check` entries, all
  targets) and ``skipped`` (the targets that could not be checked, and why).
  """
  rows = [name for name in run if name in ACCELERATE_ROWS or name.startswith("jr")]
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
  loaded = [run[n] for n in ACCELERATE_ROWS if n in run and "error" not in run[n]]
  # The leaner of Accelerate's two loads: the smaller peak RSS growth after the load.
  acc_fig = min(loaded, key=lambda f: f["rss_growth_after_load_bytes"], default=None)
  acc = acc_fig["regimes"] if acc_fig else None
  resident_step = run["jr-resident"]["regimes"]["page-cache"]["decode_step_s"]
  read_step = unit_bytes_total / run["bandwidth"]["bytes_per_s"]
  floor = max(resident_step, read_step)
  targets: dict = {"floor_step_s": floor, "resident_step_s": resident_step}
  targets["accelerate_row"] = acc_fig["name"] if acc_fig else None
  targets["read_step_s"] = read_step
  checks: list[dict] = []
  skipped: list[str] = []

  def check(name: str, ok: bool, value: str) -> None:
    _result.check(checks, name, ok, value, _result.TARGET)

  # float32: decode >= 3x Accelerate with the weights in the page cache, peak RSS <= its.
  if acc_fig is None:
    skipped.append(
      "float32 rows' page-cache decode and peak RSS, int8 rows' disk decode and RssAnon, "
      "against Accelerate's: no accelerate row"
    )
  for name in [n for n in JR_ROWS if n in run and acc_fig is not None]:
    fig = run[name]
    speed = fig["regimes"]["page-cache"]["decode_tokens_per_s"]
    speed /= acc["page-cache"]["decode_tokens_per_s"]
    anon, acc_anon = fig["anon_growth_after_load_bytes"], acc_fig["anon_growth_after_load_bytes"]
    disk = fig["regimes"]["disk"]["decode_tokens_per_s"] / acc["disk"]["decode_tokens_per_s"]
    targets[f"{name} disk decode vs accelerate"] = disk  # context, no target
    check(
      f"{label(name)}: page-cache decode tok/s >= {DECODE_OVER_ACCELERATE:g}x "
      f"{label(acc_fig['name'])}'s",
      speed >= DECODE_OVER_ACCELERATE,
      f"{speed:.2f}x",
    )
    # Anonymous memory: what the kernel cannot reclaim (mapped store pages it can).
    check(
      f"{label(name)}: RssAnon growth after the load <= {label(acc_fig['name'])}'s",
      anon <= acc_anon,
      f"{fmt_bytes(anon)} against {fmt_bytes(acc_anon)} ({anon / acc_anon:.2f}x)",
    )
  for name in [n for n in JR_ROWS if n in run]:
    growth, plan = run[name]["rss_growth_after_load_bytes"], run[name]["plan_bytes"]
    check(
      f"{label(name)}: peak RSS growth after the load <= the plan",
      growth <= plan,
      f"{fmt_bytes(growth)} against {fmt_bytes(plan)}",
    )
  for name in [n for n in PC_FLOOR_ROWS if n in run]:
    step = run[name]["regimes"]["page-cache"]["decode_step_s"]
    check(
      f"{label(name)}: page-cache decode step <= {PAGE_CACHE_SLACK:g}x floor (max of the "
      "resident step and unit bytes / warm-read bandwidth)",
      step / floor <= PAGE_CACHE_SLACK,
      f"{step:.4f} s = {step / floor:.2f}x floor {floor:.4f} s; {step / read_step:.2f}x the "
      "read term alone",
    )

  host0_targets(run, acc_fig, unit_bytes_total, targets, check)

  # FullyResident, every weight resident, against the dense stream with every unit cached:
  # on one CPU device both run the same steps on the same bytes in memory. Strictly <=
  # missed on noise alone (at 35dc93d: 1.18x on the median of 3, per run 1.29x, 1.18x,
  # 0.96x; the two children run in turn right after gave 1.01x and 0.99x).
  all_step = run["jr-all"]["regimes"]["page-cache"]["decode_step_s"]
  check(
    f"jr FullyResident: page-cache decode step <= {PAGE_CACHE_SLACK:g}x jr host all's",
    resident_step <= PAGE_CACHE_SLACK * all_step,
    f"{resident_step:.4f} s against {all_step:.4f} s ({resident_step / all_step:.2f}x)",
  )

  # The absolute anchor: FullyResident against the plain model it places, under jax.jit.
  plain_tps = run["jr-plain"]["regimes"]["page-cache"]["decode_tokens_per_s"]
  resident_tps = run["jr-resident"]["regimes"]["page-cache"]["decode_tokens_per_s"]
  targets["plain_step_s"] = run["jr-plain"]["regimes"]["page-cache"]["decode_step_s"]
  check(
    f"jr FullyResident: page-cache decode tok/s >= {RESIDENT_OVER_PLAIN:g}x the plain jitted "
    "model's",
    resident_tps >= RESIDENT_OVER_PLAIN * plain_tps,
    f"{resident_tps:.2f} against {plain_tps:.2f} tok/s ({resident_tps / plain_tps:.2f}x)",
  )

  # Quantized rows: the step against float32's at host 0, per regime; int8 against Accelerate.
  for scheme in SCHEMES:
    names = [n for n in quant_rows(scheme) if n in run and "error" not in run[n]]
    host0 = run.get(f"jr-{scheme}-host0", {"error": "not run"})
    if "error" not in host0 and "jr-host0" in run:
      for regime, limit in QUANT_STEP_RATIO[scheme].items():
        step = host0["regimes"][regime]["decode_step_s"]
        base = run["jr-host0"]["regimes"][regime]["decode_step_s"]
        check(
          f"{label(host0['name'])}: {regime} decode step <= {limit:g}x jr host 0's (float32)",
          step / base <= limit,
          f"{step / base:.2f}x ({step:.4f} s against {base:.4f} s)",
        )
    if scheme != "int8":
      continue
    for name in names:
      fig = run[name]
      growth, plan = fig["rss_growth_after_load_bytes"], fig["plan_bytes"]
      if acc_fig is not None:
        for regime in REGIMES:
          mine, theirs = fig["regimes"][regime], acc[regime]
          speed = mine["decode_tokens_per_s"] / theirs["decode_tokens_per_s"]
          reads = regime == "disk" and mine["io_read_per_step_bytes"] > 0
          bound = _disk_bound(mine, theirs, run["bandwidth"]) if reads else ""
          check(
            f"{label(name)}: {regime} decode tok/s >= {INT8_OVER_ACCELERATE:g}x "
            f"{label(acc_fig['name'])}'s",
            speed >= INT8_OVER_ACCELERATE,
            f"{speed:.2f}x{bound}",
          )
        anon, acc_anon = (
          fig["anon_growth_after_load_bytes"],
          acc_fig["anon_growth_after_load_bytes"],
        )
        check(
          f"{label(name)}: RssAnon growth after the load <= {label(acc_fig['name'])}'s",
          anon <= acc_anon,
          f"{fmt_bytes(anon)} against {fmt_bytes(acc_anon)}",
        )
      check(
        f"{label(name)}: peak RSS growth after the load <= the plan",
        growth <= plan,
        f"{fmt_bytes(growth)} against {fmt_bytes(plan)}",
      )

  # The drops: reads per step that the page cache served, or the disk.
  for name in rows:
    fig = run[name]
    if "error" in fig:
      continue
    expected = (
      unit_bytes_total
      if name in ACCELERATE_ROWS
      else fig["regimes"]["disk"].get("store_read_per_step_bytes", 0)
    )
    if expected > 0:
      drop_check(checks, fig, expected)
  targets["checks"] = checks
  targets["skipped"] = skipped
  return targets


def host0_targets(run: dict, acc_fig: dict | None, unit_bytes: int, targets: dict, check) -> None:
  """float32 host 0 (no host cache), with checksums: page-cache decode >= 4.5x Accelerate's
  (its memory targets are every float32 row's); disk-bound, a step <= 1.1x a 4-thread raw
  read of the units from disk and >= 1.5x Accelerate's tok/s."""
  fig = run.get("jr-host0")
  if fig is None:
    return
  raw_step = unit_bytes / run["bandwidth"]["cold_bytes_per_s"]
  targets["cold_read_step_s"] = raw_step
  step = fig["regimes"]["disk"]["decode_step_s"]
  check(
    f"jr host 0: disk decode step <= {DISK_OVER_RAW_READ:g}x unit bytes / {COLD_READ_THREADS}-"
    "thread raw read from disk",
    step <= DISK_OVER_RAW_READ * raw_step,
    f"{step:.4f} s = {step / raw_step:.2f}x {raw_step:.4f} s",
  )
  if acc_fig is None:
    return
  for regime, limit in HOST0_OVER_ACCELERATE.items():
    speed = fig["regimes"][regime]["decode_tokens_per_s"]
    speed /= acc_fig["regimes"][regime]["decode_tokens_per_s"]
    check(
      f"jr host 0: {regime} decode tok/s >= {limit:g}x {label(acc_fig['name'])}'s",
      speed >= limit,
      f"{speed:.2f}x",
    )


def rows_to_run(quick: bool, schemes: list[str]) -> tuple[list[str], list[str], list[str]]:
  """The float32 rows, the quantized rows, and the rows ``--quick`` leaves out."""
  float_rows = [*JR_ROWS, "jr-resident", "jr-plain"]
  q_rows = [name for scheme in schemes for name in quant_rows(scheme)]
  if not quick:
    return float_rows, q_rows, []
  keep = {"jr-host0", "jr-all", "jr-resident", "jr-plain", *(f"jr-{q}-host0" for q in schemes)}
  left = [n for n in float_rows + q_rows if n not in keep]
  return [n for n in float_rows if n in keep], [n for n in q_rows if n in keep], left


def measure(
  args: argparse.Namespace,
  unit_bytes_total: int,
  float_rows: list[str],
  q_rows: list[str],
  peers: bool,
) -> dict:
  run = {name: run_child(args, name) for name in float_rows}
  run |= {name: run_child(args, name, may_fail=True) for name in q_rows}
  if peers:
    run["accelerate"] = run_child(args, "accelerate")
    run["accelerate-reuse"] = run_child(args, "accelerate-reuse")
  run["bandwidth"] = run_child(args, "bandwidth")
  run["parity"] = check_parity(args, [*ACCELERATE_ROWS] * peers + float_rows, peers)
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


def print_parity(result: dict) -> None:
  """The parity figures: max logit differences, which rows' tokens match, quantized rows'."""
  par = result["parity"]
  diff = dict(par["max_abs_diff"])
  forced = diff.pop("torch vs jax (teacher-forced)", None)

  def worst(prefix: str, against: str) -> str:
    values = [v for k, v in diff.items() if k.startswith(prefix) and k.endswith(against)]
    return f"{max(values):.1e}" if values else "-"

  peer = (
    f"torch port vs JAX {forced:.1e} teacher-forced, {diff['torch vs jax']:.1e} greedy; "
    f"accelerate vs torch {worst('accelerate', 'vs torch')}; "
    if forced is not None
    else ""
  )
  print(
    f"parity (max |logit diff| over {par['steps_compared']} steps; logit scale "
    f"{par['logit_scale']:.1f}, limit {PARITY_RTOL:g}x that): {peer}float32 jax_residency "
    f"rows vs JAX {worst('jr', 'vs jax')}"
    + (f", vs torch {worst('jr', 'vs torch')}" if forced is not None else "")
  )
  same = [n for n, ok in par["tokens_match_jax"].items() if ok]
  differ = [n for n, ok in par["tokens_match_jax"].items() if not ok]
  acc = [par[k] for k in par if k.endswith("_tokens_match_torch")]
  print(
    f"greedy tokens = the plain JAX model's: {', '.join(same) or 'none'}"
    + (f"; DIFFER: {', '.join(differ)}" if differ else "")
    + (f"; accelerate = torch port (reported, not gated): {all(acc)}" if acc else "")
  )
  if result.get("quant_parity"):
    print("quantized rows against the float32 plain model (reported, not gated):")
    for name, q in result["quant_parity"].items():
      print(
        f"  {name}: tokens agree {q['token_agreement']:.2f} (first {q['prefix']} equal); "
        f"logits error / logit scale over {q['steps_compared']} steps: max "
        f"{q['logits_max_rel']:.2e}, mean {q['logits_mean_rel']:.2e}"
      )


def print_table(result: dict, args: argparse.Namespace) -> None:
  if result.get("refused"):
    print(f"timings not reported: {result['refused']}")
    print_parity(result)
    return
  med = result["median"]
  acc, tg = med.get("accelerate"), med["targets"]
  size = result["sizes"]
  unit = size["unit_bytes"]
  names = [n for n in med if n.startswith("jr") and "error" not in med[n]]
  names += [n for n in ACCELERATE_ROWS if n in med]

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
    + ("" if result["checksums"] else "; stores written without chunk checksums")
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
  if result["rows_left_out"]:
    print(f"--quick leaves out: {', '.join(label(n) for n in result['rows_left_out'])}")
  versions = result["versions"]
  peer = (
    f"accelerate {versions['accelerate']}, torch {versions['torch']} ({acc['threads']} threads)"
    if acc
    else f"accelerate and torch rows skipped: {result['peers_skipped']}"
  )
  print(
    f"run: {args.prompt_len}-token prompt, then {args.steps} greedy decode steps{runs_note}; "
    f"device budget static + 2 units = {fmt_bytes(size['static_bytes'] + 2 * unit)}; {peer}"
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
      if name in ACCELERATE_ROWS:
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
    f"{tg['resident_step_s']:.4f} s; floor = max = {tg['floor_step_s']:.4f} s; from disk, "
    f"{COLD_READ_THREADS} threads: {bw['cold_bytes_per_s'] / 1e9:.2f} GB/s, unit bytes / that = "
    f"{tg['cold_read_step_s']:.4f} s"
  )
  if acc:
    for name in [n for n in ACCELERATE_ROWS if n in med]:
      a = med[name]
      print(
        f"{label(name)}: load {a['load_s']:.2f} s reads {fmt_bytes(a['load_read_bytes'])}, "
        f"writes {fmt_bytes(a['load_written_bytes'])}"
      )
    print(
      f"targets compare with {label(tg['accelerate_row'])} (the smaller peak RSS growth "
      "after the load); torch resident (context): "
      f"{args.steps / med['torch']['decode_s']:.2f} tok/s, prefill "
      f"{med['torch']['prefill_s']:.2f} s"
    )
    ctx = [f"{label(n)} {tg[f'{n} disk decode vs accelerate']:.2f}x" for n in JR_ROWS if n in med]
    print(f"float32 disk-regime decode vs accelerate's (context): {', '.join(ctx)}")
  for why in tg["skipped"]:
    print(f"targets not checked: {why}")
  for scheme in SCHEMES:
    why = result["quantized"].get(scheme, "no --quantize")
    if not isinstance(why, dict):
      print(f"{scheme} targets: not checked ({why})")
  print()
  print_parity(result)
  print(f"{result['wall_s']:.0f} s wall")


def render(result: dict, args: argparse.Namespace) -> str:
  """:func:`print_table`'s text, for :func:`_result.finish`."""
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):
    print_table(result, args)
  return buf.getvalue().rstrip("\n")


def markdown(result: dict) -> str:
  """The decode table for ``benchmarks/report.py``: per row and regime the median decode
  step, tokens/s and their ratio to Accelerate's (the leaner load), and the memory."""
  med = result.get("median")
  if med is None:
    return f"Timings not reported: {result.get('refused', 'no run completed')}."
  acc_name = med["targets"].get("accelerate_row")
  acc = med[acc_name]["regimes"] if acc_name else None
  names = [n for n in med if n.startswith("jr") and "error" not in med[n]]
  names += [n for n in ACCELERATE_ROWS if n in med]
  head = "| row | " + " | ".join(
    f"{r}: s/step | {r}: tok/s" + (" | vs Accelerate" if acc else "") for r in REGIMES
  )
  head += " | peak RSS growth after load (plan) | RssAnon growth after load |"
  lines = [head, "|" + "---|" * (head.count(" | ") + 1)]
  for name in names:
    fig = med[name]
    cells = [label(name)]
    for regime in REGIMES:
      reg = fig["regimes"][regime]
      cells += [f"{reg['decode_step_s']:.3f}", f"{reg['decode_tokens_per_s']:.2f}"]
      if acc:
        ratio = reg["decode_tokens_per_s"] / acc[regime]["decode_tokens_per_s"]
        cells.append(f"{ratio:.2f}x")
    plan = f" ({fmt_bytes(fig['plan_bytes'])})" if "plan_bytes" in fig else ""
    cells += [
      fmt_bytes(fig["rss_growth_after_load_bytes"]) + plan,
      fmt_bytes(fig["anon_growth_after_load_bytes"]),
    ]
    lines.append("| " + " | ".join(cells) + " |")
  cfg, size = result["config"], result["sizes"]
  runs = len(result.get("runs", [])) or 1
  lines += [
    "",
    f"GPT d_model {cfg['d_model']}, {cfg['n_layers']} layers, d_ff {cfg['d_ff']}, vocab "
    f"{cfg['vocab_size']}; units of {fmt_read(size['unit_bytes'])} float32; "
    f"{result['prompt_len']}-token prompt, {result['steps']} decode steps; medians of {runs} "
    f"run(s); stores {'with' if result.get('checksums', True) else 'without'} chunk checksums."
    + (f" Accelerate's ratios: against {label(acc_name)}." if acc_name else ""),
  ]
  return "\n".join(lines)


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


def prepare(args: argparse.Namespace, schemes: list[str], peers: bool) -> tuple[list[str], dict]:
  """Writes what the rows need and is not written yet (in one ``build`` child), and returns
  the schemes whose rows run and each requested scheme's store sizes (or why it is skipped).

  Skips every scheme, with a message, when this jax_residency's ``jr.save``
  takes no ``quantize=``; the torch checkpoint is written only for the peers.
  """
  p = paths(args)
  quantized: dict = {}
  if schemes and not quantize_supported():
    why = "skipped: this jax_residency's jr.save takes no quantize= yet"
    print(f"{', '.join(schemes)} rows {why}", file=sys.stderr)
    schemes, quantized = [], dict.fromkeys(schemes, why)
  wanted = {"reference": "reference", "store": "float32 store"}
  wanted |= {"checkpoint": "torch checkpoint"} if peers else {}
  wanted |= {f"store-{q}-info": f"{q} store" for q in schemes}
  missing = [what for key, what in wanted.items() if not os.path.exists(p[key])]
  if missing:
    print(f"writing the {', '.join(missing)} under {p['base']} ...", file=sys.stderr)
    extra = ("--with-checkpoint",) if peers else ()
    extra += ("--quantize", ",".join(schemes)) if schemes else ()
    run_child(args, "build", extra=extra)
  return schemes, quantized | {q: store_sizes(args, q) for q in schemes}


#: ``--quick``: a toy size (units of 12 MiB float32), a short generation, one run.
QUICK = {
  "layers": 4,
  "d_model": 256,
  "d_ff": 1024,
  "vocab": 1000,
  "heads": 4,
  "prompt_len": 16,
  "steps": 4,
  "repeat": 1,
}


def main() -> int:
  quick = _result.quick_requested()
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument(
    "--dir",
    help="where the stores, checkpoint and reference are written and reused (default: "
    "$TMPDIR/jax_residency_decode; with --quick, a fresh temporary directory removed at the end)",
  )
  _measure.add_gpt_args(parser, layers=12, d_model=2048, d_ff=8192, heads=16, vocab=32000)
  parser.add_argument("--tie-head", action="store_true", help="logits from the embedding (GPT-2)")
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--steps", type=int, default=16, help="decode steps after the prefill")
  parser.add_argument(
    "--quantize",
    action="append",
    metavar="SCHEMES",
    help="also rows from quantized stores: int8, int4 (repeat, or a comma list; --quick: both)",
  )
  parser.add_argument("--repeat", type=int, default=1, help="runs; figures are medians")
  parser.add_argument(
    "--no-checksums",
    action="store_true",
    help="stores written without chunk checksums, in their own directories (jr-store-nocrc...)",
  )
  _result.add_args(parser)
  parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  parser.add_argument("--with-checkpoint", action="store_true", help=argparse.SUPPRESS)
  if quick:
    parser.set_defaults(**QUICK)
  args = parser.parse_args()
  if args.child:
    args.dir = os.path.abspath(args.dir)
    return _child.answer(CHILDREN[args.child](args))
  if args.no_checksums and not args.quick and args.result is None:
    # Its own file: a run without checksums does not replace the default run's result.
    args.result = str(_result.RESULTS / "decode-no-checksums.json")
  with _result.work_dir(args, "jax_residency_decode"):
    return bench(args)


def bench(args: argparse.Namespace) -> int:
  started = time.perf_counter()
  versions, why = _torch_peer.peer_versions(ACCELERATE_VERSION)
  peers = versions is not None
  if not peers:
    print(f"accelerate and torch rows skipped: {why}", file=sys.stderr)
  schemes = parse_schemes(args.quantize if args.quantize or not args.quick else list(SCHEMES))
  schemes, quantized = prepare(args, schemes, peers)
  float_rows, q_rows, left_out = rows_to_run(args.quick, schemes)
  size = sizes(args)
  cfg = gpt_config(args)
  unit_bytes_total = cfg.n_layers * size["unit_bytes"]
  result: dict = _result.stamp("decode", None, args.quick) | {
    "versions": versions or {},
    "peers_skipped": why or None,
    "checksums": not args.no_checksums,
    "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    "sizes": size | {"unit_bytes_total": unit_bytes_total},
    "quantized": quantized,
    "rows_left_out": left_out,
    "prompt_len": args.prompt_len,
    "steps": args.steps,
  }
  checks: list[dict] = result.setdefault("checks", [])

  def done() -> int:
    result["wall_s"] = time.perf_counter() - started
    return _result.finish(result, args, functools.partial(render, args=args))

  # The gate first: the torch port, fed the plain model's tokens, against its logits.
  if peers:
    result["torch"] = run_child(args, "torch")
    result["parity"] = check_parity(args, [], peers)
    if not result["parity"]["ok"]:
      parity_checks(checks, result["parity"])
      result["refused"] = "the torch port does not match the plain JAX model"
      return done()

  runs, pars = [], []
  for i in range(args.repeat):
    print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr)
    run = measure(args, unit_bytes_total, float_rows, q_rows, peers)
    pars.append(run.pop("parity"))
    result["quant_parity"] = run.pop("quant_parity")
    runs.append(run)
    if not pars[-1]["ok"]:
      break  # no timings of outputs that differ: the gates below fail the run
  result["parity"] = _parity.merge(pars)
  parity_checks(checks, result["parity"])
  for name in q_rows:
    errors = [run[name]["error"] for run in runs if "error" in run[name]]
    _result.check(
      checks,
      f"{label(name)}: places its store and generates (tokens reported, not gated)",
      not errors,
      errors[0] if errors else "ran",
      _result.PARITY,
    )
  result["runs"] = runs
  if not result["parity"]["ok"]:
    result["refused"] = "a row's outputs differ from the plain JAX model's"
    return done()
  # Figures are medians over runs; the targets are checked on the medians.
  med = result["median"] = median_run(runs) | ({"torch": result["torch"]} if peers else {})
  med["targets"] = derive(med, args, unit_bytes_total)
  checks += med["targets"]["checks"]
  return done()


if __name__ == "__main__":
  sys.exit(main())
