"""Tests of the background prefetch worker (docs/design.md, sections 4.4 and 6)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from jax_residency._src.errors import (
  ClosedError,
  PrefetchError,
  StoreCorruptionError,
  ZeroQueueCapacityError,
)
from jax_residency._src.policy.options import CacheEvictionPolicy
from jax_residency._src.report.stream_metrics import Tier, WorkerMetrics
from jax_residency._src.stream.ledger import ResidencyLedger
from jax_residency._src.stream.prefetch import CancelToken, PrefetchWorker

TIMEOUT = 10.0  # generous upper bound for every blocking step; never reached when passing


class Loader:
  """A `load` whose calls can be held at a gate; records what it saw."""

  def __init__(self, gated: Callable[[int], bool] = lambda unit: True):
    self.gated = gated
    self.gate = threading.Event()
    self.started: dict[int, threading.Event] = {}
    self.calls: list[int] = []
    self.installed: dict[int, str] = {}
    self.tokens: dict[int, CancelToken] = {}
    self.fail: dict[int, BaseException] = {}
    self._lock = threading.Lock()

  def started_event(self, unit: int) -> threading.Event:
    with self._lock:
      return self.started.setdefault(unit, threading.Event())

  def __call__(self, unit: int, token: CancelToken) -> None:
    self.calls.append(unit)
    self.tokens[unit] = token
    self.started_event(unit).set()
    if self.gated(unit):
      assert self.gate.wait(TIMEOUT)
    if unit in self.fail:
      raise self.fail[unit]
    if not token.cancelled:
      self.installed[unit] = f"unit {unit}"


def eventually(predicate: Callable[[], bool]) -> None:
  """Waits for a state another thread reaches without an observable event."""
  deadline = time.monotonic() + TIMEOUT
  while not predicate():
    assert time.monotonic() < deadline, "condition never became true"
    time.sleep(0.001)


def counted(worker: PrefetchWorker) -> WorkerMetrics:
  """The current pass's counters, without ending the pass (for polling another thread)."""
  with worker._lock:
    return worker._counters.snapshot()


def worker_threads(name: str) -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == name]


@pytest.fixture
def loader() -> Loader:
  return Loader()


# --- construction ------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_capacity_must_be_positive(bad):
  with pytest.raises(ZeroQueueCapacityError, match="capacity"):
    PrefetchWorker(lambda unit, token: None, capacity=bad)


# --- queueing ----------------------------------------------------------------


def test_loads_in_fifo_order(loader):
  with PrefetchWorker(loader, capacity=8) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    for unit in range(1, 6):
      assert worker.submit(unit)
    assert worker.queued_units() == (1, 2, 3, 4, 5)
    assert worker.is_pending(0)  # in flight
    loader.gate.set()
    assert all(worker.wait(unit, TIMEOUT) for unit in range(6))
  assert loader.calls == [0, 1, 2, 3, 4, 5]
  metrics = worker.end_pass()
  assert (metrics.submitted, metrics.completed, metrics.peak_queue_occupancy) == (6, 6, 5)


def test_coalesces_queued_and_in_flight_units(loader):
  with PrefetchWorker(loader, capacity=4) as worker:
    assert worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    assert not worker.submit(0)  # in flight
    assert worker.submit(1)
    assert not worker.submit(1)  # queued
    assert worker.is_pending(0) and worker.is_pending(1)
    assert worker.queued_units() == (1,)
    loader.gate.set()
    assert worker.wait(0, TIMEOUT) and worker.wait(1, TIMEOUT)
    assert worker.submit(0)  # a completed unit is queued anew
    assert worker.wait(0, TIMEOUT)
  assert loader.calls == [0, 1, 0]
  metrics = worker.end_pass()
  assert (metrics.submitted, metrics.coalesced, metrics.completed) == (3, 2, 3)


