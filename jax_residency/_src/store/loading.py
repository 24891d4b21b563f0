"""Opening a unit store for a model, and reading a model's weights from it.

A dense stream keeps the store open and reads units on demand; the other
policies read every weight once at placement, so a model saved with
:func:`jax_residency.save` can be placed under any policy from its abstract
(``nnx.eval_shape``) form without materialising its weights twice.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import tensorstore as ts
import tqdm

from jax_residency._src.placement.split import SplitModel
from jax_residency._src.policy.errors import StoreError
from jax_residency._src.policy.reads import ReadOptions
from jax_residency._src.store import checkpoints, checks, commit, discovery, handles, remote
from jax_residency._src.store.discovery import SIDECAR_KEY
from jax_residency._src.store.remote import FetchCounter
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.typing import ParamPath, path_str


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
    loc = discovery.locate(checkpoints.resolve(discovery.locate(path).path), reads)
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
    require_unit_chunks=False,  # chunks of several units are read whole (see `read_all`)
  )
  try:
    check_for(split, store, strict=strict)
  except BaseException:
    store.close()
    raise
  return store


def stacks_in(path: str, reads: ReadOptions | None = None) -> list[ParamPath]:
  """The stacks a store records (leaf-path prefixes, in order; only its metadata is
  read); empty for a plain Orbax checkpoint.

  Raises:
    StoreNotFoundError, StoreError: as `UnitStore.open`.
  """
  loc = discovery.locate(checkpoints.resolve(path), reads)
  if loc.local is not None:  # a save that died between its two renames
    commit.recover_local(loc.local)
  context = handles.store_context(reads=loc.reads)
  found = discovery.discover(loc, context, sidecar_key=SIDECAR_KEY)
  return checks.recorded_stacks(found)


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


def read_all(split: SplitModel, store: UnitStore, *, progress: bool | None = None) -> list[Any]:
  """Every leaf of ``split`` read from ``store``, in leaf order (units stacked).

  Units are read one at a time (two in flight) into one stacked buffer per
  tensor, so host memory peaks at the model's size plus two units. A store whose
  chunks span several units (an Orbax checkpoint) is read array by array
  instead, each decoded once: the model's size plus one array's chunk.
  """
  static = store.read_static()
  values: list[Any] = [None] * len(split.leaves)
  for i in split.static_index:
    values[i] = static[split.leaves[i].path]
  stacks = {i: np.empty(split.leaves[i].shape, split.leaves[i].dtype) for i in split.unit_index}
  owner = {s.offset + u: s for s in split.stacks for u in range(s.count)}
  rel = {i: split.unit_rel_path(split.leaves[i]) for i in split.unit_index}
  if not store.chunked_per_unit:
    for stack in split.stacks:
      for i in stack.index:
        values[i] = _read_whole(store, stack.path_prefix + rel[i], stacks.pop(i))
    return values
  bar = tqdm.tqdm(
    total=split.unit_count,
    desc="reading units",
    unit="unit",
    disable=None if progress is None else not progress,  # None: only on a terminal
    leave=False,
  )
  with bar:
    for u, tensors in store.read_units(range(split.unit_count)):
      stack = owner[u]
      for i in stack.index:
        stacks[i][u - stack.offset] = tensors[rel[i]]
      bar.update(1)
  for i in split.unit_index:
    values[i] = stacks.pop(i)
  return values


def _read_whole(store: UnitStore, path: ParamPath, out: np.ndarray) -> np.ndarray:
  """Reads the stored array at ``path`` (all its units) into ``out``."""
  write = ts.array(out, copy=False, write=True).write(store.array_handle(path))
  remote.wait(write, store.read_options, store.path, f"array {path_str(path)!r}")
  return out
