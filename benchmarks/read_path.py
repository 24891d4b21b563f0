"""How close `UnitStore.read_unit` comes to raw disk bandwidth.

Writes (or reuses, under `--dir`) a store of N units of M MiB each (each unit
split over a few tensors of different sizes), then measures, per repeat:

* raw, cold: sequential `readinto` of the store's files into one reused buffer,
  after dropping them from the page cache (`posix_fadvise(DONTNEED)`);
* store, cold: `UnitStore.read_units` over every unit (2 in flight), after the
  same drop;
* raw and store, warm: the same with the files in the page cache.

Cold and warm passes of raw and store reads are interleaved so that drift in
the machine's disk speed hits both alike; the table shows medians. One untimed
pass first primes the store's reusable unit buffers (the steady state of a
streaming engine).

With ``--checksums``, the cost of checking each chunk's CRC-32C: the same
store is written twice, with checksums (as `jax_residency.save` writes stores)
and without (as before they had them), and each is read both ways a dense
stream reads on CPU, copied (`read_units`: TensorStore decodes and checks) and
mapped (`use_mapped_reads`: the CRC runs over the mapped pages), cold and warm.
The ratios are time with checksums over time without, per way and cache state.

Data gates: after the timed passes, each way of reading (and, with
``--checksums``, each store) reads every unit again, from disk and from the
page cache, and each tensor it returns must be the array that was saved
(SHA-256 of its bytes, shape and dtype, against the generated data); with
``--checksums``, one store must carry checksums on every array and the other on
none. There are no performance targets: the script reports its ratios.

``--quick`` runs both parts on 4 units of 1 MiB, one repeat, in a temporary
directory. A full run writes ``benchmarks/results/read_path.json`` (with
``--checksums``: ``read_path_checksums.json``); see ``benchmarks/_result.py``.

  python benchmarks/read_path.py                   # 16 units x 128 MiB = 2 GiB
  python benchmarks/read_path.py --units 8 --unit-mib 32 --json
  python benchmarks/read_path.py --checksums --units 8 --unit-mib 128
  python benchmarks/read_path.py --quick           # toy size, both parts
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import time

import _result
import numpy as np
from _measure import drop_page_cache, files_under, read_files

from jax_residency._src.store import unit_store as st
from jax_residency._src.store import verify
from jax_residency._src.store import writer as wr

PREFIX = ("layers",)
#: ``--quick``'s sizes, where the flags are left at their defaults.
QUICK = {"units": 4, "unit_mib": 1, "repeats": 1}
#: How one unit's bytes are split over its tensors.
FRACTIONS = {("mlp", "up"): 0.5, ("attn", "q"): 0.25, ("attn", "k"): 0.125, ("attn", "v"): 0.125}


class _Stacked:
  """A (units, rows, 1024) bfloat16-sized array generated one unit at a time."""

  def __init__(self, units: int, nbytes: int, seed: int):
    self.shape = (units, max(1, nbytes // 2048), 1024)
    self.dtype = np.dtype(np.uint16)
    self._seed = seed

  def __getitem__(self, i: int) -> np.ndarray:
    rng = np.random.default_rng((self._seed, i))
    return rng.integers(0, 2**16, self.shape[1:], dtype=np.uint16)


def _store_read(store: st.UnitStore, in_flight: int) -> int:
  total = 0
  for _, tensors in store.read_units(range(store.unit_count), in_flight=in_flight):
    total += sum(a.nbytes for a in tensors.values())
    del tensors
  return total


def _timed(fn) -> float:
  start = time.perf_counter()
  nbytes = fn()
  return nbytes / (time.perf_counter() - start) / 1e9


def _ensure_store(path: str, units: int, unit_mib: int, *, checksums: bool = True) -> None:
  try:
    with st.UnitStore.open(path) as store:
      same = store.unit_count == units and store.unit_nbytes == _unit_bytes(unit_mib)
      if same and (verify.checksums(store) == "crc32c") == checksums:
        return
  except Exception:  # noqa: BLE001 - anything else: write it afresh
    pass
  arrays = {
    key: _Stacked(units, int(unit_mib * 2**20 * frac), seed)
    for seed, (key, frac) in enumerate(FRACTIONS.items())
  }
  saved, wr.WRITE_CHECKSUMS = wr.WRITE_CHECKSUMS, checksums
  try:
    wr.save_store(path, static={}, units=arrays, unit_prefix=PREFIX, overwrite=True)
  finally:
    wr.WRITE_CHECKSUMS = saved


def _digest(a: np.ndarray) -> str:
  return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def _expected(units: int, unit_mib: int) -> dict[tuple[int, tuple[str, ...]], tuple]:
  """What reading unit ``i`` must give for each tensor: ``(shape, dtype, sha256)``, from
  the same generator `_ensure_store` saved (one unit at a time)."""
  out = {}
  for seed, (key, frac) in enumerate(FRACTIONS.items()):
    stacked = _Stacked(units, int(unit_mib * 2**20 * frac), seed)
    for i in range(units):
      a = stacked[i]
      out[i, key] = (a.shape, a.dtype.str, _digest(a))
  return out


def _data_check(
  store: st.UnitStore,
  in_flight: int,
  expected: dict,
  files: list[str],
  checks: list[dict],
  what: str,
) -> dict:
  """Reads every unit from disk (page cache dropped first), then from the page cache,
  through ``store`` as it is set up; a parity check per cache state that each tensor is
  the array saved. Returns the tensors read and the mismatches, per cache state."""
  out = {}
  for cache in ("cold", "warm"):
    if cache == "cold":
      drop_page_cache(*files)
    seen, bad, equal = set(), [], 0
    for i, tensors in store.read_units(range(store.unit_count), in_flight=in_flight):
      for key, a in tensors.items():
        seen.add((i, key))
        if (a.shape, a.dtype.str, _digest(a)) == expected.get((i, key)):
          equal += 1
        else:
          bad.append(f"unit {i} {'.'.join(key)}")
      del tensors
    bad += [f"unit {i} {'.'.join(key)} not read" for i, key in sorted(set(expected) - seen)]
    out[cache] = {"tensors": len(seen), "mismatched": bad}
    _result.check(
      checks,
      f"{what}, {cache}: every tensor read is the array saved",
      not bad,
      f"{equal}/{len(expected)} tensors equal",
      _result.PARITY,
    )
  return out


def _checksum_cost(args: argparse.Namespace, root: str, checks: list[dict]) -> dict:
  """Reads a store with and without checksums, copied and mapped, cold and warm."""
  paths = {on: os.path.join(root, "store" if on else "store-no-checksums") for on in (1, 0)}
  for on, path in paths.items():
    _ensure_store(path, args.units, args.unit_mib, checksums=bool(on))
  seconds: dict[str, list[float]] = {}
  stores = {}
  stored = {}
  for on, path in paths.items():
    for way in ("copied", "mapped"):
      store = st.UnitStore.open(path)
      if way == "mapped" and not store.use_mapped_reads():
        raise SystemExit(f"{path}: mapped reads are not available here")
      _store_read(store, args.in_flight)  # prime buffers (and the chunk index)
      stores[on, way] = store
    stored["crc" if on else "plain"] = verify.checksums(stores[on, "copied"])
  _result.check(
    checks,
    "one store has checksums on every array, the other on none",
    stored == {"crc": "crc32c", "plain": "none"},
    stored,
    _result.PARITY,
  )
  files = {on: files_under(path) for on, path in paths.items()}
  for _ in range(args.repeats):
    for (on, way), store in stores.items():
      for cache in ("cold", "warm"):
        if cache == "cold":
          drop_page_cache(*files[on])
        start = time.perf_counter()
        _store_read(store, args.in_flight)
        seconds.setdefault(f"{way}_{cache}_{'crc' if on else 'plain'}", []).append(
          time.perf_counter() - start
        )
  expected = _expected(args.units, args.unit_mib)
  data = {}
  try:
    for (on, way), store in stores.items():
      kind = "crc" if on else "plain"
      what = f"{way} reads, store {'with' if on else 'without'} checksums"
      data[f"{way}_{kind}"] = _data_check(store, args.in_flight, expected, files[on], checks, what)
  finally:
    for store in stores.values():
      store.close()
  med = {k: statistics.median(v) for k, v in seconds.items()}
  gib = args.units * _unit_bytes(args.unit_mib) / 2**30
  return {
    "units": args.units,
    "unit_mib": args.unit_mib,
    "total_gib": round(gib, 3),
    "repeats": args.repeats,
    "store_checksums": stored,
    "seconds": {k: round(v, 4) for k, v in med.items()},
    "gib_per_s": {k: round(gib / v, 3) for k, v in med.items()},
    "checksum_ratio": {
      f"{way}_{cache}": round(med[f"{way}_{cache}_crc"] / med[f"{way}_{cache}_plain"], 3)
      for way in ("copied", "mapped")
      for cache in ("cold", "warm")
    },
    "data": data,
  }


def _read_vs_raw(args: argparse.Namespace, root: str, checks: list[dict]) -> dict:
  """Raw reads against the store's unit reads, cold and warm, interleaved; medians."""
  path = os.path.join(root, "store")
  start = time.perf_counter()
  _ensure_store(path, args.units, args.unit_mib)
  setup_s = time.perf_counter() - start
  files = files_under(path)
  buffer = memoryview(bytearray(64 << 20))
  results: dict[str, list[float]] = {
    k: [] for k in ("raw_cold", "store_cold", "raw_warm", "store_warm")
  }
  with st.UnitStore.open(path) as store:
    _store_read(store, args.in_flight)  # prime the reusable buffers
    for _ in range(args.repeats):
      drop_page_cache(*files)
      results["raw_cold"].append(_timed(lambda: read_files(*files, buffer=buffer)))
      drop_page_cache(*files)
      results["store_cold"].append(_timed(lambda: _store_read(store, args.in_flight)))
      results["raw_warm"].append(_timed(lambda: read_files(*files, buffer=buffer)))
      results["store_warm"].append(_timed(lambda: _store_read(store, args.in_flight)))
    total_gib = store.total_unit_bytes / 2**30
    expected = _expected(args.units, args.unit_mib)
    data = _data_check(store, args.in_flight, expected, files, checks, "store reads")
  med = {k: statistics.median(v) for k, v in results.items()}
  return {
    "units": args.units,
    "unit_mib": args.unit_mib,
    "total_gib": round(total_gib, 3),
    "in_flight": args.in_flight,
    "repeats": args.repeats,
    "setup_seconds": round(setup_s, 2),
    "gb_per_s": {k: round(v, 3) for k, v in med.items()},
    "runs_gb_per_s": {k: [round(x, 3) for x in v] for k, v in results.items()},
    "cold_ratio": round(med["store_cold"] / med["raw_cold"], 3),
    "warm_ratio": round(med["store_warm"] / med["raw_warm"], 3),
    "data": data,
  }