def test_backpressure_blocks_and_drops_nothing():
  loader = Loader(gated=lambda unit: unit == 0)
  with PrefetchWorker(loader, capacity=1) as worker:
    results: list[bool] = []

    def submitter():
      results.append(worker.submit(0))
      assert loader.started_event(0).wait(TIMEOUT)  # 0 is in flight, the queue empty
      for unit in range(1, 5):
        results.append(worker.submit(unit))

    thread = threading.Thread(target=submitter)
    thread.start()
    # Unit 1 fills the queue; the submitter then blocks on unit 2.
    eventually(lambda: counted(worker).backpressure_count == 1)
    assert thread.is_alive() and worker.queued_units() == (1,)
    loader.gate.set()
    thread.join(TIMEOUT)
    assert not thread.is_alive()
    assert all(worker.wait(unit, TIMEOUT) for unit in range(5))
  assert results == [True] * 5
  assert loader.calls == [0, 1, 2, 3, 4]
  metrics = worker.end_pass()
  assert metrics.submitted == metrics.completed == 5
  assert metrics.cancelled == metrics.rejected == 0
  assert metrics.backpressure_count >= 1 and metrics.backpressure_seconds > 0
  assert metrics.peak_queue_occupancy == 1


def test_non_blocking_submit_on_a_full_queue_is_rejected(loader):
  with PrefetchWorker(loader, capacity=1) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    assert worker.submit(1)
    assert not worker.submit(2, block=False)
    assert not worker.submit(3, timeout=0.01)
    assert not worker.is_pending(2) and worker.wait(2) is False
    loader.gate.set()
    assert worker.wait(1, TIMEOUT)
  metrics = worker.end_pass()
  assert (metrics.rejected, metrics.submitted, metrics.backpressure_count) == (2, 2, 1)
  assert 2 not in loader.calls and 3 not in loader.calls


# --- waiting -----------------------------------------------------------------


def test_wait_for_a_unit_never_submitted_returns_false_at_once(loader):
  with PrefetchWorker(loader, capacity=1) as worker:
    assert worker.wait(42) is False
  assert worker.end_pass().demand_waits == 0


def test_wait_counts_demand_waits_and_ready_before_demand(loader):
  with PrefetchWorker(loader, capacity=2) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    waited = threading.Event()

    def demander():
      assert worker.wait(0, TIMEOUT)
      waited.set()

    thread = threading.Thread(target=demander)
    thread.start()
    eventually(lambda: counted(worker).demand_waits == 1)
    assert not waited.is_set()
    loader.gate.set()
    thread.join(TIMEOUT)
    assert waited.is_set()
    worker.submit(1)
    eventually(lambda: 1 in loader.installed)
    eventually(lambda: not worker.is_pending(1))
    assert worker.wait(1) and worker.wait(1)  # counted once
    assert worker.wait(0)  # demanded before: neither counter moves
  metrics = worker.end_pass()
  assert (metrics.demand_waits, metrics.ready_before_demand) == (1, 1)
  assert metrics.demand_wait_seconds > 0


def test_wait_timeout_returns_false(loader):
  with PrefetchWorker(loader, capacity=1) as worker:
    worker.submit(0)
    assert worker.wait(0, timeout=0.01) is False
    loader.gate.set()
    assert worker.wait(0, TIMEOUT)


def test_load_errors_reach_the_waiter():
  loader = Loader(gated=lambda unit: False)
  cause = ValueError("chunk 3 is corrupt")
  loader.fail[3] = cause
  with PrefetchWorker(loader, capacity=4) as worker:
    for unit in range(2, 5):
      worker.submit(unit)
    assert worker.wait(2, TIMEOUT)
    for _ in range(2):  # delivered on every wait until resubmitted
      with pytest.raises(
        PrefetchError, match="unit 3 failed: ValueError: chunk 3 is corrupt"
      ) as info:
        worker.wait(3, TIMEOUT)
      assert info.value.__cause__ is cause
    assert worker.wait(4, TIMEOUT)  # the worker survives a failed load
    del loader.fail[3]
    assert worker.submit(3)
    assert worker.wait(3, TIMEOUT)
  metrics = worker.end_pass()
  assert (metrics.failed, metrics.completed) == (1, 3)  # 2, 4, then 3 resubmitted


