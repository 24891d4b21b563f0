"""How the dense stream gets a unit's host tensors: its two loaders (docs/design.md, 4.2).

The engine keeps a pass's lifecycle and the device window; for a unit that is not on
the device it asks its `UnitLoader`, chosen once when the stream is made:

* `CachedLoader` (``host_budget_bytes != 0``): units come through the host tier of the
  ledger, filled ahead by a `PrefetchWorker` that keeps two reads in flight;
* `DirectLoader` (``host_budget_bytes == 0``): units are read on demand, straight from
  the store, and while reads come from disk the unit after next is asked for ahead, into
  the page cache only. No thread.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from jax_residency._src.errors import AdmissionError
from jax_residency._src.report.stream_metrics import Tier, WorkerMetrics
from jax_residency._src.stream.ledger import Eviction, Reservation, ResidencyLedger
from jax_residency._src.stream.prefetch import CancelToken, PrefetchWorker
from jax_residency._src.stream.unit_source import Unit, UnitReads


class UnitLoader(Protocol):
  """What the engine asks of a loader; every member is required."""

  #: How many streamed units after the current one `after_step` is given.
  lookahead: int

  def load(self, i: int) -> tuple[Unit, bool]:
    """Unit ``i``'s host tensors, waiting for them if need be, and whether they came
    from host memory (else straight from the store)."""
    ...

  def after_step(self, ahead: Sequence[int]) -> None:
    """A step has been dispatched; ``ahead`` are the next streamed units, in order."""
    ...

  def begin_pass(self) -> None: ...

  def end_pass(self) -> WorkerMetrics | None:
    """Ends a pass; the reads' metrics, if a worker made them."""
    ...

  def note_evicted(self, eviction: Eviction) -> None:
    """The ledger evicted a unit."""
    ...

  def cancel(self) -> None:
    """Drops the reads queued and in flight (a failed pass, cleared caches)."""
    ...

  def close(self) -> None: ...


class DirectLoader:
  """Units read on demand, and asked for ahead while they come from disk.

  A read that found its chunks out of the page cache (the source's advised bytes grew)
  says the pass is reading from disk; then, after each step, the unit after next is
  asked for (`UnitReader.advise_unit`), so the disk reads on through the checks, moves
  and dispatches between reads. A pass served from the page cache asks for nothing.

  Args:
    reads: the stream's unit reads.
    experts: whether a hint covers a unit's per-expert chunks too (not where experts
      are streamed apart: only the picked ones are read then).
  """

  lookahead = 2

  def __init__(self, reads: UnitReads, *, experts: bool = True) -> None:
    self._reads = reads
    self._experts = experts
    self._from_disk = False  # the last read's pages came from disk
    self._asked_ahead: set[int] = set()  # units a hint found out of the page cache

  def load(self, i: int) -> tuple[Unit, bool]:
    asked = self._advised()
    data = self._reads.read_waiting(i)
    self._from_disk = self._advised() != asked or i in self._asked_ahead
    self._asked_ahead.discard(i)
    return data, False

  def after_step(self, ahead: Sequence[int]) -> None:
    if self._from_disk and len(ahead) > 1:
      source, j = self._reads.source, ahead[1]
      if source.advise_unit(j) if self._experts else source.advise_unit(j, experts=False):
        self._asked_ahead.add(j)

  def _advised(self) -> int:
    return self._reads.source.read_counters().advised_bytes

  def begin_pass(self) -> None:
    pass  # nothing carried between passes but what the page cache holds

  def end_pass(self) -> WorkerMetrics | None:
    return None

  def note_evicted(self, eviction: Eviction) -> None:
    pass  # no host tier

  def cancel(self) -> None:
    pass  # no read outlives its demand

  def close(self) -> None:
    pass


