"""Reading one unit for the dense stream, with failures named by unit.

The stream reads through a `store.unit_reader.UnitReader` (`UnitStore` is one) and
nothing else. `UnitReads` reads unit ``i`` as its stack needs it (a process's boxes on a
multi-process mesh, without the experts read apart): `read` now, `start` issues the read
and returns a callable that waits for it. Either raises the store's own `StoreError` as
it is, and any other failure as a `StoreError` naming the unit.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NoReturn

import numpy as np

from jax_residency._src.errors import ClosedError, StoreError
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.store.buffers import release_dropped_buffers
from jax_residency._src.store.unit_reader import UnitReader
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.stream.tally import PassTally
from jax_residency._src.typing import ParamPath

Unit = Mapping[ParamPath, np.ndarray]


class UnitReads:
  """Reads of the stream's units from ``source``.

  Args:
    source: the store.
    owner: the stack of each unit id (its read boxes, its host bytes).
    skip: the tensors of unit ``i`` a unit read leaves out (its experts, read apart).
    tally: where a read the stream waits on counts its stall.
  """

  def __init__(
    self,
    source: UnitReader,
    owner: Sequence[StreamedStack],
    skip: Callable[[int], tuple[ParamPath, ...]],
    tally: PassTally,
  ) -> None:
    self.source, self.owner, self._skip, self.tally = source, owner, skip, tally

  def read(self, i: int) -> Unit:
    """Unit ``i``, read now."""
    try:
      return self.source.read_unit(i, index=self.owner[i].read_index, skip=self._skip(i))
    except Exception as e:  # noqa: BLE001 - raised again, with the unit named
      raise_read_error(i, e)

  def read_waiting(self, i: int) -> Unit:
    """Unit ``i``, read now while a step waits for it (a stall)."""
    start = time.perf_counter()
    data = self.read(i)
    self.tally.stall(time.perf_counter() - start)
    return data

  def start(self, i: int) -> Callable[[], Unit]:
    """Issues the read of unit ``i``; the returned callable waits for it."""
    try:
      pending = self.source.read_unit_async(i, index=self.owner[i].read_index, skip=self._skip(i))
    except Exception as e:  # noqa: BLE001 - re-raised with the unit named, when waited on
      return functools.partial(raise_read_error, i, e)

    def finish() -> Unit:
      try:
        return pending.result()
      except Exception as e:  # noqa: BLE001 - raised again, with the unit named
        raise_read_error(i, e)

    return finish


def raise_read_error(i: int, e: Exception) -> NoReturn:
  if isinstance(e, StoreError | ClosedError):  # already says what happened, and where
    raise e
  raise StoreError(f"reading unit {i} from the store failed: {type(e).__name__}: {e}") from e


def tune_source(
  source: UnitReader,
  metadata: ModelMetadata,
  *,
  staging: int,
  unit_bytes: int,
  multiprocess: bool,
  map_reads: bool,
) -> None:
  """Bounds ``source``'s read buffers by the plan, and maps reads where it can.

  Idle read buffers are kept for reuse only while every buffer, live or idle, fits
  what the plan gives host-side unit buffers: the host cache, the ``staging`` unit,
  and (CPU) the device window, whose arrays are read buffers. With ``map_reads``,
  where device memory is host memory, whole units are mapped from the store's files
  instead of copied (see `mapped`): the page cache is the read buffer. A host cache
  holds copies instead (docs/design.md, 4.2).
  """
  window = metadata.device_window_units if metadata.device_is_host else 0
  cached = metadata.item_bytes("host cache") + staging
  units = window + (cached // unit_bytes if unit_bytes else 0)
  source.limit_buffers(units, reclaim=release_dropped_buffers)
  if map_reads and metadata.device_is_host and not multiprocess:
    source.use_mapped_reads()
