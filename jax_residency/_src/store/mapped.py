"""Unit reads without a copy: a local store's chunk bytes mapped as arrays.

On a CPU backend device memory is host memory, so a unit read into a buffer is
a copy the model does not need: the page cache already holds the bytes. Where a
unit tensor's chunk is stored raw (zarr3 ``bytes`` codec, little-endian, one
chunk per unit, as `jax_residency.save` writes it) in a local file, at an offset
XLA can alias (`ALIGNMENT`), `UnitMapper.map_unit` maps that file range
read-only and returns arrays that view it; ``jax.device_put(..., may_alias=True)``
then makes them device arrays with no copy at all.

What it costs and holds:

* A mapping is faulted in whole (``MADV_POPULATE_READ``, else ``MAP_POPULATE``)
  by the read thread, so the step that uses the unit finds every page present.
  This is the "read" of a mapped unit, and it overlaps the previous unit's step like
  any other read. Chunks out of the page cache are faulted in from disk as huge
  folios, in pieces on threads (`fault_in`), and so is the read-ahead of
  `UnitMapper.advise_unit`: huge folios map and unmap with one page-table entry per
  2 MiB instead of 512.
* Mapped pages are the kernel's page cache: clean and file-backed, so they
  count in the process's RSS while mapped (as a unit buffer would), but the
  kernel may drop them under memory pressure and fault them in again, and no
  two mappings of one file hold two copies. A mapping is undone when the last
  array viewing it dies; `UnitMapper.mapped_bytes` counts what is mapped now.
* A tensor that cannot be mapped (compressed, inline in the OCDBT index, not
  aligned, a remote store) is read into a buffer as before; a unit may mix both.
* A chunk with a checksum (the zarr3 ``crc32c`` codec after ``bytes``, as
  `jax_residency.save` writes it) is checked when its bytes come from disk: on its
  first read, and on any read that finds one of its pages out of the page cache
  (`residency` gives the exact rule). The check is a CRC-32C over the mapped pages,
  without a copy, on the read thread (about 12 GiB/s on the development VM). A
  mismatch raises `StoreCorruptionError` naming the store, the tensor and the unit.

The chunk locations come from the store's OCDBT index (``ts.ocdbt.dump``), read
once, on the first mapped read, for the version that is newest then. OCDBT data
files are written once and never modified, so a mapping stays valid (and the
arrays keep their values) even if the store is replaced on disk afterwards.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import mmap
import os
import sys
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import crc32c
import numpy as np

from jax_residency._src.store import fault_in, residency
from jax_residency._src.store.buffers import padded_nbytes
from jax_residency._src.store.extents import Extent, chunk_key, ocdbt_extents
from jax_residency._src.store.raw_chunks import CHECKSUM_BYTES, corrupt_chunk_error
from jax_residency._src.typing import ParamPath, tensor_nbytes

_log = logging.getLogger(__name__)

#: Byte alignment XLA's CPU client needs to use a host buffer in place.
ALIGNMENT = 64
#: Environment variable that, set to "0", turns mapped unit reads off.
MAPPED_READS_ENV = "JAX_RESIDENCY_MAPPED_READS"


#: Environment variable that, set to "0", reads every chunk through TensorStore
#: (no direct reads from the data files: `UnitMapper.read_into`).
DIRECT_READS_ENV = "JAX_RESIDENCY_DIRECT_READS"


def direct_reads_enabled() -> bool:
  """Whether raw chunks of local stores may be read straight from their files (where
  the OS has ``preadv``, and not opted out)."""
  if not hasattr(os, "preadv"):
    return False
  return os.environ.get(DIRECT_READS_ENV, "1").strip() not in ("0", "false", "no", "off")


def mapped_reads_enabled() -> bool:
  """Whether mapped reads may be used (Linux or macOS, not opted out)."""
  if os.environ.get(MAPPED_READS_ENV, "1").strip() in ("0", "false", "no", "off"):
    return False
  return sys.platform.startswith(("linux", "darwin")) and hasattr(mmap, "MAP_PRIVATE")


class UnitMapper:
  """Maps unit tensors' chunk bytes from a local store; thread-safe.

  Args:
    root: The store's local directory.
    use_ocdbt: Whether the arrays live in an OCDBT database at ``root`` (else
      each chunk is a file of its own under ``root/<array name>/c/``).
    tensors: For each mappable unit tensor (see `mappable`), by its path
      relative to the unit prefix: (array name, per-unit shape, dtype, pieces):
      ``pieces`` 0 for one chunk per unit, else the count of chunks a unit's tensor
      is split into along its first axis (one per expert: read, never mapped). A
      chunk `CHECKSUM_BYTES` longer than its data has a checksum (`chunk_trailer`):
      it is checked when read from disk (`residency`).
  """

  def __init__(
    self,
    root: str,
    *,
    use_ocdbt: bool,
    tensors: Mapping[ParamPath, tuple[str, tuple[int, ...], np.dtype, int]],
  ):
    self._root = root
    self._use_ocdbt = use_ocdbt
    self._tensors = dict(tensors)
    self._extents: dict[str, Extent] | None = None
    self._unit_extents: dict[int, list[tuple[ParamPath, Extent, int]]] = {}
    # Each live mapping's finalizer, by the mapping's id (`retire` undoes one early).
    self._finalizers: dict[int, weakref.finalize] = {}
    self._lock = threading.Lock()
    self._mapped = 0
    self._count_lock = threading.Lock()
    # Sizes of mappings whose arrays died (appended by finalizers, see `_unmapped`).
    self._unmapped_sizes: collections.deque[int] = collections.deque()
    self.total_bytes = 0  # tensor bytes mapped so far
    self.direct_bytes = 0  # bytes read straight from the data files so far
    self.checked_bytes = 0  # chunk bytes whose checksum was checked so far
    self.advised_bytes = 0  # chunk bytes found out of the page cache and read ahead or in
    self.verified = residency.VerifiedExtents()

  @property
  def mapped_bytes(self) -> int:
    """Bytes of chunk ranges mapped now (alive as arrays somewhere)."""
    with self._count_lock:
      self._take_back_locked()
      return self._mapped

  def _take_back_locked(self) -> None:
    while self._unmapped_sizes:
      self._mapped -= self._unmapped_sizes.popleft()

  def _extent(self, rel: ParamPath, unit: int, piece: int | None = None) -> Extent | None:
    with self._lock:
      if self._extents is None:
        try:
          self._extents = ocdbt_extents(self._root) if self._use_ocdbt else {}
        except Exception as e:  # noqa: BLE001 - an unreadable index only means copies
          _log.debug("no mapped reads for %s: %s", self._root, e)
          self._extents = {}
    name, shape, _, _ = self._tensors[rel]
    key = chunk_key(name, unit if piece is None else (unit, piece), len(shape) + 1)
    if self._use_ocdbt:
      return self._extents.get(key)
    path = os.path.join(self._root, *key.split("/"))
    try:
      return Extent(path, 0, os.stat(path).st_size)
    except OSError:
      return None

  def map_unit(
    self, unit: int
  ) -> tuple[dict[ParamPath, np.ndarray], list[tuple[ParamPath, concurrent.futures.Future]]]:
    """Maps what can be mapped of unit ``unit``; tensors missing from the result
    must be read (their chunk is inline, compressed, unaligned or unreadable).

    Returns the mapped arrays, and for each one whose chunk has a checksum to check
    (`residency`) the future of its check, which runs on the read threads (so the
    CRC overlaps the caller's work) and raises `StoreCorruptionError` on a mismatch:
    the arrays must not be used before every check has passed.
    """
    out, checks = {}, []
    # Chunks out of the page cache are faulted in from disk in pieces, side by side on
    # the fill threads, as huge folios (`fault_in.fill`); cached ones right here.
    fills: list[tuple[ParamPath, list[concurrent.futures.Future]]] = []
    cold_bytes = 0
    for rel, extent, nbytes in self._raw_extents(unit):
      name, shape, dtype, _ = self._tensors[rel]
      mapped = self._map(extent, shape, dtype)
      if mapped is None:
        continue
      array, identity, was_resident = mapped
      if not was_resident:
        self.verified.mark_cold(extent)
        cold_bytes += extent.length
      if array is None:
        continue
      out[rel] = array
      if not was_resident:
        start = extent.offset - extent.offset % mmap.ALLOCATIONGRANULARITY
        region = fault_in.region_of(array)
        assert region is not None
        fills.append((rel, fault_in.fill(region, start)))
      if extent.length > nbytes and self.verified.needs_check(extent, identity, was_resident):
        checks.append((rel, extent, nbytes, name, identity))
    with self._count_lock:
      self.advised_bytes += cold_bytes
    # A piece that answers False (no populate: macOS, Linux before 5.14) leaves its
    # pages to fault in as the step reads them; an unreadable chunk is read instead,
    # and the read reports it.
    for rel, pieces in fills:
      try:
        for piece in pieces:
          piece.result()
      except OSError as e:
        _log.debug("mapping %s failed: %s", rel, e)
        del out[rel]
    return out, [
      (rel, _pool().submit(self._check, out[rel], extent, nbytes, name, unit, identity))
      for rel, extent, nbytes, name, identity in checks
      if rel in out
    ]

  def advise_unit(self, unit: int, *, huge: bool = False, pieces: bool = True) -> int:
    """Starts reading unit ``unit``'s raw chunks into the page cache without waiting;
    returns the bytes asked for.

    A chunk whose pages are all cached is skipped. One that is not is marked cold
    (`residency.VerifiedExtents.mark_cold`): the read that maps or copies it next
    checks its checksum, although the read-ahead has brought its pages in by then.
    Without ``pieces``, the chunks of tensors stored a chunk per expert are left out
    (expert residency reads only the experts a router picks). With ``huge`` (for mapped
    reads) the read-ahead threads fault each cold chunk in through short-lived mappings
    (`fault_in.fault_in`), so that its pages arrive as huge folios, which map again
    cheaply; without, the kernel is asked for them (``posix_fadvise(WILLNEED)``, which
    fills the page cache with 4 KiB pages).
    """
    parts = [e for rel in self._tensors for e, _ in self._piece_extents(rel, unit) or ()]
    cold = self._find_cold([e for _, e, _ in self._raw_extents(unit)] + (parts if pieces else []))
    for extent in cold:
      if huge:
        fault_in.fault_in(extent)
      else:
        fault_in.will_need(extent)
    return sum(e.length for e in cold)

  def _raw_extents(self, unit: int) -> list[tuple[ParamPath, Extent, int]]:
    """``(tensor, extent, data bytes)`` of unit ``unit``'s chunks stored raw: their data
    alone, or their data and a checksum. Kept per unit for an OCDBT store, whose index
    is read once."""
    raw = self._unit_extents.get(unit)
    if raw is None:
      raw = [(rel, *one) for rel in self._tensors if (one := self._raw_extent(rel, unit))]
      if self._use_ocdbt:
        with self._lock:
          self._unit_extents[unit] = raw
    return raw

  def _raw_extent(self, rel: ParamPath, unit: int) -> tuple[Extent, int] | None:
    """Unit ``unit``'s chunk of tensor ``rel`` and its data bytes, if stored raw as one
    chunk."""
    if self._tensors[rel][3]:
      return None
    extent = self._extent(rel, unit)
    _, shape, dtype, _ = self._tensors[rel]
    nbytes = tensor_nbytes(shape, dtype)
    if extent is None or not nbytes or extent.length - nbytes not in (0, CHECKSUM_BYTES):
      return None
    return extent, nbytes

  def _piece_extents(self, rel: ParamPath, unit: int) -> list[tuple[Extent, int]] | None:
    """Unit ``unit``'s chunks of a tensor stored one chunk per expert, each with its data
    bytes, if every one is stored raw (else None: read it through TensorStore)."""
    _, shape, dtype, pieces = self._tensors[rel]
    nbytes = tensor_nbytes(shape[1:], dtype)
    out = []
    for piece in range(pieces):
      extent = self._extent(rel, unit, piece)
      if extent is None or not nbytes or extent.length - nbytes not in (0, CHECKSUM_BYTES):
        return None
      out.append((extent, nbytes))
    return out or None

  def _find_cold(self, extents: list[Extent]) -> set[Extent]:
    """The chunks not all in the page cache now, each marked cold (its next read checks
    its checksum)."""
    cold: set[Extent] = set()
    for extent in extents:
      try:
        fd = os.open(extent.file, os.O_RDONLY)
      except OSError:
        continue  # the read reports it
      try:
        if not residency.resident_in_file(fd, extent.offset, extent.length):
          self.verified.mark_cold(extent)
          cold.add(extent)
      finally:
        os.close(fd)
    with self._count_lock:
      self.advised_bytes += sum(e.length for e in cold)
    return cold

  def _check(
    self, array: np.ndarray, extent: Extent, nbytes: int, name: str, unit: int, identity: Any
  ) -> None:
    _check_mapped(array, extent, nbytes, self._root, name, unit)
    self._passed(extent, identity, nbytes)

  def _passed(self, extent: Extent, identity: Any, nbytes: int) -> None:
    """Records a chunk whose checksum matched (mapped or read directly)."""
    self.verified.passed(extent, identity)
    with self._count_lock:
      self.checked_bytes += nbytes

  def read_into(
    self, unit: int, rel: ParamPath, out: np.ndarray
  ) -> concurrent.futures.Future | None:
    """Starts reading unit ``unit``'s chunk of tensor ``rel`` straight from its data
    file into ``out`` (and checking its checksum, if it has one); None if the chunk
    is not a raw extent of the right size (read it through TensorStore instead).

    TensorStore decodes a checksummed chunk into its own buffer at well under
    memory speed; a ``preadv`` into the caller's buffer and a hardware CRC do
    not (`benchmarks/read_path.py --checksums`).
    """
    if rel not in self._tensors:
      return None
    if self._tensors[rel][3]:
      pieces = self._piece_extents(rel, unit)
    else:
      one = self._raw_extent(rel, unit)
      pieces = None if one is None else [one]
    if pieces is None or out.nbytes != sum(nbytes for _, nbytes in pieces):
      return None
    parts = out.reshape(len(pieces), -1)  # an expert's part of a unit's tensor: a row
    with self._count_lock:  # the checksums too: each is read with its data
      self.direct_bytes += sum(extent.length for extent, _ in pieces)
    name = self._tensors[rel][0]

    def read() -> None:  # the tensor whole, or one expert's part of it after another
      for (extent, nbytes), part in zip(pieces, parts, strict=True):
        _read_extent(extent, part, extent.length - nbytes, self._root, name, unit, self)

    return _pool().submit(read)

  def read_piece_into(
    self, unit: int, rel: ParamPath, piece: int, out: np.ndarray
  ) -> concurrent.futures.Future | None:
    """Starts reading one expert's chunk (``piece``) of unit ``unit``'s tensor ``rel``
    (stored a chunk per expert) into ``out``, as `read_into` reads a whole tensor;
    None if it is not a raw chunk of ``out``'s size."""
    if rel not in self._tensors or not self._tensors[rel][3]:
      return None
    pieces = self._piece_extents(rel, unit)
    if pieces is None or out.nbytes != pieces[piece][1]:
      return None
    extent, nbytes = pieces[piece]
    with self._count_lock:
      self.direct_bytes += extent.length
    name = self._tensors[rel][0]
    return _pool().submit(
      _read_extent, extent, out, extent.length - nbytes, self._root, name, unit, self
    )

  def _map(
    self, extent: Extent, shape: tuple[int, ...], dtype: np.dtype
  ) -> tuple[np.ndarray | None, Any, bool] | None:
    """Maps one chunk (its checksum too, if any), opening its file once: returns its data
    as an array viewing the mapping (None if unaligned: read it), its file's identity,
    and whether all its pages were cached (a resident chunk is populated here, a cold
    one by the caller: `fault_in.fill`); None if the file cannot be opened or is short."""
    start = extent.offset - extent.offset % mmap.ALLOCATIONGRANULARITY
    skip = extent.offset - start
    try:
      fd = os.open(extent.file, os.O_RDONLY)
    except OSError:
      return None
    try:
      resident = residency.resident_in_file(fd, extent.offset, extent.length)
      # A file shorter than the extent (truncated, replaced) would fault with
      # SIGBUS on access: such chunks are read instead, and the read reports it.
      stat = os.fstat(fd)
      if stat.st_size < extent.offset + extent.length:
        return None
      identity = residency.file_identity(stat)
      if skip % ALIGNMENT:
        return None, identity, resident
      span = skip + extent.length
      region = mmap.mmap(fd, span, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ, offset=start)
      if resident and not residency.populate(region):  # a kernel before 5.14
        region.close()
        flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
        region = mmap.mmap(fd, span, flags=flags, prot=mmap.PROT_READ, offset=start)
    except OSError:
      return None
    finally:
      os.close(fd)
    # Counted as a read buffer would hold it; a chunk that starts inside a page
    # maps one page more (at most 4 KiB per tensor, not counted).
    size = padded_nbytes(shape, dtype)
    with self._count_lock:
      self._take_back_locked()
      self._mapped += size
      self.total_bytes += extent.length
    array = np.frombuffer(region, dtype, math.prod(shape), skip).reshape(shape)
    done = weakref.finalize(region, self._unmapped, size, id(region))
    done.atexit = False
    self._finalizers[id(region)] = done
    return array, identity, resident

  def _unmapped(self, size: int, key: int) -> None:
    # Runs from a finalizer, possibly inside a garbage collection on a thread that
    # holds `_count_lock`: it only pops and appends (atomic); locked methods count it.
    self._finalizers.pop(key, None)
    self._unmapped_sizes.append(size)

  def retire(self, arrays: Any) -> int:
    """Drops the pages of this mapper's mappings that ``arrays`` view (a unit whose last
    step is done, which XLA holds a step longer: docs/design.md 4.2) and counts them
    gone; returns their bytes. ``MADV_DONTNEED`` on a private read-only mapping: a
    later read faults the same bytes in again. The mapping goes with the arrays."""
    retired = 0
    for array in arrays if hasattr(mmap, "MADV_DONTNEED") else ():
      region = fault_in.region_of(array) if isinstance(array, np.ndarray) else None
      done = None if region is None else self._finalizers.pop(id(region), None)
      detached = None if done is None else done.detach()
      if region is None or detached is None:  # not ours, or its finalizer has run
        continue
      region.madvise(mmap.MADV_DONTNEED)
      self._unmapped(*detached[2])
      retired += detached[2][0]
    return retired


#: Threads that read chunks straight from data files (`UnitMapper.read_into`): the
#: reads wait on the disk or copy from the page cache, with the GIL released.
DIRECT_READ_THREADS = 4
_pool_lock = threading.Lock()
_direct_pool: concurrent.futures.ThreadPoolExecutor | None = None


def _pool() -> concurrent.futures.ThreadPoolExecutor:
  global _direct_pool
  with _pool_lock:
    if _direct_pool is None:
      _direct_pool = concurrent.futures.ThreadPoolExecutor(
        DIRECT_READ_THREADS, thread_name_prefix="jax_residency-read"
      )
    return _direct_pool


def _read_extent(
  extent: Extent,
  out: np.ndarray,
  trailer: int,
  where: str,
  tensor: str,
  unit: int,
  mapper: UnitMapper | None = None,
) -> None:
  """Reads one chunk's data into ``out`` and checks the checksum after it when its
  bytes come from disk (`residency`; every time without a ``mapper``)."""
  data = out.reshape(-1).view(np.uint8).data
  tail = bytearray(trailer)
  fd = os.open(extent.file, os.O_RDONLY)
  try:
    identity = residency.file_identity(os.fstat(fd))
    was_resident = mapper is not None and residency.resident_in_file(
      fd, extent.offset, extent.length
    )
    done, offset = 0, extent.offset
    while done < len(data):  # a read may return less than asked; a short file, nothing
      n = os.preadv(fd, [data[done:]], offset + done)
      if n == 0:
        raise OSError(
          f"{extent.file} ends at byte {offset + done}, inside unit {unit}'s chunk of "
          f"{tensor!r} (bytes {offset}..{offset + extent.length}): the file was truncated"
        )
      done += n
    if trailer and os.preadv(fd, [tail], offset + done) != trailer:
      raise OSError(f"{extent.file} ends before the checksum of unit {unit}'s chunk of {tensor!r}")
  finally:
    os.close(fd)
  if trailer and (mapper is None or mapper.verified.needs_check(extent, identity, was_resident)):
    stored, computed = int.from_bytes(tail, "little"), crc32c.crc32c(data)
    if computed != stored:
      raise corrupt_chunk_error(where, tensor, unit, extent, stored, computed)
    if mapper is not None:
      mapper._passed(extent, identity, len(data))


def _check_mapped(
  array: np.ndarray, extent: Extent, nbytes: int, where: str, tensor: str, unit: int
) -> None:
  """Checks a mapped chunk's data against the CRC-32C after it, on the mapped pages
  themselves (no copy), hardware-accelerated and without the GIL (about 12 GiB/s on
  the development VM). ``array`` views the mapping, which holds the checksum too."""
  region = fault_in.region_of(array)
  assert region is not None
  start = extent.offset % mmap.ALLOCATIONGRANULARITY
  with memoryview(region) as view:
    stored = int.from_bytes(view[start + nbytes : start + nbytes + CHECKSUM_BYTES], "little")
    with view[start : start + nbytes] as data:
      computed = crc32c.crc32c(data)
  if computed != stored:
    raise corrupt_chunk_error(where, tensor, unit, extent, stored, computed)
