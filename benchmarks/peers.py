"""DenseDiskStream against Hugging Face Accelerate's disk offload, same model, one run.

Accelerate's disk offload (PyTorch) is what users reach for today when a model
does not fit in memory. This script runs the same seeded toy transformer (a
2.1 GiB, 20-unit float32 model by default) both ways on this machine:

* **jax_residency**: the NNX model written once with ``jr.save`` and placed
  from the store with ``jr.DenseDiskStream`` (256 MiB host and device budgets,
  as in ``benchmarks/dense_stream.py``), and once with a host budget that holds
  every unit (the warm pass);
* **Accelerate**: a PyTorch port of the same architecture (same weights, from
  one ``model.safetensors``), built on the ``meta`` device with
  ``accelerate.init_empty_weights`` and loaded with
  ``accelerate.load_checkpoint_and_dispatch`` with every block on ``"disk"``
  (embedding, final norm and head on ``"cpu"``), an ``offload_folder`` and the
  CPU as execution device: the documented disk-offload recipe.

It first checks parity: the PyTorch port's logits against the plain JAX model's
on the same token ids (and later Accelerate's and jax_residency's logits against
both). If any differs by more than 1e-3 of the logit scale it refuses to report
timings. Then, each in a fresh process, with the page cache dropped
(``posix_fadvise(DONTNEED)`` on every store / checkpoint / offload file) before
each cold measurement:

* ``load_s``: ``load_checkpoint_and_dispatch`` (Accelerate) / ``jr.place``
  (jax_residency) in a new process;
* ``first_pass_s``: the first forward pass after loading (jax_residency: reads
  the units from disk and compiles the step; Accelerate: reads the offloaded
  weights it has just written, mostly from the page cache), so load + first pass
  is the time from a cold start to the first logits;
* ``cold_pass_s``: a forward pass (batch 1, 32 tokens) with nothing cached; each
  side has already run one pass (torch warm-up / XLA compile) and its caches and
  the page cache were dropped after it;
* ``warm_pass_s``: the next pass on the same input (Accelerate: the page cache
  now holds the offloaded weights; jax_residency: a host cache holding every
  unit, in its own process). ``pc_warm_pass_s`` is jax_residency's second pass
  with the 256 MiB budgets, page cache warm: the same footing as Accelerate's;
* ``baseline_rss`` before loading and the peak RSS (``VmHWM``) over loading and
  the passes; ``pass_peak_rss`` over the cold pass alone;
* bytes read from / written to disk (``/proc/self/io``) while loading and during
  the cold pass;
* for context, a fully resident pass of each framework (plain torch; ``FullyResident``).

Ratios are jax_residency / Accelerate, measured in the same run; absolute times
depend on the machine and are not targets.

Run it (torch and accelerate are not dependencies of jax_residency; install
torch first: on this project's machines ``torch==2.13.0`` resolves to a local
CPU-only wheel; elsewhere install PyTorch's CPU-only build of 2.13.0, not the
default multi-GB CUDA one)::

    pip install torch==2.13.0
    pip install accelerate==1.15.0
    python benchmarks/peers.py                 # table
    python benchmarks/peers.py --json          # one JSON object
    python benchmarks/peers.py --dir /data/bench

The first run builds the model, its store and the safetensors checkpoint under
``--dir`` (about 7 GiB of disk, 1-2 minutes); later runs reuse them. Three runs
(``--repeat``, default 3; figures are medians, ratios are taken within a run)
take about 3 minutes on a 2-core machine, 4-5 with the first build.

What to expect (2-core VM, medians): Accelerate reads the whole checkpoint into
RAM at every load and writes it back out as one ``.dat`` file per tensor, so its
load is ~6x slower than ``jr.place`` (which reads only the static weights) and
its peak RSS growth is about the model's size (jr / acc ~0.4). It pages each
offloaded block in synchronously when the block runs; DenseDiskStream reads
units ahead, and its cold pass takes ~0.6-0.9x Accelerate's. With a host cache
holding every unit, jax_residency's warm pass takes ~0.5x Accelerate's. Where
Accelerate does as well or better: a warm pass against jax_residency at 256 MiB
budgets (both served from the page cache, ~0.9-1.3x), RSS during a pass once
loading is done (Accelerate holds one block; jax_residency holds its budgets and
the compiled step), and plain compute (a resident torch pass is ~2.3x faster
than XLA's on CPU for this model). Figures vary by tens of percent run to run on
a shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _measure import (  # benchmarks/ is on sys.path when a script here runs
  BUDGET,
  MiB,
  add_model_args,
  config,
  dense_policy,
  drop_page_cache,
  files_under,
  peak_rss_bytes,
  reset_peak_rss,
  rss_bytes,
)

LN_EPS = 1e-6  # flax's LayerNorm default (torch's is 1e-5)
PARITY_RTOL = 1e-3  # max |diff| / max |logit| allowed


# ---------------------------------------------------------------------------- shared helpers


def io_bytes() -> tuple[int, int]:
  """(read_bytes, write_bytes) this process caused at the storage layer."""
  fields = {}
  with open("/proc/self/io") as f:
    for line in f:
      key, _, value = line.partition(":")
      fields[key] = int(value)
  return fields["read_bytes"], fields["write_bytes"]


class Peaks:
  """Peak RSS over a process whose VmHWM is reset between phases."""

  def __init__(self) -> None:
    self.process = 0

  def reset(self) -> None:
    self.process = max(self.process, peak_rss_bytes())
    reset_peak_rss()

  def read(self) -> int:
    peak = peak_rss_bytes()
    self.process = max(self.process, peak)
    return peak


def paths(args: argparse.Namespace) -> dict[str, str]:
  base = os.path.join(args.dir, f"toy-{args.layers}x{args.d_model}x{args.d_ff}-t{args.tokens}")
  return {
    "base": base,
    "store": os.path.join(base, "jr-store"),
    "checkpoint": os.path.join(base, "torch", "model.safetensors"),
    "offload": os.path.join(base, "accelerate-offload"),
    "reference": os.path.join(base, "reference.npz"),
  }


def reference(args: argparse.Namespace):
  import numpy as np

  with np.load(paths(args)["reference"]) as ref:
    return ref["tokens"], ref["logits"]


def save_logits(args: argparse.Namespace, name: str, logits) -> None:
  import numpy as np

  np.save(os.path.join(paths(args)["base"], f"logits-{name}.npy"), np.asarray(logits))


# ---------------------------------------------------------------------------- the torch port


def torch_port(cfg):
  """The toy transformer in PyTorch: same math as ``jax_residency.toy.ToyTransformer``."""
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
      self.out = nn.Linear(d, d)
      self.norm2 = nn.LayerNorm(d, eps=LN_EPS)
      self.up = nn.Linear(d, cfg.d_ff)
      self.down = nn.Linear(cfg.d_ff, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
      b, t, d = x.shape
      q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
      q, k, v = (a.view(b, t, self.heads, d // self.heads).transpose(1, 2) for a in (q, k, v))
      att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
      x = x + self.out(att.transpose(1, 2).reshape(b, t, d))
      return x + self.down(F.gelu(self.up(self.norm2(x)), approximate="tanh"))

  class Toy(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
      self.layers = nn.ModuleList(Block() for _ in range(cfg.n_layers))
      self.norm = nn.LayerNorm(cfg.d_model, eps=LN_EPS)
      self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
      x = self.embed(tokens)
      for block in self.layers:
        x = block(x)
      return self.head(self.norm(x))

  return Toy


def torch_state_dict(params: dict, n_layers: int) -> dict:
  """NNX parameters (nested dict of arrays) -> the torch port's state dict, as numpy."""
  import numpy as np

  def linear(p: dict, prefix: str, i: int | None = None) -> dict:
    kernel, bias = (p["kernel"], p["bias"]) if i is None else (p["kernel"][i], p["bias"][i])
    # nnx.Linear keeps (in, out); torch.nn.Linear keeps (out, in).
    return {f"{prefix}.weight": np.asarray(kernel).T, f"{prefix}.bias": np.asarray(bias)}

  def norm(p: dict, prefix: str, i: int | None = None) -> dict:
    scale, bias = (p["scale"], p["bias"]) if i is None else (p["scale"][i], p["bias"][i])
    return {f"{prefix}.weight": np.asarray(scale), f"{prefix}.bias": np.asarray(bias)}

  out = {"embed.weight": np.asarray(params["embed"]["embedding"])}
  layers = params["layers"]
  for i in range(n_layers):
    for name in ("norm1", "norm2"):
      out |= norm(layers[name], f"layers.{i}.{name}", i)
    for name in ("qkv", "out", "up", "down"):
      out |= linear(layers[name], f"layers.{i}.{name}", i)
  out |= norm(params["norm"], "norm") | linear(params["head"], "head")
  return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