def test_store_errors_reach_the_waiter_as_store_errors():
  """A failed read raises what a read on the caller's thread would: the same error type
  (attributes kept), so ``except jr.StoreError`` catches it whichever thread read the unit."""
  loader = Loader(gated=lambda unit: False)
  cause = StoreCorruptionError("unit 1 is corrupt", store="/s", tensor="layers.w", unit=1)
  loader.fail[1] = cause
  with PrefetchWorker(loader, capacity=2) as worker:
    worker.submit(1)
    for _ in range(2):
      with pytest.raises(StoreCorruptionError, match="unit 1 is corrupt") as info:
        worker.wait(1, TIMEOUT)
      error = info.value
      assert error is not cause and error.__cause__ is cause
      assert (error.store, error.tensor, error.unit) == ("/s", "layers.w", 1)
      assert not isinstance(error, PrefetchError)


# --- cancellation ----------------------------------------------------------------


def test_cancel_drops_queued_work_and_fences_the_load_in_flight(loader):
  with PrefetchWorker(loader, capacity=4) as worker:
    for unit in range(3):
      worker.submit(unit)
    assert loader.started_event(0).wait(TIMEOUT)
    token = loader.tokens[0]
    assert not token.cancelled and token.unit == 0
    assert worker.cancel() == 2
    assert token.cancelled and token.wait(0)
    assert worker.queued_units() == ()
    assert worker.wait(1) is False and worker.wait(2) is False
    assert not worker.is_pending(0)
    # The fenced load finishes after the cancel: discarded, not completed.
    loader.gate.set()
    assert worker.wait(0, TIMEOUT) is False
    assert loader.installed == {}
    metrics = worker.end_pass()
    assert (metrics.completed, metrics.cancelled, metrics.submitted) == (0, 3, 3)
    # A new epoch works normally.
    assert worker.submit(1)
    assert worker.wait(1, TIMEOUT)
  assert loader.calls == [0, 1]
  assert loader.installed == {1: "unit 1"}
  assert worker.end_pass().completed == 1


def test_cancel_of_a_failing_load_counts_cancelled_not_failed(loader):
  loader.fail[0] = OSError("late failure")
  with PrefetchWorker(loader, capacity=1) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    worker.cancel()
    loader.gate.set()
    assert worker.wait(0, TIMEOUT) is False  # no error delivered
  metrics = worker.end_pass()
  assert (metrics.failed, metrics.cancelled) == (0, 1)


def test_cancel_wait_blocks_until_the_fenced_load_returns(loader):
  with PrefetchWorker(loader, capacity=1) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    returned = threading.Event()

    def canceller():
      worker.cancel(wait=True)
      returned.set()

    thread = threading.Thread(target=canceller)
    thread.start()
    assert loader.tokens[0].wait(TIMEOUT)  # the fence is up...
    assert not returned.is_set()  # ...but cancel(wait=True) is still waiting
    loader.gate.set()
    thread.join(TIMEOUT)
    assert returned.is_set() and worker._running is None  # the fenced load returned


def test_cancel_fences_a_blocked_submitter(loader):
  with PrefetchWorker(loader, capacity=1) as worker:
    worker.submit(0)
    assert loader.started_event(0).wait(TIMEOUT)
    worker.submit(1)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(worker.submit(2)))
    thread.start()
    eventually(lambda: counted(worker).backpressure_count == 1)
    worker.cancel()
    thread.join(TIMEOUT)
    assert result == [False]
    loader.gate.set()
  assert loader.calls == [0]
  assert worker.end_pass().cancelled == 3  # queued 1, in-flight 0, blocked 2


# --- shutdown ----------------------------------------------------------------------


def test_close_joins_the_thread_and_rejects_submits(loader):
  loader.gate.set()
  worker = PrefetchWorker(loader, capacity=2, name="test-prefetch-close")
  assert len(worker_threads("test-prefetch-close")) == 1
  worker.submit(0)
  assert worker.wait(0, TIMEOUT)
  worker.close()
  worker.close()  # idempotent
  assert worker_threads("test-prefetch-close") == []
  with pytest.raises(ClosedError):
    worker.submit(1)


def test_context_manager_closes(loader):
  with PrefetchWorker(loader, capacity=1, name="test-prefetch-ctx") as worker:
    assert len(worker_threads("test-prefetch-ctx")) == 1
  assert worker_threads("test-prefetch-ctx") == []
  with pytest.raises(ClosedError):
    worker.submit(0)


