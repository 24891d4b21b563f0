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
on the same token ids (and later Accelerate's and jax_residency's logits, those
of both DenseDiskStream processes and of ``FullyResident``, against both). Each
is a parity gate: if any differs by more than 1e-3 of the logit scale the run
fails and no timings are reported. Then, each in a fresh process, with the page
cache dropped (``posix_fadvise(DONTNEED)`` on every store / checkpoint / offload
file) before each cold measurement:

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
    pip install accelerate==1.16.0 safetensors
    python benchmarks/peers.py                 # table
    python benchmarks/peers.py --json          # one JSON object
    python benchmarks/peers.py --dir /data/bench
    python benchmarks/peers.py --quick         # toy size, one run, seconds

Without torch, accelerate or safetensors (none is a jax_residency dependency)
the script says which cannot be imported, skips the Accelerate and torch rows
and runs the jax_residency side alone, gated on the plain JAX model's logits.
``--quick`` runs the same children at a toy size (2 units of 192 x 768, 8
tokens, one run) in a fresh temporary directory (unless ``--dir`` is given).
The script has parity gates and no performance targets (the ratios are
reported): it exits 1 when a gate fails, else 0. A full run writes its result
to ``benchmarks/results/peers.json`` (``--result PATH`` elsewhere; ``--quick``
only there).

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
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling modules

import _child
import _parity  # noqa: E402
import _result  # noqa: E402
import _torch_peer  # noqa: E402
from _measure import (  # noqa: E402
  BUDGET,
  MiB,
  Peaks,
  add_model_args,
  config,
  dense_policy,
  drop_page_cache,
  files_under,
  fmt_bytes,
  io_bytes,
  peak_rss_bytes,
  reset_peak_rss,
  rss_bytes,
  timed_load,
)
from _parity import PARITY_RTOL  # noqa: E402

# ---------------------------------------------------------------------------- shared helpers


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
  from torch import nn

  Block = _torch_peer.block(cfg, proj="out")

  class Toy(nn.Module):
    def __init__(self) -> None:
      super().__init__()
      self.embed = nn.Embedding(cfg.vocab, cfg.d_model)
      self.layers = nn.ModuleList(Block() for _ in range(cfg.n_layers))
      self.norm = nn.LayerNorm(cfg.d_model, eps=_torch_peer.LN_EPS)
      self.head = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, tokens):
      x = self.embed(tokens)
      for block in self.layers:
        x = block(x)[0]
      return self.head(self.norm(x))

  return Toy


# ---------------------------------------------------------------------------- children


def build(args: argparse.Namespace) -> dict:
  """Model -> jax_residency store, reference tokens and logits, and (``--with-checkpoint``)
  the torch port's checkpoint: whichever of them is not written yet."""
  import jax
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency.toy import ToyTransformer

  p = paths(args)
  cfg = config(args)
  model = ToyTransformer(cfg, rngs=nnx.Rngs(0))
  os.makedirs(p["base"], exist_ok=True)
  if not os.path.exists(p["reference"]):
    tokens = jax.random.randint(jax.random.key(1), (1, args.tokens), 0, cfg.vocab)
    logits = np.asarray(model(tokens))
    np.savez(p["reference"] + ".tmp.npz", tokens=np.asarray(tokens), logits=logits)
    os.replace(p["reference"] + ".tmp.npz", p["reference"])
  if not os.path.exists(p["store"]):
    jr.save(model, p["store"], progress=False, overwrite=True)
  if args.with_checkpoint and not os.path.exists(p["checkpoint"]):
    state = _torch_peer.state_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)), cfg.n_layers)
    del model
    _torch_peer.save_checkpoint(state, p["checkpoint"])
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
  import torch

  p = paths(args)
  cfg = config(args)
  tokens, _ = reference(args)
  x = torch.from_numpy(tokens).long()
  device_map = {"embed": "cpu", "norm": "cpu", "head": "cpu"}
  device_map |= {f"layers.{i}": "disk" for i in range(cfg.n_layers)}
  peaks = Peaks()
  model, out = _torch_peer.disk_offload(
    torch_port(cfg), p["checkpoint"], device_map, p["offload"], peaks
  )
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
  drop_page_cache(p["store"])
  placed, out = timed_load(lambda: jr_place(args, dense_policy(BUDGET)), peaks)
  out["load_written_bytes"] = 0
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
  """FullyResident from the same store, for context (its logits join the parity gate)."""
  import jax

  import jax_residency as jr

  tokens, _ = reference(args)
  x = jax.numpy.asarray(tokens)
  with jr_place(args, jr.FullyResident()) as placed:
    logits = jax.block_until_ready(placed(x))
    start = time.perf_counter()
    jax.block_until_ready(placed(x))
    resident = time.perf_counter() - start
  save_logits(args, "jr_resident", logits)
  return {"resident_pass_s": resident}


