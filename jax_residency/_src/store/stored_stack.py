"""One layer stack of an open store: its unit arrays, and how a unit id finds it.

A store holds one or more stacks (``jax_residency.json`` records them, in the
model's forward order). Their units are numbered one after another: the first
stack's units are ``0 .. n0 - 1``, the next stack's start at ``n0``, and so on,
so a stream addresses any unit of any stack with one int (`locate`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_residency._src.policy import errors
from jax_residency._src.store import discovery, mapped
from jax_residency._src.store.buffers import buffer_layout, padded_nbytes
from jax_residency._src.typing import ParamPath, TensorSpec, path_str, tensor_nbytes


@dataclasses.dataclass
class StoredStack:
  """A stack of an open store.

  Attributes:
    prefix: its path in the store.
    count: its units.
    offset: the id of its first unit.
    arrays: its unit arrays, keyed by path relative to ``prefix``.
    mapper: maps its raw local chunks (``mapped.UnitMapper``), if any can be.
    mapped_unit_bytes: bytes one mapped read of a unit maps.
  """

  prefix: ParamPath
  count: int
  offset: int
  arrays: dict[ParamPath, discovery.ArrayInfo]
  mapper: mapped.UnitMapper | None = None
  mapped_unit_bytes: int = 0

  @property
  def specs(self) -> dict[ParamPath, TensorSpec]:
    """(per-unit shape, dtype) of each unit tensor, keyed relative to ``prefix``."""
    return {p: (a.shape[1:], a.dtype) for p, a in self.arrays.items()}

  @property
  def unit_nbytes(self) -> int:
    return sum(tensor_nbytes(a.shape[1:], a.dtype) for a in self.arrays.values())

  @property
  def slab_nbytes(self) -> int:
    """Bytes of one unit's read buffer (each tensor rounded up to a page)."""
    return buffer_layout([(path_str(p), a.shape[1:], a.dtype) for p, a in self.arrays.items()])[1]


def split_stacks(
  arrays: Mapping[ParamPath, discovery.ArrayInfo],
  stacks: Sequence[tuple[ParamPath, int]],
  *,
  local: str | None,
  use_ocdbt: bool,
) -> tuple[list[StoredStack], dict[ParamPath, discovery.ArrayInfo]]:
  """A store's arrays as its stacks and its static arrays (those under no stack)."""
  out: list[StoredStack] = []
  offset = 0
  claimed: set[ParamPath] = set()
  for prefix, count in stacks:
    n = len(prefix)
    units = {p[n:]: a for p, a in sorted(arrays.items()) if p[:n] == prefix and len(p) > n}
    claimed.update(prefix + rel for rel in units)
    # Unit chunks stored raw in local files: read straight into the unit's buffer
    # (`mapped.UnitMapper.read_into`), or mapped once mapped reads are on.
    raw = {
      rel: (path_str(prefix + rel), a.shape[1:], a.dtype)
      for rel, a in units.items()
      if a.raw and a.read_chunk == (1, *a.shape[1:])
    }
    mapper = None
    if local and raw and use_ocdbt:
      mapper = mapped.UnitMapper(local, use_ocdbt=use_ocdbt, tensors=raw)
    nbytes = sum(padded_nbytes(shape, dtype) for _, shape, dtype in raw.values())
    out.append(StoredStack(prefix, count, offset, units, mapper, nbytes))
    offset += count
  static = {p: a for p, a in sorted(arrays.items()) if p not in claimed}
  return out, static


def locate(stacks: Sequence[StoredStack], i: Any, path: str) -> tuple[StoredStack, int]:
  """The stack unit id ``i`` lies in, and its index there.

  Raises:
    StoreError: ``i`` is not an id of a unit the store holds.
  """
  total = sum(s.count for s in stacks)
  if isinstance(i, int | np.integer) and not isinstance(i, bool) and 0 <= i < total:
    for s in stacks:
      if i < s.offset + s.count:
        return s, int(i) - s.offset
  raise errors.StoreError(
    f"Unit index {i!r} is out of range for {path}, which holds {total} units; use 0 <= i < {total}."
  )
