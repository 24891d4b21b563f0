"""Mapped chunks brought in from disk as huge folios, several pieces at a time.

A mapping of page-cache pages costs one page-table entry per 4 KiB page to make
and to undo, unless the pages sit in 2 MiB folios, which map with one entry each
(`docs/design.md` 4.5). The kernel decides a folio's size when it reads the page
from disk and keeps it while the page stays cached, so this module reads cold chunks
the way that yields huge folios: by faulting them in through mappings advised
``MADV_HUGEPAGE`` (`residency.advise_huge`), in pieces on threads so that
the disk serves several reads at once, as ``posix_fadvise(WILLNEED)`` (which yields
4 KiB pages) did.

* `fill` populates a cold chunk's own mapping in `FILL_PIECE` pieces on the fill
  threads, for a read that waits on it;
* `fault_in` reads a chunk ahead without waiting, on the read-ahead threads, each
  `READ_AHEAD_WINDOW` of it through a mapping that lives only while that window is
  faulted in: read-ahead holds at most ``READ_AHEAD_THREADS * READ_AHEAD_WINDOW``
  bytes mapped (the plan's "read-ahead mappings" item);
* `will_need` asks the kernel instead, for reads that copy (no mapping to gain).
"""

from __future__ import annotations

import concurrent.futures
import logging
import mmap
import os
import threading

import numpy as np

from jax_residency._src.plan.memory import READ_AHEAD_THREADS, READ_AHEAD_WINDOW
from jax_residency._src.store import residency
from jax_residency._src.store.extents import Extent

_log = logging.getLogger(__name__)

#: Bytes of a cold chunk one fill thread faults in at a time (a multiple of 2 MiB).
FILL_PIECE = 16 << 20
FILL_THREADS = 8

_lock = threading.Lock()
_pools: dict[str, concurrent.futures.ThreadPoolExecutor] = {}


def _pool(name: str, threads: int) -> concurrent.futures.ThreadPoolExecutor:
  with _lock:
    if name not in _pools:
      _pools[name] = concurrent.futures.ThreadPoolExecutor(
        threads, thread_name_prefix=f"jax_residency-{name}"
      )
    return _pools[name]


def region_of(array: np.ndarray) -> mmap.mmap | None:
  """The mapping ``array`` views (a file's, as the arrays of `mapped.UnitMapper` do, or
  anonymous memory's), or None if it views other memory."""
  region: object = array
  while isinstance(region, np.ndarray):
    region = region.base
  if isinstance(region, memoryview):
    region = region.obj
  return region if isinstance(region, mmap.mmap) else None


def fill(region: mmap.mmap, file_offset: int) -> list[concurrent.futures.Future]:
  """Starts faulting in all of ``region`` (mapping its file from byte ``file_offset``,
  page-aligned) as huge folios, in `FILL_PIECE` pieces aligned in the file; each
  future gives `residency.populate`'s answer (False: the kernel cannot populate)."""
  pool = _pool("fill", FILL_THREADS)
  residency.advise_huge(region)
  futures, start = [], 0
  while start < len(region):
    boundary = ((file_offset + start) // FILL_PIECE + 1) * FILL_PIECE  # in the file
    end = min(len(region), boundary - file_offset)
    futures.append(pool.submit(residency.populate, region, start, end - start))
    start = end
  return futures


def fault_in(extent: Extent) -> None:
  """Starts reading ``extent`` into the page cache as huge folios, without waiting."""
  pool = _pool("read-ahead", READ_AHEAD_THREADS)
  first = extent.offset // residency.HUGE_PAGE * residency.HUGE_PAGE
  for start in range(first, extent.offset + extent.length, READ_AHEAD_WINDOW):
    pool.submit(_fault_in_window, extent.file, start, extent.offset + extent.length)


def _fault_in_window(path: str, start: int, end: int) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return  # the read reports it
  try:
    length = min(start + READ_AHEAD_WINDOW, end, os.fstat(fd).st_size) - start
    if length <= 0:
      return
    with mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=start) as m:
      residency.advise_huge(m)
      residency.populate(m)
  except (OSError, ValueError) as e:  # only a read-ahead: the read itself reports errors
    _log.debug("read-ahead of %s at %d failed: %s", path, start, e)
  finally:
    os.close(fd)


def will_need(extent: Extent) -> None:
  """Asks the kernel to read ``extent`` into the page cache (``posix_fadvise``)."""
  if not hasattr(os, "posix_fadvise"):
    return
  try:
    fd = os.open(extent.file, os.O_RDONLY)
  except OSError:
    return
  try:
    os.posix_fadvise(fd, extent.offset, extent.length, os.POSIX_FADV_WILLNEED)
  except OSError:
    pass  # only a hint
  finally:
    os.close(fd)