CHILDREN = {
  "build": build,
  "torch_resident": torch_resident,
  "accelerate": accelerate_offload,
  "jr_cold": jr_cold,
  "jr_warm": jr_warm,
  "jr_resident": jr_resident,
}


# ---------------------------------------------------------------------------- parent


def run_child(args: argparse.Namespace, which: str, extra: tuple[str, ...] = ()) -> dict:
  argv = ["--child", which, "--dir", args.dir, *extra]
  argv += _child.flags(args, ("layers", "d_model", "d_ff", "tokens"))
  return _child.run(__file__, *argv, what=which)


JR_RUNS = ("jr_cold", "jr_warm", "jr_resident")  # the jax_residency runs whose logits are gated


def measure(args: argparse.Namespace, peers: bool, torch_run: dict | None = None) -> dict:
  """One run of every timed child; figures, jr / accelerate ratios (with the peers) and parity.

  ``torch_run``: the torch port's child already run for this run (the gate's), else run here.
  """
  acc = run_child(args, "accelerate") if peers else None
  jrc = run_child(args, "jr_cold") | run_child(args, "jr_warm")
  jrc["resident_pass_s"] = run_child(args, "jr_resident")["resident_pass_s"]
  sides = [jrc]
  if acc is not None:
    torch_run = torch_run or run_child(args, "torch_resident")
    acc["resident_pass_s"] = torch_run["resident_pass_s"]
    sides.append(acc)
  names = ["torch", "accelerate", *JR_RUNS] if peers else list(JR_RUNS)
  par = parity(args, names, torch=peers)
  for fig in sides:
    fig["peak_rss_growth_bytes"] = fig["peak_rss_bytes"] - fig["baseline_rss_bytes"]
    fig["pass_peak_rss_growth_bytes"] = fig["pass_peak_rss_bytes"] - fig["baseline_rss_bytes"]
  run: dict = {"jax_residency": jrc, "parity": par}
  if acc is None:
    return run
  run["accelerate"] = acc
  run["ratios"] = {
    "load": jrc["load_s"] / acc["load_s"],
    "first_output": (jrc["load_s"] + jrc["first_pass_s"]) / (acc["load_s"] + acc["first_pass_s"]),
    "cold_pass": jrc["cold_pass_s"] / acc["cold_pass_s"],
    "warm_pass": jrc["warm_pass_s"] / acc["warm_pass_s"],
    "pc_warm_pass": jrc["pc_warm_pass_s"] / acc["warm_pass_s"],
    "peak_rss_growth": jrc["peak_rss_growth_bytes"] / acc["peak_rss_growth_bytes"],
    "pass_peak_rss_growth": jrc["pass_peak_rss_growth_bytes"] / acc["pass_peak_rss_growth_bytes"],
    "resident_pass": jrc["resident_pass_s"] / acc["resident_pass_s"],
  }
  return run


def parity(args: argparse.Namespace, names: list[str], torch: bool = True) -> dict:
  """Max |diff| of each named run's logits against the plain JAX model's (and torch's)."""
  import numpy as np

  _, ref = reference(args)

  def logits(name: str):
    return np.load(os.path.join(paths(args)["base"], f"logits-{name}.npy"))

  return _parity.parity_of(
    ref, {name: logits(name) for name in names}, torch=logits("torch") if torch else None
  )


RUN_LABELS = {
  "torch": "torch port (loaded whole)",
  "accelerate": "accelerate disk offload",
  "jr_cold": "jr DenseDiskStream 256 MiB budgets",
  "jr_warm": "jr DenseDiskStream, every unit in the host cache",
  "jr_resident": "jr FullyResident",
}


def parity_checks(checks: list[dict], par: dict, labels: dict[str, str]) -> None:
  """One parity gate per run in ``par`` (:func:`parity_of`): its logits within
  ``PARITY_RTOL`` of the logit scale of the plain JAX model's, and of the torch port's."""
  limit = PARITY_RTOL * par["logit_scale"]
  for name, diffs in _parity.by_run(par["max_abs_diff"]).items():
    who = " and the torch port's" if "torch" in diffs else ""
    _result.check(
      checks,
      f"{labels.get(name, name)}: logits within {PARITY_RTOL:g} x logit scale of the plain "
      f"JAX model's{who}",
      all(d <= limit for d in diffs.values()),
      ", ".join(f"max |diff| vs {k} {d:.2e}" for k, d in diffs.items()) + f"; limit {limit:.2e}",
      _result.PARITY,
    )


#: ``--quick``: a toy size (3 MiB of units) and one run.
QUICK = {"layers": 2, "d_model": 192, "d_ff": 768, "tokens": 8, "repeat": 1}


