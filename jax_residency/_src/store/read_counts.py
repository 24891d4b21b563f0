"""What a store has read: the counting half of `UnitStore` (which sets ``_mappers``,
``_pool``, ``_local``, ``_fetched`` and ``_infos``), as `StackLayout` is its
description half."""

from __future__ import annotations

from typing import Any

from jax_residency._src.store.buffers import BufferPool
from jax_residency._src.store.mapped import UnitMapper
from jax_residency._src.store.remote import FetchCounter
from jax_residency._src.store.stored_stack import LocalFetches
from jax_residency._src.typing import ParamPath


class ReadCounts:
  """Bytes read, mapped, fetched and buffered by a store since it opened."""

  _mappers: list[UnitMapper]
  _pool: BufferPool
  _local: LocalFetches | None
  _fetched: FetchCounter
  _infos: dict[ParamPath, Any]

  @property
  def advised_bytes(self) -> int:
    """Chunk bytes found out of the page cache and read ahead (`advise_unit`) or faulted
    in (mapped reads of their own chunks) since the store opened."""
    return sum(m.advised_bytes for m in self._mappers)

  @property
  def mapped_bytes_total(self) -> int:
    """Tensor bytes that reads have mapped instead of copied, since the store opened."""
    return sum(m.total_bytes for m in self._mappers)

  @property
  def own_read_bytes(self) -> int:
    """Bytes the store counted itself: what mapped and direct reads took from its
    files and, for a local store, what reads through TensorStore fetched (whose own
    counter misses memory-mapped reads; see `LocalFetches`)."""
    local = self._local.total if self._local is not None else 0
    return local + sum(m.total_bytes + m.direct_bytes for m in self._mappers)

  def _count(self, path: ParamPath, unit: int | None) -> None:
    if self._local is not None:
      self._local.count(self._infos[path], unit)

  @property
  def fetched_bytes_total(self) -> int:
    """Bytes fetched from the store's storage since it was opened (metadata included):
    what TensorStore's counter for its kind of storage counted (process-wide, see
    `remote.FetchCounter`) plus `own_read_bytes`."""
    return self._fetched.total() + self.own_read_bytes

  @property
  def buffer_bytes(self) -> int:
    """Bytes of unit buffers alive now (arrays returned by reads and not yet freed),
    mapped chunk ranges included."""
    return self._pool.leased_bytes + sum(m.mapped_bytes for m in self._mappers)

  @property
  def buffer_peak_bytes(self) -> int:
    """Most bytes of unit buffers, live and idle, and mapped chunk ranges held at once
    since `reset_buffer_peak`."""
    return self._pool.peak_bytes

  def retire_mapped(self, arrays: Any) -> int:
    """Unmaps the pages of mapped unit arrays whose last step has completed, before the
    arrays themselves go (`mapped.UnitMapper.retire`); returns the bytes retired."""
    return sum(m.retire(arrays) for m in self._mappers)

  def reset_buffer_peak(self) -> None:
    """Starts `buffer_peak_bytes` over from the buffers held now."""
    self._pool.reset_peak()
