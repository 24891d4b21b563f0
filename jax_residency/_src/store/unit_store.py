"""The unit store: a model's weights on disk, read one unit (layer) at a time.

A store is an Orbax-compatible checkpoint: an OCDBT database of one zarr3 array
per parameter, named as Orbax names them (`'.'.join(path)`), plus Orbax's
`_METADATA`. Unit parameters are stacked on axis 0, one uncompressed chunk per
unit, so reading unit `i` reads exactly its bytes; the `jax_residency.json`
sidecar records the format version and the stacks. Plain Orbax checkpoints
open too (see ``docs/design.md`` 5.5). `writer.py` writes stores; opening uses
`discovery.py` and `checks.py`, reads `handles.py`, `unit_reads.py`,
`buffers.py` and `mapped.py`.

Example:
  >>> import numpy as np
  >>> from jax_residency._src.store.writer import save_store
  >>> info = save_store(
  ...     "memory://doc/store",
  ...     static={("embed",): np.ones((4, 2), np.float32)},
  ...     units={("w",): np.arange(6, dtype=np.float32).reshape(3, 2)},
  ...     unit_prefix=("layers",),
  ... )
  >>> with UnitStore.open("memory://doc/store") as store:
  ...   store.unit_count, store.read_unit(1)[("w",)].tolist()
  (3, [2.0, 3.0])
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.policy.options import DEFAULT_MAX_CACHED_SHARDS
from jax_residency._src.store import (
  checkpoints,
  checks,
  commit,
  discovery,
  generation,
  handles,
  locations,
  mapped,
  pointers,
  remote,
)
from jax_residency._src.store.buffers import BufferPool
from jax_residency._src.store.discovery import SIDECAR_KEY
from jax_residency._src.store.info import StackInfo, StoreInfo
from jax_residency._src.store.read_counts import ReadCounts
from jax_residency._src.store.read_options import ReadOptions
from jax_residency._src.store.remote import FetchCounter
from jax_residency._src.store.stored_stack import (
  LocalFetches,
  StoredStack,
  StoreLayout,
  failed_unit,
  locate,
  split_stacks,
)
from jax_residency._src.store.unit_reader import ReadCounters
from jax_residency._src.store.unit_reads import (
  UnitRead,
  in_order,
  issue_unit_read,
  read_error,
)
from jax_residency._src.typing import ParamPath, TensorSpec, path_str

if TYPE_CHECKING:
  from jax.typing import DTypeLike

#: Idle unit buffers a store keeps for reuse (per request size): 2 reads in flight + 1 held.
DEFAULT_SPARE_UNIT_BUFFERS = 3


class UnitStore:
  """A store opened for reading: metadata up front, tensor data on demand.

  Open with `UnitStore.open`. Thread-safe: the engine's main thread and its
  prefetch worker may read concurrently. `close()` (or leaving a `with` block)
  drops open handles and idle buffers; arrays already returned stay valid.

  Memory: each unit read lands in one reused, page-aligned host buffer of
  `unit_nbytes` (see `BufferPool`); up to `spare_unit_buffers` idle
  buffers are kept for reuse, on top of what the caller holds. TensorStore's
  chunk cache is off; a bounded 16 MiB cache holds OCDBT index nodes.

  A store is made of parts it holds: its `layout` (what its stacks and static arrays
  are), its read buffers (`BufferPool`), a raw-chunk mapper per local stack
  (`mapped.UnitMapper`) and its counters (`ReadCounts`). It is the dense stream's
  `unit_reader.UnitReader`.
  """

  def __init__(
    self,
    *,
    location: locations.Location,
    context: ts.Context,
    arrays: Mapping[ParamPath, discovery.ArrayInfo],
    stacks: Sequence[tuple[ParamPath, int]],
    use_ocdbt: bool,
    max_cached_shards: int,
    spare_unit_buffers: int,
    quantization: QuantPlan | None = None,
    fetched: FetchCounter | None = None,
  ):
    self._loc = location
    self._context = context
    self._use_ocdbt = use_ocdbt
    self._stacks, self._static = split_stacks(
      arrays, stacks, local=location.local, use_ocdbt=use_ocdbt
    )
    self.layout = StoreLayout(location.path, self._stacks, self._static, quantization)
    self._names = {p: a.stored_name for p, a in arrays.items()}  # by path: Orbax's name
    self._drivers = {a.stored_name: a.driver for a in arrays.values()}
    self._handles = handles.HandleCache(max_cached_shards, self._open_handle)
    self._pool = BufferPool(spare_unit_buffers)
    self._mappers = [s.mapper for s in self._stacks if s.mapper is not None]
    # Chunks of several units are decoded one at a time, on one thread (`issue_unit_read`).
    shared = any(s.shared for s in self._stacks)
    self._decoder = ThreadPoolExecutor(1, "jax_residency-decode") if shared else None
    self._map = False
    self._closed = False
    # A placement serves the store it opened: reads check it was not replaced since.
    self._watch = generation.Watch(location.local, location.path) if location.local else None
    local = location.local
    self._cache_bytes = 0  # of the chunk cache (see `open`'s cache_largest_chunk)
    self._infos = dict(arrays)
    if fetched is None:
      fetched = FetchCounter(location.path, local=location.local is not None)
    local_fetches = LocalFetches(local, use_ocdbt=use_ocdbt) if local else None
    self.counts = ReadCounts(self._mappers, self._pool, local_fetches, fetched, arrays)

  @classmethod
  def open(
    cls,
    path: str,
    *,
    unit_prefix: ParamPath | None = None,
    stacks: Sequence[ParamPath] | None = None,
    max_cached_shards: int = DEFAULT_MAX_CACHED_SHARDS,
    require_unit_chunks: bool = True,
    spare_unit_buffers: int = DEFAULT_SPARE_UNIT_BUFFERS,
    cache_largest_chunk: bool = False,
    read_options: ReadOptions | None = None,
    require_recorded: bool | None = None,
  ) -> UnitStore:
    """Opens a store, reading only metadata.

    Args:
      path: A local directory, or any TensorStore kvstore URL of the checkpoint
        directory (`file://…`, `memory://…`, `gs://…`, `s3://…`).
      stacks: Paths of several stacked unit subtrees (instead of `unit_prefix`);
        both None take the stacks the store records.
      unit_prefix: Path of the stacked unit subtree. Defaults to the one in the
        store's `jax_residency.json`; required for plain Orbax checkpoints.
      max_cached_shards: Maximum number of open TensorStore array handles (LRU).
        Reads reopen evicted handles, so a value at least the number of tensors
        per unit avoids churn.
      require_unit_chunks: Raise `StoreLayoutError` if a unit array's chunk
        spans more than one unit (it could not be streamed one unit at a time).
      spare_unit_buffers: Idle unit buffers kept for reuse.
      cache_largest_chunk: Size a chunk cache for the store's largest chunk, so
        reading a chunk of several units one unit at a time decodes it once (for
        copying it, as `rechunk_store` does; reads otherwise cache nothing).
      read_options: retries and time-out of every read (default `ReadOptions()`).
      require_recorded: see `checks.check_layout`.

    Raises:
      StoreNotFoundError: No checkpoint at `path`.
      StoreLayoutError: Units disagree on their count, or (with
        `require_unit_chunks`) a unit array is not chunked one unit per chunk.
      StoreError: No unit prefix is known, or nothing lies under it.
    """
    if not isinstance(max_cached_shards, int) or max_cached_shards < 1:
      raise errors.ZeroMaxCachedShardsError(
        f"max_cached_shards must be an int >= 1 (open TensorStore handles); got "
        f"{max_cached_shards=}. Use the default, {DEFAULT_MAX_CACHED_SHARDS}."
      )
    loc = locations.locate(checkpoints.resolve(locations.locate(path).path), read_options)
    fetched = FetchCounter(loc.path, local=loc.local is not None)
    if loc.local is not None:  # a save that died between its two renames
      commit.recover_local(loc.local)
    context = handles.store_context(reads=loc.reads)
    loc = pointers.follow(loc, context)  # an object store's current generation
    found = discovery.discover_checked(path, loc, context, sidecar_key=SIDECAR_KEY)
    layout = checks.check_layout(
      path,
      found,
      unit_prefix,
      require_unit_chunks=require_unit_chunks,
      stacks=stacks,
      require_recorded=require_recorded,
    )
    cache_bytes = found.largest_chunk_cache_bytes() if cache_largest_chunk else 0
    if cache_bytes:
      context = handles.store_context(cache_bytes=cache_bytes, reads=loc.reads)
    store = cls(
      location=loc,
      context=context,
      arrays=found.arrays,
      stacks=layout,
      use_ocdbt=found.use_ocdbt,
      max_cached_shards=max_cached_shards,
      spare_unit_buffers=spare_unit_buffers,
      quantization=checks.recorded_quantization(found, loc.path),
      fetched=fetched,
    )
    store._cache_bytes = cache_bytes
    return store

  # -- description

  @property
  def path(self) -> str:
    return self._loc.path

  @property
  def open_handles(self) -> int:
    """TensorStore array handles currently open (at most `max_cached_shards`)."""
    return self._handles.open_count

  def __repr__(self) -> str:
    return (
      f"UnitStore(path={self.path!r}, unit_prefix={self.unit_prefix}, "
      f"unit_count={self.unit_count}, unit_nbytes={self.unit_nbytes})"
    )

  # The layout's description, as the store's own (`StoreLayout`).

  @property
  def unit_prefix(self) -> ParamPath:
    """The (first) stack's path."""
    return self.layout.unit_prefix

  @property
  def info(self) -> StoreInfo:
    return self.layout.info

  @property
  def quantization(self) -> QuantPlan | None:
    """The tensors the store holds quantized (its sidecar's record), or None."""
    return self.layout.quantization

  @property
  def stored_stacks(self) -> tuple[StoredStack, ...]:
    """Every stack opened, with its arrays' chunking (`StoredStack`)."""
    return self.layout.stored_stacks

  @property
  def stacks(self) -> tuple[StackInfo, ...]:
    """Every stack opened, in order; unit ids run through them one after another."""
    return self.layout.stacks

  @property
  def unit_count(self) -> int:
    """Units over all stacks."""
    return self.layout.unit_count

  @property
  def unit_specs(self) -> dict[ParamPath, TensorSpec]:
    """The (first) stack's unit tensors, keyed by path relative to `unit_prefix`."""
    return self.layout.unit_specs

  def stack_specs(self, k: int) -> dict[ParamPath, TensorSpec]:
    """Stack ``k``'s unit tensors, keyed by path relative to its prefix."""
    return self.layout.stack_specs(k)

  @property
  def static_specs(self) -> dict[ParamPath, TensorSpec]:
    """Static tensors, keyed by full path: (shape, dtype)."""
    return self.layout.static_specs

  @property
  def unit_nbytes(self) -> int:
    """Bytes of one unit (of the largest, with several stacks)."""
    return self.layout.unit_nbytes

  @property
  def total_unit_bytes(self) -> int:
    return self.layout.total_unit_bytes

  @property
  def static_nbytes(self) -> int:
    return self.layout.static_nbytes

  @property
  def chunked_per_unit(self) -> bool:
    """Whether every unit array holds at most one unit per chunk (streamable)."""
    return self.layout.chunked_per_unit

  @property
  def bytes_read_per_byte_used(self) -> float:
    """See `StoreLayout.bytes_read_per_byte_used`."""
    return self.layout.bytes_read_per_byte_used

  @property
  def largest_shared_chunk(self) -> int:
    """See `StoreLayout.largest_shared_chunk`."""
    return self.layout.largest_shared_chunk

  @property
  def compressed(self) -> bool:
    """Whether any unit array is compressed (slower reads; `rechunk_store` drops it)."""
    return self.layout.compressed

  # The counters, as the store's own (`ReadCounts`).

  @property
  def advised_bytes(self) -> int:
    """See `ReadCounts.advised_bytes`."""
    return self.counts.advised_bytes

  @property
  def mapped_bytes_total(self) -> int:
    """See `ReadCounts.mapped_bytes_total`."""
    return self.counts.mapped_bytes_total

  @property
  def own_read_bytes(self) -> int:
    """See `ReadCounts.own_read_bytes`."""
    return self.counts.own_read_bytes

  @property
  def fetched_bytes_total(self) -> int:
    """See `ReadCounts.fetched_bytes_total`."""
    return self.counts.fetched_bytes_total

  @property
  def buffer_bytes(self) -> int:
    """See `ReadCounts.buffer_bytes`."""
    return self.counts.buffer_bytes

  @property
  def buffer_peak_bytes(self) -> int:
    """See `ReadCounts.buffer_peak_bytes`."""
    return self.counts.buffer_peak_bytes

  def read_counters(self) -> ReadCounters:
    """Every counter now (`UnitReader.read_counters`)."""
    return self.counts.snapshot()

  def reset_buffer_peak(self) -> None:
    """Starts `buffer_peak_bytes` over from the buffers held now."""
    self._pool.reset_peak()

  def retire_mapped(self, arrays: Any) -> int:
    """Unmaps the pages of mapped unit arrays whose last step has completed, before the
    arrays themselves go (`mapped.UnitMapper.retire`); returns the bytes retired."""
    return sum(m.retire(arrays) for m in self._mappers)

  def limit_buffers(self, units: int | None, *, reclaim: Callable[[], None] | None = None) -> None:
    """Holds unit buffers, live and idle, to ``units`` whole-unit buffers.

    A placement sets this to the units its plan gives host-side unit buffers,
    so buffers kept for reuse never take memory the budgets do not hold, and a
    read waits (briefly, calling ``reclaim``) for the buffers of units its
    caller has dropped to come back before it takes a new one (see
    `BufferPool.set_limit`). A buffer is a whole unit with each tensor
    rounded up to a page.
    """
    slab = max(s.slab_nbytes for s in self._stacks)
    self._pool.set_limit(None if units is None else units * slab, reclaim=reclaim)

  def use_mapped_reads(self) -> bool:
    """Makes whole-unit reads map raw chunks in place of copying them (CPU backends).

    Arrays from a mapped read view the store's files through the page cache
    (see `mapped`): no copy, and on a CPU backend no copy into device arrays
    either. Only tensors stored raw in a local file at an aligned offset are
    mapped; the rest of a unit is read as before. Returns whether any unit
    tensor can be mapped (False for remote or compressed stores, or where
    `mapped.MAPPED_READS_ENV` is "0").
    """
    if not self._mappers or not mapped.mapped_reads_enabled():
      return False
    self._map = True
    # Mapped units count against the same limit as read buffers (`limit_buffers`).
    self._pool.count_external(lambda: sum(m.mapped_bytes for m in self._mappers))
    return True

  @property
  def read_options(self) -> ReadOptions:
    return self._loc.reads

  def _renew_context(self) -> None:
    """After a time-out, arrays reopen in a fresh context: in the old one a new read of a
    chunk joins the cancelled one, which may still be waiting on the server."""
    self._context = handles.store_context(cache_bytes=self._cache_bytes, reads=self._loc.reads)
    self._handles.clear()

  # -- reading

  def read_unit_async(
    self,
    i: int,
    *,
    index: Mapping[ParamPath, tuple[Any, ...]] | None = None,
    skip: Collection[ParamPath] = (),
  ) -> UnitRead:
    """Starts reading unit `i`; see `read_unit`. Returns a future-like `UnitRead`.
    Tensors in ``skip`` are left out (a unit's experts, read by `read_experts_async`)."""
    self._check_usable()
    stack, j = locate(self._stacks, i, self.path)
    units, prefix, mapper = stack.arrays, stack.prefix, stack.mapper
    ready: dict[ParamPath, np.ndarray] = {}
    checks: list[tuple[ParamPath, Any]] = []
    if index is None:
      if self._map and mapper is not None:
        # A mapping holds memory as a buffer would: wait for dropped units first.
        self._pool.wait_for_room(stack.mapped_unit_bytes, outside=True)
        ready, checks = mapper.map_unit(j)
        self._pool.note_external()
      requests: Mapping[ParamPath, tuple[Any, ...]] = {
        p: () for p in units if p not in ready and p not in skip
      }
    else:
      unknown = [path_str(p) for p in index if tuple(p) not in units]
      if unknown:
        raise errors.StoreError(
          f"read_unit index names tensors that are not unit tensors of {self.path}:\n"
          f"{errors.format_paths(unknown)}\nKeys are paths relative to the stack's prefix "
          f"{prefix}; see UnitStore.stack_specs."
        )
      requests = {tuple(p): tuple(s) if isinstance(s, tuple) else (s,) for p, s in index.items()}
    sources = []
    for (rel, idx), handle in zip(requests.items(), self._handles_of(stack, requests), strict=True):
      try:
        sources.append((rel, handle[(j, *idx)]))
      except (IndexError, ValueError, TypeError) as e:
        raise errors.StoreError(
          f"Cannot index unit tensor {path_str(rel)!r} (per-unit shape "
          f"{units[rel].shape[1:]}) with {idx!r}: {e}"
        ) from e
    direct = mapper if index is None and mapped.direct_reads_enabled() else None
    return self._issue(
      i,
      stack,
      sources,
      whole=[rel for rel in requests if not units[rel].partial_reads],
      direct=None if direct is None else functools.partial(direct.read_into, j),
      ready=ready,
      pending=checks,
      serial=stack.shared,
      decoder=self._decoder,
    )

  def read_experts_async(
    self,
    i: int,
    experts: Sequence[int],
    tensors: Sequence[ParamPath],
    *,
    into: Mapping[ParamPath, np.ndarray] | None = None,
  ) -> UnitRead:
    """Starts reading only experts ``experts``' chunks of unit ``i``'s ``tensors``
    (stack-relative paths, stored a chunk per expert), keyed ``(*path, str(expert))``:
    into the caller's arrays in ``into`` (every key), else pooled buffers."""
    self._check_usable()
    stack, j = locate(self._stacks, i, self.path)
    mapper = stack.mapper if mapped.direct_reads_enabled() else None
    handles = self._handles_of(stack, tensors)
    sources = [
      ((*rel, str(e)), handle[j, e])
      for rel, handle in zip(tensors, handles, strict=True)
      for e in experts
    ]

    def direct(key: ParamPath, out: np.ndarray) -> Any:
      assert mapper is not None
      return mapper.read_piece_into(j, tuple(key[:-1]), int(key[-1]), out)

    whole = [k for k, _ in sources if not stack.arrays[tuple(k[:-1])].partial_reads]
    return self._issue(i, stack, sources, whole=whole, direct=direct if mapper else None, into=into)

  def _handles_of(self, stack: StoredStack, tensors: Iterable[ParamPath]) -> list[ts.TensorStore]:
    names = [self._names[stack.prefix + rel] for rel in tensors]
    return self._handles.get_many(names, self._open_handle_async)

  def _issue(
    self, i: int, stack: StoredStack, sources: Sequence[tuple[Any, Any]], **kw: Any
  ) -> UnitRead:
    """`issue_unit_read` of unit ``i``'s ``sources``, counting what TensorStore reads."""
    j = i - stack.offset
    read = issue_unit_read(
      j,
      sources,
      self._pool,
      self.path,
      prefix=stack.prefix,
      timeout_s=self._loc.reads.timeout_s,
      attempts=self._loc.reads.attempts,
      on_timeout=self._renew_context,
      **kw,
    )
    read.id = int(i)
    for key in read.tensorstore_keys:
      self.counts.count(stack.prefix + (key if key in stack.arrays else tuple(key[:-1])), j)
    return read

  def advise_unit(self, i: int, *, experts: bool = True) -> int:
    """Asks the kernel to start reading unit `i`'s raw local chunks into the page cache,
    without waiting (`mapped.UnitMapper.advise_unit`; without ``experts``, not its
    per-expert chunks); returns the bytes asked for."""
    self._check_usable()
    stack, j = locate(self._stacks, i, self.path)
    if stack.mapper is None or not (self._map or mapped.direct_reads_enabled()):
      return 0
    return stack.mapper.advise_unit(j, huge=self._map, pieces=experts)

  def read_unit(
    self,
    i: int,
    *,
    index: Mapping[ParamPath, tuple[Any, ...]] | None = None,
    skip: Collection[ParamPath] = (),
  ) -> dict[ParamPath, np.ndarray]:
    """Reads the tensors of unit `i`, keyed by path relative to its stack's prefix.

    Unit ids run through the stacks in order (see `stacks`): with one stack,
    `i` is the layer index.

    All tensors are read concurrently into one reused host buffer.

    Args:
      i: Unit id, `0 <= i < unit_count`.
      index: If given, read only these tensors, each restricted to its tuple of
        slices/ints over the per-unit shape (`()` means all of it) — a process
        reads just what its devices own.
      skip: Tensors to leave out (a unit's experts, read by `read_experts_async`).
    """
    return self.read_unit_async(i, index=index, skip=skip).result()

  def read_units(
    self,
    indices: Iterable[int],
    *,
    index: Mapping[ParamPath, tuple[Any, ...]] | None = None,
    in_flight: int = 2,
  ) -> Iterator[tuple[int, dict[ParamPath, np.ndarray]]]:
    """Yields `(i, tensors)` in order, keeping `in_flight` unit reads ahead."""
    return in_order(functools.partial(self.read_unit_async, index=index), indices, in_flight)

  def read_static(self) -> dict[ParamPath, np.ndarray]:
    """Reads every static tensor, keyed by full path."""
    return {p: self.read_static_tensor(p) for p in self._static}

  def read_static_tensor(self, path: ParamPath) -> np.ndarray:
    """Reads one static tensor (to place static weights one at a time)."""
    if tuple(path) not in self._static:
      raise errors.StoreError(f"{path_str(path)!r} is not a static tensor of {self.path}.")
    return self.read_array(path)

  def read_array(self, path: ParamPath, out: np.ndarray | None = None) -> np.ndarray:
    """Reads the whole array at full ``path`` (a static tensor, or a unit array with
    every unit), each chunk decoded once, into ``out`` if given; returns it."""
    handle = self.array_handle(path)
    future = handle.read() if out is None else ts.array(out, copy=False, write=True).write(handle)
    self.counts.count(tuple(path), None)
    name = path_str(tuple(path))

    def fail(e: BaseException) -> errors.StoreError:  # naming the unit whose chunk failed
      unit = failed_unit(str(e), self._infos[tuple(path)], self._stacks)
      return read_error(e, self.path, name, unit)

    what = f"tensor {name!r}"
    got = remote.wait(
      future, self._loc.reads, self.path, what, other=fail, on_timeout=self._renew_context
    )
    return got if out is None else out

  def array_handle(self, path: ParamPath) -> ts.TensorStore:
    """The open TensorStore array at full ``path``: a static tensor, or a unit array
    whole (all units stacked), for copying a store array by array (`rechunk_store`)."""
    self._check_usable()
    if tuple(path) not in self._names:
      raise errors.StoreError(f"{path_str(tuple(path))!r} is not an array of {self.path}.")
    return self._handles.get(self._names[tuple(path)])

  def check_against(
    self,
    expected_units: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]] | None,
    expected_static: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
    *,
    strict: bool,
    expected_stacks: Sequence[Mapping[ParamPath, tuple[Sequence[int], DTypeLike]]] = (),
  ) -> None:
    """Checks that the store holds exactly what a model expects; see
    `checks.check_against`. ``expected_units`` are the (first) stack's tensors keyed
    relative to `unit_prefix`; ``expected_stacks`` each stack's, in order."""
    if expected_units is not None:
      expected_stacks = [expected_units, *expected_stacks[1:]]
    stored = [(s.prefix, s.specs) for s in self._stacks]
    checks.check_stacks(
      self.path, stored, self.static_specs, expected_stacks, expected_static, strict
    )

  # -- lifetime

  def close(self) -> None:
    """Drops open handles and idle buffers. Returned arrays stay valid."""
    self._closed = True
    self._handles.clear()
    self._pool.clear()
    if self._decoder is not None:
      self._decoder.shutdown(wait=False)

  def __enter__(self) -> UnitStore:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def _check_usable(self) -> None:
    """Raises `ClosedError` after `close`, `StoreReplacedError` if the store changed."""
    if self._closed:
      raise errors.ClosedError(f"{self!r} was used after close(); open the store again.")
    if self._watch is not None:
      self._watch.check()

  def _open_handle(self, name: str) -> ts.TensorStore:
    return self._open_handle_async(name).result()

  def _open_handle_async(self, name: str) -> handles.Opening:
    """A future of an open handle; opening errors surface as `StoreError`."""
    return handles.open_array(
      self._loc,
      name,
      driver=self._drivers[name],
      use_ocdbt=self._use_ocdbt,
      context=self._context,
    )