# ---------------------------------------------------------------------------- children


def build(args: argparse.Namespace) -> dict:
  """Model -> jax_residency store, torch checkpoint, reference tokens and logits."""
  import jax
  import numpy as np
  from flax import nnx
  from safetensors.numpy import save_file

  import jax_residency as jr
  from jax_residency.toy import ToyTransformer

  p = paths(args)
  cfg = config(args)
  model = ToyTransformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (1, args.tokens), 0, cfg.vocab)
  logits = np.asarray(model(tokens))
  jr.save(model, p["store"], progress=False, overwrite=True)
  state = torch_state_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg.n_layers)
  del model
  os.makedirs(os.path.dirname(p["checkpoint"]), exist_ok=True)
  save_file(state, p["checkpoint"] + ".tmp", metadata={"format": "pt"})
  os.replace(p["checkpoint"] + ".tmp", p["checkpoint"])
  np.savez(p["reference"] + ".tmp.npz", tokens=np.asarray(tokens), logits=logits)
  os.replace(p["reference"] + ".tmp.npz", p["reference"])
  return {}


def torch_resident(args: argparse.Namespace) -> dict:
  """The torch port loaded whole: parity logits and a resident pass for context."""
  import torch
  from safetensors.torch import load_file

  tokens, _ = reference(args)
  model = torch_port(config(args))()
  model.load_state_dict(load_file(paths(args)["checkpoint"]))
  model.eval()
  x = torch.from_numpy(tokens).long()
  with torch.inference_mode():
    logits = model(x)
    start = time.perf_counter()
    model(x)
    resident = time.perf_counter() - start
  save_logits(args, "torch", logits.numpy())
  return {"resident_pass_s": resident, "threads": torch.get_num_threads()}


