"""One layer stack of an open store: its unit arrays, and how a unit id finds it.

A store holds one or more stacks (``jax_residency.json`` records them, in the
model's forward order). Their units are numbered one after another: the first
stack's units are ``0 .. n0 - 1``, the next stack's start at ``n0``, and so on,
so a stream addresses any unit of any stack with one int (`locate`).
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jax_residency._src import errors
from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.store import discovery, mapped
from jax_residency._src.store.buffers import buffer_layout, padded_nbytes
from jax_residency._src.store.discovery import FORMAT_VERSION, PLAIN_FORMAT_VERSION
from jax_residency._src.store.info import StackInfo, StoreInfo
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
  def experts(self) -> int:
    """How many experts each unit holds as chunks of their own (`per_expert`); 0 if none."""
    return max((a.shape[1] for a in self.arrays.values() if per_expert(a)), default=0)

  @property
  def shared(self) -> frozenset[ParamPath]:
    """Its tensors whose chunks hold several units: reading one unit decodes them all."""
    return frozenset(rel for rel, a in self.arrays.items() if min(a.read_chunk[0], self.count) > 1)

  @property
  def read_nbytes(self) -> int:
    """Bytes a read of one unit decodes: each tensor's chunks that hold the unit."""
    return sum(
      min(a.read_chunk[0], self.count) * tensor_nbytes(a.shape[1:], a.dtype)
      for a in self.arrays.values()
    )

  @property
  def largest_shared_chunk(self) -> int:
    """Bytes of its largest chunk that holds several units (decoded), 0 if none."""
    return max(
      (
        tensor_nbytes(tuple(min(c, d) for c, d in zip(a.read_chunk, a.shape, strict=True)), a.dtype)
        for rel, a in self.arrays.items()
        if rel in self.shared
      ),
      default=0,
    )

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
      rel: (a.stored_name, a.shape[1:], a.dtype, 0 if one else a.shape[1])
      for rel, a in units.items()
      if a.raw and ((one := a.read_chunk == (1, *a.shape[1:])) or per_expert(a))
    }
    mapper = None
    if local and raw and use_ocdbt:
      mapper = mapped.UnitMapper(local, use_ocdbt=use_ocdbt, tensors=raw)
    nbytes = sum(padded_nbytes(shape, dtype) for _, shape, dtype, _ in raw.values())
    out.append(StoredStack(prefix, count, offset, units, mapper, nbytes))
    offset += count
  static = {p: a for p, a in sorted(arrays.items()) if p not in claimed}
  return out, static


def per_expert(a: discovery.ArrayInfo) -> bool:
  """Whether a unit array is stored one chunk per expert: ``(1, 1, ...)`` chunks of a
  ``(units, experts, ...)`` array with more than one expert (docs/design.md, 5.6)."""
  return len(a.shape) >= 3 and a.shape[1] > 1 and a.read_chunk == (1, 1, *a.shape[2:])


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


