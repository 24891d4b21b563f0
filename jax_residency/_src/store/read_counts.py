"""What a store has read since it opened: a part `UnitStore` holds (its counters)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jax_residency._src.store import discovery
from jax_residency._src.store.buffers import BufferPool
from jax_residency._src.store.mapped import UnitMapper
from jax_residency._src.store.remote import FetchCounter
from jax_residency._src.store.stored_stack import LocalFetches
from jax_residency._src.store.unit_reader import ReadCounters
from jax_residency._src.typing import ParamPath


class ReadCounts:
  """Bytes read, mapped, fetched and buffered by a store since it opened.

  Args:
    mappers: the store's raw-chunk mappers (`mapped.UnitMapper`), one per local stack.
    pool: the store's read buffers.
    local: counts reads through TensorStore of a local store's files (None: remote).
    fetched: TensorStore's counter for the store's kind of storage.
    infos: every array of the store, by path.
  """

  def __init__(
    self,
    mappers: Sequence[UnitMapper],
    pool: BufferPool,
    local: LocalFetches | None,
    fetched: FetchCounter,
    infos: Mapping[ParamPath, discovery.ArrayInfo],
  ) -> None:
    self._mappers, self._pool, self._local = list(mappers), pool, local
    self._fetched, self._infos = fetched, dict(infos)

  def count(self, path: ParamPath, unit: int | None) -> None:
    """Counts a read through TensorStore of unit ``unit`` of the array at ``path``
    (None: all of it)."""
    if self._local is not None:
      self._local.count(self._infos[path], unit)

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
    since the pool's peak was last reset."""
    return self._pool.peak_bytes

  def snapshot(self) -> ReadCounters:
    """Every counter now, as one record."""
    return ReadCounters(
      advised_bytes=self.advised_bytes,
      mapped_bytes=self.mapped_bytes_total,
      fetched_bytes=self.fetched_bytes_total,
      buffer_bytes=self.buffer_bytes,
      buffer_peak_bytes=self.buffer_peak_bytes,
    )