def accelerate_offload(args: argparse.Namespace) -> dict:
  """Accelerate's documented disk offload: meta model, load_checkpoint_and_dispatch."""
  import logging

  import torch
  from accelerate import init_empty_weights, load_checkpoint_and_dispatch

  logging.getLogger("accelerate").setLevel(logging.ERROR)
  p = paths(args)
  cfg = config(args)
  tokens, _ = reference(args)
  x = torch.from_numpy(tokens).long()
  shutil.rmtree(p["offload"], ignore_errors=True)
  with init_empty_weights():
    model = torch_port(cfg)()
  device_map = {"embed": "cpu", "norm": "cpu", "head": "cpu"}
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
  load_peak = peaks.read()
  model.eval()
  out: dict = {
    "load_s": load_s,
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": load_peak,
    "load_read_bytes": io1[0] - io0[0],
    "load_written_bytes": io1[1] - io0[1],
  }
  with torch.inference_mode():
    start = time.perf_counter()
    model(x)  # first pass: torch warm-up (weights mostly in the page cache from the load)
    out["first_pass_s"] = time.perf_counter() - start
    drop_page_cache(p["offload"], p["checkpoint"])
    out["rss_before_cold_bytes"] = rss_bytes()
    peaks.reset()
    io0 = io_bytes()
    start = time.perf_counter()
    logits = model(x)
    out["cold_pass_s"] = time.perf_counter() - start
    out["cold_read_bytes"] = io_bytes()[0] - io0[0]
    out["pass_peak_rss_bytes"] = peaks.read()
    start = time.perf_counter()
    model(x)
    out["warm_pass_s"] = time.perf_counter() - start
    peaks.read()
  out["peak_rss_bytes"] = peaks.process
  out["offload_bytes"] = sum(os.path.getsize(f) for f in files_under(p["offload"]))
  save_logits(args, "accelerate", logits.numpy())
  return out


