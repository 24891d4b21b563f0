"""Host buffers for unit reads: the `BufferPool` of reused slabs, and malloc tuning.

Reading a unit from a local, uncompressed store is bounded by two costs on a
typical Linux host: the disk (or page-cache copy) and the first-touch page
faults of the host buffers the data lands in. Measured on a 2-core VM, faulting
in fresh pages runs at about 1 GB/s, reusing warm pages at 10-20 GB/s, so a
reader that allocates new buffers for every unit spends most of its time in the
kernel. This module removes that cost:

* `BufferPool`: each unit read lands in one page-aligned anonymous mapping
  ("slab"); the returned arrays are views of it. When the caller drops every
  array of a unit, the slab goes back to the pool and the next read reuses its
  already-faulted pages. This does not depend on the state of `malloc`.
* `buffer_layout`: where each tensor of a unit lies in its slab.
* `release_dropped_buffers`: frees the buffers of device arrays just dropped at once.
* `tune_malloc`: opt-in glibc settings (`JAX_RESIDENCY_MALLOC_TUNING=1`) that
  let TensorStore's own large allocations (static reads, decompression, remote
  reads) be reused too; applied once, before this library opens its first
  TensorStore (see `handles.store_context`). Off by default because they are
  process-wide.

With these, and raw chunks of local stores read straight from their files
(`mapped.UnitMapper.read_into`), `benchmarks/read_path.py` measures 1.6x of a
sequential `readinto` cold (two unit reads in flight keep the disk queue
fuller) and 3.7x warm (8 x 128 MiB units, 2-core development VM).
"""

from __future__ import annotations

import collections
import ctypes
import gc
import logging
import math
import mmap
import os
import platform
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from jax_residency._src.typing import tensor_nbytes

try:  # XLA's deferred-reference pass, see release_dropped_buffers
  from jax._src.lib import _jax as _jax_lib
except ImportError:  # pragma: no cover - a jaxlib that moved it
  _jax_lib = None

_log = logging.getLogger(__name__)

# glibc <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: Freed memory at the top of the heap is kept up to this size, not returned.
MALLOC_TRIM_THRESHOLD = 1 << 30
#: Longest a unit read waits for dropped buffers to come back before it takes a
#: new one past its pool's limit (see `BufferPool.set_limit`).
ROOM_WAIT_SECONDS = 0.5
#: Alignment of each tensor inside a unit buffer (a page).
BUFFER_ALIGNMENT = 4096
#: Environment variable that, set to "1", lets `tune_malloc` change malloc (off by default:
#: unit reads land in reused `BufferPool` slabs and do not need it, and the settings are
#: process-wide — freed memory would no longer return to the OS).
MALLOC_TUNING_ENV = "JAX_RESIDENCY_MALLOC_TUNING"

_malloc_lock = threading.Lock()
_malloc_tuned: bool | None = None


def tune_malloc() -> bool:
  """Makes glibc reuse freed large buffers instead of unmapping them.

  Sets, once per process, `M_MMAP_MAX=0` (large blocks come from the heap, not
  from fresh mappings), `M_TRIM_THRESHOLD=1 GiB` (freed heap is kept for reuse)
  and `M_ARENA_MAX=1` (TensorStore's worker threads allocate from the same
  reusable heap; glibc honours this only before a process creates its ninth
  arena, so call this early — `jax_residency` calls it before its first
  TensorStore open). The trade-off: the process's RSS no longer shrinks when
  large arrays are freed; the memory is reused by the next allocation instead.

  Opt-in: a no-op returning False unless the environment variable
  `JAX_RESIDENCY_MALLOC_TUNING=1` is set, and on non-glibc platforms. Unit
  reads do not depend on it (they land in `BufferPool` slabs, measured at or
  above raw-read bandwidth without it); it speeds up TensorStore's own
  allocations, at the cost of a process whose RSS never shrinks.

  Returns:
    Whether the settings were applied (now or by an earlier call).

  Example:
    >>> isinstance(tune_malloc(), bool)
    True
  """
  global _malloc_tuned
  with _malloc_lock:
    if _malloc_tuned is None:
      _malloc_tuned = _apply_mallopt()
    return _malloc_tuned