def render(result: dict) -> str:
  out = []
  if "read" in result:
    r = result["read"]
    out.append(
      f"{r['units']} units x {r['unit_mib']} MiB = {r['total_gib']:.2f} GiB, "
      f"{r['in_flight']} in flight, median of {r['repeats']} (GB/s)"
    )
    out.append(f"{'':8}{'raw readinto':>14}{'read_unit':>12}{'ratio':>8}")
    for cache in ("cold", "warm"):
      raw, ours = r["gb_per_s"][f"raw_{cache}"], r["gb_per_s"][f"store_{cache}"]
      out.append(f"{cache:8}{raw:>14.2f}{ours:>12.2f}{ours / raw:>7.2f}x")
  if "checksums" in result:
    cost = result["checksums"]
    out.append(
      f"{cost['units']} units x {cost['unit_mib']} MiB = {cost['total_gib']:.2f} GiB, "
      f"median of {cost['repeats']}: GiB/s without -> with checksums (time ratio)"
    )
    for key, ratio in cost["checksum_ratio"].items():
      plain, crc = cost["gib_per_s"][f"{key}_plain"], cost["gib_per_s"][f"{key}_crc"]
      out.append(f"  {key:<13}{plain:>8.2f} -> {crc:>6.2f}   {ratio:.3f}x")
  return "\n".join(out)


