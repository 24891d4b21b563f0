"""Which chunk bytes a read must check against their checksum: those that come from disk.

A storage engine checks a block's checksum when it reads the block from the device,
not each time it serves the block again from its own cache. The page cache is that
cache here: a chunk read straight from a local data file (mapped, `mapped.UnitMapper`,
or copied with ``preadv``) is checked

* the first time this open store reads it, and
* on every later read that finds any of its pages out of the page cache (evicted, or
  dropped), since those pages are then read from disk again,
* and on every read after its data file changed identity (device, inode, size or
  modification time: a file rewritten in place, or a store replaced on disk).

A chunk whose pages all stayed in the page cache since its check passed is served
without another CRC (`VerifiedExtents`). A read-ahead hint (`mapped.UnitMapper`
asks the kernel for chunks before reading them) tests residency before it asks, and
marks the chunks it found out of the cache: their next read checks them although their
pages are cached by then. What this leaves unchecked: a change to the cached pages
themselves that leaves the file's modification time as it was (memory corruption, or a
write that resets the time), and pages evicted and read back between the residency test
and the read (for a mapped unit, one test of each chunk before the first is mapped).
TensorStore checks the chunks it decodes itself (compressed, inline or remote ones) on
every read.

Residency comes from ``cachestat(2)`` over the chunk's bytes (Linux 6.5+), else from
``mincore(2)`` over a mapping of them (older Linux, macOS); where neither is available
every read is checked.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import sys
import threading
from typing import Any

import numpy as np

#: ``madvise`` advice that faults a mapping's pages in for reading (Linux 5.14+).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
#: ``madvise`` advice that lets a mapping's faults bring file pages in as huge folios.
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14 if sys.platform.startswith("linux") else None)
#: A huge folio's bytes (x86-64 and arm64 with 4 KiB pages): what one fault through a
#: mapping `advise_huge` advised brings in.
HUGE_PAGE = 2 << 20
_PAGE = mmap.PAGESIZE


def _libc() -> Any:
  if not sys.platform.startswith(("linux", "darwin")):
    return None
  try:
    lib = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.mincore.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    lib.madvise.restype = ctypes.c_int
  except (OSError, AttributeError):
    return None
  return lib


_LIBC = _libc()


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
  """What ties a verified chunk to its data file: device, inode, size, modification time."""
  return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class _CachestatRange(ctypes.Structure):
  _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _Cachestat(ctypes.Structure):
  _fields_ = [
    (name, ctypes.c_uint64)
    for name in ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")
  ]


#: ``cachestat(2)`` (Linux 6.5+, the same number on every architecture): counts a file
#: range's cached pages, several times faster than ``mincore`` over a mapping.
_CACHESTAT = 451
_cachestat_ok = sys.platform.startswith("linux") and _LIBC is not None


def resident_in_file(fd: int, offset: int, length: int) -> bool:
  """Whether every page of bytes ``offset .. offset + length`` of the open file ``fd`` is
  in the page cache now (False where that cannot be told)."""
  global _cachestat_ok
  if _LIBC is None or length <= 0:
    return False
  first, end = offset // _PAGE, -(-(offset + length) // _PAGE)
  if _cachestat_ok:
    where = _CachestatRange(first * _PAGE, (end - first) * _PAGE)
    stat = _Cachestat()
    if _LIBC.syscall(_CACHESTAT, fd, ctypes.byref(where), ctypes.byref(stat), 0) == 0:
      return stat.nr_cache >= end - first
    if ctypes.get_errno() not in (errno.ENOSYS, errno.EPERM):
      return False  # this file's range cannot be told: check it
    _cachestat_ok = False  # an older kernel (or a sandbox without it): mincore from now on
  start = offset - offset % mmap.ALLOCATIONGRANULARITY
  try:
    region = mmap.mmap(fd, offset - start + length, prot=mmap.PROT_READ, offset=start)
  except (OSError, ValueError):
    return False
  try:
    return _mincore(region, offset - start, length)
  finally:
    region.close()


def _mincore(region: mmap.mmap, start: int, length: int) -> bool:
  base = np.frombuffer(region, np.uint8).ctypes.data
  first = (base + start) // _PAGE * _PAGE
  span = base + start + length - first
  vec = (ctypes.c_ubyte * -(-span // _PAGE))()
  if _LIBC.mincore(ctypes.c_void_p(first), ctypes.c_size_t(span), vec) != 0:
    return False
  return bool((np.frombuffer(memoryview(vec), np.uint8) & 1).all())


def advise_huge(region: mmap.mmap) -> None:
  """Advises ``region`` (a file mapping) ``MADV_HUGEPAGE`` and ``MADV_RANDOM``: pages
  its faults read from disk enter the page cache as 2 MiB folios where the filesystem
  has large folios (ext4 and XFS on recent Linux), and a later mapping of those maps
  each with one page-table entry instead of 512 (`docs/design.md` 4.5). ``MADV_RANDOM``
  makes each fault read its own folio and no read-ahead beyond it, which would race
  with a neighbouring range faulted on another thread and leave small folios where
  they meet. Pages already cached keep their folios. Only a hint: errors are ignored.
  """
  for advice in (MADV_HUGEPAGE, getattr(mmap, "MADV_RANDOM", None)):
    if advice is not None:
      try:
        region.madvise(advice)
      except (OSError, ValueError):
        pass


def populate(region: mmap.mmap, start: int = 0, length: int | None = None) -> bool:
  """Faults bytes ``start .. start + length`` of ``region`` (page-aligned; all of it by
  default) in for reading, as ``MAP_POPULATE`` would; False where the kernel lacks
  ``MADV_POPULATE_READ`` (map again with ``MAP_POPULATE``). It waits on the disk for
  pages out of the page cache without holding the GIL."""
  length = len(region) - start if length is None else length
  if _LIBC is None or not sys.platform.startswith("linux"):
    try:
      region.madvise(MADV_POPULATE_READ, start, length)
    except (OSError, ValueError, AttributeError):
      return False
    return True
  anchor = np.frombuffer(region, np.uint8)  # pins the mapping for the call
  try:
    rc = _LIBC.madvise(anchor.ctypes.data + start, length, MADV_POPULATE_READ)
  finally:
    del anchor
  if rc == 0:
    return True
  if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
    return False  # a kernel before 5.14
  raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))


class VerifiedExtents:
  """The chunks of one open store whose checksum passed (by any hashable key naming
  the chunk's file and byte range: `mapped.Extent`), each with the identity its data
  file had then; thread-safe.

  A chunk whose pages a read-ahead hint asked the kernel for (`mark_cold`) came from
  disk even if its pages are all cached by the time it is read: its next read checks it.
  """

  def __init__(self) -> None:
    self._lock = threading.Lock()
    self._passed: dict[Any, tuple[int, int, int, int]] = {}
    self._cold: set[Any] = set()

  def needs_check(self, key: Any, identity: Any, all_resident: bool) -> bool:
    """Whether a read of chunk ``key`` must check it: its pages were not all in the page
    cache before the read (or before a hint asked for them), or it never passed, or its
    file changed since."""
    with self._lock:
      cold = key in self._cold
      self._cold.discard(key)
      return cold or not all_resident or self._passed.get(key) != identity

  def mark_cold(self, key: Any) -> None:
    """Records that chunk ``key``'s pages were not all cached when a hint asked for them."""
    with self._lock:
      self._cold.add(key)

  def passed(self, key: Any, identity: Any) -> None:
    with self._lock:
      self._passed[key] = identity

  def __len__(self) -> int:
    with self._lock:
      return len(self._passed)
