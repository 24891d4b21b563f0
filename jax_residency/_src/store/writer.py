"""Writing unit stores: `StoreWriter` (chunks, in flight and committed atomically) and
`save_store`; `rechunk.py` copies a store with it.

Stores are written into a temporary sibling directory and put in place only
when complete (local paths; `commit.py`), or on object stores as a new generation
that a pointer object is switched to last (`pointers.py`), with one uncompressed
chunk per unit for the stacked layers; see `unit_store.py` for the layout and for reading.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import os
import shutil
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.report.progress import progress_bar
from jax_residency._src.store import checks, commit, layout, mapped, pointers, remote, space
from jax_residency._src.store.discovery import (
  FORMAT_NAME,
  FORMAT_VERSION,
  PLAIN_FORMAT_VERSION,
  SIDECAR_KEY,
  as_path,
)
from jax_residency._src.store.handles import store_context
from jax_residency._src.store.info import StackInfo, StoreInfo
from jax_residency._src.store.locations import OCDBT_INLINE_BYTES, locate, ocdbt_spec
from jax_residency._src.store.raw_chunks import CHECKSUM_BYTES
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes

if TYPE_CHECKING:
  from jax.typing import ArrayLike

_CHECKPOINT_MARKERS = ("_METADATA", "manifest.ocdbt", SIDECAR_KEY)
#: Bytes a writer lets be in flight before it waits for the oldest write.
WRITE_IN_FLIGHT_BYTES = 256 << 20
#: Whether stores are written with a CRC-32C after each chunk (the zarr3 ``crc32c``
#: codec), which reads check (docs/memory.md, "Checksums on the read path"). Off only
#: to make stores as older versions did.
WRITE_CHECKSUMS = True


def _orbax_metadata(paths: Iterable[ParamPath]) -> dict[str, Any]:
  tree = {
    str(path): {
      "key_metadata": [{"key": k, "key_type": 2} for k in path],
      "value_metadata": {"value_type": "np.ndarray", "skip_deserialize": False},
    }
    for path in sorted(paths)
  }
  return {
    "tree_metadata": tree,
    "use_ocdbt": True,
    "use_zarr3": True,
    "store_array_data_equal_to_fill_value": True,
    "custom_metadata": None,
  }


def _write_chunk(handle: ts.TensorStore, index: Any, value: np.ndarray) -> Any:
  """Starts one chunk write (a seam for tests to inject failures)."""
  return handle[index].write(value)


class StoreWriter:
  """Writes one store into a temporary sibling, put in place on `commit` (`commit.py`).

  On object stores (`memory://`, `gs://`, `s3://`) it writes a new generation under the
  path, markers (`_METADATA`, the sidecar) last, then switches the path's pointer to it
  and removes the old one (`pointers.py`): the path holds the old store or the new
  at every moment. Writes are bounded to `WRITE_IN_FLIGHT_BYTES`.
  A local writer first puts back a store a dead writer left renamed aside, and
  removes dead writers' temporaries; it refuses a store of `total` bytes that
  cannot fit in the free space. Its temporary directory is made by the first `create`
  (so a caller's ``try`` that ends in `fail` covers everything it leaves on disk).

  Every write it starts is recorded before anything can interrupt it (`commit.held`)
  and stays recorded until it has finished, so `abort` waits for each one, even one
  whose wait was interrupted, before removing what was written: nothing lands in the
  temporary (or the generation) after it is removed.
  """

  def __init__(
    self,
    path: str,
    *,
    overwrite: bool,
    progress: bool | None,
    total: int,
    desc: str,
    in_flight: int = WRITE_IN_FLIGHT_BYTES,
  ):
    self.dest = locate(path)
    if remote.driver_of(self.dest.path, local=self.dest.local is not None) == "http":
      raise errors.StoreError(
        f"Cannot write a store to {self.dest.path}: http(s) stores are read-only. Save "
        "to a local directory (or gs://, s3://) and serve that directory over HTTP."
      )
    self._limit = in_flight
    self._overwrite = overwrite
    self._total = total
    self._checksums = WRITE_CHECKSUMS
    #: Chunk writes in flight, oldest first, and their bytes; other operations in flight.
    self._pending: collections.deque[tuple[Any, int]] = collections.deque()
    self._waiting: list[Any] = []
    self._in_flight = 0
    self._paths: list[ParamPath] = []
    if self.dest.local is not None:
      ancestor = commit.existing_ancestor(self.dest.local, self.dest.path)
      commit.recover_local(self.dest.local)
      commit.remove_stale(self.dest.local)
    self._replacing = self._check_destination()
    #: The temporary directory (made by the first `create`), or the generation: what
    #: `abort` removes.
    self._tmp: str | None = None
    self._made = False
    self._generation: str | None = None
    self._free: int | None = None
    if self.dest.local is not None:
      self._free = space.check_free(self.dest.path, ancestor, total, replacing=self._replacing)
      self._tmp = commit.sibling_name(self.dest.local, commit.TMP_TAG)
      self.target = locate(self._tmp)
    else:
      self._generation = pointers.new_name()
      base = pointers.generation_base(self.dest.base, self._generation)
      self.target = dataclasses.replace(self.dest, base=base)
    self.context = store_context()
    self._ocdbt = ocdbt_spec(self.target, write=True)
    self._bar = progress_bar(total, desc=desc, progress=progress)

  def _check_destination(self) -> bool:
    """Whether a store is there (to be replaced); raises if it may not be."""
    if self.dest.local is not None:
      if not os.path.lexists(self.dest.local):
        return False
      entries = os.listdir(self.dest.local) if os.path.isdir(self.dest.local) else None
      if entries is None or (entries and not set(entries) & set(_CHECKPOINT_MARKERS)):
        raise errors.StoreError(
          f"Refusing to write a store over {self.dest.path}: it exists and is not a "
          "checkpoint directory. Choose another path or remove it yourself."
        )
      exists = True
    else:
      kv = ts.KvStore.open(self.dest.base, context=store_context()).result()
      keys = (pointers.POINTER_KEY, *_CHECKPOINT_MARKERS)
      exists = any(kv.read(k).result().state == "value" for k in keys)
    if exists and not self._overwrite:
      raise errors.StoreError(
        f"A store already exists at {self.dest.path}. Pass overwrite=True to replace "
        "it, or choose another path."
      )
    return exists

  def create(
    self, path: ParamPath, shape: tuple[int, ...], dtype: np.dtype, chunk: Sequence[int]
  ) -> ts.TensorStore:
    endian = [{"name": "bytes", "configuration": {"endian": "little"}}]
    checksum = [{"name": "crc32c"}] if self._checksums else []
    metadata = {
      "shape": list(shape),
      "data_type": ts.dtype(dtype).name,
      "chunk_grid": {
        "name": "regular",
        "configuration": {"chunk_shape": [max(1, c) for c in chunk]},
      },
      "codecs": (endian if dtype.itemsize > 1 else [{"name": "bytes"}]) + checksum,
    }
    spec = {
      "driver": "zarr3",
      "kvstore": {**self._ocdbt, "path": path_str(path) + "/"},
      "metadata": metadata,
      "store_data_equal_to_fill_value": True,
    }
    self._paths.append(path)
    self._make_target()
    try:
      return self._result(lambda: ts.open(spec, context=self.context, create=True))
    except ValueError as e:
      raise errors.StoreError(
        f"Cannot create array {path_str(path)!r} ({dtype}, {shape}): {e}"
      ) from e

  def _make_target(self) -> None:
    """Makes the temporary directory (local stores), once."""
    if self._tmp is not None and not self._made:
      assert self.dest.local is not None
      os.makedirs(os.path.dirname(self.dest.local), exist_ok=True)
      os.mkdir(self._tmp)
      self._made = True

  def _result(self, start: Any) -> Any:
    """The result of the operation ``start()`` begins; recorded while it is in flight, so
    that an interrupted wait leaves it for `abort` to wait for."""
    with commit.held():
      future = start()
      self._waiting.append(future)
    result = future.result()
    self._waiting.remove(future)
    return result

  def create_stacked(
    self,
    path: ParamPath,
    count: int,
    unit_shape: tuple[int, ...],
    dtype: np.dtype,
    *,
    per_expert: bool,
  ) -> ts.TensorStore:
    """`create` for a stack's array of ``count`` units: one chunk per unit, or (with
    ``per_expert``) per expert of a unit (docs/design.md, 5.6)."""
    chunk = (1, 1, *unit_shape[1:]) if per_expert else (1, *unit_shape)
    return self.create(path, (count, *unit_shape), dtype, chunk)

  def write_unit(
    self, handle: ts.TensorStore, i: int, unit: np.ndarray, *, per_expert: bool
  ) -> None:
    """Writes unit ``i`` of an array `create_stacked` made: one chunk, or one per expert."""
    if not per_expert:
      self.write(handle, i, unit)
      return
    for e in range(unit.shape[0]):
      self.write(handle, (i, e), unit[e])

  def write(self, handle: ts.TensorStore, index: Any, value: np.ndarray) -> None:
    # OCDBT packs the values a batch of writes commits back to back in one data
    # file. A stored value (the data and its checksum) whose size is not a
    # multiple of `mapped.ALIGNMENT` (and too big to sit inline in the index)
    # would shift every value after it off the alignment that mapped reads need,
    # so it is written alone: the writes before it land first, and it lands
    # before any write after it starts, at the start of a data file of its own.
    stored = value.nbytes + (CHECKSUM_BYTES if self._checksums else 0)
    odd = stored % mapped.ALIGNMENT and stored > OCDBT_INLINE_BYTES
    if odd:
      self._drain()
    with commit.held():  # a write started is a write recorded, for `abort` to wait for
      self._pending.append((_write_chunk(handle, index, value), value.nbytes))
    if odd:
      self._drain()
      return
    self._in_flight += value.nbytes
    while self._in_flight > self._limit and len(self._pending) > 1:
      self._wait_oldest()

  def _wait_oldest(self) -> None:
    future, nbytes = self._pending[0]
    future.result()  # an interrupt here leaves the write recorded, in flight
    self._pending.popleft()
    self._in_flight -= nbytes
    self._bar.update(nbytes)

  def _drain(self) -> None:
    while self._pending:
      self._wait_oldest()

  def commit(
    self,
    *,
    stacks: Sequence[tuple[ParamPath, int]],
    extra: Mapping[str, Any] | None = None,
    quantization: Mapping[str, Any] | None = None,
    experts: Mapping[ParamPath, tuple[list[list[str]], int]] | None = None,
  ) -> None:
    """Writes the markers and puts the store in place; ``quantization`` is the sidecar's
    record of the tensors held quantized (`plan.quantized.QuantPlan.to_dict`), ``experts``
    each stack's expert paths and count, where its experts are chunks of their own."""
    self._make_target()
    self._drain()
    kv = self._result(lambda: ts.KvStore.open(self.target.base, context=self.context))
    sidecar: dict[str, Any] = {
      "format": FORMAT_NAME,
      "format_version": PLAIN_FORMAT_VERSION if quantization is None else FORMAT_VERSION,
      # The first stack as single-stack readers read it; "stacks" lists them all.
      "unit_prefix": list(stacks[0][0]),
      "unit_count": stacks[0][1],
      "stacks": [{"prefix": list(p), "count": n} for p, n in stacks],
    }
    for entry, (prefix, _) in zip(sidecar["stacks"], stacks, strict=True):
      if experts and prefix in experts:
        paths, count = experts[prefix]
        entry["experts"] = {"paths": paths, "count": count}
    if quantization is not None:
      sidecar["quantization"] = dict(quantization)
    for key, value in (
      *(extra or {}).items(),
      ("_METADATA", _orbax_metadata(self._paths)),
      (SIDECAR_KEY, sidecar),
      ("commit_success.txt", f"Checkpoint commit was successful to {self.dest.path}"),
    ):
      text = value if isinstance(value, str) else json.dumps(value, indent=1)
      self._result(lambda key=key, text=text: kv.write(key, text.encode()))
    self._bar.close()
    if self._generation is not None:
      self._switch(self._generation)
      return
    assert self._tmp is not None and self.dest.local is not None
    with commit.held():  # in place and no longer ours to remove, as one step
      commit.put_in_place(self._tmp, self.dest.local)
      self._tmp = None

  def _switch(self, name: str) -> None:
    """Points the object store's path at the generation just written, then removes the
    others (a failure there leaves garbage the next save removes, not a failed save)."""
    root = self._result(lambda: ts.KvStore.open(self.dest.base, context=self.context))
    # One step: a switch whose wait was cut might land after `abort` removed its
    # generation, and the old generation is removed before an interrupt stops the save.
    with commit.held():
      pointers.switch(root, name)
      self._generation = None  # in place: nothing for `abort` to remove
      try:
        pointers.remove_others(root, keep=name)
      except ValueError as e:
        warnings.warn(
          f"The store at {self.dest.path} was written, but removing its old generation "
          f"failed ({e}); the next save to that path removes it.",
          stacklevel=3,
        )

  def abort(self) -> None:
    """Waits for every write and operation in flight (each one this writer started), then
    removes everything written. Runs `commit.held`: an interrupt meanwhile is raised once
    it is done."""
    with commit.held():
      self._abort()

  def _abort(self) -> None:
    for future in [f for f, _ in self._pending] + self._waiting:
      try:
        future.result()
      except Exception:  # noqa: BLE001 - the original error is what matters.
        pass
    self._pending.clear()
    self._waiting.clear()
    self._bar.close()
    if self._tmp is not None:
      shutil.rmtree(self._tmp, ignore_errors=True)
      self._tmp = None
    elif self._generation is not None:  # the path still names the old store, if any
      try:
        root = ts.KvStore.open(self.dest.base, context=store_context()).result()
        pointers.remove_generation(root, self._generation)
      except ValueError:  # the next save removes what is left
        pass
      self._generation = None

  def fail(self, error: BaseException) -> errors.StoreError | None:
    """Aborts after `error`; returns the error to raise instead (a full disk), if any."""
    self.abort()
    if not space.is_disk_full(error):
      return None
    return space.disk_full_error(self.dest.path, self._total, self._free, replaced=self._replacing)