def markdown(result: dict) -> str:
  """The result's figures as Markdown tables (``benchmarks/report.py``)."""
  out = []
  if "read" in result:
    r = result["read"]
    out += [
      f"{r['units']} units x {r['unit_mib']} MiB = {r['total_gib']:.2f} GiB, "
      f"{r['in_flight']} unit reads in flight, medians of {r['repeats']}:",
      "",
      "| cache | raw `readinto` | `read_units` | ratio |",
      "|---|---|---|---|",
    ]
    for cache in ("cold", "warm"):
      raw, ours = r["gb_per_s"][f"raw_{cache}"], r["gb_per_s"][f"store_{cache}"]
      out.append(f"| {cache} | {raw:.2f} GB/s | {ours:.2f} GB/s | {ours / raw:.2f}x |")
  if "checksums" in result:
    c = result["checksums"]
    if out:
      out.append("")
    out += [
      f"{c['units']} units x {c['unit_mib']} MiB = {c['total_gib']:.2f} GiB, "
      f"medians of {c['repeats']}:",
      "",
      "| read | without checksums | with checksums | time ratio |",
      "|---|---|---|---|",
    ]
    for key, ratio in c["checksum_ratio"].items():
      plain, crc = c["gib_per_s"][f"{key}_plain"], c["gib_per_s"][f"{key}_crc"]
      way, cache = key.split("_")
      out.append(f"| {way}, {cache} | {plain:.2f} GiB/s | {crc:.2f} GiB/s | {ratio:.2f}x |")
  return "\n".join(out)


