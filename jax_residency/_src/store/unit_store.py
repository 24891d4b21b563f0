"""The unit store: a model's weights on disk, read one unit (layer) at a time.

A store is an Orbax-compatible checkpoint: an OCDBT key-value database holding
one zarr3 array per parameter, named the way Orbax names them
(`'.'.join(path)`), plus Orbax's `_METADATA`, so `orbax.checkpoint` restores it
as a nested dict of numpy arrays. Unit ("layer") parameters are stacked on axis
0 with one uncompressed chunk per unit, so reading unit `i` reads exactly that
unit's bytes; static parameters are one chunk each. A small sidecar,
`jax_residency.json`, records the format version, the unit prefix and the unit
count; plain Orbax checkpoints without it open too, given `unit_prefix`.

This module opens and reads stores; `writer.py` writes them (`save_store`,
`rechunk_store`). Both work on flat mappings keyed by parameter-path tuples and
know nothing of Flax. The read fast path lives in `reads.py`, mapped reads in `mapped.py`.

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

import collections
import dataclasses
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from jax_residency._src.policy import errors
from jax_residency._src.store import mapped
from jax_residency._src.store import reads as readers
from jax_residency._src.typing import ParamPath, TensorSpec

if TYPE_CHECKING:
  from jax.typing import DTypeLike

FORMAT_NAME = "jax_residency.unit_store"
FORMAT_VERSION = 1
SIDECAR_KEY = "jax_residency.json"
DEFAULT_MAX_CACHED_SHARDS = 4
#: Idle unit buffers a store keeps for reuse (per request size): 2 reads in flight + 1 held.
DEFAULT_SPARE_UNIT_BUFFERS = 3


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreInfo:
  """What `save_store` / `rechunk_store` wrote.

  Attributes:
    path: The store's path as given.
    unit_prefix: Path of the stacked unit subtree (e.g. `("params", "layers")`).
    unit_count: Number of units (the leading dimension of every unit array).
    unit_nbytes: Bytes of one unit (all unit tensors of one index).
    static_nbytes: Bytes of all static (non-unit) tensors.
    format_version: Version of the sidecar format.
  """

  path: str
  unit_prefix: ParamPath
  unit_count: int
  unit_nbytes: int
  static_nbytes: int
  format_version: int = FORMAT_VERSION

  @property
  def total_unit_bytes(self) -> int:
    return self.unit_nbytes * self.unit_count


_name = readers.param_name


def _nbytes(shape: Sequence[int], dtype: np.dtype) -> int:
  return math.prod(shape) * dtype.itemsize


def _fmt(spec: tuple[Sequence[int], Any]) -> str:
  return f"{tuple(spec[0])} {np.dtype(spec[1]).name}"


# --- reading ------------------------------------------------------------------


class UnitStore:
  """A store opened for reading: metadata up front, tensor data on demand.

  Open with `UnitStore.open`. Thread-safe: the engine's main thread and its
  prefetch worker may read concurrently. `close()` (or leaving a `with` block)
  drops open handles and idle buffers; arrays already returned stay valid.

  Memory: each unit read lands in one reused, page-aligned host buffer of
  `unit_nbytes` (see `readers.BufferPool`); up to `spare_unit_buffers` idle
  buffers are kept for reuse, on top of what the caller holds. TensorStore's
  chunk cache is off; a bounded 16 MiB cache holds OCDBT index nodes.
  """

  def __init__(
    self,
    *,
    location: readers.Location,
    context: ts.Context,
    arrays: Mapping[ParamPath, readers.ArrayInfo],
    unit_prefix: ParamPath,
    unit_count: int,
    use_ocdbt: bool,
    max_cached_shards: int,
    spare_unit_buffers: int,
  ):
    self._loc = location
    self._context = context
    self._prefix = unit_prefix
    self._unit_count = unit_count
    self._use_ocdbt = use_ocdbt
    n = len(unit_prefix)
    self._units = {p[n:]: a for p, a in sorted(arrays.items()) if p[:n] == unit_prefix}
    self._static = {p: a for p, a in sorted(arrays.items()) if p[:n] != unit_prefix}
    self._drivers = {_name(p): a.driver for p, a in arrays.items()}
    self._handles = readers.HandleCache(max_cached_shards, self._open_handle)
    self._pool = readers.BufferPool(spare_unit_buffers)
    self._mapper: mapped.UnitMapper | None = None
    self._mapped_unit_bytes = 0
    self._closed = False

  @classmethod
  def open(
    cls,
    path: str,
    *,
    unit_prefix: ParamPath | None = None,
    max_cached_shards: int = DEFAULT_MAX_CACHED_SHARDS,
    require_unit_chunks: bool = True,
    spare_unit_buffers: int = DEFAULT_SPARE_UNIT_BUFFERS,
  ) -> UnitStore:
    """Opens a store, reading only metadata.

    Args:
      path: A local directory, or any TensorStore kvstore URL of the checkpoint
        directory (`file://…`, `memory://…`, `gs://…`, `s3://…`).
      unit_prefix: Path of the stacked unit subtree. Defaults to the one in the
        store's `jax_residency.json`; required for plain Orbax checkpoints.
      max_cached_shards: Maximum number of open TensorStore array handles (LRU).
        Reads reopen evicted handles, so a value at least the number of tensors
        per unit avoids churn.
      require_unit_chunks: Raise `StoreLayoutError` if a unit array's chunk
        spans more than one unit (it could not be streamed one unit at a time).
      spare_unit_buffers: Idle unit buffers kept for reuse.

    Raises:
      StoreNotFoundError: No checkpoint at `path`.
      StoreLayoutError: Units disagree on their count, or (with
        `require_unit_chunks`) a unit array is not chunked one unit per chunk.
      StoreError: No unit prefix is known, or nothing lies under it.
    """
    return _open_store(
      path,
      unit_prefix=unit_prefix,
      max_cached_shards=max_cached_shards,
      require_unit_chunks=require_unit_chunks,
      spare_unit_buffers=spare_unit_buffers,
    )

  # -- description

  @property
  def path(self) -> str:
    return self._loc.path

  @property
  def unit_prefix(self) -> ParamPath:
    return self._prefix

  @property
  def unit_count(self) -> int:
    return self._unit_count

  @property
  def unit_specs(self) -> dict[ParamPath, TensorSpec]:
    """Unit tensors, keyed by path relative to `unit_prefix`: (per-unit shape, dtype)."""
    return {p: (a.shape[1:], a.dtype) for p, a in self._units.items()}

  @property
  def static_specs(self) -> dict[ParamPath, TensorSpec]:
    """Static tensors, keyed by full path: (shape, dtype)."""
    return {p: (a.shape, a.dtype) for p, a in self._static.items()}

  @property
  def unit_nbytes(self) -> int:
    return sum(_nbytes(a.shape[1:], a.dtype) for a in self._units.values())

  @property
  def total_unit_bytes(self) -> int:
    return self.unit_nbytes * self._unit_count

  @property
  def static_nbytes(self) -> int:
    return sum(_nbytes(a.shape, a.dtype) for a in self._static.values())

  @property
  def chunked_per_unit(self) -> bool:
    """Whether every unit array holds at most one unit per chunk (streamable)."""
    return all(a.read_chunk[:1] == (1,) for a in self._units.values())

  @property
  def compressed(self) -> bool:
    """Whether any unit array is compressed (slower reads; `rechunk_store` drops it)."""
    return any(a.compressed for a in self._units.values())

  @property
  def open_handles(self) -> int:
    """TensorStore array handles currently open (at most `max_cached_shards`)."""
    return self._handles.open_count

  @property
  def info(self) -> StoreInfo:
    return StoreInfo(
      path=self.path,
      unit_prefix=self._prefix,
      unit_count=self._unit_count,
      unit_nbytes=self.unit_nbytes,
      static_nbytes=self.static_nbytes,
    )

  def __repr__(self) -> str:
    return (
      f"UnitStore(path={self.path!r}, unit_prefix={self._prefix}, "
      f"unit_count={self._unit_count}, unit_nbytes={self.unit_nbytes})"
    )

  def limit_buffers(self, units: int | None, *, reclaim: Callable[[], None] | None = None) -> None:
    """Holds unit buffers, live and idle, to ``units`` whole-unit buffers.

    A placement sets this to the units its plan gives host-side unit buffers,
    so buffers kept for reuse never take memory the budgets do not hold, and a
    read waits (briefly, calling ``reclaim``) for the buffers of units its
    caller has dropped to come back before it takes a new one (see
    `readers.BufferPool.set_limit`). A buffer is a whole unit with each tensor
    rounded up to a page.
    """
    specs = [(_name(p), a.shape[1:], a.dtype) for p, a in self._units.items()]
    slab = readers.buffer_layout(specs)[1]
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
    tensors = {
      rel: (_name(self._prefix + rel), a.shape[1:], a.dtype)
      for rel, a in self._units.items()
      if a.raw and a.read_chunk[:1] == (1,) and tuple(a.read_chunk[1:]) == tuple(a.shape[1:])
    }
    if self._loc.local is None or not tensors or not mapped.mapped_reads_enabled():
      return False
    self._mapper = mapped.UnitMapper(self._loc.local, use_ocdbt=self._use_ocdbt, tensors=tensors)
    # Mapped units count against the same limit as read buffers (`limit_buffers`).
    self._pool.count_external(lambda: self._mapper.mapped_bytes if self._mapper else 0)
    self._mapped_unit_bytes = sum(
      mapped.mapped_size(shape, dtype) for _, shape, dtype in tensors.values()
    )
    return True

  @property
  def mapped_bytes_total(self) -> int:
    """Tensor bytes that reads have mapped instead of copied, since the store opened."""
    return self._mapper.total_bytes if self._mapper is not None else 0

  @property
  def buffer_bytes(self) -> int:
    """Bytes of unit buffers alive now (arrays returned by reads and not yet freed),
    mapped chunk ranges included."""
    return self._pool.leased_bytes + (self._mapper.mapped_bytes if self._mapper else 0)

  @property
  def buffer_peak_bytes(self) -> int:
    """Most bytes of unit buffers, live and idle, and mapped chunk ranges held at once
    since `reset_buffer_peak`."""
    return self._pool.peak_bytes

  def reset_buffer_peak(self) -> None:
    """Starts `buffer_peak_bytes` over from the buffers held now."""
    self._pool.reset_peak()

  # -- reading

  def read_unit_async(
    self, i: int, *, index: Mapping[ParamPath, tuple[Any, ...]] | None = None
  ) -> readers.UnitRead:
    """Starts reading unit `i`; see `read_unit`. Returns a future-like `UnitRead`."""
    self._check_usable()
    if not isinstance(i, int | np.integer) or not 0 <= i < self._unit_count:
      raise errors.StoreError(
        f"Unit index {i!r} is out of range for {self.path}, which holds "
        f"{self._unit_count} units; use 0 <= i < {self._unit_count}."
      )
    ready: dict[ParamPath, np.ndarray] = {}
    if index is None:
      if self._mapper is not None:
        # A mapping holds memory as a buffer would: wait for dropped units first.
        self._pool.wait_for_room(self._mapped_unit_bytes, outside=True)
        ready = self._mapper.map_unit(int(i))
        self._pool.note_external()
      requests: Mapping[ParamPath, tuple[Any, ...]] = {p: () for p in self._units if p not in ready}
    else:
      unknown = [_name(p) for p in index if tuple(p) not in self._units]
      if unknown:
        raise errors.StoreError(
          f"read_unit index names tensors that are not unit tensors of {self.path}:\n"
          f"{errors.format_paths(unknown)}\nKeys are paths relative to unit_prefix="
          f"{self._prefix}; see UnitStore.unit_specs."
        )
      requests = {tuple(p): tuple(s) if isinstance(s, tuple) else (s,) for p, s in index.items()}
    sources = []
    handles = self._handles.get_many(
      [_name(self._prefix + rel) for rel in requests], self._open_handle_async
    )
    for (rel, idx), handle in zip(requests.items(), handles, strict=True):
      try:
        sources.append((rel, handle[(int(i), *idx)]))
      except (IndexError, ValueError, TypeError) as e:
        raise errors.StoreError(
          f"Cannot index unit tensor {_name(rel)!r} (per-unit shape "
          f"{self._units[rel].shape[1:]}) with {idx!r}: {e}"
        ) from e
    return readers.issue_unit_read(int(i), sources, self._pool, self.path, ready=ready)

  def read_unit(
    self, i: int, *, index: Mapping[ParamPath, tuple[Any, ...]] | None = None
  ) -> dict[ParamPath, np.ndarray]:
    """Reads the tensors of unit `i`, keyed by path relative to `unit_prefix`.

    All tensors are read concurrently into one reused host buffer.

    Args:
      i: Unit index, `0 <= i < unit_count`.
      index: If given, read only these tensors, each restricted to its tuple of
        slices/ints over the per-unit shape (`()` means all of it) — a process
        reads just what its devices own.
    """
    return self.read_unit_async(i, index=index).result()

  def read_units(
    self,
    indices: Iterable[int],
    *,
    index: Mapping[ParamPath, tuple[Any, ...]] | None = None,
    in_flight: int = 2,
  ) -> Iterator[tuple[int, dict[ParamPath, np.ndarray]]]:
    """Yields `(i, tensors)` in order, keeping `in_flight` unit reads ahead."""
    if in_flight < 1:
      raise errors.StoreError(f"read_units needs in_flight >= 1; got {in_flight=}.")
    pending: collections.deque[readers.UnitRead] = collections.deque()
    todo = iter(indices)
    for i in todo:
      pending.append(self.read_unit_async(i, index=index))
      if len(pending) >= in_flight:
        break
    while pending:
      head = pending.popleft()
      nxt = next(todo, None)
      if nxt is not None:
        pending.append(self.read_unit_async(nxt, index=index))
      yield head.unit, head.result()

  def read_static(self) -> dict[ParamPath, np.ndarray]:
    """Reads every static tensor, keyed by full path."""
    self._check_usable()
    futures = [(p, self._handles.get(_name(p)).read()) for p in self._static]
    return {path: self._static_result(path, future) for path, future in futures}

  def read_static_tensor(self, path: ParamPath) -> np.ndarray:
    """Reads one static tensor (to place static weights one at a time)."""
    self._check_usable()
    if tuple(path) not in self._static:
      raise errors.StoreError(f"{_name(path)!r} is not a static tensor of {self.path}.")
    return self._static_result(path, self._handles.get(_name(path)).read())

  def _static_result(self, path: ParamPath, future: Any) -> np.ndarray:
    try:
      return future.result()
    except ValueError as e:
      raise errors.StoreError(f"Reading {_name(path)!r} from {self.path} failed: {e}") from e

  def check_against(
    self,
    expected_units: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
    expected_static: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
    *,
    strict: bool,
  ) -> None:
    """Checks that the store holds exactly what a model expects.

    Args:
      expected_units: Per-unit (shape, dtype) by path relative to `unit_prefix`.
      expected_static: (shape, dtype) by full path.
      strict: Also reject stored tensors the model does not claim.

    Raises:
      MissingCheckpointParametersError: Expected tensors are absent (checked
        first; the message counts the other problems too).
      CheckpointShapeMismatchError: Shapes or dtypes differ.
      UnexpectedCheckpointParametersError: With `strict`, unclaimed tensors.
    """
    missing, mismatched = [], []
    for label, expected, stored in (
      ("per unit", expected_units, self.unit_specs),
      ("", expected_static, self.static_specs),
    ):
      full = (lambda p: self._prefix + p) if label else (lambda p: p)
      for path, (shape, dtype) in expected.items():
        name = _name(full(tuple(path))) + (f" ({label})" if label else "")
        want = (tuple(int(d) for d in shape), np.dtype(dtype))
        found = stored.get(tuple(path))
        if found is None:
          missing.append(f"{name}: expected {_fmt(want)}")
        elif found != want:
          mismatched.append(f"{name}: expected {_fmt(want)}, found {_fmt(found)}")
    claimed = {self._prefix + tuple(p) for p in expected_units} | {
      tuple(p) for p in expected_static
    }
    unexpected = []
    if strict:
      for rel, spec in self.unit_specs.items():
        if self._prefix + rel not in claimed:
          unexpected.append(f"{_name(self._prefix + rel)} (per unit): {_fmt(spec)}")
      for path, spec in self.static_specs.items():
        if path not in claimed:
          unexpected.append(f"{_name(path)}: {_fmt(spec)}")
    where = f"the store at {self.path} (unit_prefix={self._prefix})"
    if missing:
      also = _also(mismatched=len(mismatched), unexpected=len(unexpected))
      raise errors.MissingCheckpointParametersError(
        f"The model has {len(missing)} parameter(s) that {where} does not hold:\n"
        f"{errors.format_paths(missing)}\n{also}Fix: save the store from this model "
        "(save_store), or check that unit_prefix names the model's layer stack."
      )
    if mismatched:
      also = _also(unexpected=len(unexpected))
      raise errors.CheckpointShapeMismatchError(
        f"{len(mismatched)} tensor(s) in {where} disagree with the model:\n"
        f"{errors.format_paths(mismatched)}\n{also}Fix: the store was written for a "
        "different model configuration; save it again from this model."
      )
    if unexpected:
      raise errors.UnexpectedCheckpointParametersError(
        f"{where} holds {len(unexpected)} tensor(s) the model does not claim:\n"
        f"{errors.format_paths(unexpected)}\nFix: pass strict_loading=False to ignore "
        "them, or save a store from this model."
      )

  # -- lifetime

  def close(self) -> None:
    """Drops open handles and idle buffers. Returned arrays stay valid."""
    self._closed = True
    self._handles.clear()
    self._pool.clear()

  def __enter__(self) -> UnitStore:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def _check_usable(self) -> None:
    if self._closed:
      raise errors.ClosedError(f"{self!r} was used after close(); open the store again.")

  def _open_handle(self, name: str) -> ts.TensorStore:
    return self._open_handle_async(name).result()

  def _open_handle_async(self, name: str) -> _Opening:
    """A future of an open handle; opening errors surface as `StoreError`."""
    spec = {
      "driver": self._drivers[name],
      "kvstore": readers.array_kvstore(self._loc, name, use_ocdbt=self._use_ocdbt),
      "recheck_cached_data": False,
      "recheck_cached_metadata": False,
    }
    return _Opening(ts.open(spec, context=self._context, read=True, open=True), name, self.path)


class _Opening:
  """A handle being opened; `result()` names the array and store on failure."""

  def __init__(self, future: Any, name: str, path: str):
    self._future, self._name, self._path = future, name, path

  def result(self) -> ts.TensorStore:
    try:
      return self._future.result()
    except ValueError as e:
      raise errors.StoreError(f"Cannot open array {self._name!r} in {self._path}: {e}") from e


def _also(*, mismatched: int = 0, unexpected: int = 0) -> str:
  parts = [f"{mismatched} shape/dtype mismatch(es)"] if mismatched else []
  parts += [f"{unexpected} unexpected tensor(s)"] if unexpected else []
  return f"(Also found: {', '.join(parts)}.)\n" if parts else ""


def _open_store(
  path: str,
  *,
  unit_prefix: ParamPath | None,
  max_cached_shards: int,
  require_unit_chunks: bool,
  spare_unit_buffers: int,
  cache_largest_chunk: bool = False,
) -> UnitStore:
  """`UnitStore.open`; `cache_largest_chunk` sizes a chunk cache for `rechunk_store`."""
  if not isinstance(max_cached_shards, int) or max_cached_shards < 1:
    raise errors.ZeroMaxCachedShardsError(
      f"max_cached_shards must be an int >= 1 (open TensorStore handles); got "
      f"{max_cached_shards=}. Use the default, {DEFAULT_MAX_CACHED_SHARDS}."
    )
  loc = readers.locate(path)
  context = readers.store_context()
  try:
    found = readers.discover(loc, context, sidecar_key=SIDECAR_KEY)
  except errors.StoreError:
    raise
  except (ValueError, OSError) as e:  # corrupt metadata, manifest or data files
    raise errors.StoreError(
      f"{path} is not a readable checkpoint ({type(e).__name__}: {e}). Write it again with "
      "jax_residency.save, or point at the checkpoint directory itself."
    ) from e
  sidecar, arrays, paths = found.sidecar, found.arrays, list(found.arrays)
  if sidecar is not None and sidecar.get("format_version", 0) > FORMAT_VERSION:
    raise errors.StoreError(
      f"{path} was written by a newer jax_residency (format_version="
      f"{sidecar.get('format_version')}; this one reads <= {FORMAT_VERSION}). Upgrade."
    )
  if unit_prefix is None:
    if sidecar is None or not sidecar.get("unit_prefix"):
      tops = sorted({_name(p[:2]) for p in paths if len(p) > 2})
      raise errors.StoreError(
        f"{path} has no {SIDECAR_KEY} (a plain Orbax checkpoint), so the unit prefix is "
        f"unknown. Pass unit_prefix=(...) naming the stacked layer subtree; candidates:\n"
        f"{errors.format_paths(tops)}"
      )
    unit_prefix = tuple(sidecar["unit_prefix"])
  prefix = _as_path(unit_prefix)
  units = {p: a for p, a in arrays.items() if p[: len(prefix)] == prefix and len(p) > len(prefix)}
  if not units:
    parents = sorted({_name(p[:-1]) for p in paths if len(p) > 1})
    raise errors.StoreError(
      f"{path} holds no arrays under unit_prefix={prefix}. Pass the prefix of the "
      f"stacked layer subtree; array parents found:\n{errors.format_paths(parents)}"
    )
  counts = {_name(p): a.shape[0] if a.shape else None for p, a in units.items()}
  unit_count = next(iter(counts.values()))
  if unit_count is None or any(c != unit_count for c in counts.values()):
    raise errors.StoreLayoutError(
      f"Unit arrays under {prefix} in {path} must share one leading (unit) dimension; "
      f"found:\n{errors.format_paths(f'{k}: leading dim {v}' for k, v in counts.items())}\n"
      "Fix unit_prefix so it names only the stacked layers."
    )
  if sidecar is not None and sidecar.get("unit_count", unit_count) != unit_count:
    raise errors.StoreLayoutError(
      f"{path}: {SIDECAR_KEY} records unit_count={sidecar['unit_count']} but the arrays "
      f"hold {unit_count} units. The store is inconsistent; write it again."
    )
  bad = [f"{_name(p)}: chunk shape {a.read_chunk}" for p, a in units.items() if a.read_chunk[0] > 1]
  if bad and require_unit_chunks:
    raise errors.StoreLayoutError(
      f"{path} cannot be streamed one unit at a time: these unit arrays hold several "
      f"units per chunk (streaming needs chunk shape (1, ...)):\n{errors.format_paths(bad)}\n"
      f"Fix: run `jax-residency rechunk {path} DST --units {_name(prefix)}` or call "
      f"rechunk_store({path!r}, dst, unit_prefix={prefix}), then open DST."
    )
  if cache_largest_chunk:
    largest = max(_nbytes(a.read_chunk, a.dtype) for a in arrays.values())
    context = readers.store_context(cache_bytes=largest + largest // 4 + (1 << 20))
  return UnitStore(
    location=loc,
    context=context,
    arrays=arrays,
    unit_prefix=prefix,
    unit_count=unit_count,
    use_ocdbt=found.use_ocdbt,
    max_cached_shards=max_cached_shards,
    spare_unit_buffers=spare_unit_buffers,
  )


# --- writing ------------------------------------------------------------------


def _as_path(key: Any) -> ParamPath:
  return tuple(str(k) for k in (key if isinstance(key, tuple) else (key,)))
