"""DenseDiskStream against raw disk reads and a fully resident model.

Builds (once, under --dir) a seeded transformer with >= 2 GiB of unit weights
and its store, then measures in fresh processes:

* ``raw_read_s``: plain sequential reads of the store's files into one reused
  buffer, after dropping them from the page cache (``posix_fadvise``);
* ``cold_pass_s``: one DenseDiskStream pass with 256 MiB host and device
  budgets, page cache dropped and caches cleared first (the step is compiled
  by an earlier pass), with ``peak_rss_bytes`` / ``baseline_rss_bytes``;
* ``warm_pass_s``: the second pass with a host budget that holds every unit;
* ``resident_pass_s``: a FullyResident pass of the same weights (read from the
  store once, at placement).

Targets: peak RSS - baseline <= host + device budgets + 1.7 MiB; cold stream
bandwidth >= 0.8 x raw-read bandwidth; warm pass <= 1.5 x resident pass.
Parity gate: the cold and warm streamed passes give the resident pass's logits within
1e-5 of the logit scale on a CPU backend (the stream runs the eager model's steps, the
resident pass the jitted model's program: docs/parity.md), 1e-3 elsewhere.

``--unit-mib 8 64 200 400`` runs the memory sweep instead: for each unit size a
toy model with at least 2 GiB of units (its own store under --dir), placed with
a device budget of static + 2 units and host budgets of 0, 2 units and every
unit, each in a fresh process: place, a first pass (compiles), then a cold pass
(caches and page cache dropped) and a warm one. It reports the process's peak
RSS minus its RSS before ``place`` (``VmHWM``, which counts mapped page-cache
pages too) and the peak of anonymous memory alone, against the budgets (device
budget, which holds the static parameters, + host budget) and the placement's
``metadata.planned_process_bytes`` (those plus named overheads). Target: at
most 64 MiB over the budgets. Parity gate, per row: the cold and warm passes
give the same logits.

``--quick`` runs the pass benchmark on a 4-layer toy (d_model 192, 1.7 MiB
units) and one sweep row (host budget of 2 units) on the same store, in a
temporary directory: the parity gates hold, the targets are reported only.
A full run writes ``benchmarks/results/dense_stream.json`` (the sweep:
``dense_stream_sweep.json``); see ``benchmarks/_result.py``.

    python benchmarks/dense_stream.py            # table
    python benchmarks/dense_stream.py --repeat 3 # medians of 3 runs (each child a fresh process)
    python benchmarks/dense_stream.py --json     # one JSON object
    python benchmarks/dense_stream.py --unit-mib 8 64 200 400   # memory sweep
    python benchmarks/dense_stream.py --quick    # toy size, about 20 s
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import threading
import time

import _child
import _result
from _measure import (  # benchmarks/ is on sys.path when a script here runs
  BUDGET,
  MiB,
  add_model_args,
  config,
  dense_policy,
  drop_page_cache,
  files_under,
  parallel_read,
  peak_rss_bytes,
  read_files,
  reset_peak_rss,
  rss_bytes,
  status_bytes,
  toy_model,
  toy_tokens,
)

RSS_SLACK = 128 * MiB
#: ``--quick``'s model, where the size flags are left at their defaults.
QUICK_SIZES = {"layers": 4, "d_model": 192, "d_ff": 768}
#: ``--quick``'s sweep row: a host budget of this many units, on the pass benchmark's store.
QUICK_SWEEP_HOST_UNITS = 2
#: Streamed logits may differ from the resident ones by this fraction of the logit scale:
#: on CPU float32 rounding (eager steps against one jitted program, docs/parity.md), off
#: it the backend's own tolerance.
CPU_RTOL, ACCELERATOR_RTOL = 1e-5, 1e-3


def _keep_output(out, path: str | None, tag: str) -> dict:
  """Saves a pass's logits to ``path`` (``.npy``) when given; returns their summary."""
  import jax
  import numpy as np

  a = np.asarray(out)
  if path:
    np.save(path, a)
  return {
    f"{tag}_sha256": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(),
    f"{tag}_sum": float(a.astype(np.float64).sum()),
    "backend": jax.default_backend(),
  }


