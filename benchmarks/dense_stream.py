"""DenseDiskStream against raw disk reads and a fully resident model.

Builds (once, under --dir) a seeded transformer with >= 2 GiB of unit weights
and its store, then measures in fresh processes:

* ``raw_read_s``: plain sequential reads of the store's files into one reused
  buffer, after dropping them from the page cache (``posix_fadvise``);
* ``cold_pass_s``: one DenseDiskStream pass with 256 MiB host and device
  budgets, page cache dropped and caches cleared first (the step is compiled
  by an earlier pass), with ``peak_rss_bytes`` / ``baseline_rss_bytes``;
* ``warm_pass_s``: the second pass with a host budget that holds every unit;
* ``resident_pass_s``: a FullyResident pass of the same model.

Targets: peak RSS - baseline <= host + device budgets + 128 MiB; cold stream
bandwidth >= 0.8 x raw-read bandwidth; warm pass <= 1.5 x resident pass.

``--unit-mib 8 64 200 400`` runs the memory sweep instead: for each unit size a
toy model with at least 2 GiB of units (its own store under --dir), placed with
a device budget of static + 2 units and host budgets of 0, 2 units and every
unit, each in a fresh process: place, a first pass (compiles), then a cold pass
(caches and page cache dropped) and a warm one. It reports the process's peak
RSS minus its RSS before ``place`` (``VmHWM``, which counts mapped page-cache
pages too) and the peak of anonymous memory alone, against the budgets (device
budget, which holds the static parameters, + host budget) and the placement's
``metadata.planned_process_bytes`` (those plus named overheads). Target: at
most 64 MiB over the budgets.

    python benchmarks/dense_stream.py            # table
    python benchmarks/dense_stream.py --json     # one JSON object
    python benchmarks/dense_stream.py --unit-mib 8 64 200 400   # memory sweep
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
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
  toy_model,
  toy_tokens,
)

RSS_SLACK = 128 * MiB


def _parallel_read(files: list[str], *, threads: int) -> int:
  """Reads every file in 16 MiB ranges with ``threads`` readers; returns bytes read."""
  from concurrent.futures import ThreadPoolExecutor

  chunk = 16 * MiB
  ranges = [(name, off) for name in files for off in range(0, max(os.path.getsize(name), 1), chunk)]
  local = threading.local()

  def read(item: tuple[str, int]) -> int:
    name, off = item
    buf = getattr(local, "buf", None)
    if buf is None:
      buf = local.buf = bytearray(chunk)
    fd = os.open(name, os.O_RDONLY)
    try:
      return os.preadv(fd, [buf], off)
    finally:
      os.close(fd)

  with ThreadPoolExecutor(threads) as pool:
    return sum(pool.map(read, ranges))


def child(args: argparse.Namespace) -> dict:
  import jax
  import numpy as np

  import jax_residency as jr

  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  x = toy_tokens(args.tokens)
  if args.child == "save":
    jr.save(toy_model(config(args), abstract=False), args.store, progress=True, overwrite=True)
    return {}
  if args.child == "raw":
    drop_page_cache(args.store)
    buf = bytearray(16 * MiB)
    view = memoryview(buf)
    total, start = 0, time.perf_counter()
    for name in files_under(args.store):
      with open(name, "rb", buffering=0) as f:
        while n := f.readinto(view):
          total += n
    raw = {"raw_read_s": time.perf_counter() - start, "raw_bytes": total}
    # Context: the same bytes read by 4 threads at once (what a parallel reader can get).
    drop_page_cache(args.store)
    start = time.perf_counter()
    _parallel_read(files_under(args.store), threads=4)
    raw["raw_parallel_read_s"] = time.perf_counter() - start
    return raw
  if args.child == "resident":
    m = toy_model(config(args), abstract=False)
    with jr.place(m, jr.FullyResident(), mesh=mesh) as placed:
      placed(x)
      start = time.perf_counter()
      jax.block_until_ready(placed(x))
      return {"resident_pass_s": time.perf_counter() - start}
  abstract = toy_model(config(args), abstract=True)
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
      placed(x)
      cold = time.perf_counter() - start
      last = placed.report().last
      return {
        "cold_pass_s": cold,
        "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak_rss_bytes(),
        "bytes_read": last.disk_to_host_bytes + last.disk_to_device_bytes,
        "stalls": last.stalls,
        "stall_s": last.stall_seconds,
      }
  if args.child == "warm":
    everything = args.layers * config(args).unit_bytes() + 64 * MiB
    with jr.place(abstract, dense_policy(everything), store=args.store, mesh=mesh) as placed:
      placed(x)
      start = time.perf_counter()
      placed(x)
      warm = time.perf_counter() - start
      last = placed.report().last
      return {"warm_pass_s": warm, "warm_bytes_read": last.disk_to_host_bytes}
  raise SystemExit(f"unknown child {args.child!r}")


SWEEP_SLACK = 64 * MiB
#: Sampling period of the anonymous-RSS sampler (the kernel's VmHWM has no anon split).
_SAMPLE_S = 0.002


def _status_kib(*keys: str) -> dict[str, int]:
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name in keys:
        out[name] = int(rest.split()[0]) * 1024
  return out


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
  baseline = _status_kib("VmRSS", "RssAnon", "RssFile")
  peak_anon = [baseline["RssAnon"]]
  stop = threading.Event()

  def sample() -> None:
    while not stop.is_set():
      peak_anon[0] = max(peak_anon[0], _status_kib("RssAnon")["RssAnon"])
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
    placed(x)
    cold = time.perf_counter() - start
    start = time.perf_counter()
    placed(x)
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
  }


def sweep_shape(unit_mib: float, total_gib: float, heads: int = 12) -> tuple[int, int, int]:
  """``(d_model, d_ff, layers)`` of a toy with units near ``unit_mib``, ``total_gib`` of them."""
  d = max(heads, round((unit_mib * MiB / 48) ** 0.5 / heads) * heads)  # 12 d^2 float32 params
  unit = 48 * d * d
  return d, 4 * d, max(3, -(-int(total_gib * (1 << 30)) // unit))


def sweep(args: argparse.Namespace) -> list[dict]:
  rows = []
  for mib in args.unit_mib:
    args.d_model, args.d_ff, args.layers = sweep_shape(mib, args.sweep_gib)
    args.store = os.path.join(args.dir, f"toy-{args.layers}x{args.d_model}x{args.d_ff}")
    if not os.path.exists(args.store):
      os.makedirs(args.dir, exist_ok=True)
      run_child(args, "save")
    for host_units in (0, 2, args.layers):
      row = run_child(args, "sweep", "--host-units", str(host_units))
      row["unit_mib_asked"] = mib
      over = row["peak_rss_growth_bytes"] - row["budgets_bytes"]
      row["over_budgets_bytes"] = over
      row["anon_over_budgets_bytes"] = row["peak_anon_growth_bytes"] - row["budgets_bytes"]
      row["target_met"] = over <= SWEEP_SLACK
      rows.append(row)
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
  return rows


def run_child(args: argparse.Namespace, which: str, *extra: str) -> dict:
  cmd = [sys.executable, __file__, "--child", which, "--store", args.store]
  cmd += ["--layers", str(args.layers), "--d-model", str(args.d_model), "--d-ff", str(args.d_ff)]
  cmd += ["--tokens", str(args.tokens), *extra]
  out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
  return json.loads(out.strip().splitlines()[-1]) if out.strip() else {}


def main() -> int:
  """Runs the benchmark; returns 1 when a target was missed (the pass targets, or a
  row of the memory sweep over its limit), else 0."""
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "jax_residency_bench"))
  add_model_args(parser)
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument("--json", action="store_true", help="print one JSON object")
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
  args = parser.parse_args()
  if args.child:
    print(json.dumps(sweep_child(args) if args.child == "sweep" else child(args)))
    return 0
  if args.unit_mib:
    rows = sweep(args)
    if args.json:
      print(json.dumps(rows))
    over = [row for row in rows if not row.get("target_met", True)]
    if over:
      print(f"{len(over)} sweep row(s) over the RSS limit: MISSED", file=sys.stderr)
    return 1 if over else 0

  args.store = os.path.join(args.dir, f"toy-{args.layers}x{args.d_model}x{args.d_ff}")
  if not os.path.exists(args.store):
    os.makedirs(args.dir, exist_ok=True)
    run_child(args, "save")
  result = {"host_budget_bytes": BUDGET, "device_budget_bytes": BUDGET, "tokens": args.tokens}
  for which in ("raw", "cold", "warm", "resident"):
    result.update(run_child(args, which))
  unit_bytes = args.layers * config(args).unit_bytes()
  result["unit_bytes_total"] = unit_bytes
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
  result["targets"] = {
    "rss_within_budgets": growth <= 2 * BUDGET + RSS_SLACK,
    "cold_bandwidth_ge_0.8_raw": cold_bw >= 0.8 * raw_bw,
    "warm_le_1.5_resident": result["warm_pass_s"] <= 1.5 * result["resident_pass_s"],
  }
  missed = [name for name, ok in result["targets"].items() if not ok]
  if args.json:
    print(json.dumps(result))
    return 1 if missed else 0
  rows = [
    ("unit weights", f"{unit_bytes / MiB:,.0f} MiB in {args.layers} units"),
    ("raw read (cold)", f"{result['raw_read_s']:.2f} s  {result['raw_read_gbps']:.2f} GB/s"),
    ("stream pass (cold)", f"{result['cold_pass_s']:.2f} s  {result['cold_stream_gbps']:.2f} GB/s"),
    ("  ratio to raw", f"{result['cold_over_raw_bandwidth']:.2f}  (target >= 0.8)"),
    ("raw read, 4 threads", f"{result['raw_parallel_read_s']:.2f} s  {par_bw / 1e9:.2f} GB/s"),
    ("  stream / 4-thread raw", f"{result['cold_over_parallel_raw_bandwidth']:.2f}  (context)"),
    ("stream pass (warm)", f"{result['warm_pass_s']:.3f} s"),
    ("resident pass", f"{result['resident_pass_s']:.3f} s"),
    ("  warm / resident", f"{result['warm_over_resident']:.2f}  (target <= 1.5)"),
    ("RSS growth", f"{growth / MiB:,.0f} MiB  (limit {result['rss_limit_bytes'] / MiB:,.0f} MiB)"),
  ]
  width = max(len(k) for k, _ in rows)
  for k, v in rows:
    print(f"{k:<{width}}  {v}")
  print("targets met:" if not missed else "targets MISSED:", result["targets"])
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main())