def jr_place(args: argparse.Namespace, policy):
  import jax
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency.toy import ToyTransformer

  cfg = config(args)
  abstract = nnx.eval_shape(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0)))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  return jr.place(abstract, policy, store=paths(args)["store"], mesh=mesh)


def jr_cold(args: argparse.Namespace) -> dict:
  """DenseDiskStream with 256 MiB host and device budgets: load, cold pass, page-cache-warm pass."""
  import jax

  p = paths(args)
  tokens, _ = reference(args)
  x = jax.numpy.asarray(tokens)
  x.block_until_ready()  # backend initialised
  peaks = Peaks()
  baseline = rss_bytes()
  drop_page_cache(p["store"])
  peaks.reset()
  io0 = io_bytes()
  start = time.perf_counter()
  placed = jr_place(args, dense_policy(BUDGET))
  load_s = time.perf_counter() - start
  out: dict = {
    "load_s": load_s,
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": peaks.read(),
    "load_read_bytes": io_bytes()[0] - io0[0],
    "load_written_bytes": 0,
  }
  with placed:
    start = time.perf_counter()
    jax.block_until_ready(placed(x))  # first pass: compiles the step
    out["first_pass_s"] = time.perf_counter() - start
    placed.clear_caches()
    drop_page_cache(p["store"])
    out["rss_before_cold_bytes"] = rss_bytes()
    peaks.reset()
    io0 = io_bytes()
    start = time.perf_counter()
    logits = jax.block_until_ready(placed(x))
    out["cold_pass_s"] = time.perf_counter() - start
    out["cold_read_bytes"] = io_bytes()[0] - io0[0]
    out["pass_peak_rss_bytes"] = peaks.read()
    last = placed.report().last
    out["stream_bytes_read"] = last.disk_to_host_bytes + last.disk_to_device_bytes
    out["stalls"], out["stall_s"] = last.stalls, last.stall_seconds
    start = time.perf_counter()
    jax.block_until_ready(placed(x))
    out["pc_warm_pass_s"] = time.perf_counter() - start
    peaks.read()
  out["peak_rss_bytes"] = peaks.process
  save_logits(args, "jr_cold", logits)
  return out


def jr_warm(args: argparse.Namespace) -> dict:
  """DenseDiskStream with a host budget holding every unit: the second pass reads nothing."""
  import jax

  tokens, _ = reference(args)
  x = jax.numpy.asarray(tokens)
  everything = args.layers * config(args).unit_bytes() + 64 * MiB
  baseline = rss_bytes()
  reset_peak_rss()
  with jr_place(args, dense_policy(everything)) as placed:
    jax.block_until_ready(placed(x))
    start = time.perf_counter()
    logits = jax.block_until_ready(placed(x))
    warm = time.perf_counter() - start
    last = placed.report().last
  save_logits(args, "jr_warm", logits)
  return {
    "warm_pass_s": warm,
    "warm_bytes_read": last.disk_to_host_bytes + last.disk_to_device_bytes,
    "warm_host_budget_bytes": everything,
    "warm_peak_rss_growth_bytes": peak_rss_bytes() - baseline,
  }