def _raw(store: str) -> dict:
  drop_page_cache(store)
  buf = bytearray(16 * MiB)
  start = time.perf_counter()
  total = read_files(store, buffer=buf)
  raw = {"raw_read_s": time.perf_counter() - start, "raw_bytes": total}
  # Context: the same bytes read by 4 threads at once (what a parallel reader can get).
  drop_page_cache(store)
  start = time.perf_counter()
  parallel_read(files_under(store), threads=4)
  raw["raw_parallel_read_s"] = time.perf_counter() - start
  return raw


def child(args: argparse.Namespace) -> dict:
  if args.child == "raw":  # plain reads: no JAX in this process
    return _raw(args.store)
  import jax
  import numpy as np

  import jax_residency as jr
  from jax_residency._src.models.init import seeded_weights

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  x = toy_tokens(args.tokens)
  abstract = toy_model(config(args), abstract=True)
  if args.child == "save":  # seeded host-side (nnx's initialisers compile, seconds each)
    jr.save(seeded_weights(abstract, seed=0), args.store, progress=True, overwrite=True)
    return {}
  if args.child == "resident":  # the same weights, read from the store once
    with jr.place(abstract, jr.FullyResident(), store=args.store, mesh=mesh) as placed:
      placed(x)
      start = time.perf_counter()
      out = jax.block_until_ready(placed(x))
      resident = time.perf_counter() - start
      return {"resident_pass_s": resident, **_keep_output(out, args.output, "resident_output")}
  if args.child == "cold":
    jnp_ready = jax.numpy.zeros(()).block_until_ready()  # backend initialised
    del jnp_ready
    baseline = rss_bytes()
    with jr.place(abstract, dense_policy(BUDGET), store=args.store, mesh=mesh) as placed:
      placed(x)  # compiles the step
      placed.clear_caches()
      drop_page_cache(args.store)
      reset_peak_rss()
      start = time.perf_counter()
      out = jax.block_until_ready(placed(x))
      cold = time.perf_counter() - start
      peak = peak_rss_bytes()
      last = placed.report().last
      return {
        "cold_pass_s": cold,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak,
        "unit_bytes_total": args.layers * config(args).unit_bytes(),
        "bytes_read": last.disk_to_host_bytes + last.disk_to_device_bytes,
        "stalls": last.stalls,
        "stall_s": last.stall_seconds,
        **_keep_output(out, args.output, "cold_output"),
      }
  if args.child == "warm":
    everything = args.layers * config(args).unit_bytes() + 64 * MiB
    with jr.place(abstract, dense_policy(everything), store=args.store, mesh=mesh) as placed:
      placed(x)
      start = time.perf_counter()
      out = jax.block_until_ready(placed(x))
      warm = time.perf_counter() - start
      last = placed.report().last
      return {
        "warm_pass_s": warm,
        "warm_bytes_read": last.disk_to_host_bytes,
        **_keep_output(out, args.output, "warm_output"),
      }
  raise SystemExit(f"unknown child {args.child!r}")


SWEEP_SLACK = 64 * MiB
#: Sampling period of the anonymous-RSS sampler (the kernel's VmHWM has no anon split).
_SAMPLE_S = 0.002


