"""Cold chunks faulted in as huge folios (store/fault_in.py; docs/design.md, section 4.5).

A mapped read maps page-cache pages one page-table entry per folio page; the kernel
picks a folio's size when it reads the page from disk. Mapped reads fault their cold
chunks in through ``MADV_HUGEPAGE`` mappings, in pieces on threads, and read-ahead does
the same through short-lived windows, so what comes from disk maps again cheaply.
"""

from __future__ import annotations

import mmap
import os
import shutil
import threading
import time

import jax
import numpy as np
import pytest
from damage import drop_pages
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src.plan import memory
from jax_residency._src.store import fault_in, mapped, residency
from jax_residency._src.store import unit_store as st
from jax_residency.toy import ToyConfig

pytestmark = pytest.mark.skipif(
  not (hasattr(os, "posix_fadvise") and mapped.mapped_reads_enabled()),
  reason="needs posix_fadvise and mapped reads",
)

CFG = ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=128, n_layers=4)
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
model, tokens, store = toy_fixtures(CFG, seeded=True)


def _raw_extents(opened: st.UnitStore, unit: int) -> list[mapped.Extent]:
  mapper = opened._stacks[0].mapper
  assert mapper is not None
  return [extent for _, extent, _ in mapper._raw_extents(unit)]


def _cold_copy(store: str, tmp_path) -> tuple[st.UnitStore, st.UnitStore]:
  """A copy of ``store`` opened with mapped reads and dropped from the page cache, and
  ``store`` itself opened to read the same units by copy."""
  copy = str(tmp_path / "store")
  shutil.copytree(store, copy)
  opened = st.UnitStore.open(copy)
  assert opened.use_mapped_reads()
  drop_pages(copy)
  return opened, st.UnitStore.open(store)


def _wait_resident(extents: list[mapped.Extent]) -> None:
  deadline = time.monotonic() + 30
  for extent in extents:
    fd = os.open(extent.file, os.O_RDONLY)
    try:
      while not residency.resident_in_file(fd, extent.offset, extent.length):
        assert time.monotonic() < deadline, f"read-ahead never brought {extent} in"
        time.sleep(0.005)
    finally:
      os.close(fd)


def test_cold_chunks_are_faulted_in_piece_by_piece_and_read_right(store, tmp_path, monkeypatch):
  monkeypatch.setattr(fault_in, "FILL_PIECE", mmap.PAGESIZE)  # a piece per page
  pieces: list[int] = []
  real_fill = fault_in.fill

  def fill(region, file_offset):
    futures = real_fill(region, file_offset)
    pieces.append(len(futures))
    return futures

  monkeypatch.setattr(fault_in, "fill", fill)
  opened, copied = _cold_copy(store, tmp_path)
  for i in range(CFG.n_layers):
    got, want = opened.read_unit(i), copied.read_unit(i)
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=str(key))
  assert max(pieces) > 1  # chunks of several pages came in as several pieces
  assert opened.advised_bytes > 0  # found out of the page cache ...
  assert sum(m.checked_bytes for m in opened._mappers) > 0  # ... so checked
  _wait_resident(_raw_extents(opened, CFG.n_layers - 1))
  pieces.clear()
  opened.read_unit(0)  # from the page cache now: mapped and populated, no pieces
  assert pieces == []
  copied.close()
  opened.close()


def test_without_populate_a_cold_chunk_is_still_mapped(store, tmp_path, monkeypatch):
  """Where the kernel cannot populate a mapping (macOS, Linux before 5.14) a cold chunk
  stays mapped and its pages fault in as they are read."""
  monkeypatch.setattr(residency, "populate", lambda region, start=0, length=None: False)
  opened, copied = _cold_copy(store, tmp_path)
  got, want = opened.read_unit(1), copied.read_unit(1)
  mapped_views = [a for a in got.values() if fault_in.region_of(a) is not None]
  assert mapped_views  # mapped, not read by copy
  for key, value in want.items():
    np.testing.assert_array_equal(got[key], value, err_msg=str(key))
  copied.close()
  opened.close()


def test_read_ahead_maps_no_more_than_its_planned_windows(store, tmp_path, monkeypatch):
  window = 2 * mmap.PAGESIZE
  monkeypatch.setattr(fault_in, "READ_AHEAD_WINDOW", window)
  lock, live, most, spans = threading.Lock(), [0], [0], []
  real = fault_in._fault_in_window

  def counted(path: str, start: int, end: int) -> None:
    with lock:
      live[0] += 1
      most[0] = max(most[0], live[0])
      spans.append(min(window, end - start))
    try:
      time.sleep(0.002)  # long enough for the windows to overlap
      real(path, start, end)
    finally:
      with lock:
        live[0] -= 1

  monkeypatch.setattr(fault_in, "_fault_in_window", counted)
  copy = str(tmp_path / "store")
  shutil.copytree(store, copy)
  opened = st.UnitStore.open(copy)
  assert opened.use_mapped_reads()
  drop_pages(copy)
  extents = _raw_extents(opened, 1)
  assert opened.advise_unit(1) == sum(e.length for e in extents)
  _wait_resident(extents)
  deadline = time.monotonic() + 30
  while live[0]:
    assert time.monotonic() < deadline
    time.sleep(0.005)
  assert len(spans) > fault_in.READ_AHEAD_THREADS  # more windows than threads ...
  assert most[0] <= memory.READ_AHEAD_THREADS  # ... never more mapped at once
  assert max(spans) <= window
  assert opened.advise_unit(1) == 0  # all cached now: nothing to ask for
  opened.close()