def jr_resident(args: argparse.Namespace) -> dict:
  """FullyResident from the same store, for context."""
  import jax

  import jax_residency as jr

  tokens, _ = reference(args)
  x = jax.numpy.asarray(tokens)
  with jr_place(args, jr.FullyResident()) as placed:
    jax.block_until_ready(placed(x))
    start = time.perf_counter()
    jax.block_until_ready(placed(x))
    return {"resident_pass_s": time.perf_counter() - start}


CHILDREN = {
  "build": build,
  "torch_resident": torch_resident,
  "accelerate": accelerate_offload,
  "jr_cold": jr_cold,
  "jr_warm": jr_warm,
  "jr_resident": jr_resident,
}


# ---------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, which: str) -> dict:
  cmd = [sys.executable, __file__, "--child", which, "--dir", args.dir]
  cmd += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--d-ff", str(args.d_ff)]
  cmd += ["--tokens", str(args.tokens)]
  # stderr (Accelerate's per-tensor progress bar, warnings) is shown only if the child fails.
  done = subprocess.run(cmd, capture_output=True, text=True)
  if done.returncode:
    sys.stderr.write(done.stderr)
    raise SystemExit(f"{which} failed (exit {done.returncode})")
  out = done.stdout.strip()
  return json.loads(out.splitlines()[-1]) if out else {}


def measure(args: argparse.Namespace) -> dict:
  """One run of every timed child; figures, jr / accelerate ratios and parity."""
  acc = run_child(args, "accelerate")
  jrc = run_child(args, "jr_cold") | run_child(args, "jr_warm")
  jrc["resident_pass_s"] = run_child(args, "jr_resident")["resident_pass_s"]
  acc["resident_pass_s"] = run_child(args, "torch_resident")["resident_pass_s"]
  par = parity(args, ["torch", "accelerate", "jr_cold", "jr_warm"])
  for fig in (acc, jrc):
    fig["peak_rss_growth_bytes"] = fig["peak_rss_bytes"] - fig["baseline_rss_bytes"]
    fig["pass_peak_rss_growth_bytes"] = fig["pass_peak_rss_bytes"] - fig["baseline_rss_bytes"]
  ratios = {
    "load": jrc["load_s"] / acc["load_s"],
    "first_output": (jrc["load_s"] + jrc["first_pass_s"]) / (acc["load_s"] + acc["first_pass_s"]),
    "cold_pass": jrc["cold_pass_s"] / acc["cold_pass_s"],
    "warm_pass": jrc["warm_pass_s"] / acc["warm_pass_s"],
    "pc_warm_pass": jrc["pc_warm_pass_s"] / acc["warm_pass_s"],
    "peak_rss_growth": jrc["peak_rss_growth_bytes"] / acc["peak_rss_growth_bytes"],
    "pass_peak_rss_growth": jrc["pass_peak_rss_growth_bytes"] / acc["pass_peak_rss_growth_bytes"],
    "resident_pass": jrc["resident_pass_s"] / acc["resident_pass_s"],
  }
  return {"accelerate": acc, "jax_residency": jrc, "ratios": ratios, "parity": par}


def check_peers_installed(accelerate_version: str = "1.15.0") -> dict:
  """torch's and accelerate's versions; exits with the install commands if one is missing."""
  try:
    import accelerate
    import torch
  except ImportError as e:
    raise SystemExit(
      f"{e.name} is not installed; this benchmark needs it (not a jax_residency dependency):\n"
      "  pip install torch==2.13.0   # the CPU-only build\n"
      f"  pip install accelerate=={accelerate_version}"
    ) from None
  return {"torch": torch.__version__, "accelerate": accelerate.__version__}