def sweep_child(args: argparse.Namespace) -> dict:
  """One memory-sweep measurement: place, compile, cold pass, warm pass."""
  import jax
  import numpy as np

  import jax_residency as jr

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  x = toy_tokens(args.tokens)
  abstract = toy_model(config(args), abstract=True)
  unit = config(args).unit_bytes()
  jax.numpy.zeros(()).block_until_ready()  # backend initialised
  baseline = status_bytes("VmRSS", "RssAnon", "RssFile")
  peak_anon = [baseline["RssAnon"]]
  stop = threading.Event()

  def sample() -> None:
    while not stop.is_set():
      peak_anon[0] = max(peak_anon[0], status_bytes("RssAnon")["RssAnon"])
      time.sleep(_SAMPLE_S)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  host = unit * args.host_units
  from flax import nnx

  weights = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(nnx.state(abstract)))
  static = weights - args.layers * unit
  device = static + 2 * unit
  policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      device_budget_bytes=device,
      host_budget_bytes=host,
      host_lookahead=2 if host else 0,
      background_queue_capacity=2 if host else 0,
    )
  )
  reset_peak_rss()
  with jr.place(abstract, policy, store=args.store, mesh=mesh) as placed:
    placed(x)  # compiles the step
    placed.clear_caches()
    drop_page_cache(args.store)
    start = time.perf_counter()
    cold_out = np.asarray(placed(x))
    cold = time.perf_counter() - start
    start = time.perf_counter()
    warm_out = np.asarray(placed(x))
    warm = time.perf_counter() - start
    meta = placed.metadata
    totals = placed.report().total
  stop.set()
  sampler.join()
  return {
    "unit_bytes": unit,
    "layers": args.layers,
    "host_units": args.host_units,
    "static_bytes": static,
    "device_budget_bytes": device,
    "host_budget_bytes": host,
    "budgets_bytes": device + host,  # the device budget holds the static parameters
    "planned_process_bytes": meta.planned_process_bytes,
    "peak_rss_growth_bytes": peak_rss_bytes() - baseline["VmRSS"],
    "peak_anon_growth_bytes": peak_anon[0] - baseline["RssAnon"],
    "ledger_peak_device_bytes": totals.peak_device_bytes,
    "ledger_peak_host_bytes": totals.peak_host_bytes,
    "peak_buffer_bytes": totals.peak_buffer_bytes,
    "mapped_bytes": totals.mapped_bytes,
    "cold_pass_s": cold,
    "warm_pass_s": warm,
    **_keep_output(cold_out, None, "cold_output"),
    **_keep_output(warm_out, None, "warm_output"),
  }


