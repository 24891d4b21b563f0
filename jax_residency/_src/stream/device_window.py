"""The dense stream's device window: the unit loop's callbacks (docs/design.md, 4.2).

The staged forward asks for unit ``i`` before each step (`fetch`) and says when the step
is dispatched (`after_step`). The window answers from the ledger's device tier, which
holds at most the current unit and the next one within the device budget: a unit kept
on the device (`KeptUnits`) is served as it is, any other comes from the stream's loader
(`.loaders`) or the kept host units and is moved in, the next unit while the current
one computes.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

from jax_residency._src.report.records import TimelinePoint
from jax_residency._src.report.stream_metrics import Tier
from jax_residency._src.store.buffers import release_dropped_buffers
from jax_residency._src.store.unit_reader import UnitReader
from jax_residency._src.stream.kept import KeptUnits
from jax_residency._src.stream.ledger import ResidencyLedger
from jax_residency._src.stream.loaders import UnitLoader
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.stream.tally import PassTally


class DeviceWindow:
  """Serves each step its unit on the device, and moves the next one in.

  Args:
    ledger: the stream's ledger (this window uses its device tier).
    kept: the units kept resident.
    owner: the stack of each unit id.
    loader: where a unit's host tensors come from.
    source: the store (to unmap the pages of a unit that left the window).
    tally: the pass's counters.
  """

  def __init__(
    self,
    ledger: ResidencyLedger,
    kept: KeptUnits,
    owner: Sequence[StreamedStack],
    loader: UnitLoader,
    source: UnitReader,
    tally: PassTally,
  ) -> None:
    self._ledger, self._kept, self._owner = ledger, kept, owner
    self._loader, self._source, self._tally = loader, source, tally
    self._ran: tuple[int | None, int | None] = (None, None)  # see `fetch`
    self._pass_start = time.perf_counter()

  def begin_pass(self, start: float) -> None:
    """A pass starts at ``start`` (`time.perf_counter`), which its timeline counts from."""
    self._ran, self._pass_start = (None, None), start

  def fetch(self, i: int, upcoming: Sequence[int]) -> list[Any]:
    """Unit ``i``'s device arrays for its step (``upcoming``: the units after it)."""
    arrays = self._kept.on_device(i)
    self._ran = (self._ran[1], i)  # the unit run before this one, and this one
    if arrays is None:
      self._ledger.protect(Tier.DEVICE, (i, *self._next_in_stack(i, upcoming)))
      arrays = self._ledger.get(Tier.DEVICE, i)
      if arrays is None:
        arrays = self._load(i)
    point = TimelinePoint(
      seconds=time.perf_counter() - self._pass_start,
      unit=i,
      host_bytes=self._ledger.resident_bytes(Tier.HOST),
      device_bytes=self._ledger.resident_bytes(Tier.DEVICE),
    )
    self._tally.ran(self._owner[i].name, point)
    return arrays

  def after_step(self, i: int, upcoming: Sequence[int]) -> None:
    """Step ``i`` is dispatched: reads ahead follow the forward, into the next stack (the
    host cache is shared), and the next unit of ``i``'s stack moves in."""
    self._loader.after_step(self._kept.streamed(upcoming, self._loader.lookahead))
    for j in self._next_in_stack(i, upcoming):
      if not self._ledger.contains(Tier.DEVICE, j):
        self._ledger.protect(Tier.DEVICE, (i, j))
        self._load(j, finished=self._ran[0])  # its step is done (run_staged)

  def _next_in_stack(self, i: int, upcoming: Sequence[int]) -> tuple[int, ...]:
    """The unit the window moves in after ``i``: the next one not kept on the device, if
    it is of ``i``'s stack (the window of a stack holds only its units)."""
    for j in upcoming:
      if self._kept.on_device(j) is None:
        return (j,) if self._owner[j] is self._owner[i] else ()
    return ()

  def _load(self, i: int, finished: int | None = None) -> list[Any]:
    """Takes unit ``i`` from the loader (or the kept host units) to the device tier.

    The device bytes are reserved first, so the unit that makes room is gone before the
    read lands: on CPU the read buffer is the device array (no copy), and the device
    tier never holds more than its window, reads included. An evicted ``finished`` unit
    (its step done) no host cache holds is unmapped now (`retire_finished`).
    """
    st = self._owner[i]
    done = None if finished is None else self._ledger.peek(Tier.DEVICE, finished)
    with self._ledger.reserve(Tier.DEVICE, i, st.device_bytes) as reservation:
      if finished in reservation.evicted and not self._ledger.contains(Tier.HOST, finished):
        retire_finished(self._source, done)
      del done
      if reservation.evicted:
        release_dropped_buffers()
      kept = self._kept.in_host(i)
      host, from_host = (kept, True) if kept is not None else self._loader.load(i)
      arrays = st.to_device(host, alias=True, in_place=True)
      del host
      reservation.commit(arrays)
    self._tally.moved(st.name, st.host_bytes, from_host=from_host)
    return arrays


def retire_finished(source: UnitReader, arrays: list[jax.Array] | None) -> None:
  """Unmaps the pages of a unit's mapped arrays whose last step has completed, before
  XLA lets go of them (`UnitReader.retire_mapped`); nothing for a unit not held."""
  if arrays is not None:
    source.retire_mapped(arrays)
