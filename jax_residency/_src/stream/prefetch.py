"""The background prefetch worker: one thread reading units ahead (docs/design.md, section 4.4).

The worker knows nothing about stores or the ledger. It calls the caller's
`load(unit, token)` for each request, in FIFO order, on one daemon thread;
`load` reads the unit and installs it in the host cache.

* **Bounded queue.** At most `capacity` requests wait (the one being loaded
  does not count). A full queue blocks the submitter (backpressure, counted in
  events and seconds); work is never dropped silently.
* **Coalescing.** A unit already queued or being loaded is not queued again.
* **Fencing.** `cancel()` drops queued requests and fences the one in flight:
  each request carries a `CancelToken` of the epoch it was submitted in;
  `cancel()` cancels that epoch and opens a new one. The in-flight `load` keeps
  running (it can poll `token.cancelled` and stop early, and must check it
  before installing what it read); when it returns its result is counted and
  reported as cancelled, its error (if any) discarded.
* **Errors reach the demander.** A failed `load` is delivered to whoever
  `wait`s for that unit, with the original as `__cause__`: a `StoreError` (the
  store could not be read, or is corrupt) as a copy of itself, so callers catch
  the same type whichever thread read the unit; anything else as `PrefetchError`.
* **Closing joins.** `close()` cancels, stops the thread and joins it.

Telemetry follows the ledger's per-pass pattern: `begin_pass()`, then
`end_pass()` returns the pass's `WorkerMetrics`. Nothing polls: every wait is on a
`threading.Condition` sharing one lock.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import enum
import operator
import threading
import time
from collections.abc import Callable

from jax_residency._src.errors import (
  ClosedError,
  PrefetchError,
  StoreError,
  ZeroQueueCapacityError,
)
from jax_residency._src.report.metrics import Tally
from jax_residency._src.report.stream_metrics import WorkerMetrics


class _Epoch:
  """Requests submitted between two `cancel()` calls share an epoch."""

  __slots__ = ("event",)

  def __init__(self) -> None:
    self.event = threading.Event()


class CancelToken:
  """Tells a running `load` whether its request was cancelled.

  Attributes:
    unit: the unit being loaded.
  """

  __slots__ = ("unit", "_epoch")

  def __init__(self, unit: int, epoch: _Epoch):
    self.unit = unit
    self._epoch = epoch

  @property
  def cancelled(self) -> bool:
    """True once `cancel()` or `close()` fenced this request."""
    return self._epoch.event.is_set()

  def wait(self, timeout: float | None = None) -> bool:
    """Blocks until cancelled or `timeout` seconds pass; returns `cancelled`."""
    return self._epoch.event.wait(timeout)


class _State(enum.Enum):
  QUEUED = "queued"
  RUNNING = "running"
  DONE = "done"
  FAILED = "failed"
  CANCELLED = "cancelled"


_LIVE = (_State.QUEUED, _State.RUNNING)


@dataclasses.dataclass(eq=False, slots=True)
class _Request:
  unit: int
  epoch: _Epoch
  state: _State = _State.QUEUED
  error: BaseException | None = None
  demanded: bool = False


#: What the worker calls: read `unit` and install it, unless `token.cancelled`.
LoadFn = Callable[[int, CancelToken], None]


class PrefetchWorker:
  """One daemon thread loading units from a bounded FIFO queue.

  Args:
    load: `load(unit, token)` reads the unit and installs it (e.g. commits a
      host-tier ledger reservation). It runs on the worker thread, one call at
      a time. It should skip installing when `token.cancelled` is True; what it
      raises is delivered to `wait(unit)`.
    capacity: most requests waiting in the queue (>= 1).
    name: the thread's name.

  Example:
    >>> loaded = []
    >>> with PrefetchWorker(lambda unit, token: loaded.append(unit), capacity=2) as worker:
    ...   worker.submit(0), worker.submit(1)
    ...   worker.wait(0), worker.wait(1)
    (True, True)
    (True, True)
    >>> loaded
    [0, 1]
  """

  def __init__(self, load: LoadFn, *, capacity: int, name: str = "jax-residency-prefetch"):
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
      raise ZeroQueueCapacityError(
        f"PrefetchWorker(capacity={capacity!r}): the queue needs room for at least one "
        "request; pass capacity >= 1 (background_queue_capacity)."
      )
    self._load = load
    self._capacity = capacity
    self._lock = threading.Lock()
    self._not_empty = threading.Condition(self._lock)  # work queued, or closing
    self._not_full = threading.Condition(self._lock)  # room in the queue, or fence
    self._settled = threading.Condition(self._lock)  # a request reached a final state
    self._queue: collections.deque[_Request] = collections.deque()
    self._requests: dict[int, _Request] = {}  # latest request per unit
    self._running: _Request | None = None
    self._epoch = _Epoch()
    self._closed = False
    self._counters = Tally(WorkerMetrics)
    self._thread = threading.Thread(target=self._run, name=name, daemon=True)
    self._thread.start()

  def queued_units(self) -> tuple[int, ...]:
    """Units waiting in the queue, in FIFO order."""
    with self._lock:
      return tuple(r.unit for r in self._queue)

  def is_pending(self, unit: int) -> bool:
    """Whether a live (queued or in-flight, not cancelled) request exists for `unit`."""
    with self._lock:
      return self._live(unit)

  # --- requests --------------------------------------------------------------

  def submit(self, unit: int, *, block: bool = True, timeout: float | None = None) -> bool:
    """Queues a load of `unit`; returns whether a new request was queued.

    False means: coalesced with a live request for the unit, or (with
    `block=False` or a `timeout`) the queue stayed full (counted `rejected`),
    or `cancel()` fenced the call while it was blocked (counted `cancelled`).
    A unit whose earlier request completed, failed or was cancelled is queued
    anew.

    Raises:
      ClosedError: the worker is closed (or was closed while blocked).
    """
    unit = operator.index(unit)
    with self._lock:
      self._check_open()
      if self._live(unit):
        self._counters.add(coalesced=1)
        return False
      if len(self._queue) >= self._capacity:
        if not block:
          self._counters.add(rejected=1)
          return False
        epoch = self._epoch
        deadline = None if timeout is None else time.monotonic() + timeout
        self._counters.add(backpressure_count=1)
        start = time.perf_counter()
        try:
          while len(self._queue) >= self._capacity and not self._closed and epoch is self._epoch:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
              break
            self._not_full.wait(remaining)
        finally:
          self._counters.add(backpressure_seconds=time.perf_counter() - start)
        self._check_open()
        if epoch is not self._epoch:
          self._counters.add(cancelled=1)
          return False
        if len(self._queue) >= self._capacity:
          self._counters.add(rejected=1)
          return False
        if self._live(unit):
          self._counters.add(coalesced=1)
          return False
      request = _Request(unit, self._epoch)
      self._queue.append(request)
      self._requests[unit] = request
      self._counters.add(submitted=1)
      self._note_occupancy()
      self._not_empty.notify()
      return True

  def wait(self, unit: int, timeout: float | None = None) -> bool:
    """Blocks until the unit's latest request is settled; True if it loaded.

    Returns False (at once) for a unit never submitted; False for a request
    that was cancelled (after its fenced load returned) or when `timeout`
    elapsed. False means "not loaded by the worker": load it on demand.

    Counts `demand_waits` when it has to block, `ready_before_demand` when the
    request had already completed the first time anyone waited for it.

    Raises:
      StoreError: the load raised a `StoreError` (of any subclass): a copy of it
        is raised, the original (with the worker's traceback) as `__cause__`.
      PrefetchError: the load raised anything else; the original is `__cause__`.
        Either is raised on every `wait` until the unit is submitted again.
    """
    unit = operator.index(unit)
    with self._lock:
      request = self._requests.get(unit)
      if request is None:
        return False
      if request.state in _LIVE:
        if not request.demanded:
          request.demanded = True
          self._counters.add(demand_waits=1)
        start = time.perf_counter()
        settled = self._settled.wait_for(lambda: request.state not in _LIVE, timeout)
        self._counters.add(demand_wait_seconds=time.perf_counter() - start)
        if not settled:
          return False
      elif request.state is _State.DONE and not request.demanded:
        self._counters.add(ready_before_demand=1)
      request.demanded = True
      if request.state is _State.FAILED:
        error = request.error
        if isinstance(error, StoreError):
          raise copy.copy(error).with_traceback(None) from error
        raise PrefetchError(
          f"background prefetch of unit {unit} failed: {type(error).__name__}: {error}"
        ) from error
      return request.state is _State.DONE

  def cancel(self, *, wait: bool = False) -> int:
    """Drops queued requests and fences the in-flight one; returns how many were dropped.

    Args:
      wait: also block until a fenced in-flight load has returned, so that no
        load of the old epoch runs afterwards (not from inside `load`).
    """
    with self._lock:
      dropped = self._cancel_locked()
      if wait and threading.current_thread() is not self._thread:
        self._settled.wait_for(
          lambda: self._running is None or not self._running.epoch.event.is_set()
        )
      return dropped

  def close(self) -> None:
    """Cancels, stops and joins the thread. Idempotent; `submit` then raises `ClosedError`.

    A load in progress runs to its end (its token reports cancelled) before
    the join returns. Called from inside `load`, it does not join.
    """
    with self._lock:
      if not self._closed:
        self._closed = True
        self._cancel_locked()
        self._not_empty.notify_all()
    if threading.current_thread() is not self._thread:
      self._thread.join()

  def __enter__(self) -> PrefetchWorker:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  # --- telemetry -------------------------------------------------------------

  def note_evicted_before_use(self, count: int = 1) -> None:
    """Counts prefetched units evicted before any use (wire to the ledger's `on_evict`)."""
    with self._lock:
      self._counters.add(evicted_before_use=count)

  def begin_pass(self) -> None:
    """Starts a fresh per-pass accumulator; the peak starts at the current queue length."""
    with self._lock:
      self._fresh_counters()

  def end_pass(self) -> WorkerMetrics:
    """Ends the pass: returns its metrics and starts a fresh accumulator (the placed
    model's telemetry keeps the totals of the passes that succeeded)."""
    with self._lock:
      snapshot = self._counters.snapshot()
      self._fresh_counters()
      return snapshot

  # --- internals (hold the lock) ----------------------------------------------

  def _live(self, unit: int) -> bool:
    request = self._requests.get(unit)
    return request is not None and request.epoch is self._epoch and request.state in _LIVE

  def _cancel_locked(self) -> int:
    self._epoch.event.set()
    self._epoch = _Epoch()
    dropped = len(self._queue)
    for request in self._queue:
      request.state = _State.CANCELLED
    self._queue.clear()
    self._counters.add(cancelled=dropped)
    self._not_full.notify_all()
    self._settled.notify_all()
    return dropped

  def _note_occupancy(self) -> None:
    self._counters.raise_to(peak_queue_occupancy=len(self._queue))

  def _fresh_counters(self) -> None:
    self._counters = Tally(WorkerMetrics)
    self._note_occupancy()

  def _check_open(self) -> None:
    if self._closed:
      raise ClosedError("the prefetch worker was used after close().")

  # --- the thread --------------------------------------------------------------

  def _run(self) -> None:
    while True:
      with self._lock:
        while not self._queue and not self._closed:
          self._not_empty.wait()
        if not self._queue:
          return
        request = self._queue.popleft()
        request.state = _State.RUNNING
        self._running = request
        self._not_full.notify()
      error: BaseException | None = None
      try:
        self._load(request.unit, CancelToken(request.unit, request.epoch))
      except BaseException as e:  # noqa: BLE001 - delivered to `wait`, never lost in the thread
        error = e
      with self._lock:
        self._running = None
        if request.epoch.event.is_set():
          request.state = _State.CANCELLED
          self._counters.add(cancelled=1)
        elif error is not None:
          request.state = _State.FAILED
          request.error = error
          self._counters.add(failed=1)
        else:
          request.state = _State.DONE
          self._counters.add(completed=1)
        self._settled.notify_all()
      del error
