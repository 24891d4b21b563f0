"""The counters of the dense stream's pass in progress (docs/design.md, 4.2).

The engine counts what its steps ran and moved; its loader counts reads and stalls,
on the prefetch worker's thread too. `PassTally` holds one pass's `PassCounters`
behind a lock; the engine commits them to its telemetry only when the pass succeeds.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from jax_residency._src.report.metrics import StackPass
from jax_residency._src.report.records import PassCounters, TimelinePoint


class PassTally:
  """One pass's counters, safe to add to from several threads.

  Args:
    stacks: the names of the stream's stacks (each gets a `StackPass`).
  """

  def __init__(self, stacks: Sequence[str]) -> None:
    self._stacks = tuple(stacks)
    self._lock = threading.Lock()
    self._counters = self._fresh()

  def _fresh(self) -> PassCounters:
    return PassCounters(stacks={name: StackPass() for name in self._stacks})

  def restart(self) -> None:
    """Starts a pass's counters from zero."""
    with self._lock:
      self._counters = self._fresh()

  def counters(self) -> PassCounters:
    """The pass's counters (the object itself: read it once the pass has ended)."""
    with self._lock:
      return self._counters

  def stall(self, seconds: float) -> None:
    """A step waited ``seconds`` for its unit's read."""
    with self._lock:
      self._counters.stalls += 1
      self._counters.stall_seconds += seconds

  def read_to_host(self, nbytes: int) -> None:
    """A unit's ``nbytes`` were read from the store into the host cache."""
    with self._lock:
      self._counters.disk_to_host_bytes += nbytes

  def moved(self, stack: str, nbytes: int, *, from_host: bool) -> None:
    """A unit of ``stack`` went to the device, from host memory or straight from the store."""
    with self._lock:
      if from_host:
        self._counters.host_to_device_bytes += nbytes
      else:
        self._counters.disk_to_device_bytes += nbytes
      self._counters.stacks[stack] += StackPass(bytes_moved=nbytes)

  def ran(self, stack: str, point: TimelinePoint) -> None:
    """A step of ``stack`` got its unit, where ``point`` says."""
    with self._lock:
      self._counters.stacks[stack] += StackPass(units_run=1)
      self._counters.timeline.append(point)

  def step_temp(self, nbytes: int) -> None:
    """The pass's compiled steps need ``nbytes`` of temporaries."""
    with self._lock:
      self._counters.step_temp_bytes = nbytes