def _apply_mallopt() -> bool:
  if os.environ.get(MALLOC_TUNING_ENV, "0") != "1":
    return False
  if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
    return False
  try:
    mallopt = ctypes.CDLL(None).mallopt
  except (OSError, AttributeError):
    return False
  mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
  mallopt.restype = ctypes.c_int
  ok = all(
    mallopt(param, value) == 1
    for param, value in (
      (_M_MMAP_MAX, 0),
      (_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD),
      (_M_ARENA_MAX, 1),
    )
  )
  if not ok:
    _log.debug("mallopt rejected a setting; malloc tuning is partial")
  return ok


class BufferPool:
  """Page-aligned host buffers ("slabs") that are reused once their arrays die.

  `lease` hands out numpy arrays that are views of one slab. The slab returns to
  the pool when the last of those arrays (and every view of them) is garbage.
  At most `spare` idle slabs of each size are kept, and only while the bytes
  of every slab, leased or idle, stay within `limit_bytes`; others are unmapped.
  Thread-safe.
  """

  def __init__(self, spare: int, *, limit_bytes: int | None = None):
    self._spare = spare
    self._limit = limit_bytes
    self._free: dict[int, list[mmap.mmap]] = collections.defaultdict(list)
    self._lock = threading.Lock()
    # Slabs whose arrays died. `_give` runs from finalizers, which a garbage
    # collection may start on any thread at any allocation, even one holding
    # `_lock`: it only appends here (atomic), and locked methods take them in.
    self._returned: collections.deque[mmap.mmap] = collections.deque()
    self._leased = 0
    self._reclaim: Callable[[], None] | None = None
    self._external: Callable[[], int] = lambda: 0
    self.slabs_created = 0
    self.peak_bytes = 0
    self.room_waits = 0

  def set_limit(
    self, limit_bytes: int | None, *, reclaim: Callable[[], None] | None = None
  ) -> None:
    """Caps the bytes of slabs, leased and idle; idle slabs over the cap go now.

    With a cap, a `lease` that would take leased bytes past it first calls
    `reclaim` (which should free arrays already dropped) and waits up to
    `ROOM_WAIT_SECONDS` for slabs to come back, then leases anyway: the caller's
    own accounting is what keeps leases within the cap; this absorbs the lag
    between an array's death and its buffer's return.
    """
    with self._lock:
      self._take_back_locked()
      self._limit = limit_bytes
      self._reclaim = reclaim
      self._trim_locked()

  def count_external(self, held: Callable[[], int]) -> None:
    """Counts ``held()`` bytes (unit memory held outside the pool: mapped chunks)
    against the limit, beside the leased slabs."""
    self._external = held

  def note_external(self) -> None:
    """Takes the bytes counted by `count_external` into `peak_bytes` (call after they grow)."""
    with self._lock:
      self._take_back_locked()
      self.peak_bytes = max(self.peak_bytes, self._held_locked() + self._idle_locked())

  def reset_peak(self) -> None:
    """Starts `peak_bytes` over from what the pool holds now."""
    with self._lock:
      self._take_back_locked()
      self.peak_bytes = self._held_locked() + self._idle_locked()

  @property
  def leased_bytes(self) -> int:
    """Bytes of slabs whose arrays are still alive."""
    with self._lock:
      self._take_back_locked()
      return self._leased

  @property
  def idle_bytes(self) -> int:
    """Bytes held in idle slabs, waiting for reuse."""
    with self._lock:
      self._take_back_locked()
      return self._idle_locked()

  def lease(
    self, layout: Sequence[tuple[str, tuple[int, ...], np.dtype, int]], nbytes: int
  ) -> dict[str, np.ndarray]:
    """Returns one writable array per `(name, shape, dtype, offset)` in a shared slab."""
    if nbytes == 0:
      return {name: np.empty(shape, dtype) for name, shape, dtype, _ in layout}
    self.wait_for_room(nbytes)
    slab = self._take(nbytes)
    # The arrays' base: it lives exactly as long as any view of the slab does.
    holder: Any = (ctypes.c_char * nbytes).from_buffer(slab)
    out = {}
    for name, shape, dtype, offset in layout:
      count = math.prod(shape)
      if count == 0:
        out[name] = np.empty(shape, dtype)
      else:
        out[name] = np.frombuffer(holder, dtype, count, offset).reshape(shape)
    done = weakref.finalize(holder, self._give, slab)
    done.atexit = False
    return out

  def clear(self) -> None:
    with self._lock:
      self._take_back_locked()
      self._free.clear()

  def wait_for_room(self, nbytes: int, *, outside: bool = False) -> None:
    """Waits (briefly, see `set_limit`) until ``nbytes`` more fit the limit.

    ``outside``: the bytes are not a slab of this pool (a mapping), so idle slabs
    that no longer fit beside them are unmapped now.
    """
    deadline = None
    while True:
      with self._lock:
        self._take_back_locked()
        if self._limit is None or self._held_locked() + nbytes <= self._limit:
          if outside:
            self._trim_locked(nbytes)
          return
        reclaim = self._reclaim
      now = time.monotonic()
      if deadline is None:
        deadline = now + ROOM_WAIT_SECONDS
        self.room_waits += 1
      elif now >= deadline:
        _log.debug("lease of %d bytes goes past the buffer limit %s", nbytes, self._limit)
        return
      if reclaim is not None:
        reclaim()
      time.sleep(0.001)

  def _take_back_locked(self) -> None:
    while self._returned:
      slab = self._returned.popleft()
      n = len(slab)
      self._leased -= n
      free = self._free[n]
      fits = self._limit is None or self._held_locked() + self._idle_locked() + n <= self._limit
      if len(free) < self._spare and fits:
        free.append(slab)

  def _idle_locked(self) -> int:
    return sum(n * len(slabs) for n, slabs in self._free.items())

  def _held_locked(self) -> int:
    return self._leased + self._external()

  def _trim_locked(self, extra: int = 0) -> None:
    if self._limit is None:
      return
    idle, held = self._idle_locked(), self._held_locked() + extra
    for n in sorted(self._free, reverse=True):
      slabs = self._free[n]
      while slabs and held + idle > self._limit:
        slabs.pop()
        idle -= n

  def _take(self, nbytes: int) -> mmap.mmap:
    with self._lock:
      self._take_back_locked()
      self._leased += nbytes
      free = self._free.get(nbytes)
      slab: mmap.mmap | None
      if free:
        slab = free.pop()
      else:
        slab = None
        # A new slab: unmap idle ones of other sizes that no longer fit beside it.
        self._trim_locked()
      self.peak_bytes = max(self.peak_bytes, self._held_locked() + self._idle_locked())
    if slab is not None:
      return slab
    slab = anonymous_slab(nbytes)
    self.slabs_created += 1
    return slab

  def _give(self, slab: mmap.mmap) -> None:
    # Runs while the last view is being destroyed, possibly inside a garbage
    # collection on a thread that holds `_lock`: never lock or close the slab
    # here (its buffer export is still held). Dropping it later unmaps it.
    self._returned.append(slab)