class CachedLoader:
  """Units through the ledger's host tier, read ahead by a worker thread.

  After each step the next ``lookahead`` streamed units are protected on the host tier
  and those neither cached nor pending are submitted to the worker. The worker's load
  issues the next queued read as well, so two unit reads are in flight. A unit in flight
  is waited for (a stall); if everything cached is pinned, a demand read bypasses the
  cache rather than fail.

  Args:
    reads: the stream's unit reads.
    ledger: the stream's ledger (this loader uses its host tier).
    lookahead: units protected and read ahead of the current one.
    capacity: requests the worker's queue holds.
  """

  def __init__(
    self, reads: UnitReads, ledger: ResidencyLedger, *, lookahead: int, capacity: int
  ) -> None:
    self._reads, self._ledger, self.lookahead = reads, ledger, lookahead
    self.worker = PrefetchWorker(self._prefetch, capacity=capacity)
    self._ahead: dict[int, tuple[Reservation, Callable[[], Unit]]] = {}
    self._ahead_lock = threading.Lock()

  def _host_bytes(self, i: int) -> int:
    return self._reads.owner[i].host_bytes

  def _held_or_coming(self, i: int) -> bool:
    return self._ledger.contains(Tier.HOST, i) or self._ledger.is_pending(Tier.HOST, i)

  def load(self, i: int) -> tuple[Unit, bool]:
    if self.worker.is_pending(i):
      self._reads.tally.stall(self._wait(i))
    host = self._ledger.get(Tier.HOST, i)
    if host is not None:
      return host, True
    try:
      reservation = self._ledger.reserve(Tier.HOST, i, self._host_bytes(i))
    except AdmissionError:
      return self._reads.read_waiting(i), True  # everything cached is pinned: not cached
    with reservation:
      data = self._reads.read_waiting(i)
      self._reads.tally.read_to_host(self._host_bytes(i))
      reservation.commit(data)
    return data, True

  def _wait(self, i: int) -> float:
    """Waits for the worker's read of unit ``i`` (raising its error); the seconds waited."""
    start = time.perf_counter()
    self.worker.wait(i)
    return time.perf_counter() - start

  def after_step(self, ahead: Sequence[int]) -> None:
    self._ledger.protect(Tier.HOST, ahead)
    for j in ahead:
      if not self._held_or_coming(j):
        self.worker.submit(j)

  def _prefetch(self, i: int, token: CancelToken) -> None:
    """Runs on the worker thread: reads unit ``i`` into the host tier, and issues the
    read of the next queued unit (its host bytes reserved first)."""
    with self._ahead_lock:
      started = self._ahead.pop(i, None)
    if started is None:
      if token.cancelled or self._held_or_coming(i):
        return
      try:
        reservation = self._ledger.reserve(Tier.HOST, i, self._host_bytes(i))
      except AdmissionError:
        return  # no room right now; demand will read it
      started = (reservation, self._reads.start(i))
    self._read_ahead()
    reservation, finish = started
    with reservation:
      data = finish()
      if token.cancelled:
        return
      reservation.commit(data, prefetched=True)
    self._reads.tally.read_to_host(self._host_bytes(i))

  def _read_ahead(self) -> None:
    for j in self.worker.queued_units()[:1]:
      with self._ahead_lock:
        if j in self._ahead:
          continue
      if self._held_or_coming(j):
        continue
      try:
        reservation = self._ledger.reserve(Tier.HOST, j, self._host_bytes(j))
      except AdmissionError:
        continue
      with self._ahead_lock:
        self._ahead[j] = (reservation, self._reads.start(j))

  def _drop_read_ahead(self) -> None:
    """Waits out and releases reads issued ahead for requests that were dropped."""
    with self._ahead_lock:
      started, self._ahead = list(self._ahead.values()), {}
    for reservation, finish in started:
      with contextlib.suppress(Exception):
        finish()
      reservation.release()

  def begin_pass(self) -> None:
    self.worker.begin_pass()

  def end_pass(self) -> WorkerMetrics | None:
    return self.worker.end_pass()

  def note_evicted(self, eviction: Eviction) -> None:
    if eviction.tier is Tier.HOST and not eviction.used:
      self.worker.note_evicted_before_use()

  def cancel(self) -> None:
    self.worker.cancel(wait=True)
    self._drop_read_ahead()

  def close(self) -> None:
    self.worker.close()
    self._drop_read_ahead()