def _chunk_regions(shape: tuple[int, ...], chunk: tuple[int, ...]) -> list[tuple[slice, ...]]:
  """The regions of a ``chunk``-chunked array of ``shape``; ``[()]`` for one chunk."""
  if chunk == shape:
    return [()]
  grids = [range(0, n, c) for n, c in zip(shape, chunk, strict=True)]
  return [
    tuple(slice(o, min(o + c, n)) for o, c, n in zip(origin, chunk, shape, strict=True))
    for origin in itertools.product(*grids)
  ]


def _native(value: Any, dtype: np.dtype) -> np.ndarray:
  return np.asarray(np.asarray(value), dtype=dtype, order="C")


def save_store(
  path: str,
  *,
  static: Mapping[tuple[str, ...], ArrayLike],
  units: Mapping[tuple[str, ...], ArrayLike] | None = None,
  unit_prefix: tuple[str, ...] | None = None,
  stacks: Mapping[tuple[str, ...], Mapping[tuple[str, ...], ArrayLike]] | None = None,
  progress: bool | None = None,
  overwrite: bool = False,
  in_flight_bytes: int = WRITE_IN_FLIGHT_BYTES,
  extra: Mapping[str, Any] | None = None,
  desc: str = "save_store",
  quantization: QuantPlan | None = None,
  experts: Sequence[ParamPath | str] = (),
) -> StoreInfo:
  """Writes a streamable, Orbax-compatible store.

  Local paths are written into a temporary sibling directory and put in place
  when complete, so a failed save leaves nothing behind (and a failed overwrite
  leaves the old store intact); after a crash the path holds the old store or
  the new one, and the next save removes what the crashed one left (see
  `commit.py`). Other kvstores (`memory://`, `gs://`...)
  are written in place, Orbax's `_METADATA` and the sidecar last; there,
  `overwrite` deletes the old store first and a failed save deletes what it wrote.
  Path components are converted with `str()`.

  Args:
    path: Local directory or TensorStore kvstore URL of the checkpoint.
    static: Full path -> array, for parameters that are not per unit.
    units: Path relative to `unit_prefix` -> array stacked on axis 0 (leading
      dimension = unit count, equal for all).
    unit_prefix: Path of the unit subtree, e.g. `("params", "layers")`.
    stacks: Instead of `units` and `unit_prefix`, several layer stacks: each
      stack's prefix -> its `units`, in the order the model runs them.
    progress: Show a progress bar over bytes written; None shows it when stderr
      is a terminal.
    overwrite: Replace an existing store at `path`.
    in_flight_bytes: Bytes of chunk writes in flight before a write waits for
      the oldest (with lazy arrays, what bounds the host memory a save holds).
    extra: More files to write into the store with it (name -> JSON value or
      str), e.g. the model's config; written before the markers.
    desc: The progress bar's label.
    quantization: The tensors the arrays hold quantized, as their parts
      (`plan.quantized.quantized_split`), recorded in the sidecar.
    experts: Paths, relative to a unit, of the modules whose arrays are stacked per
      expert (``(units, experts, ...)``): each expert of each unit is written as a
      chunk of its own and can be read alone (docs/design.md, 5.6).

  Arrays may be lazy: anything with ``shape``, ``dtype`` and ``__getitem__``
  (a unit array is indexed one unit at a time) and ``__array__`` (a static one
  is read whole), so a converter can hand over tensors it reads only when
  written.

  Returns:
    A `StoreInfo` describing what was written.

  Raises:
    StoreError: `path` holds a store and `overwrite` is False; units disagree on
      their count; paths collide as Orbax names; a dtype is unsupported; a file
      is in the way of `path`; or the disk is full (checked before writing, and
      reported with the bytes needed if it fills up while writing).
  """
  static_arrays, laid_out = layout.lay_out(
    static, layout.stacks_argument(units, unit_prefix, stacks)
  )
  expert_paths = [tuple(e.split(".")) if isinstance(e, str) else as_path(e) for e in experts]
  per_expert, expert_counts = layout.expert_arrays(laid_out, expert_paths)
  full = {
    **static_arrays,
    **{prefix + p: a for prefix, arrays, _ in laid_out for p, a in arrays.items()},
  }
  checks.check_save_paths(full, tuple(prefix for prefix, _, _ in laid_out))
  dtypes = {p: np.dtype(a.dtype).newbyteorder("=") for p, a in full.items()}
  unit_nbytes = {
    prefix: sum(tensor_nbytes(a.shape[1:], dtypes[prefix + p]) for p, a in arrays.items())
    for prefix, arrays, _ in laid_out
  }
  static_nbytes = sum(tensor_nbytes(a.shape, dtypes[p]) for p, a in static_arrays.items())
  with commit.terminations_raise():  # SIGTERM, as SIGINT, removes the temporary store
    writer = StoreWriter(
      path,
      overwrite=overwrite,
      progress=progress,
      total=sum(unit_nbytes[p] * n for p, _, n in laid_out) + static_nbytes,
      desc=desc,
      in_flight=in_flight_bytes,
    )
    try:
      _write_static(writer, static_arrays, dtypes)
      _write_stacks(writer, laid_out, dtypes, per_expert)
      writer.commit(
        stacks=[(prefix, count) for prefix, _, count in laid_out],
        experts={
          prefix: ([list(e) for e in expert_paths], n) for prefix, n in expert_counts.items()
        },
        extra=extra,
        quantization=None if quantization is None else quantization.to_dict(),
      )
    except BaseException as e:
      if (disk_full := writer.fail(e)) is not None:
        raise disk_full from e
      raise
  return StoreInfo(
    path=path,
    unit_prefix=laid_out[0][0],
    unit_count=sum(n for _, _, n in laid_out),
    unit_nbytes=max(unit_nbytes.values()),
    static_nbytes=static_nbytes,
    stacks=tuple(StackInfo(p, n, unit_nbytes[p], expert_counts.get(p, 0)) for p, _, n in laid_out),
    format_version=PLAIN_FORMAT_VERSION if quantization is None else FORMAT_VERSION,
    quantization=quantization,
  )


