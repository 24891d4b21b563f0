"""Open TensorStore handles: per-store contexts (`store_context`), opening one
stored array (`open_array`), and the bounded `HandleCache` of open arrays.

* `store_context`: TensorStore contexts with the chunk cache off (every host
  byte is one the caller holds and accounts for), a small bounded cache for
  OCDBT b-tree nodes, and `file_io_mode: memmap` (local reads copy straight from
  the page cache into the destination buffer).
* `HandleCache`: an LRU of open TensorStore array handles, bounded by
  `max_cached_shards`.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from typing import Any

import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.plan.memory import STORE_INDEX_CACHE_BYTES
from jax_residency._src.store import buffers, discovery, locations, remote
from jax_residency._src.store.read_options import ReadOptions

#: Bytes of decoded OCDBT b-tree nodes cached per open store (metadata only); the
#: plan names it as an overhead.
OCDBT_NODE_CACHE_BYTES = STORE_INDEX_CACHE_BYTES

_root_lock = threading.Lock()
_root_context: ts.Context | None = None


def store_context(*, cache_bytes: int = 0, reads: ReadOptions | None = None) -> ts.Context:
  """Returns a fresh TensorStore context for one open store.

  Each store gets its own caches, so a store replaced on disk is never read
  through a stale OCDBT manifest. All contexts share one process-wide parent,
  which owns the `memory://` key-value store: a `memory://` store written by
  `save_store` is visible to `UnitStore.open` in the same process.

  Args:
    cache_bytes: Chunk cache limit. 0 (the default) caches nothing.
    reads: how remote requests retry (default `ReadOptions()`).
  """
  global _root_context
  buffers.tune_malloc()
  with _root_lock:
    if _root_context is None:
      _root_context = ts.Context()
    root = _root_context
  spec = {
    "cache_pool": {"total_bytes_limit": cache_bytes},
    "cache_pool#ocdbt": {"total_bytes_limit": OCDBT_NODE_CACHE_BYTES},
    "file_io_mode": {"mode": "memmap"},
    **(reads or ReadOptions()).context_spec(),
  }
  return ts.Context(ts.Context.Spec(spec), parent=root)


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


def open_array(
  loc: locations.Location,
  name: str,
  *,
  driver: str,
  use_ocdbt: bool,
  context: ts.Context,
) -> Opening:
  """Starts opening the array stored under ``name`` for reading; returns its future.

  Opening errors surface from `Opening.result` as `StoreError`.
  """
  spec = {
    "driver": driver,
    "kvstore": discovery.array_kvstore(loc, name, use_ocdbt=use_ocdbt),
    "recheck_cached_data": False,
    "recheck_cached_metadata": False,
  }
  return Opening(ts.open(spec, context=context, read=True, open=True), name, loc)


class Opening:
  """A handle being opened; `result()` names the array and store on failure, and
  waits at most the store's time-out."""

  def __init__(self, future: Any, name: str, loc: locations.Location):
    self._future, self._name, self._loc = future, name, loc

  def result(self) -> ts.TensorStore:
    def failed(e: BaseException) -> errors.StoreError:
      return errors.StoreError(f"Cannot open array {self._name!r} in {self._loc.path}: {e}")

    return remote.wait(
      self._future, self._loc.reads, self._loc.path, f"array {self._name!r}", other=failed
    )