def parity_of(ref, logits, torch) -> dict:
  """The parity gate: max |diff| of each run's logits against ``ref`` and against torch's.

  Args:
    ref: the plain JAX model's logits.
    logits: run name -> logits of the same shape.
    torch: the torch port's logits (run whole); every run but one named
      ``"torch"`` is also compared with them.

  Returns:
    ``logit_scale`` (max |ref|), ``max_abs_diff`` ("NAME vs jax" / "NAME vs
    torch" -> float) and ``ok``: every difference is within ``PARITY_RTOL``
    of the logit scale.
  """
  import numpy as np

  scale = float(np.abs(ref).max())
  out: dict = {"logit_scale": scale, "max_abs_diff": {}}
  for name, value in logits.items():
    out["max_abs_diff"][f"{name} vs jax"] = float(np.abs(value - ref).max())
    if name != "torch":
      out["max_abs_diff"][f"{name} vs torch"] = float(np.abs(value - torch).max())
  out["ok"] = all(d <= PARITY_RTOL * scale for d in out["max_abs_diff"].values())
  return out


def parity(args: argparse.Namespace, names: list[str]) -> dict:
  """Max |diff| of each named run's logits against the plain JAX model's (and torch's)."""
  import numpy as np

  _, ref = reference(args)

  def logits(name: str):
    return np.load(os.path.join(paths(args)["base"], f"logits-{name}.npy"))

  return parity_of(ref, {name: logits(name) for name in names}, torch=logits("torch"))


def refuse(result: dict, args: argparse.Namespace) -> None:
  if args.json:
    print(json.dumps(result))
  print(
    f"PARITY FAILED (limit {PARITY_RTOL:g} x logit scale): {result['parity']}; "
    "refusing to report timings",
    file=sys.stderr,
  )
  raise SystemExit(1)


def fmt_bytes(n: float) -> str:
  return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / MiB:,.0f} MiB"