def table_rows(result: dict) -> list[tuple[str, ...]]:
  """The table's rows: each figure for both sides and their ratio (jax_residency alone
  without peers); the first row is the header."""
  jrc, acc = result["jax_residency"], result.get("accelerate")
  repeat = len(result["runs"])

  def ratio(key: str) -> str:
    lo, hi = result["ratio_ranges"][key]
    cell = f"{result['ratios'][key]:.2f}"
    return cell if repeat == 1 else f"{cell} ({lo:.2f}-{hi:.2f})"

  a = acc or {}
  rows = [
    ("figure", "jax_residency", "accelerate", "jr / acc" + (" (range)" if repeat > 1 else "")),
    ("load (new process)", f"{jrc['load_s']:.2f} s", a and f"{a['load_s']:.2f} s", "load"),
    (
      "  bytes read / written",
      f"{fmt_bytes(jrc['load_read_bytes'])} / 0",
      a and f"{fmt_bytes(a['load_read_bytes'])} / {fmt_bytes(a['load_written_bytes'])}",
      "",
    ),
    (
      "load + first pass",
      f"{jrc['load_s'] + jrc['first_pass_s']:.2f} s (compiles)",
      a and f"{a['load_s'] + a['first_pass_s']:.2f} s",
      "first_output",
    ),
    ("cold pass", f"{jrc['cold_pass_s']:.2f} s", a and f"{a['cold_pass_s']:.2f} s", "cold_pass"),
    (
      "  bytes read",
      fmt_bytes(jrc["cold_read_bytes"]),
      a and fmt_bytes(a["cold_read_bytes"]),
      "",
    ),
    (
      "warm pass",
      f"{jrc['warm_pass_s']:.3f} s (host cache)",
      a and f"{a['warm_pass_s']:.3f} s (page cache)",
      "warm_pass",
    ),
    ("  jr 256 MiB, page cache warm", f"{jrc['pc_warm_pass_s']:.3f} s", "", "pc_warm_pass"),
    (
      "resident pass (context)",
      f"{jrc['resident_pass_s']:.3f} s",
      a and f"{a['resident_pass_s']:.3f} s (torch)",
      "resident_pass",
    ),
    (
      "baseline RSS",
      fmt_bytes(jrc["baseline_rss_bytes"]),
      a and fmt_bytes(a["baseline_rss_bytes"]),
      "",
    ),
    (
      "peak RSS growth (load+passes)",
      fmt_bytes(jrc["peak_rss_growth_bytes"]),
      a and fmt_bytes(a["peak_rss_growth_bytes"]),
      "peak_rss_growth",
    ),
    (
      "  over the cold pass",
      fmt_bytes(jrc["pass_peak_rss_growth_bytes"]),
      a and fmt_bytes(a["pass_peak_rss_growth_bytes"]),
      "pass_peak_rss_growth",
    ),
  ]
  if acc is None:
    return [row[:2] for row in rows]
  return [rows[0], *((f, j, c, ratio(k) if k else "") for f, j, c, k in rows[1:])]


def describe(result: dict) -> tuple[str, str]:
  """Two lines: the model and input, and what each side ran."""
  jrc, acc, versions = result["jax_residency"], result.get("accelerate"), result["versions"]
  repeat = len(result["runs"])
  runs_note = f"; medians of {repeat} runs" if repeat > 1 else ""
  model = (
    f"model: seeded toy transformer, {result['layers']} units, "
    f"{fmt_bytes(result['unit_bytes_total'])} of unit weights, float32; input "
    f"(1, {result['tokens']}) token ids{runs_note}"
  )
  peer = (
    f"accelerate {versions['accelerate']} disk offload, torch {versions['torch']} "
    f"({result['threads']} threads)"
    if acc is not None
    else f"accelerate and torch rows skipped: {result['peers_skipped']}"
  )
  sides = (
    f"jax_residency: DenseDiskStream, 256 MiB host and device budgets (warm pass: host "
    f"{fmt_bytes(jrc['warm_host_budget_bytes'])}); {peer}"
  )
  return model, sides


