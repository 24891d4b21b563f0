"""The fast read path of the unit store.

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
* `tune_malloc`: opt-in glibc settings (`JAX_RESIDENCY_MALLOC_TUNING=1`) that
  let TensorStore's own large allocations (static reads, decompression, remote
  reads) be reused too; applied once, before this library opens its first
  TensorStore. Off by default because they are process-wide.
* `store_context`: TensorStore contexts with the chunk cache off (every host
  byte is one the caller holds and accounts for), a small bounded cache for
  OCDBT b-tree nodes, and `file_io_mode: memmap` (local reads copy straight from
  the page cache into the destination buffer).
* `HandleCache`: an LRU of open TensorStore array handles, bounded by
  `max_cached_shards`.
* `UnitRead`: the future of one unit read, whose tensors are read concurrently.
* `locate` / `discover`: where a store is and what arrays it holds, from its
  metadata alone (Orbax `_METADATA`, zarr v2/v3 array metadata, the sidecar).

With these, `benchmarks/read_path.py` measures 1.3-1.9x of a sequential
`readinto` cold (two unit reads in flight keep the disk queue fuller) and
0.8-1.1x warm on the 2-core development VM.
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import json
import logging
import mmap
import os
import platform
import sys
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src.placement.budget import STORE_INDEX_CACHE_BYTES
from jax_residency._src.policy import errors
from jax_residency._src.store import mapped
from jax_residency._src.typing import ParamPath

_log = logging.getLogger(__name__)

# glibc <malloc.h> parameter numbers.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8

#: Freed memory at the top of the heap is kept up to this size, not returned.
MALLOC_TRIM_THRESHOLD = 1 << 30
#: Bytes of decoded OCDBT b-tree nodes cached per open store (metadata only); the
#: plan names it as an overhead.
OCDBT_NODE_CACHE_BYTES = STORE_INDEX_CACHE_BYTES
#: Longest a unit read waits for dropped buffers to come back before it takes a
#: new one past its pool's limit (see `BufferPool.set_limit`).
ROOM_WAIT_SECONDS = 0.5
#: Bytes a unit read copies per request: larger tensors are read in pieces.
READ_PIECE_BYTES = 32 << 20
#: Alignment of each tensor inside a unit buffer (a page).
BUFFER_ALIGNMENT = 4096
#: Environment variable that, set to "1", lets `tune_malloc` change malloc (off by default:
#: unit reads land in reused `BufferPool` slabs and do not need it, and the settings are
#: process-wide — freed memory would no longer return to the OS).
MALLOC_TUNING_ENV = "JAX_RESIDENCY_MALLOC_TUNING"

_ARRAY_VALUE_TYPES = frozenset({"np.ndarray", "jax.Array", "scalar"})
_UNCOMPRESSED_CODECS = frozenset({"bytes", "transpose", "crc32c"})
#: OCDBT settings for writing, as Orbax uses them.
#: Values up to this size are stored inside the OCDBT index, not in data files.
OCDBT_INLINE_BYTES = 1024
OCDBT_WRITE_CONFIG = {
  "max_inline_value_bytes": OCDBT_INLINE_BYTES,
  "max_decoded_node_bytes": 100_000_000,
  "manifest_kind": "single",
}

_malloc_lock = threading.Lock()
_malloc_tuned: bool | None = None
_root_context: ts.Context | None = None


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


def store_context(*, cache_bytes: int = 0) -> ts.Context:
  """Returns a fresh TensorStore context for one open store.

  Each store gets its own caches, so a store replaced on disk is never read
  through a stale OCDBT manifest. All contexts share one process-wide parent,
  which owns the `memory://` key-value store: a `memory://` store written by
  `save_store` is visible to `UnitStore.open` in the same process.

  Args:
    cache_bytes: Chunk cache limit. 0 (the default) caches nothing.
  """
  global _root_context
  tune_malloc()
  with _malloc_lock:
    if _root_context is None:
      _root_context = ts.Context()
    root = _root_context
  spec = {
    "cache_pool": {"total_bytes_limit": cache_bytes},
    "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_NODE_CACHE_BYTES},
    "file_io_mode": {"mode": "memmap"},
  }
  return ts.Context(ts.Context.Spec(spec), parent=root)


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
      count = int(np.prod(shape, dtype=np.int64))
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
    if hasattr(mmap, "MAP_PRIVATE") and hasattr(mmap, "MAP_ANONYMOUS"):
      # Private, not the default shared mapping: ordinary anonymous memory
      # (transparent huge pages apply, RSS counts it as anonymous, not shmem).
      slab = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
      slab = mmap.mmap(-1, nbytes)
    if hasattr(mmap, "MADV_HUGEPAGE"):
      try:
        slab.madvise(mmap.MADV_HUGEPAGE)
      except OSError:
        pass
    self.slabs_created += 1
    return slab

  def _give(self, slab: mmap.mmap) -> None:
    # Runs while the last view is being destroyed, possibly inside a garbage
    # collection on a thread that holds `_lock`: never lock or close the slab
    # here (its buffer export is still held). Dropping it later unmaps it.
    self._returned.append(slab)


def buffer_layout(
  specs: Sequence[tuple[str, tuple[int, ...], np.dtype]],
) -> tuple[list[tuple[str, tuple[int, ...], np.dtype, int]], int]:
  """Places tensors back to back, each at a `BUFFER_ALIGNMENT` boundary."""
  layout, offset = [], 0
  for name, shape, dtype in specs:
    layout.append((name, shape, dtype, offset))
    size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    offset += -(-size // BUFFER_ALIGNMENT) * BUFFER_ALIGNMENT
  return layout, offset


class HandleCache:
  """An LRU of open TensorStore handles, at most `capacity` open at a time.

  Handles are opened lazily by `opener(name)`. Evicting a handle only drops
  this cache's reference: reads already issued on it finish normally.
  Thread-safe.
  """

  def __init__(self, capacity: int, opener: Callable[[str], ts.TensorStore]):
    self._capacity = capacity
    self._opener = opener
    self._handles: collections.OrderedDict[str, ts.TensorStore] = collections.OrderedDict()
    self._lock = threading.RLock()
    self.opened = 0
    self.evicted = 0

  @property
  def open_count(self) -> int:
    with self._lock:
      return len(self._handles)

  @property
  def names(self) -> list[str]:
    """Open handles, least recently used first."""
    with self._lock:
      return list(self._handles)

  def get(self, name: str) -> ts.TensorStore:
    with self._lock:
      handle = self._handles.get(name)
      if handle is not None:
        self._handles.move_to_end(name)
        return handle
      handle = self._opener(name)
      self.opened += 1
      self._handles[name] = handle
      while len(self._handles) > self._capacity:
        self._handles.popitem(last=False)
        self.evicted += 1
      return handle

  def get_many(
    self, names: Sequence[str], open_async: Callable[[str], Any]
  ) -> list[ts.TensorStore]:
    """Handles for ``names``; those not cached are opened concurrently.

    ``open_async(name)`` returns a future of a handle. The returned handles are
    the caller's to use even when more names were asked for than the cache
    holds; the cache keeps only the ``capacity`` most recently used.
    """
    with self._lock:
      cached = {n: self._handles[n] for n in names if n in self._handles}
      for n in cached:
        self._handles.move_to_end(n)
    pending = {n: open_async(n) for n in dict.fromkeys(names) if n not in cached}
    opened = {n: f.result() for n, f in pending.items()}
    with self._lock:
      for n, handle in opened.items():
        self.opened += 1
        self._handles[n] = handle
        self._handles.move_to_end(n)
      while len(self._handles) > self._capacity:
        self._handles.popitem(last=False)
        self.evicted += 1
    found = {**cached, **opened}
    return [found[n] for n in names]

  def clear(self) -> None:
    with self._lock:
      self._handles.clear()


class UnitRead:
  """The pending read of one unit; `result()` returns its tensors.

  All tensors of the unit are read concurrently. Errors surface from `result()`
  as `StoreError` naming the tensor, the unit and the store.
  """

  def __init__(
    self,
    unit: int,
    arrays: Mapping[Any, np.ndarray],
    futures: Sequence[tuple[Any, Any]],
    where: str,
  ):
    self.unit = unit
    self._arrays = dict(arrays)
    self._futures = list(futures)
    self._where = where
    self.nbytes = sum(a.nbytes for a in self._arrays.values())

  def done(self) -> bool:
    return all(f.done() for _, f in self._futures)

  def cancel(self) -> None:
    """Cancels the reads not yet finished (best effort); `result()` then raises."""
    for _, future in self._futures:
      future.cancel()

  def result(self, timeout: float | None = None) -> dict[Any, np.ndarray]:
    deadline = None if timeout is None else time.monotonic() + timeout
    for key, future in self._futures:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      try:
        future.result(timeout=left)
      except TimeoutError:
        raise
      except Exception as e:  # TensorStore reports IO errors as ValueError.
        raise errors.StoreError(
          f"Reading tensor {'.'.join(key)!r} of unit {self.unit} from {self._where} "
          f"failed: {e}. Check that the store is complete and readable."
        ) from e
    self._futures.clear()
    return dict(self._arrays)


def issue_unit_read(
  unit: int,
  sources: Sequence[tuple[Any, ts.TensorStore]],
  pool: BufferPool,
  where: str,
  *,
  ready: Mapping[Any, np.ndarray] | None = None,
) -> UnitRead:
  """Starts copying each `(key, source)` view into one pooled slab; `ready` arrays
  (mapped, not read) join the result as they are."""
  specs = [(str(i), tuple(src.shape), src.dtype.numpy_dtype) for i, (_, src) in enumerate(sources)]
  layout, nbytes = buffer_layout(specs)
  buffers = pool.lease(layout, nbytes)
  arrays: dict[Any, np.ndarray] = dict(ready or {})
  futures = []
  for i, (key, src) in enumerate(sources):
    out = buffers[str(i)]
    arrays[key] = out
    if not out.size:
      continue
    src = src.translate_to[0]
    # Large tensors are copied in leading-axis pieces: more copies run at once and
    # each touches less memory (page-cache reads measured ~1.8x faster on 2 cores).
    rows = out.shape[0] if out.ndim else 1
    step = rows if out.ndim == 0 else max(1, READ_PIECE_BYTES // max(1, out.nbytes // rows))
    for start in range(0, rows, step):
      stop = min(start + step, rows)
      piece = (out, src) if step >= rows else (out[start:stop], src[start:stop].translate_to[0])
      futures.append((key, ts.array(piece[0], copy=False, write=True).write(piece[1])))
  return UnitRead(unit, arrays, futures, where)


# --- finding a store's arrays --------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Location:
  """Where a store lives: a local directory or a TensorStore kvstore URL."""

  path: str  # as the caller gave it, for messages
  base: Any  # TensorStore kvstore spec of the directory (ends with "/")
  local: str | None  # absolute directory for local paths, else None


def locate(path: str) -> Location:
  """Resolves a local path, `file://` URL or other kvstore URL (`memory://`, `gs://`...)."""
  if not isinstance(path, str) or not path:
    raise errors.StoreError(f"A store path must be a non-empty string; got {path=}.")
  if "://" in path and not path.startswith("file://"):
    return Location(path, path if path.endswith("/") else path + "/", None)
  local = urllib.parse.unquote(path[len("file://") :]) if path.startswith("file://") else path
  local = os.path.abspath(os.path.expanduser(local))
  return Location(path, {"driver": "file", "path": local + "/"}, local)


def ocdbt_spec(loc: Location, *, write: bool = False) -> dict[str, Any]:
  spec: dict[str, Any] = {"driver": "ocdbt", "base": loc.base, "cache_pool": "cache_pool#ocdbt"}
  if write:
    spec.update(config=dict(OCDBT_WRITE_CONFIG), assume_config=True)
  return spec


def param_name(path: ParamPath) -> str:
  return ".".join(path)


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """One stored array, from its zarr metadata."""

  path: ParamPath
  driver: str  # "zarr3" or "zarr" (zarr v2, Orbax's default before zarr3)
  shape: tuple[int, ...]
  dtype: np.dtype
  read_chunk: tuple[int, ...]  # the chunk a read of one element must fetch
  compressed: bool
  raw: bool = False  # each chunk stored as plain native-order bytes (mappable)


def _dtype(name: Any) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:
    return ts.dtype(name).numpy_dtype


def _parse_array(path: ParamPath, meta: dict[str, Any]) -> ArrayInfo:
  zarr3 = meta.get("zarr_format") == 3
  if zarr3:
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    codecs = meta.get("codecs", [])
    while codecs and codecs[0].get("name") == "sharding_indexed":
      chunk, codecs = (
        codecs[0]["configuration"]["chunk_shape"],
        codecs[0]["configuration"]["codecs"],
      )
    compressed = any(c.get("name") not in _UNCOMPRESSED_CODECS for c in codecs)
    dtype = _dtype(meta["data_type"])
  else:
    chunk = meta["chunks"]
    compressed = meta.get("compressor") is not None or bool(meta.get("filters"))
    dtype = _dtype(meta["dtype"])
  driver = "zarr3" if zarr3 else "zarr"
  raw = mapped.mappable(meta)
  return ArrayInfo(path, driver, tuple(meta["shape"]), dtype, tuple(chunk), compressed, raw)


def _read_json(kv: ts.KvStore, keys: Sequence[str]) -> list[Any]:
  results = [r.result() for r in [kv.read(k) for k in keys]]
  return [json.loads(r.value) if r.state == "value" else None for r in results]


def _tree_paths(metadata: Any) -> list[ParamPath] | None:
  """Array leaves of an Orbax `_METADATA` file, or None if it is not one."""
  tree = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
  if not isinstance(tree, dict):
    return None
  paths = []
  for entry in tree.values():
    value = entry.get("value_metadata", {})
    if value.get("value_type") in _ARRAY_VALUE_TYPES and not value.get("skip_deserialize"):
      paths.append(tuple(str(k["key"]) for k in entry["key_metadata"]))
  return paths


def array_kvstore(loc: Location, name: str, *, use_ocdbt: bool) -> Any:
  if use_ocdbt:
    return {**ocdbt_spec(loc), "path": name + "/"}
  if isinstance(loc.base, dict):
    return {**loc.base, "path": loc.base["path"] + name + "/"}
  return loc.base + name + "/"


@dataclasses.dataclass(frozen=True)
class Discovered:
  """What a checkpoint directory holds, from its metadata alone."""

  arrays: dict[ParamPath, ArrayInfo]
  sidecar: dict[str, Any] | None
  use_ocdbt: bool


def discover(loc: Location, context: ts.Context, *, sidecar_key: str) -> Discovered:
  """Reads a checkpoint's metadata (never tensor data): Orbax's `_METADATA`, the
  sidecar, and each array's zarr metadata. Without a usable `_METADATA`, the
  arrays are found by listing the OCDBT keys."""
  if loc.local is not None and not os.path.isdir(loc.local):
    raise errors.StoreNotFoundError(f"No unit store at {loc.path}: not a directory.")
  base = ts.KvStore.open(loc.base, context=context).result()
  metadata, sidecar = _read_json(base, ["_METADATA", sidecar_key])
  has_manifest = base.read("manifest.ocdbt").result().state == "value"
  if metadata is None and not has_manifest:
    raise errors.StoreNotFoundError(
      f"No unit store at {loc.path}: found neither Orbax's _METADATA nor an OCDBT "
      "manifest.ocdbt there. Point at the checkpoint item directory (for a "
      "CheckpointManager, <step>/<item>), or write one with save_store."
    )
  use_ocdbt = bool(metadata.get("use_ocdbt", has_manifest)) if metadata else True
  kv = ts.KvStore.open(ocdbt_spec(loc), context=context).result() if use_ocdbt else base
  paths = _tree_paths(metadata)
  if paths is None:
    keys = [k.decode() for k in kv.list().result()]
    names = {k.rsplit("/", 1)[0] for k in keys if k.endswith(("/zarr.json", "/.zarray"))}
    paths = [tuple(n.split(".")) for n in sorted(names)]
  metas = _read_json(kv, [f"{param_name(p)}/zarr.json" for p in paths])
  v2 = [i for i, m in enumerate(metas) if m is None]
  v2_paths = [f"{param_name(paths[i])}/.zarray" for i in v2]
  for i, m in zip(v2, _read_json(kv, v2_paths), strict=True):
    metas[i] = m
  absent = [param_name(p) for p, m in zip(paths, metas, strict=True) if m is None]
  if absent:
    raise errors.StoreLayoutError(
      f"{loc.path} lists arrays without zarr metadata (an incomplete write?):\n"
      f"{errors.format_paths(absent)}\nWrite the store again."
    )
  arrays = {p: _parse_array(p, m) for p, m in zip(paths, metas, strict=True)}
  return Discovered(arrays=arrays, sidecar=sidecar, use_ocdbt=use_ocdbt)
