"""Opening a unit store for a model, and reading a model's weights from it.

A dense stream keeps the store open and reads units on demand; the other
policies read every weight once at placement, so a model saved with
:func:`jax_residency.save` can be placed under any policy from its abstract
(``nnx.eval_shape``) form without materialising its weights twice.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from jax_residency._src.errors import StoreError
from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.report.progress import progress_bar
from jax_residency._src.store import (
  checkpoints,
  checks,
  commit,
  discovery,
  handles,
  locations,
  pointers,
)
from jax_residency._src.store.discovery import SIDECAR_KEY
from jax_residency._src.store.read_options import ReadOptions
from jax_residency._src.store.remote import FetchCounter
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StoreSource:
  """The store a placement reads: its path, how its reads retry and time out, and a
  count of the bytes fetched from it since the placement began."""

  path: str
  reads: ReadOptions
  fetched: FetchCounter

  @classmethod
  def of(cls, path: str | os.PathLike[str], reads: ReadOptions | None = None) -> StoreSource:
    """Raises `StoreError` for a path or ``reads`` of the wrong type. A
    ``CheckpointManager`` directory stands for its latest step's checkpoint."""
    loc = locations.locate(checkpoints.resolve(locations.locate(path).path), reads)
    return cls(loc.path, loc.reads, FetchCounter(loc.path, local=loc.local is not None))


def open_for(
  split: SplitModel, source: StoreSource, *, strict: bool, max_cached_shards: int
) -> UnitStore:
  """Opens ``source`` with ``split``'s stacks and checks it holds exactly what ``split`` expects.

  Raises:
    StoreNotFoundError: nothing at ``path``.
    StoreError: the store records other stacks than ``split``'s (the message
      names both), or a stack's unit count differs.
    MissingCheckpointParametersError, CheckpointShapeMismatchError,
    UnexpectedCheckpointParametersError: one error listing every bad path.
  """
  store = UnitStore.open(
    source.path,
    stacks=[s.path_prefix for s in split.stacks],
    max_cached_shards=max_cached_shards,
    read_options=source.reads,
    require_unit_chunks=False,  # a chunk of several units is decoded whole to read one
    require_recorded=True,
  )
  try:
    check_for(split, store, strict=strict)
  except BaseException:
    store.close()
    raise
  return store


def recorded_in(
  path: str, reads: ReadOptions | None = None
) -> tuple[list[ParamPath], QuantPlan | None]:
  """The stacks a store records (leaf-path prefixes, in order; empty for a plain Orbax
  checkpoint) and the tensors it holds quantized (None for a float store). Only its
  metadata is read.

  Raises:
    StoreNotFoundError, StoreError: as `UnitStore.open`.
  """
  loc = locations.locate(checkpoints.resolve(path), reads)
  if loc.local is not None:  # a save that died between its two renames
    commit.recover_local(loc.local)
  context = handles.store_context(reads=loc.reads)
  loc = pointers.follow(loc, context)  # an object store's current generation
  found = discovery.discover_checked(loc.path, loc, context, sidecar_key=SIDECAR_KEY)
  return checks.recorded_stacks(found), checks.recorded_quantization(found, loc.path)


def check_for(split: SplitModel, store: UnitStore, *, strict: bool) -> None:
  """Checks an open ``store`` holds exactly the tensors ``split`` expects (see `open_for`)."""
  store.check_against(
    None,
    {leaf.path: (leaf.shape, leaf.dtype) for leaf in split.static_leaves()},
    strict=strict,
    expected_stacks=[
      {split.unit_rel_path(leaf): (leaf.shape[1:], leaf.dtype) for leaf in split.stack_leaves(s)}
      for s in split.stacks
    ],
  )
  for stack, stored in zip(split.stacks, store.stacks, strict=True):
    if stored.count != stack.count:
      raise StoreError(
        f"the store at {store.path!r} holds {stored.count} units of {stack.name!r} but the "
        f"model has {stack.count}; save this model again with jax_residency.save"
      )


def read_all(
  split: SplitModel,
  store: UnitStore,
  *,
  place: Callable[[int, np.ndarray], Any] = lambda i, value: value,
  progress: bool | None = None,
) -> list[Any]:
  """Every leaf of ``split`` read from ``store``, in leaf order (units stacked), each
  passed through ``place(leaf_index, array)`` as soon as it is read.

  One stored array at a time: it is read whole (each chunk decoded once, also
  where a chunk holds several units) and handed to ``place``, which should
  return once the array is where it belongs (e.g. ``jax.device_put`` waited
  on), so that host memory holds the placed leaves plus one array in transit,
  TensorStore's buffers of its chunks and, for a chunk of several units, its
  decode: `transit_bytes`.
  """
  values: list[Any] = [None] * len(split.leaves)
  total = sum(leaf.nbytes for leaf in split.leaves)
  bar = progress_bar(total, desc="reading weights", progress=progress, leave=False)
  with bar:
    for i, leaf in enumerate(split.leaves):
      values[i] = place(i, store.read_array(leaf.path, np.empty(leaf.shape, leaf.dtype)))
      bar.update(leaf.nbytes)
  return values


def transit_bytes(split: SplitModel, store: UnitStore) -> int:
  """Host bytes `read_all` holds besides what it has placed: the largest array in
  transit, TensorStore's buffers of that array's chunks while it copies them in
  (up to the array's bytes again: it reads chunks concurrently), and the decode of
  a chunk of several units (TensorStore decodes it into its own buffer, then
  copies it). Measured: reading a 100 MiB stacked kernel of four 25 MiB chunks
  grew the process's RSS by 126-152 MiB (`tests/test_memory_plan.py` checks a
  whole placement against its plan)."""
  largest = max((leaf.nbytes for leaf in split.leaves), default=0)
  return 2 * largest + store.largest_shared_chunk