def test_close_while_a_load_is_blocked_returns_once_it_does(loader):
  worker = PrefetchWorker(loader, capacity=2, name="test-prefetch-blocked")
  worker.submit(0)
  worker.submit(1)
  assert loader.started_event(0).wait(TIMEOUT)
  closed = threading.Event()

  def closer():
    worker.close()
    closed.set()

  thread = threading.Thread(target=closer)
  thread.start()
  assert loader.tokens[0].wait(TIMEOUT)  # close() fenced the load...
  assert not closed.is_set()  # ...and is joining the thread
  start = time.monotonic()
  loader.gate.set()
  assert closed.wait(TIMEOUT)
  assert time.monotonic() - start < 1.0
  thread.join(TIMEOUT)
  assert worker_threads("test-prefetch-blocked") == []
  assert loader.calls == [0] and loader.installed == {}
  assert worker.wait(0) is False and worker.wait(1) is False


def test_close_from_inside_load_does_not_deadlock():
  holder: list[PrefetchWorker] = []

  def load(unit, token):
    holder[0].close()

  worker = PrefetchWorker(load, capacity=1, name="test-prefetch-self-close")
  holder.append(worker)
  worker.submit(0)
  assert worker.wait(0, TIMEOUT) is False  # closed -> fenced
  worker.close()
  assert worker_threads("test-prefetch-self-close") == []


def test_idle_worker_does_not_spin(loader):
  with PrefetchWorker(loader, capacity=2):
    cpu = time.process_time()
    time.sleep(0.2)
    assert time.process_time() - cpu < 0.05


# --- telemetry -----------------------------------------------------------------------


def test_pass_metrics_merge_over_passes(loader):
  loader.gate.set()
  with PrefetchWorker(loader, capacity=2) as worker:
    worker.begin_pass()
    worker.submit(0)
    worker.wait(0, TIMEOUT)
    worker.note_evicted_before_use()
    first = worker.end_pass()
    worker.begin_pass()
    worker.submit(1)
    worker.wait(1, TIMEOUT)
    worker.note_evicted_before_use(2)
    failed = worker.end_pass()
  assert (first.submitted, first.completed, first.evicted_before_use) == (1, 1, 1)
  assert (failed.submitted, failed.evicted_before_use) == (1, 2)
  assert first + failed == WorkerMetrics(
    submitted=2,
    completed=2,
    evicted_before_use=3,
    peak_queue_occupancy=1,
    demand_waits=first.demand_waits + failed.demand_waits,
    demand_wait_seconds=first.demand_wait_seconds + failed.demand_wait_seconds,
    ready_before_demand=first.ready_before_demand + failed.ready_before_demand,
  )


# --- with the ledger -------------------------------------------------------------------


def test_prefetch_into_the_ledger_host_tier():
  """The wiring the streaming engine uses: load commits a host reservation."""
  ledger_ref: list[ResidencyLedger] = []
  worker_ref: list[PrefetchWorker] = []

  def on_evict(eviction):
    if not eviction.used:
      worker_ref[0].note_evicted_before_use()

  ledger = ResidencyLedger(
    host_budget_bytes=200,
    device_budget_bytes=None,
    eviction_policy=CacheEvictionPolicy.LEAST_RECENTLY_USED,
    on_evict=on_evict,
  )
  ledger_ref.append(ledger)

  def load(unit, token):
    if token.cancelled or ledger.contains(Tier.HOST, unit):
      return
    with ledger.reserve(Tier.HOST, unit, 100) as r:
      value = {"w": unit}
      if not token.cancelled:
        r.commit(value, prefetched=True)

  with PrefetchWorker(load, capacity=2) as worker:
    worker_ref.append(worker)
    for unit in range(3):
      worker.submit(unit)
      assert worker.wait(unit, TIMEOUT)
    assert [u for u in range(4) if ledger.contains(Tier.HOST, u)] == [1, 2]
    assert ledger.get(Tier.HOST, 2) == {"w": 2}
    worker.submit(3)  # evicts 1, never used
    assert worker.wait(3, TIMEOUT)
  assert worker.end_pass().evicted_before_use == 2  # units 0 and 1
  assert [u for u in range(4) if ledger.contains(Tier.HOST, u)] == [2, 3]