class StoreLayout:
  """What a store's stacks and static arrays are, from its metadata: a part `UnitStore`
  holds (its layout).

  Args:
    path: the store's path, as its `StoreInfo` names it.
    stacks: the stacks, in the model's forward order (`split_stacks`).
    static: the static arrays, by full path.
    quantization: the tensors the store holds quantized (its sidecar's record), or None.
  """

  def __init__(
    self,
    path: str,
    stacks: Sequence[StoredStack],
    static: Mapping[ParamPath, discovery.ArrayInfo],
    quantization: QuantPlan | None = None,
  ) -> None:
    self.path = path
    self._stacks = list(stacks)
    self._static = dict(static)
    self._unit_count = sum(s.count for s in self._stacks)
    self.quantization = quantization

  @property
  def unit_prefix(self) -> ParamPath:
    """The (first) stack's path."""
    return self._stacks[0].prefix

  @property
  def info(self) -> StoreInfo:
    return StoreInfo(
      path=self.path,
      unit_prefix=self.unit_prefix,
      unit_count=self._unit_count,
      unit_nbytes=self.unit_nbytes,
      static_nbytes=self.static_nbytes,
      stacks=self.stacks,
      format_version=PLAIN_FORMAT_VERSION if self.quantization is None else FORMAT_VERSION,
      quantization=self.quantization,
    )

  @property
  def stored_stacks(self) -> tuple[StoredStack, ...]:
    """Every stack opened, with its arrays' chunking (`StoredStack`)."""
    return tuple(self._stacks)

  @property
  def stacks(self) -> tuple[StackInfo, ...]:
    """Every stack opened, in order; unit ids run through them one after another."""
    return tuple(StackInfo(s.prefix, s.count, s.unit_nbytes, s.experts) for s in self._stacks)

  @property
  def unit_count(self) -> int:
    """Units over all stacks."""
    return self._unit_count

  @property
  def unit_specs(self) -> dict[ParamPath, TensorSpec]:
    """The (first) stack's unit tensors, keyed by path relative to `unit_prefix`:
    (per-unit shape, dtype). See `stack_specs` for the others."""
    return self._stacks[0].specs

  def stack_specs(self, k: int) -> dict[ParamPath, TensorSpec]:
    """Stack ``k``'s unit tensors, keyed by path relative to its prefix."""
    return self._stacks[k].specs

  @property
  def static_specs(self) -> dict[ParamPath, TensorSpec]:
    """Static tensors, keyed by full path: (shape, dtype)."""
    return {p: (a.shape, a.dtype) for p, a in self._static.items()}

  @property
  def unit_nbytes(self) -> int:
    """Bytes of one unit (of the largest, with several stacks)."""
    return max(s.unit_nbytes for s in self._stacks)

  @property
  def total_unit_bytes(self) -> int:
    return sum(s.unit_nbytes * s.count for s in self._stacks)

  @property
  def static_nbytes(self) -> int:
    return sum(tensor_nbytes(a.shape, a.dtype) for a in self._static.values())

  @property
  def chunked_per_unit(self) -> bool:
    """Whether every unit array holds at most one unit per chunk (streamable)."""
    return all(a.read_chunk[:1] == (1,) for s in self._stacks for a in s.arrays.values())

  @property
  def bytes_read_per_byte_used(self) -> float:
    """Bytes a pass over every unit decodes for each unit byte it uses: 1.0 when each
    chunk holds one unit, more when chunks span several (`jax-residency rechunk`)."""
    used = sum(s.unit_nbytes * s.count for s in self._stacks)
    return sum(s.read_nbytes * s.count for s in self._stacks) / used if used else 1.0

  @property
  def largest_shared_chunk(self) -> int:
    """Bytes of the largest chunk that holds several units (decoded whole to read one
    of them; one such decode runs at a time); 0 when every chunk holds one unit."""
    return max(s.largest_shared_chunk for s in self._stacks)

  @property
  def compressed(self) -> bool:
    """Whether any unit array is compressed (slower reads; `rechunk_store` drops it)."""
    return any(a.compressed for s in self._stacks for a in s.arrays.values())


class LocalFetches:
  """Bytes reads through TensorStore fetch from a local store's files, counted here
  from the OCDBT index: TensorStore's own file counter misses memory-mapped reads.

  Each read counts the stored (possibly compressed) bytes of the chunks it must
  fetch; a chunk the index keeps inline, or a store without OCDBT, counts its
  decoded bytes. Thread-safe; the index is read on the first count.
  """

  def __init__(self, root: str, *, use_ocdbt: bool):
    self._root, self._use_ocdbt = root, use_ocdbt
    self._sizes: dict[str, dict[int, int]] | None = None
    self._lock = threading.Lock()
    self.total = 0

  def _table(self) -> dict[str, dict[int, int]]:
    """Stored bytes per array name, per chunk index along axis 0."""
    if self._sizes is None:
      sizes: dict[str, dict[int, int]] = {}
      extents = mapped.ocdbt_extents(self._root) if self._use_ocdbt else {}
      for key, extent in extents.items():
        name, _, rest = key.partition("/")
        first = re.split(r"[./]", rest.removeprefix("c/"), maxsplit=1)[0]
        if first.isdigit():
          row = sizes.setdefault(name, {})
          row[int(first)] = row.get(int(first), 0) + extent.length
      self._sizes = sizes
    return self._sizes

  def count(self, info: discovery.ArrayInfo, unit: int | None) -> None:
    """Counts a read of unit ``unit`` of the array ``info`` (None: all of it)."""
    with self._lock:
      row = self._table().get(info.stored_name)
      if row:
        if unit is None:
          self.total += sum(row.values())
        else:
          self.total += row.get(unit // info.read_chunk[0], 0)
      elif unit is None or not info.shape:
        self.total += tensor_nbytes(info.shape, info.dtype)
      else:
        self.total += min(info.read_chunk[0], info.shape[0]) * tensor_nbytes(
          info.shape[1:], info.dtype
        )


def failed_unit(text: str, info: discovery.ArrayInfo, stacks: Sequence[StoredStack]) -> int | None:
  """The unit whose chunk a failed read of the whole array ``info`` names in
  TensorStore's ``text`` (``Error reading "<array>/c/2/0/0"``): the chunk's first
  unit, as a store-wide id; None for a static array, or if no chunk is named."""
  stack = next((s for s in stacks if info.path[: len(s.prefix)] == s.prefix), None)
  match = re.search(re.escape(info.stored_name) + r"/(?:c/)?(\d+)", text)
  if stack is None or match is None:
    return None
  return stack.offset + int(match.group(1)) * info.read_chunk[0]