def main() -> None:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "jax_residency_peers"))
  add_model_args(parser)
  parser.add_argument("--tokens", type=int, default=32)
  parser.add_argument("--repeat", type=int, default=3, help="runs; figures are medians")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  args = parser.parse_args()
  args.dir = os.path.abspath(args.dir)
  if args.child:
    print(json.dumps(CHILDREN[args.child](args)))
    return

  started = time.perf_counter()
  versions = check_peers_installed()
  p = paths(args)
  if not os.path.exists(p["reference"]):
    os.makedirs(p["base"], exist_ok=True)
    print(f"building the model, its store and checkpoint under {p['base']} ...", file=sys.stderr)
    run_child(args, "build")
  cfg = config(args)
  unit_bytes = cfg.n_layers * cfg.unit_bytes()
  result: dict = {
    "versions": versions,
    "unit_bytes_total": unit_bytes,
    "layers": cfg.n_layers,
    "tokens": args.tokens,
    "host_budget_bytes": BUDGET,
    "device_budget_bytes": BUDGET,
  }

  # Parity first: the torch port against the plain JAX model.
  threads = run_child(args, "torch_resident")["threads"]
  result["parity"] = parity(args, ["torch"])
  if not result["parity"]["ok"]:
    refuse(result, args)

  runs = []
  for i in range(args.repeat):
    if args.repeat > 1:
      print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr)
    run = measure(args)
    result["parity"] = run.pop("parity")
    if not result["parity"]["ok"]:
      refuse(result, args)
    runs.append(run)
  # Each figure and each ratio: the median over runs (ratios are taken within a run).
  for side in ("accelerate", "jax_residency", "ratios"):
    result[side] = {k: statistics.median(run[side][k] for run in runs) for k in runs[0][side]}
  result["ratio_ranges"] = {
    k: [min(run["ratios"][k] for run in runs), max(run["ratios"][k] for run in runs)]
    for k in runs[0]["ratios"]
  }
  result["runs"] = runs
  acc, jrc = result["accelerate"], result["jax_residency"]
  result["wall_s"] = time.perf_counter() - started
  if args.json:
    print(json.dumps(result))
    return

  def ratio(key: str) -> str:
    lo, hi = result["ratio_ranges"][key]
    cell = f"{result['ratios'][key]:.2f}"
    return cell if args.repeat == 1 else f"{cell} ({lo:.2f}-{hi:.2f})"

  rows = [
    ("figure", "jax_residency", "accelerate", "jr / acc" + (" (range)" if args.repeat > 1 else "")),
    ("load (new process)", f"{jrc['load_s']:.2f} s", f"{acc['load_s']:.2f} s", ratio("load")),
    (
      "  bytes read / written",
      f"{fmt_bytes(jrc['load_read_bytes'])} / 0",
      f"{fmt_bytes(acc['load_read_bytes'])} / {fmt_bytes(acc['load_written_bytes'])}",
      "",
    ),
    (
      "load + first pass",
      f"{jrc['load_s'] + jrc['first_pass_s']:.2f} s (compiles)",
      f"{acc['load_s'] + acc['first_pass_s']:.2f} s",
      ratio("first_output"),
    ),
    (
      "cold pass",
      f"{jrc['cold_pass_s']:.2f} s",
      f"{acc['cold_pass_s']:.2f} s",
      ratio("cold_pass"),
    ),
    (
      "  bytes read",
      fmt_bytes(jrc["cold_read_bytes"]),
      fmt_bytes(acc["cold_read_bytes"]),
      "",
    ),
    (
      "warm pass",
      f"{jrc['warm_pass_s']:.3f} s (host cache)",
      f"{acc['warm_pass_s']:.3f} s (page cache)",
      ratio("warm_pass"),
    ),
    (
      "  jr 256 MiB, page cache warm",
      f"{jrc['pc_warm_pass_s']:.3f} s",
      "",
      ratio("pc_warm_pass"),
    ),
    (
      "resident pass (context)",
      f"{jrc['resident_pass_s']:.3f} s",
      f"{acc['resident_pass_s']:.3f} s (torch)",
      ratio("resident_pass"),
    ),
    (
      "baseline RSS",
      fmt_bytes(jrc["baseline_rss_bytes"]),
      fmt_bytes(acc["baseline_rss_bytes"]),
      "",
    ),
    (
      "peak RSS growth (load+passes)",
      fmt_bytes(jrc["peak_rss_growth_bytes"]),
      fmt_bytes(acc["peak_rss_growth_bytes"]),
      ratio("peak_rss_growth"),
    ),
    (
      "  over the cold pass",
      fmt_bytes(jrc["pass_peak_rss_growth_bytes"]),
      fmt_bytes(acc["pass_peak_rss_growth_bytes"]),
      ratio("pass_peak_rss_growth"),
    ),
  ]
  widths = [max(len(row[i]) for row in rows) for i in range(4)]
  runs_note = f"; medians of {args.repeat} runs" if args.repeat > 1 else ""
  print(
    f"model: seeded toy transformer, {cfg.n_layers} units, {fmt_bytes(unit_bytes)} of unit "
    f"weights, float32; input (1, {args.tokens}) token ids{runs_note}"
  )
  print(
    f"jax_residency: DenseDiskStream, 256 MiB host and device budgets (warm pass: host "
    f"{fmt_bytes(jrc['warm_host_budget_bytes'])}); accelerate {versions['accelerate']} "
    f"disk offload, torch {versions['torch']} ({threads} threads)"
  )
  print()
  for row in rows:
    print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
  print()
  par = result["parity"]
  diffs = ", ".join(f"{k} {v:.1e}" for k, v in par["max_abs_diff"].items())
  print(f"parity (max |diff|, logit scale {par['logit_scale']:.2f}): {diffs}")
  print(
    f"jr cold pass: {fmt_bytes(jrc['stream_bytes_read'])} streamed, {jrc['stalls']:.0f} stalls "
    f"({jrc['stall_s']:.2f} s); first passes (compile / torch warm-up): "
    f"jr {jrc['first_pass_s']:.2f} s, accelerate {acc['first_pass_s']:.2f} s; "
    f"{result['wall_s']:.0f} s wall"
  )


if __name__ == "__main__":
  main()