def _write_static(
  writer: StoreWriter, static_arrays: Mapping[ParamPath, Any], dtypes: Mapping[ParamPath, Any]
) -> None:
  """Writes each static array whole, or in the chunks a lazy array asks for (a converter
  writing a large tensor in pieces; each chunk is then read and written on its own)."""
  for p, a in sorted(static_arrays.items()):
    chunk = tuple(getattr(a, "chunk_shape", None) or a.shape)
    handle = writer.create(p, tuple(a.shape), dtypes[p], chunk)
    for region in _chunk_regions(tuple(a.shape), chunk):
      writer.write(handle, region, _native(a[region] if region else a, dtypes[p]))


def _write_stacks(
  writer: StoreWriter,
  laid_out: Sequence[layout.LaidOut],
  dtypes: Mapping[ParamPath, Any],
  experts: Mapping[ParamPath, frozenset[ParamPath]],
) -> None:
  """Writes every stack one unit at a time: one chunk per unit of each array, and of an
  expert array (``experts``: each stack's) one chunk per expert of each unit."""
  for prefix, arrays, count in laid_out:
    split = experts.get(prefix, frozenset())
    handles = {
      p: writer.create_stacked(
        prefix + p, count, tuple(a.shape[1:]), dtypes[prefix + p], per_expert=p in split
      )
      for p, a in sorted(arrays.items())
    }
    for i in range(count):
      for p, a in sorted(arrays.items()):
        unit = _native(a[i], dtypes[prefix + p])
        writer.write_unit(handles[p], i, unit, per_expert=p in split)