def _unit_bytes(unit_mib: int) -> int:
  return sum(max(1, int(unit_mib * 2**20 * f) // 2048) * 2048 for f in FRACTIONS.values())


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", help="keep the store here and reuse it (default: a temp dir)")
  parser.add_argument("--units", type=int, default=16, help="number of units (default 16)")
  parser.add_argument("--unit-mib", type=int, default=128, help="MiB per unit (default 128)")
  parser.add_argument("--repeats", type=int, default=3, help="measured repeats (default 3)")
  parser.add_argument("--in-flight", type=int, default=2, help="unit reads in flight (default 2)")
  parser.add_argument(
    "--checksums", action="store_true", help="measure what checking chunk checksums costs"
  )
  _result.add_args(parser)
  args = parser.parse_args(argv)
  _result.quick_sizes(args, parser, QUICK)

  result = _result.stamp("read_path", argv, args.quick)
  result["mode"] = "checksums" if args.checksums else "read" + ("+checksums" if args.quick else "")
  checks: list[dict] = []
  root = args.dir or tempfile.mkdtemp(prefix="jax_residency_bench_")
  try:
    if not args.checksums:
      result["read"] = _read_vs_raw(args, root, checks)
    if args.checksums or args.quick:  # --quick runs both parts
      result["checksums"] = _checksum_cost(args, root, checks)
  finally:
    if not args.dir:
      shutil.rmtree(root, ignore_errors=True)
  if args.checksums and not args.quick and not args.result:
    args.result = str(_result.RESULTS / "read_path_checksums.json")
  result["checks"] = checks
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