def render(result: dict) -> str:
  """The table: each figure for both sides and their ratio (jax_residency alone without peers)."""
  jrc, acc = result.get("jax_residency"), result.get("accelerate")
  if jrc is None:
    return "timings not reported: a parity gate failed"
  rows = table_rows(result)
  widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
  out = [*describe(result), ""]
  for row in rows:
    out.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
  out.append("")
  par = result["parity"]
  diffs = ", ".join(f"{k} {v:.1e}" for k, v in par["max_abs_diff"].items())
  out.append(f"parity (max |diff|, logit scale {par['logit_scale']:.2f}): {diffs}")
  first = f"jr {jrc['first_pass_s']:.2f} s" + (
    f", accelerate {acc['first_pass_s']:.2f} s" if acc is not None else ""
  )
  out.append(
    f"jr cold pass: {fmt_bytes(jrc['stream_bytes_read'])} streamed, {jrc['stalls']:.0f} stalls "
    f"({jrc['stall_s']:.2f} s); first passes (compile / torch warm-up): {first}; "
    f"{result['wall_s']:.0f} s wall"
  )
  return "\n".join(out)


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  if result.get("jax_residency") is None:
    return "Timings not reported: a parity gate failed."
  rows = table_rows(result)
  model, sides = describe(result)
  out = [f"{model[0].upper()}{model[1:]}.", "", f"{sides}.", ""]
  out.append("| " + " | ".join(rows[0]) + " |")
  out.append("|" + "---|" * len(rows[0]))
  for row in rows[1:]:
    cells = [c.strip() if i else c.replace("  ", "&nbsp;&nbsp;") for i, c in enumerate(row)]
    out.append("| " + " | ".join(cells) + " |")
  par = result["parity"]
  diffs = ", ".join(f"{k} {v:.1e}" for k, v in par["max_abs_diff"].items())
  out += ["", f"Parity (max \\|diff\\|, logit scale {par['logit_scale']:.2f}): {diffs}."]
  return "\n".join(out)


def main() -> int:
  quick = _result.quick_requested()
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument(
    "--dir",
    help="where the model, store and checkpoint are written and reused (default: "
    "$TMPDIR/jax_residency_peers; with --quick, a fresh temporary directory removed at the end)",
  )
  add_model_args(parser)
  parser.add_argument("--tokens", type=int, default=32)
  parser.add_argument("--repeat", type=int, default=3, help="runs; figures are medians")
  _result.add_args(parser)
  parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  parser.add_argument("--with-checkpoint", action="store_true", help=argparse.SUPPRESS)
  if quick:
    parser.set_defaults(**QUICK)
  args = parser.parse_args()
  if args.child:
    args.dir = os.path.abspath(args.dir)
    return _child.answer(CHILDREN[args.child](args))
  with _result.work_dir(args, "jax_residency_peers"):
    return bench(args)


def bench(args: argparse.Namespace) -> int:
  started = time.perf_counter()
  versions, why = _torch_peer.peer_versions()
  peers = versions is not None
  if not peers:
    print(f"accelerate and torch rows skipped: {why}", file=sys.stderr)
  p = paths(args)
  missing = [
    k
    for k in ("store", "reference") + (("checkpoint",) if peers else ())
    if not os.path.exists(p[k])
  ]
  if missing:
    os.makedirs(p["base"], exist_ok=True)
    print(f"building the model's {', '.join(missing)} under {p['base']} ...", file=sys.stderr)
    run_child(args, "build", ("--with-checkpoint",) if peers else ())
  cfg = config(args)
  unit_bytes = cfg.n_layers * cfg.unit_bytes()
  result: dict = _result.stamp("peers", None, args.quick) | {
    "versions": versions or {},
    "unit_bytes_total": unit_bytes,
    "layers": cfg.n_layers,
    "tokens": args.tokens,
    "host_budget_bytes": BUDGET,
    "device_budget_bytes": BUDGET,
  }
  checks: list[dict] = result.setdefault("checks", [])
  if not peers:
    result["peers_skipped"] = why

  # Parity first: the torch port against the plain JAX model; no timings if it fails.
  torch_run = None
  if peers:
    torch_run = run_child(args, "torch_resident")
    result["threads"] = torch_run["threads"]
    result["parity"] = parity(args, ["torch"])
    if not result["parity"]["ok"]:
      parity_checks(checks, result["parity"], RUN_LABELS)
      result["wall_s"] = time.perf_counter() - started
      return _result.finish(result, args, render)

  runs, pars = [], []
  for i in range(args.repeat):
    if args.repeat > 1:
      print(f"run {i + 1}/{args.repeat} ...", file=sys.stderr)
    run = measure(args, peers, torch_run if i == 0 else None)  # run 1 reuses the gate's
    pars.append(run.pop("parity"))
    runs.append(run)
    if not pars[-1]["ok"]:
      break  # no timings of outputs that differ: the gates below fail the run
  result["parity"] = _parity.merge(pars)
  parity_checks(checks, result["parity"], RUN_LABELS)
  result["runs"] = runs
  result["wall_s"] = time.perf_counter() - started
  if not result["parity"]["ok"]:
    return _result.finish(result, args, render)
  # Each figure and each ratio: the median over runs (ratios are taken within a run).
  for side in ("accelerate", "jax_residency", "ratios"):
    if side in runs[0]:
      result[side] = {k: statistics.median(run[side][k] for run in runs) for k in runs[0][side]}
  if peers:
    result["ratio_ranges"] = {
      k: [min(run["ratios"][k] for run in runs), max(run["ratios"][k] for run in runs)]
      for k in runs[0]["ratios"]
    }
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
