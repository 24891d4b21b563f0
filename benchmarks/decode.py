"""Greedy decoding from disk: DenseDiskStream against Hugging Face Accelerate's disk offload.

The workload is the GPT decoder of ``jax_residency.models`` (by default d_model
2048, 12 layers, 16 heads, d_ff 8192, vocab 32000, float32: units of ~201 MB,
2.42 GB of units; ``--tie-head`` ties the output head to the token embedding as
GPT-2 does). One generation is a 128-token prompt (the prefill), then 16 greedy
one-token decode steps over a KV cache. The weights are written once under
``--dir`` (a jax_residency store with ``jr.save``, a ``model.safetensors`` for a
PyTorch port of the same decoder) and reused by later runs.

Each row below runs in a fresh process (``--child``, one JSON object on
stdout). It places or loads the model, runs one warm-up generation of a
different prompt (prefill + one decode step: XLA compiles here, torch warms
up), clears the policy's caches, drops the weights from the page cache
(``posix_fadvise``) and then times the generation:

* ``jr host 0``, ``jr host 2 units``, ``jr host all``: ``DenseDiskStream`` with
  a host cache of 0 bytes (disk straight to device), 2 units, or every unit,
  and a device budget of the static parameters + 2 units. The host-0 and
  2-unit processes then clear their caches, read the store once so it sits in
  the page cache, and time a second generation: ``page cache warm``.
* ``jr resident``: ``FullyResident`` from the same store (the resident decode step).
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

Figures per row: ``first_prefill_s`` (the warm-up prefill, with compilation),
``prefill_s`` (compiled, weights cold on disk), decode tokens/s (16 / the decode
steps' total), peak RSS growth over the baseline taken before loading (over
load, warm-up and the timed generation; and over the timed generation alone),
bytes read (``placed.report()``'s disk-to-host + disk-to-device bytes, and the
process's storage reads from ``/proc/self/io``).

Parity: before timing anything the torch port is run whole, fed the plain JAX
model's greedy tokens, and its logits at every step must match the JAX model's
within 1e-3 of the logit scale (``benchmarks/peers.py``'s gate), or the script
refuses to report timings. Afterwards every row's greedy tokens are compared
with the plain model's (and Accelerate's with the torch port's), and its logits
with the same tolerance over the steps whose inputs agree.

Targets (docs/benchmarks.md), evaluated for each ``DenseDiskStream`` row:

* decode tokens/s >= 3x Accelerate's, with peak RSS growth <= Accelerate's;
* decode with the store in the page cache (host 0 / 2 units) within 1.25x of
  the larger of the resident decode step and the unit bytes divided by the
  warm-read bandwidth.

Run it (torch and accelerate are not jax_residency dependencies; on this
project's machines ``torch==2.13.0`` resolves to a CPU-only wheel)::

    pip install torch==2.13.0
    pip install accelerate==1.16.0 safetensors
    python benchmarks/decode.py                  # table; about 8 GB under --dir
    python benchmarks/decode.py --tie-head       # GPT-2 style tied head
    python benchmarks/decode.py --json           # one JSON object
    python benchmarks/decode.py --d-model 256 --d-ff 1024 --layers 4 --vocab 1000  # quick

The first run writes the store, the checkpoint and the reference generation;
at the default size that run, build included, took 13 minutes on a busy 2-core
VM. ``--repeat N`` runs every row N times; figures are medians and the targets
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
  drop_page_cache,
  files_under,
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
DECODE_OVER_ACCELERATE = 3.0  # target: decode tokens/s >= 3x Accelerate's
PAGE_CACHE_SLACK = 1.25  # target: page-cache decode step <= 1.25x max(resident, bytes / bw)
READ_THREADS = (1, 2, 4, 8)
JR_ROWS = ("jr-host0", "jr-host2", "jr-all")  # DenseDiskStream host budgets: 0, 2 units, all
PC_WARM_ROWS = ("jr-host0", "jr-host2")  # also timed with the store in the page cache


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
    "checkpoint": os.path.join(base, "torch", "model.safetensors"),
    "offload": os.path.join(base, "accelerate-offload"),
    "reference": os.path.join(base, "reference.npz"),
  }


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


def greedy(step, prompt, steps: int, force=None) -> dict:
  """A prefill over ``prompt``, then ``steps`` one-token steps, timed.

  Args:
    step: ``step(tokens, cache, pos) -> (last-position logits as numpy, cache)``
      with ``tokens`` a numpy ``(1, t)`` int array and ``cache`` ``None`` for
      the prefill; it returns once the logits are computed.
    prompt: ``(1, t)`` token ids.
    steps: decode steps after the prefill.
    force: feed these tokens instead of the argmax (teacher forcing), so the
      logits can be compared step by step with another model's.

  Returns:
    ``tokens`` ``(1 + steps,)`` (each step's argmax), ``logits``
    ``(1 + steps, vocab)``, ``prefill_s`` and ``step_s`` (one time per decode step).
  """
  import numpy as np

  start = time.perf_counter()
  logits, cache = step(prompt, None, 0)
  prefill_s = time.perf_counter() - start
  all_logits, step_s = [logits], []
  for i in range(steps):
    token = int(np.argmax(all_logits[-1])) if force is None else int(force[i])
    start = time.perf_counter()
    logits, cache = step(np.array([[token]], np.int32), cache, prompt.shape[1] + i)
    step_s.append(time.perf_counter() - start)
    all_logits.append(logits)
  stacked = np.stack(all_logits)
  return {
    "tokens": np.argmax(stacked, axis=-1).astype(np.int32),
    "logits": stacked,
    "prefill_s": prefill_s,
    "step_s": np.array(step_s),
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


def timed_generation(args: argparse.Namespace, step, prepare, peaks: Peaks, report=None) -> dict:
  """Warm-up already done: ``prepare()`` (drop or fill caches), then the timed generation.

  ``report`` returns the placed model's report (jax_residency) for the bytes it read.
  """
  ref = reference(args)
  prepare()
  out: dict = {"rss_before_bytes": rss_bytes()}
  before = report() if report else None
  peaks.reset()
  io0 = io_bytes()
  run = greedy(step, ref["prompt"], args.steps)
  out["disk_read_bytes"] = io_bytes()[0] - io0[0]
  out["generation_peak_rss_bytes"] = peaks.read()
  out["prefill_s"] = run["prefill_s"]
  out["decode_s"] = float(run["step_s"].sum())
  out["step_s"] = run["step_s"].tolist()
  if report:
    after = report()
    out["prefill_bytes_read"] = after.prefill.bytes_read - before.prefill.bytes_read
    out["decode_bytes_read"] = after.decode.bytes_read - before.decode.bytes_read
    out["stalls"] = after.total.stalls - before.total.stalls
    # The library's own peaks over the placement's life (what its caches held).
    out["peak_device_bytes"] = after.total.peak_device_bytes
    out["peak_host_bytes"] = after.total.peak_host_bytes
  return out | {"_run": run}


def warm_up(args: argparse.Namespace, step) -> dict:
  """Prefill + one decode step on a different prompt: compiles (XLA) or warms up (torch)."""
  run = greedy(step, reference(args)["warmup"], 1)
  return {"first_prefill_s": run["prefill_s"], "first_decode_step_s": float(run["step_s"][0])}


def jr_child(args: argparse.Namespace) -> dict:
  """One jax_residency row: DenseDiskStream at a host budget, or FullyResident."""
  import jax
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  p = paths(args)
  cfg = gpt_config(args)
  size = sizes(args)
  unit = size["unit_bytes"]
  jax.numpy.zeros(()).block_until_ready()  # backend initialised before the baseline
  if args.child == "jr-resident":
    policy = jr.FullyResident()
  else:
    host = {"jr-host0": 0, "jr-host2": 2 * unit, "jr-all": cfg.n_layers * unit}[args.child]
    depth = 0 if host == 0 else 2
    policy = jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(
        device_budget_bytes=size["static_bytes"] + 2 * unit,
        host_budget_bytes=host,
        host_lookahead=depth,
        background_queue_capacity=depth,
      )
    )
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  peaks = Peaks()
  baseline = rss_bytes()
  drop_page_cache(p["store"])
  peaks.reset()
  io0 = io_bytes()
  start = time.perf_counter()
  placed = jr.place(abstract, policy, store=p["store"], mesh=mesh)
  out: dict = {
    "load_s": time.perf_counter() - start,
    "load_read_bytes": io_bytes()[0] - io0[0],
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": peaks.read(),
  }
  if isinstance(policy, jr.DenseDiskStream):
    out["host_budget_bytes"] = policy.options.host_budget_bytes
    out["device_budget_bytes"] = policy.options.device_budget_bytes
  with placed:
    step = jax_step(placed)
    out |= warm_up(args, step)

    def cold() -> None:
      placed.clear_caches()
      drop_page_cache(p["store"])

    def page_cache_warm() -> None:
      placed.clear_caches()
      _parallel_read(files_under(p["store"]), threads=4)

    out |= timed_generation(args, step, cold, peaks, placed.report)
    out["peak_rss_bytes"] = peaks.process  # load, warm-up and the cold generation
    save_run(args, args.child, out.pop("_run"))
    if args.child in PC_WARM_ROWS:
      warm = timed_generation(args, step, page_cache_warm, peaks, placed.report)
      save_run(args, f"{args.child}-pc-warm", warm.pop("_run"))
      out["pc_warm"] = warm | {"baseline_rss_bytes": baseline}
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
    "threads": torch.get_num_threads(),
  }
  step = torch_step(model)

  def cold() -> None:
    drop_page_cache(p["offload"], p["checkpoint"])

  with torch.inference_mode():
    out |= warm_up(args, step)
    out |= timed_generation(args, step, cold, peaks)
  out["peak_rss_bytes"] = peaks.process
  out["offload_bytes"] = sum(os.path.getsize(f) for f in files_under(p["offload"]))
  save_run(args, "accelerate", out.pop("_run"))
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
  "torch": torch_child,
  "accelerate": accelerate_child,
  "bandwidth": bandwidth_child,
  **{name: jr_child for name in (*JR_ROWS, "jr-resident")},
}


# ---------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, which: str) -> dict:
  cmd = [sys.executable, __file__, "--child", which, "--dir", args.dir]
  cmd += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--d-ff", str(args.d_ff)]
  cmd += ["--vocab", str(args.vocab), "--heads", str(args.heads)]
  cmd += ["--prompt-len", str(args.prompt_len), "--steps", str(args.steps)]
  cmd += ["--tie-head"] if args.tie_head else []
  # stderr (Accelerate's progress bars, warnings) is shown only if the child fails.
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    sys.stderr.write(done.stderr)
    raise SystemExit(f"{which} failed (exit {done.returncode})")
  out = done.stdout.strip()
  return json.loads(out.splitlines()[-1]) if out else {}


def common_prefix(a, b) -> int:
  """How many leading tokens ``a`` and ``b`` share."""
  n = 0
  while n < min(len(a), len(b)) and a[n] == b[n]:
    n += 1
  return n


def check_parity(args: argparse.Namespace, names: list[str]) -> dict:
  """Tokens of every run against the plain model's; logits within the gate's tolerance.

  Logits are compared over the steps whose inputs every run shares (all of
  them, unless a float difference flipped a greedy token somewhere); the torch
  port is also compared teacher-forced, over every step.
  """
  ref = reference(args)
  runs = {name: load_run(args, name) for name in ["torch", *names]}
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
  if "accelerate" in runs:
    out["accelerate_tokens_match_torch"] = bool(
      (runs["accelerate"]["tokens"] == runs["torch"]["tokens"]).all()
    )
  # A row of jax_residency must generate the plain model's tokens exactly.
  out["ok"] = out["ok"] and all(out["tokens_match_jax"][n] for n in names if n.startswith("jr"))
  return out


def derive(run: dict, args: argparse.Namespace, unit_bytes_total: int) -> dict:
  """Rates, RSS growths, target checks and ratios of one run of every row."""
  acc = run["accelerate"]
  for fig in [run[name] for name in (*JR_ROWS, "jr-resident", "accelerate")]:
    fig["decode_tokens_per_s"] = args.steps / fig["decode_s"]
    fig["decode_step_s"] = fig["decode_s"] / args.steps
    fig["peak_rss_growth_bytes"] = fig["peak_rss_bytes"] - fig["baseline_rss_bytes"]
    fig["generation_rss_growth_bytes"] = (
      fig["generation_peak_rss_bytes"] - fig["baseline_rss_bytes"]
    )
    if "pc_warm" in fig:
      warm = fig["pc_warm"]
      warm["decode_step_s"] = warm["decode_s"] / args.steps
      warm["decode_tokens_per_s"] = args.steps / warm["decode_s"]
  resident_step = run["jr-resident"]["decode_step_s"]
  read_step = unit_bytes_total / run["bandwidth"]["bytes_per_s"]
  floor = max(resident_step, read_step)
  targets: dict = {"floor_step_s": floor, "resident_step_s": resident_step}
  targets["read_step_s"] = read_step
  for name in JR_ROWS:
    fig = run[name]
    speed = fig["decode_tokens_per_s"] / acc["decode_tokens_per_s"]
    rss = fig["peak_rss_growth_bytes"] / acc["peak_rss_growth_bytes"]
    targets[f"{name} decode vs accelerate"] = speed
    targets[f"{name} rss vs accelerate"] = rss
    targets[f"{name} met decode+rss"] = speed >= DECODE_OVER_ACCELERATE and rss <= 1.0
  for name in PC_WARM_ROWS:
    ratio = run[name]["pc_warm"]["decode_step_s"] / floor
    targets[f"{name} pc-warm step vs floor"] = ratio
    targets[f"{name} met pc-warm"] = ratio <= PAGE_CACHE_SLACK
  return targets


def measure(args: argparse.Namespace, unit_bytes_total: int) -> dict:
  run = {name: run_child(args, name) for name in (*JR_ROWS, "jr-resident", "accelerate")}
  run["bandwidth"] = run_child(args, "bandwidth")
  run["parity"] = check_parity(
    args, ["accelerate", *JR_ROWS, *(f"{n}-pc-warm" for n in PC_WARM_ROWS), "jr-resident"]
  )
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
  rows = [
    (
      "row",
      "load",
      "1st prefill",
      "prefill",
      "decode tok/s",
      "s/step",
      "peak RSS growth",
      "gen. RSS growth",
      "bytes read (store / disk)",
    )
  ]

  def read(fig: dict) -> str:
    if "prefill_bytes_read" not in fig:
      return f"- / {fmt_bytes(fig['disk_read_bytes'])}"
    store = fig["prefill_bytes_read"] + fig["decode_bytes_read"]
    return f"{fmt_bytes(store)} / {fmt_bytes(fig['disk_read_bytes'])}"

  def row(label: str, fig: dict, *, load: bool = True) -> tuple:
    return (
      label,
      f"{fig['load_s']:.2f} s" if load else "",
      f"{fig['first_prefill_s']:.2f} s" if load else "",
      f"{fig['prefill_s']:.2f} s",
      f"{fig['decode_tokens_per_s']:.2f}",
      f"{fig['decode_step_s']:.3f}",
      fmt_bytes(fig["peak_rss_growth_bytes"]) if load else "",
      fmt_bytes(fig["generation_peak_rss_bytes"] - fig["baseline_rss_bytes"]),
      read(fig),
    )

  labels = {"jr-host0": "jr host 0", "jr-host2": "jr host 2 units", "jr-all": "jr host all"}
  for name in JR_ROWS:
    rows.append(row(labels[name] + " (cold)", med[name]))
  for name in PC_WARM_ROWS:
    rows.append(row(f"  {labels[name]}, page cache warm", med[name]["pc_warm"], load=False))
  rows.append(row("jr FullyResident", med["jr-resident"]))
  rows.append(row("accelerate disk offload (cold)", acc))
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  cfg = result["config"]
  runs_note = f"; medians of {args.repeat} runs" if args.repeat > 1 else ""
  print(
    f"model: GPT d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, "
    f"d_ff {cfg['d_ff']}, vocab {cfg['vocab_size']}, float32"
    + (", head tied to the embedding" if cfg["tie_head"] else "")
    + f"; units {fmt_bytes(unit)} each, {fmt_bytes(unit * cfg['n_layers'])} in all; "
    f"static {fmt_bytes(size['static_bytes'])}"
  )
  print(
    f"run: {args.prompt_len}-token prompt, then {args.steps} greedy decode steps{runs_note}; "
    f"device budget static + 2 units = {fmt_bytes(size['static_bytes'] + 2 * unit)}; "
    f"accelerate {result['versions']['accelerate']}, torch {result['versions']['torch']} "
    f"({acc['threads']} threads)"
  )
  print()
  for r in rows:
    print("  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip())
  print()
  bw = med["bandwidth"]
  print(
    f"warm-read bandwidth (store in the page cache, best of {', '.join(bw['threads'])} "
    f"threads: {bw['best_threads']}): {bw['bytes_per_s'] / 1e9:.2f} GB/s; "
    f"unit bytes / bandwidth = {tg['read_step_s']:.3f} s; resident decode step "
    f"{tg['resident_step_s']:.3f} s; floor = max = {tg['floor_step_s']:.3f} s"
  )
  print(
    f"accelerate: load {acc['load_s']:.2f} s reads {fmt_bytes(acc['load_read_bytes'])}, "
    f"writes {fmt_bytes(acc['load_written_bytes'])}; torch resident (context): "
    f"{args.steps / med['torch']['decode_s']:.2f} tok/s, prefill {med['torch']['prefill_s']:.2f} s"
  )
  print()
  print("targets:")

  def mark(ok: bool) -> str:
    return "met" if ok else "MISSED"

  for name in JR_ROWS:
    speed = tg[f"{name} decode vs accelerate"]
    rss = tg[f"{name} rss vs accelerate"]
    print(
      f"  {labels[name]:<16} decode {speed:.2f}x accelerate (>= {DECODE_OVER_ACCELERATE:g}x), "
      f"peak RSS growth {rss:.2f}x (<= 1): {mark(tg[f'{name} met decode+rss'])}"
    )
  for name in PC_WARM_ROWS:
    ratio = tg[f"{name} pc-warm step vs floor"]
    step = med[name]["pc_warm"]["decode_step_s"]
    print(
      f"  {labels[name]:<16} page-cache decode step {step:.3f} s = {ratio:.2f}x floor "
      f"(<= {PAGE_CACHE_SLACK:g}x): {mark(tg[f'{name} met pc-warm'])}; "
      f"{step / tg['read_step_s']:.2f}x the read term alone"
    )
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
    f"greedy; accelerate vs torch {diff['accelerate vs torch']:.1e}, vs JAX "
    f"{diff['accelerate vs jax']:.1e}; jax_residency rows vs JAX {jr_vs['vs jax']:.1e}, "
    f"vs torch {jr_vs['vs torch']:.1e}"
  )
  same = [n for n, ok in par["tokens_match_jax"].items() if ok]
  differ = [n for n, ok in par["tokens_match_jax"].items() if not ok]
  print(
    f"greedy tokens = the plain JAX model's: {', '.join(same) or 'none'}"
    + (f"; DIFFER: {', '.join(differ)}" if differ else "")
    + f"; accelerate = torch port: {par.get('accelerate_tokens_match_torch')}"
  )
  print(f"{result['wall_s']:.0f} s wall")


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
  p = paths(args)
  if not os.path.exists(p["reference"]):
    os.makedirs(p["base"], exist_ok=True)
    print(f"building the model, its store and checkpoint under {p['base']} ...", file=sys.stderr)
    run_child(args, "build")
  size = sizes(args)
  cfg = gpt_config(args)
  unit_bytes_total = cfg.n_layers * size["unit_bytes"]
  result: dict = {
    "versions": versions,
    "config": {k: getattr(cfg, k) for k in cfg.__dataclass_fields__},
    "sizes": size | {"unit_bytes_total": unit_bytes_total},
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
    run = measure(args, unit_bytes_total)
    result["parity"] = run.pop("parity")
    if not result["parity"]["ok"]:
      refuse(result, args)
    runs.append(run)
  result["runs"] = runs
  # Figures are medians over runs; the targets are checked on the medians.
  med = result["median"] = median_run(runs) | {"torch": result["torch"]}
  med["targets"] = derive(med, args, unit_bytes_total)
  result["targets_met"] = {k: v for k, v in med["targets"].items() if " met " in k}
  result["wall_s"] = time.perf_counter() - started
  with open(os.path.join(p["base"], "result.json"), "w") as f:  # the last run's, in full
    json.dump(result, f)
  if args.json:
    print(json.dumps(result))
    return
  print_table(result, args)


if __name__ == "__main__":
  main()