def sweep_shape(unit_mib: float, total_gib: float, heads: int = 12) -> tuple[int, int, int]:
  """``(d_model, d_ff, layers)`` of a toy with units near ``unit_mib``, ``total_gib`` of them."""
  d = max(heads, round((unit_mib * MiB / 48) ** 0.5 / heads) * heads)  # 12 d^2 float32 params
  unit = 48 * d * d
  return d, 4 * d, max(3, -(-int(total_gib * (1 << 30)) // unit))


def _store_path(args: argparse.Namespace) -> str:
  """The store of the model that ``args`` sizes under ``--dir``, written if missing."""
  path = os.path.join(args.dir, f"toy-{args.layers}x{args.d_model}x{args.d_ff}")
  if not os.path.exists(path):
    os.makedirs(args.dir, exist_ok=True)
    args.store = path
    run_child(args, "save")
  return path


def sweep_row(args: argparse.Namespace, host_units: int, checks: list[dict]) -> dict:
  """One sweep row in a fresh process, its limit and parity added to ``checks``."""
  row = run_child(args, "sweep", "--host-units", str(host_units))
  over = row["peak_rss_growth_bytes"] - row["budgets_bytes"]
  row["over_budgets_bytes"] = over
  row["anon_over_budgets_bytes"] = row["peak_anon_growth_bytes"] - row["budgets_bytes"]
  row["target_met"] = over <= SWEEP_SLACK
  what = f"unit {row['unit_bytes'] / MiB:.1f} MiB x {row['layers']}, host {host_units} units"
  _result.check(
    checks,
    f"sweep {what}: peak RSS growth <= budgets + {SWEEP_SLACK // MiB} MiB",
    row["target_met"],
    f"{over / MiB:+.0f} MiB",
  )
  same = row["cold_output_sha256"] == row["warm_output_sha256"]
  _result.check(
    checks, f"sweep {what}: cold pass logits == warm pass logits", same, same, _result.PARITY
  )
  if not args.json:
    mib_of = {k: v / MiB for k, v in row.items() if k.endswith("bytes")}
    print(
      f"unit {mib_of['unit_bytes']:6.1f} MiB x {row['layers']:3d}  host {host_units:3d} units"
      f"  budgets {mib_of['budgets_bytes']:7.0f} MiB"
      f"  planned {mib_of['planned_process_bytes']:7.0f}"
      f"  peak RSS +{mib_of['peak_rss_growth_bytes']:6.0f}"
      f" ({mib_of['over_budgets_bytes']:+5.0f})"
      f"  anon +{mib_of['peak_anon_growth_bytes']:6.0f}"
      f" ({mib_of['anon_over_budgets_bytes']:+5.0f})  cold {row['cold_pass_s']:.2f} s"
      f"  {'ok' if row['target_met'] else 'OVER'}",
      flush=True,
    )
  return row


def sweep(args: argparse.Namespace, checks: list[dict]) -> list[dict]:
  rows = []
  for mib in args.unit_mib:
    args.d_model, args.d_ff, args.layers = sweep_shape(mib, args.sweep_gib)
    args.store = _store_path(args)
    for host_units in (0, 2, args.layers):
      row = sweep_row(args, host_units, checks)
      row["unit_mib_asked"] = mib
      rows.append(row)
  return rows


def run_child(args: argparse.Namespace, which: str, *extra: str) -> dict:
  argv = ["--child", which, "--store", args.store]
  argv += _child.flags(args, ("layers", "d_model", "d_ff", "tokens"))
  return _child.run(__file__, *argv, *extra, what=which)


def output_parity(result: dict, outputs: dict[str, str], checks: list[dict]) -> None:
  """Gates the cold and warm passes' logits against the resident pass's (``outputs``:
  the ``.npy`` each child saved); records each one's largest difference in ``result``."""
  import numpy as np

  ref = np.load(outputs["resident"])
  scale = float(np.max(np.abs(ref)))
  rtol = CPU_RTOL if result["backend"] == "cpu" else ACCELERATOR_RTOL
  tol = rtol * scale
  result["logit_scale"] = scale
  for which in ("cold", "warm"):
    got = np.load(outputs[which])
    same_shape = got.shape == ref.shape and got.dtype == ref.dtype
    diff = float(np.max(np.abs(got.astype(np.float64) - ref))) if same_shape else float("inf")
    result[f"{which}_max_abs_diff"] = diff
    ok = same_shape and diff <= tol
    how = f"within {rtol:g} of the logit scale"
    _result.check(
      checks,
      f"{which} stream pass logits == resident pass logits ({how})",
      ok,
      diff,
      _result.PARITY,
    )


def pass_benchmark(args: argparse.Namespace, checks: list[dict]) -> dict:
  """The raw, cold, warm and resident children; figures, targets and parity gates."""
  args.store = _store_path(args)
  result = {
    "layers": args.layers,
    "d_model": args.d_model,
    "d_ff": args.d_ff,
    "host_budget_bytes": BUDGET,
    "device_budget_bytes": BUDGET,
    "tokens": args.tokens,
  }
  runs = []
  for _ in range(args.repeat):  # each child a fresh process, every run's parity gated
    run: dict = dict(result)
    outputs = {}
    for which in ("raw", "cold", "warm", "resident"):
      extra = []
      if which != "raw":
        outputs[which] = os.path.join(args.dir, f"logits-{which}-{os.getpid()}.npy")
        extra = ["--output", outputs[which]]
      run.update(run_child(args, which, *extra))
    try:
      output_parity(run, outputs, checks)
    finally:
      for path in outputs.values():
        if os.path.exists(path):
          os.remove(path)
    runs.append(run)
  result = median_of(runs)
  if args.repeat > 1:
    result["runs"] = runs
  raw_bw = result["raw_bytes"] / result["raw_read_s"]
  cold_bw = result["bytes_read"] / result["cold_pass_s"]
  result["raw_read_gbps"] = raw_bw / 1e9
  result["cold_stream_gbps"] = cold_bw / 1e9
  result["cold_over_raw_bandwidth"] = cold_bw / raw_bw
  par_bw = result["raw_bytes"] / result["raw_parallel_read_s"]
  result["raw_parallel_read_gbps"] = par_bw / 1e9
  result["cold_over_parallel_raw_bandwidth"] = cold_bw / par_bw
  result["warm_over_resident"] = result["warm_pass_s"] / result["resident_pass_s"]
  growth = result["peak_rss_bytes"] - result["baseline_rss_bytes"]
  result["rss_growth_bytes"] = growth
  result["rss_limit_bytes"] = 2 * BUDGET + RSS_SLACK
  _result.check(
    checks,
    f"peak RSS growth <= host + device budgets + {RSS_SLACK // MiB} MiB",
    growth <= 2 * BUDGET + RSS_SLACK,
    f"{growth / MiB:.0f} MiB",
  )
  _result.check(
    checks,
    "cold stream bandwidth >= 0.8x raw read",
    cold_bw >= 0.8 * raw_bw,
    round(result["cold_over_raw_bandwidth"], 3),
  )
  _result.check(
    checks,
    "warm pass <= 1.5x resident pass",
    result["warm_pass_s"] <= 1.5 * result["resident_pass_s"],
    round(result["warm_over_resident"], 3),
  )
  return result


def median_of(runs: list[dict]) -> dict:
  """Each numeric figure's median over ``runs`` (the last run's for anything else)."""
  out = dict(runs[-1])
  for key, value in out.items():
    if isinstance(value, int | float) and not isinstance(value, bool):
      out[key] = statistics.median(run[key] for run in runs)
  return out


def render(result: dict) -> str:
  out = []
  if "raw_read_s" in result:
    r = result
    rows = [
      ("unit weights", f"{r['unit_bytes_total'] / MiB:,.0f} MiB in {r['layers']} units"),
      ("raw read (cold)", f"{r['raw_read_s']:.2f} s  {r['raw_read_gbps']:.2f} GB/s"),
      ("stream pass (cold)", f"{r['cold_pass_s']:.2f} s  {r['cold_stream_gbps']:.2f} GB/s"),
      ("  ratio to raw", f"{r['cold_over_raw_bandwidth']:.2f}  (target >= 0.8)"),
      (
        "raw read, 4 threads",
        f"{r['raw_parallel_read_s']:.2f} s  {r['raw_parallel_read_gbps']:.2f} GB/s",
      ),
      ("  stream / 4-thread raw", f"{r['cold_over_parallel_raw_bandwidth']:.2f}  (context)"),
      ("stream pass (warm)", f"{r['warm_pass_s']:.3f} s"),
      ("resident pass", f"{r['resident_pass_s']:.3f} s"),
      ("  warm / resident", f"{r['warm_over_resident']:.2f}  (target <= 1.5)"),
      (
        "RSS growth",
        f"{r['rss_growth_bytes'] / MiB:,.0f} MiB  (limit {r['rss_limit_bytes'] / MiB:,.0f} MiB)",
      ),
      (
        "logits vs resident",
        f"cold {r['cold_max_abs_diff']:.3g}, warm {r['warm_max_abs_diff']:.3g} max abs diff"
        f" ({r['backend']})",
      ),
    ]
    width = max(len(k) for k, _ in rows)
    out += [f"{k:<{width}}  {v}" for k, v in rows]
  if result.get("sweep"):
    out.append(f"memory sweep: {len(result['sweep'])} row(s), printed above")
  return "\n".join(out)


def markdown(result: dict) -> str:
  """The result's figures as Markdown tables (``benchmarks/report.py``)."""
  out = []
  if "raw_read_s" in result:
    r = result
    diffs = f"cold {r['cold_max_abs_diff']:.3g}, warm {r['warm_max_abs_diff']:.3g}"
    out += [
      f"{r['unit_bytes_total'] / MiB:,.0f} MiB of units in {r['layers']} units, "
      f"{r['host_budget_bytes'] // MiB} MiB host and device budgets, {r['backend']} backend:",
      "",
      "| figure | value | target |",
      "|---|---|---|",
      f"| cold stream pass vs raw sequential read | {r['cold_pass_s']:.2f} s vs "
      f"{r['raw_read_s']:.2f} s: {r['cold_stream_gbps']:.2f} vs {r['raw_read_gbps']:.2f} GB/s "
      f"({r['cold_over_raw_bandwidth']:.2f}x) | >= 0.8x |",
      f"| the same vs a 4-thread raw read | {r['cold_stream_gbps']:.2f} vs "
      f"{r['raw_parallel_read_gbps']:.2f} GB/s "
      f"({r['cold_over_parallel_raw_bandwidth']:.2f}x) | - |",
      f"| warm pass vs resident pass | {r['warm_pass_s']:.3f} s vs {r['resident_pass_s']:.3f} s "
      f"({r['warm_over_resident']:.2f}x) | <= 1.5x |",
      f"| peak RSS - baseline | {r['rss_growth_bytes'] / MiB:,.0f} MiB | "
      f"<= {r['rss_limit_bytes'] / MiB:,.0f} MiB |",
      f"| logits vs the resident pass (max abs diff) | {diffs} | parity |",
    ]
  if result.get("sweep"):
    if out:
      out.append("")
    out += [
      "| unit x units | host budget | budgets | peak RSS growth (over) | anonymous growth (over) |",
      "|---|---|---|---|---|",
    ]
    for row in result["sweep"]:
      m = {k: v / MiB for k, v in row.items() if k.endswith("bytes")}
      out.append(
        f"| {m['unit_bytes']:.1f} MiB x {row['layers']} | {row['host_units']} units "
        f"| {m['budgets_bytes']:.0f} MiB | {m['peak_rss_growth_bytes']:.0f} MiB "
        f"({m['over_budgets_bytes']:+.0f}) | {m['peak_anon_growth_bytes']:.0f} MiB "
        f"({m['anon_over_budgets_bytes']:+.0f}) |"
      )
  return "\n".join(out)


def main() -> int:
  """Runs the benchmark; returns 1 when a parity gate failed or (unless ``--quick``) a
  target was missed: the pass targets, or a row of the memory sweep over its limit."""
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument(
    "--dir",
    help="keep models and stores here and reuse them (default: a temporary directory"
    " named jax_residency_bench; with --quick, a fresh one removed afterwards)",
  )
  add_model_args(parser)
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument(
    "--repeat",
    type=int,
    default=1,
    help="runs of the pass benchmark, each child a fresh process; figures and targets are "
    "medians (the cold pass varies with the machine's free-page state)",
  )
  _result.add_args(parser)
  parser.add_argument(
    "--unit-mib",
    type=float,
    nargs="+",
    help="memory sweep over these unit sizes (MiB), e.g. 8 64 200 400",
  )
  parser.add_argument(
    "--sweep-gib", type=float, default=2.0, help="unit weights per sweep model (default 2 GiB)"
  )
  parser.add_argument("--host-units", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--child", help=argparse.SUPPRESS)
  parser.add_argument("--store", help=argparse.SUPPRESS)
  parser.add_argument("--output", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(sweep_child(args) if args.child == "sweep" else child(args))
  _result.quick_sizes(args, parser, QUICK_SIZES)
  result = _result.stamp("dense_stream", None, args.quick)
  checks: list[dict] = []
  with _result.work_dir(args, "jax_residency_bench"):
    if args.unit_mib:
      result["mode"] = "sweep"
      result["sweep"] = sweep(args, checks)
      if not args.quick and not args.result:
        args.result = str(_result.RESULTS / "dense_stream_sweep.json")
    else:
      result["mode"] = "passes"
      result.update(pass_benchmark(args, checks))
      if args.quick:  # one sweep row, on the same store
        result["sweep"] = [sweep_row(args, QUICK_SWEEP_HOST_UNITS, checks)]
  result["checks"] = checks
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