@pytest.mark.parametrize("host", [0, 1 << 30])
def test_the_plan_names_read_ahead_mappings_only_where_they_happen(model, store, host):
  policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(device_budget_bytes=2**30, host_budget_bytes=host)
  )
  with jr.place(model, policy, store=store, mesh=MESH1) as placed:
    items = {item.name: item for item in placed.metadata.memory}
  ahead = items.get("read-ahead mappings")
  if host:
    assert ahead is None  # the host cache's reads copy: no read-ahead mappings
  else:
    assert ahead is not None and ahead.counted_in == "overhead"
    assert ahead.nbytes == memory.READ_AHEAD_THREADS * memory.READ_AHEAD_WINDOW


# -- huge folios, where the kernel can show them ------------------------------------

HUGE = residency.HUGE_PAGE
BIG = ToyConfig(vocab=64, d_model=1024, n_heads=4, d_ff=2048, n_layers=2)  # 8 MiB kernels


def _in_huge_folios(array: np.ndarray) -> float | None:
  """The share of ``array``'s pages that sit in folios of 2 MiB or more, from
  ``/proc/self/pagemap`` and ``/proc/kpageflags`` (None where they cannot be read)."""
  page = mmap.PAGESIZE
  first, end = array.ctypes.data // page, -(-(array.ctypes.data + array.nbytes) // page)
  try:
    with open("/proc/self/pagemap", "rb") as f:
      f.seek(first * 8)
      entries = np.frombuffer(f.read((end - first) * 8), np.uint64)
    pfns = entries & np.uint64((1 << 55) - 1)
    if not pfns.any():
      return None  # PFNs hidden (no CAP_SYS_ADMIN)
    with open("/proc/kpageflags", "rb") as f:
      flags = []
      for pfn in pfns.tolist():
        f.seek(pfn * 8)
        flags.append(int.from_bytes(f.read(8), "little"))
  except OSError:
    return None
  in_huge, run = 0, 0
  for bits in [*flags, 0]:
    if (bits >> 16) & 1:  # a tail page: the folio goes on
      run += 1
      continue
    in_huge += run if run >= HUGE // page else 0
    run = 1
  return in_huge / len(flags)


def _filesystem_has_large_folios(directory: str) -> bool:
  """Whether pages faulted in through a ``MADV_HUGEPAGE`` mapping of a file in
  ``directory`` become huge folios (ext4 and XFS on recent Linux)."""
  path = os.path.join(directory, "probe")
  with open(path, "wb") as f:
    f.write(b"\1" * (2 * HUGE))
  drop_pages(directory)
  fd = os.open(path, os.O_RDONLY)
  try:
    with mmap.mmap(fd, 2 * HUGE, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ) as region:
      region.madvise(mmap.MADV_HUGEPAGE)  # the kernel's own means, not the library's
      region.madvise(residency.MADV_POPULATE_READ)
      view = np.frombuffer(region, np.uint8)
      share = _in_huge_folios(view)
      del view
  finally:
    os.close(fd)
  os.remove(path)
  return bool(share)


def test_chunks_read_from_disk_come_in_as_huge_folios(toy_store, tmp_path):
  if _in_huge_folios(np.zeros(1, np.uint8)) is None:
    pytest.skip("/proc/kpageflags cannot be read here")
  if not _filesystem_has_large_folios(str(tmp_path)):
    pytest.skip("this filesystem keeps no large folios in the page cache")
  copy = str(tmp_path / "store")
  shutil.copytree(toy_store(BIG, seeded=True), copy)
  opened = st.UnitStore.open(copy)
  assert opened.use_mapped_reads()
  drop_pages(copy)
  for unit in range(BIG.n_layers):
    if unit == 1:  # read ahead, then read
      drop_pages(copy)
      assert opened.advise_unit(1) > 0
      _wait_resident(_raw_extents(opened, 1))
    read = opened.read_unit(unit)
    big = max(read.values(), key=lambda a: a.nbytes)
    assert big.nbytes >= 4 * HUGE
    share = _in_huge_folios(big)
    # All but the ends of the chunk (folios are aligned in the file) are huge folios.
    assert share is not None and share >= 0.5, (unit, share)
    del read, big
  opened.close()
