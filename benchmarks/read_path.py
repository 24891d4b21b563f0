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

  python benchmarks/read_path.py                   # 16 units x 128 MiB = 2 GiB
  python benchmarks/read_path.py --units 8 --unit-mib 32 --json
  python benchmarks/read_path.py --checksums --units 8 --unit-mib 128
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from jax_residency._src.store import unit_store as st
from jax_residency._src.store import verify
from jax_residency._src.store import writer as wr

PREFIX = ("layers",)
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


def _store_files(path: str) -> list[str]:
  return sorted(os.path.join(d, f) for d, _, names in os.walk(path) for f in names)


def _drop_page_cache(files: list[str]) -> None:
  for name in files:
    fd = os.open(name, os.O_RDONLY)
    try:
      os.fsync(fd)
      os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)


def _raw_read(files: list[str], buffer: memoryview) -> int:
  total = 0
  for name in files:
    with open(name, "rb", buffering=0) as f:
      while n := f.readinto(buffer):
        total += n
  return total


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


def _checksum_cost(args: argparse.Namespace, root: str) -> dict:
  """Reads a store with and without checksums, copied and mapped, cold and warm."""
  paths = {on: os.path.join(root, "store" if on else "store-no-checksums") for on in (1, 0)}
  for on, path in paths.items():
    _ensure_store(path, args.units, args.unit_mib, checksums=bool(on))
  seconds: dict[str, list[float]] = {}
  stores = {}
  for on, path in paths.items():
    for way in ("copied", "mapped"):
      store = st.UnitStore.open(path)
      if way == "mapped" and not store.use_mapped_reads():
        raise SystemExit(f"{path}: mapped reads are not available here")
      _store_read(store, args.in_flight)  # prime buffers (and the chunk index)
      stores[on, way] = store
  files = {on: _store_files(path) for on, path in paths.items()}
  for _ in range(args.repeats):
    for (on, way), store in stores.items():
      for cache in ("cold", "warm"):
        if cache == "cold":
          _drop_page_cache(files[on])
        start = time.perf_counter()
        _store_read(store, args.in_flight)
        seconds.setdefault(f"{way}_{cache}_{'crc' if on else 'plain'}", []).append(
          time.perf_counter() - start
        )
  for store in stores.values():
    store.close()
  med = {k: statistics.median(v) for k, v in seconds.items()}
  gib = args.units * _unit_bytes(args.unit_mib) / 2**30
  return {
    "units": args.units,
    "unit_mib": args.unit_mib,
    "total_gib": round(gib, 3),
    "repeats": args.repeats,
    "seconds": {k: round(v, 4) for k, v in med.items()},
    "gib_per_s": {k: round(gib / v, 3) for k, v in med.items()},
    "checksum_ratio": {
      f"{way}_{cache}": round(med[f"{way}_{cache}_crc"] / med[f"{way}_{cache}_plain"], 3)
      for way in ("copied", "mapped")
      for cache in ("cold", "warm")
    },
  }


def _unit_bytes(unit_mib: int) -> int:
  return sum(max(1, int(unit_mib * 2**20 * f) // 2048) * 2048 for f in FRACTIONS.values())


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", help="keep the store here and reuse it (default: a temp dir)")
  parser.add_argument("--units", type=int, default=16, help="number of units (default 16)")
  parser.add_argument("--unit-mib", type=int, default=128, help="MiB per unit (default 128)")
  parser.add_argument("--repeats", type=int, default=3, help="measured repeats (default 3)")
  parser.add_argument("--in-flight", type=int, default=2, help="unit reads in flight (default 2)")
  parser.add_argument("--json", action="store_true", help="print one JSON object")
  parser.add_argument(
    "--checksums", action="store_true", help="measure what checking chunk checksums costs"
  )
  args = parser.parse_args(argv)

  root = args.dir or tempfile.mkdtemp(prefix="jax_residency_bench_")
  if args.checksums:
    try:
      cost = _checksum_cost(args, root)
    finally:
      if not args.dir:
        shutil.rmtree(root, ignore_errors=True)
    if args.json:
      print(json.dumps(cost))
      return 0
    print(
      f"{cost['units']} units x {cost['unit_mib']} MiB = {cost['total_gib']:.2f} GiB, "
      f"median of {cost['repeats']}: GiB/s without -> with checksums (time ratio)"
    )
    for key, ratio in cost["checksum_ratio"].items():
      plain, crc = cost["gib_per_s"][f"{key}_plain"], cost["gib_per_s"][f"{key}_crc"]
      print(f"  {key:<13}{plain:>8.2f} -> {crc:>6.2f}   {ratio:.3f}x")
    return 0
  path = os.path.join(root, "store")
  try:
    start = time.perf_counter()
    _ensure_store(path, args.units, args.unit_mib)
    setup_s = time.perf_counter() - start
    files = _store_files(path)
    buffer = memoryview(bytearray(64 << 20))
    results: dict[str, list[float]] = {
      k: [] for k in ("raw_cold", "store_cold", "raw_warm", "store_warm")
    }
    with st.UnitStore.open(path) as store:
      _store_read(store, args.in_flight)  # prime the reusable buffers
      for _ in range(args.repeats):
        _drop_page_cache(files)
        results["raw_cold"].append(_timed(lambda: _raw_read(files, buffer)))
        _drop_page_cache(files)
        results["store_cold"].append(_timed(lambda: _store_read(store, args.in_flight)))
        results["raw_warm"].append(_timed(lambda: _raw_read(files, buffer)))
        results["store_warm"].append(_timed(lambda: _store_read(store, args.in_flight)))
      total_gib = store.total_unit_bytes / 2**30
  finally:
    if not args.dir:
      shutil.rmtree(root, ignore_errors=True)

  med = {k: statistics.median(v) for k, v in results.items()}
  report = {
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
  }
  if args.json:
    print(json.dumps(report))
    return 0
  print(
    f"{args.units} units x {args.unit_mib} MiB = {total_gib:.2f} GiB, "
    f"{args.in_flight} in flight, median of {args.repeats} (GB/s)"
  )
  print(f"{'':8}{'raw readinto':>14}{'read_unit':>12}{'ratio':>8}")
  for cache in ("cold", "warm"):
    raw, ours = med[f"raw_{cache}"], med[f"store_{cache}"]
    print(f"{cache:8}{raw:>14.2f}{ours:>12.2f}{ours / raw:>7.2f}x")
  return 0


if __name__ == "__main__":
  sys.exit(main())