def anonymous_slab(nbytes: int) -> mmap.mmap:
  """``nbytes`` of page-aligned anonymous memory, huge pages asked for. Private, not the
  default shared mapping: ordinary anonymous memory (transparent huge pages apply, RSS
  counts it as anonymous, not shmem)."""
  if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
    slab = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
  else:
    slab = mmap.mmap(-1, nbytes)
  if hasattr(mmap, "MADV_HUGEPAGE"):
    try:
      slab.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
      pass
  return slab


def buffer_layout(
  specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
) -> tuple[list[tuple[str, tuple[int, ...], np.dtype, int]], int]:
  """Places tensors back to back, each at a `BUFFER_ALIGNMENT` boundary."""
  layout, offset = [], 0
  for name, shape, dtype in specs:
    layout.append((name, shape, dtype, offset))
    offset += padded_nbytes(shape, dtype)
  return layout, offset


def padded_nbytes(shape: Sequence[int], dtype: Any) -> int:
  """Bytes one tensor takes in a unit buffer (or a mapping of its chunk): its
  bytes rounded up to `BUFFER_ALIGNMENT`, a page."""
  return -(-tensor_nbytes(shape, dtype) // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT


def release_dropped_buffers() -> None:
  """Frees the host memory of arrays just dropped, now rather than at the next GC.

  When a device array that aliases a numpy buffer (CPU, ``may_alias``) dies,
  XLA defers dropping its reference to the numpy buffer to its next garbage
  pass (jax-ml/jax#14882), which runs at Python's next garbage collection. An
  evicted unit would then stay in memory while the next unit is read into a new
  buffer. This runs that pass at once.
  """
  collect = getattr(_jax_lib, "collect_garbage", None)
  if collect is not None:
    collect()
  else:  # pragma: no cover - older or newer jaxlib without the hook
    gc.collect(0)
