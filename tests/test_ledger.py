"""Tests of the residency ledger (docs/design.md, sections 4.3 and 6)."""

from __future__ import annotations

import dataclasses
import gc
import threading
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_residency._src.errors import (
  AdmissionError,
  ClosedError,
  InvalidBudgetError,
  ResidencyRuntimeError,
  WeightResidencyPolicyError,
)
from jax_residency._src.policy.options import CacheEvictionPolicy
from jax_residency._src.report.stream_metrics import LedgerMetrics, Tier, TierMetrics
from jax_residency._src.stream.ledger import Eviction, ResidencyLedger

LRU = CacheEvictionPolicy.LEAST_RECENTLY_USED
LFU = CacheEvictionPolicy.LEAST_FREQUENTLY_USED
HOST, DEVICE = Tier.HOST, Tier.DEVICE
UNIT = 100  # bytes of one test unit


def make(host=None, device=None, policy=LRU, on_evict=None) -> ResidencyLedger:
  return ResidencyLedger(
    host_budget_bytes=host,
    device_budget_bytes=device,
    eviction_policy=policy,
    on_evict=on_evict,
  )


def install(ledger, unit, *, tier=HOST, nbytes=UNIT, value=None, prefetched=False):
  with ledger.reserve(tier, unit, nbytes) as r:
    r.commit({"unit": unit} if value is None else value, prefetched=prefetched)
  return r


def demand(ledger, unit, *, tier=HOST, nbytes=UNIT):
  """The engine's demand path: get, and on a miss load and install."""
  if ledger.get(tier, unit) is None:
    install(ledger, unit, tier=tier, nbytes=nbytes)


def resident(ledger, tier=HOST, units=range(128)):
  """Units with an entry on the tier, ascending (asked through `contains`)."""
  return tuple(u for u in units if ledger.contains(tier, u))


def charged(ledger, tier=HOST):
  """Bytes admission counts against the tier's budget: entries plus pending reservations,
  read under the ledger's lock (other threads may be changing them)."""
  with ledger._lock:
    return ledger._tiers[tier].charged_bytes()


class Recorder:
  def __init__(self):
    self.events: list[Eviction] = []

  def __call__(self, eviction: Eviction) -> None:
    self.events.append(eviction)


# --- construction ------------------------------------------------------------


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", True])
def test_bad_budget_is_rejected(bad):
  with pytest.raises(InvalidBudgetError, match="host_budget_bytes"):
    make(host=bad)


def test_bad_policy_is_rejected():
  with pytest.raises(WeightResidencyPolicyError, match="eviction_policy"):
    ResidencyLedger(host_budget_bytes=1, device_budget_bytes=1, eviction_policy="lru")  # type: ignore[arg-type]


def test_tiers_are_independent():
  ledger = make(host=UNIT, device=2 * UNIT)
  install(ledger, 0, tier=HOST)
  install(ledger, 0, tier=DEVICE)
  install(ledger, 1, tier=DEVICE)
  assert resident(ledger) == (0,)
  assert resident(ledger, DEVICE) == (0, 1)
  assert install(ledger, 1, tier=HOST).evicted == (0,)  # the host budget holds one unit
  assert resident(ledger, DEVICE) == (0, 1)


# --- reservations ------------------------------------------------------------


def test_reservation_charges_while_pending_and_commit_installs():
  ledger = make(host=3 * UNIT)
  with ledger.reserve(HOST, 7, UNIT) as r:
    assert ledger.is_pending(HOST, 7)
    assert charged(ledger) == UNIT
    assert ledger.resident_bytes(HOST) == 0
    assert not ledger.contains(HOST, 7)
    r.commit("seven")
  assert not ledger.is_pending(HOST, 7)
  assert ledger.contains(HOST, 7)
  assert ledger.get(HOST, 7) == "seven"
  assert charged(ledger) == ledger.resident_bytes(HOST) == UNIT


def test_exit_without_commit_releases_bytes():
  ledger = make(host=UNIT)
  with ledger.reserve(HOST, 0, UNIT):
    assert charged(ledger) == UNIT
  assert charged(ledger) == 0
  assert not ledger.contains(HOST, 0) and not ledger.is_pending(HOST, 0)
  install(ledger, 1)  # the bytes really came back


def test_exception_inside_reservation_releases_bytes():
  ledger = make(host=UNIT)
  with pytest.raises(OSError), ledger.reserve(HOST, 0, UNIT):
    raise OSError("read failed")
  assert charged(ledger) == 0


def test_commit_twice_or_after_release_raises():
  ledger = make(host=UNIT)
  r = install(ledger, 0)
  with pytest.raises(ResidencyRuntimeError, match="no longer pending"):
    r.commit("again")
  with ledger.reserve(HOST, 1, 0) as r2:
    pass
  with pytest.raises(ResidencyRuntimeError):
    r2.commit("late")
  assert resident(ledger) == (0,)


def test_reserving_a_resident_or_pending_unit_raises_and_changes_nothing():
  ledger = make(host=2 * UNIT)
  install(ledger, 0)
  with pytest.raises(AdmissionError, match="resident"):
    ledger.reserve(HOST, 0, UNIT)
  with ledger.reserve(HOST, 1, UNIT):
    with pytest.raises(AdmissionError, match="pending"):
      ledger.reserve(HOST, 1, UNIT)
    assert charged(ledger) == 2 * UNIT
  assert charged(ledger) == UNIT


def test_negative_reservation_is_rejected():
  with pytest.raises(AdmissionError, match="nbytes"):
    make().reserve(HOST, 0, -1)


def test_atomic_admission_failure_changes_nothing():
  events = Recorder()
  ledger = make(host=4 * UNIT, on_evict=events)
  for unit in range(3):
    install(ledger, unit)
  pending = ledger.reserve(HOST, 3, UNIT)  # tier now full: 0, 1, 2 + pending 3
  ledger.protect(HOST, [0, 1])
  before = (resident(ledger), charged(ledger))
  # Only unit 2 (100 bytes) is evictable; 200 are needed.
  with pytest.raises(AdmissionError) as info:
    ledger.reserve(HOST, 4, 2 * UNIT)
  assert (resident(ledger), charged(ledger)) == before
  assert ledger.end_pass().host.evictions == 0
  assert events.events == []
  message = str(info.value)
  assert "unit 0 (100 bytes): in the protected window" in message
  assert "unit 1 (100 bytes): in the protected window" in message
  assert "unit 3 (100 bytes): pending reservation" in message
  assert "unit 2" not in message  # evictable units do not block
  assert "Nothing was changed" in message
  assert "100 bytes short" in message
  # What does fit still works, and evicts only the evictable unit.
  with ledger.reserve(HOST, 4, UNIT) as r:
    assert r.evicted == (2,)
    r.commit("four")
  pending.release()
  assert resident(ledger) == (0, 1, 4)
  assert [e.unit for e in events.events] == [2]


def test_admission_failure_when_unit_exceeds_budget():
  ledger = make(host=UNIT)
  with pytest.raises(AdmissionError, match="exceeds the budget"):
    ledger.reserve(HOST, 0, UNIT + 1)
  assert charged(ledger) == 0


def test_admission_evicts_fewest_entries_in_policy_order():
  ledger = make(host=4 * UNIT)
  for unit in range(4):
    install(ledger, unit)
  with ledger.reserve(HOST, 9, 2 * UNIT) as r:
    assert r.evicted == (0, 1)
    r.commit("nine")
  assert resident(ledger) == (2, 3, 9)


def test_protected_entry_fails_admission_at_once():
  ledger = make(host=UNIT)
  install(ledger, 0)
  ledger.protect(HOST, [0])
  with pytest.raises(AdmissionError, match="protected"):
    ledger.reserve(HOST, 1, UNIT)
  assert resident(ledger) == (0,)


# --- budgets -----------------------------------------------------------------


def test_budget_zero_admits_nothing():
  ledger = make(host=0, device=0)
  for tier, nbytes in [(HOST, UNIT), (DEVICE, UNIT), (HOST, 0)]:
    with pytest.raises(AdmissionError, match="disabled"):
      ledger.reserve(tier, 0, nbytes)
  assert resident(ledger) == resident(ledger, DEVICE) == ()
  assert charged(ledger) == 0
  assert ledger.get(HOST, 0) is None


def test_budget_none_is_unbounded():
  ledger = make(host=None)
  for unit in range(100):
    install(ledger, unit, nbytes=1 << 40)
  assert len(resident(ledger)) == 100
  assert charged(ledger) == 100 << 40
  metrics = ledger.end_pass().host
  assert metrics.evictions == 0 and metrics.peak_units == 100


# --- protected windows ------------------------------------------------------------


def test_protected_window_blocks_eviction_and_is_replaced():
  ledger = make(device=3 * UNIT)
  for unit in range(3):
    install(ledger, unit, tier=DEVICE)
  ledger.protect(DEVICE, [0, 1])
  with ledger.reserve(DEVICE, 3, UNIT) as r:
    assert r.evicted == (2,)
    r.commit("three")
  with pytest.raises(AdmissionError, match="protected"):
    ledger.reserve(DEVICE, 4, 2 * UNIT)
  ledger.protect(DEVICE, [3])  # replaces: 0 and 1 are evictable again
  assert ledger.reserve(DEVICE, 4, 2 * UNIT).evicted == (0, 1)
  assert resident(ledger, DEVICE) == (3,)


# --- eviction order --------------------------------------------------------------


def test_lru_evicts_least_recent_use():
  ledger = make(host=3 * UNIT, policy=LRU)
  for unit in range(3):
    install(ledger, unit)
  ledger.get(HOST, 0)
  with ledger.reserve(HOST, 3, UNIT) as r:
    assert r.evicted == (1,)
  assert ledger.reserve(HOST, 4, 3 * UNIT).evicted == (2, 0)


def test_lfu_evicts_fewest_uses_ties_by_older_use():
  ledger = make(host=3 * UNIT, policy=LFU)
  for unit in range(3):
    install(ledger, unit)  # a demand install counts one use
  for unit in (0, 0, 1, 2):
    ledger.get(HOST, unit)
  # uses: 0 -> 3, 1 -> 2, 2 -> 2; 1 was used before 2.
  with ledger.reserve(HOST, 3, UNIT) as r:
    assert r.evicted == (1,)
  assert ledger.reserve(HOST, 4, 3 * UNIT).evicted == (2, 0)


def test_lru_and_lfu_differ_on_the_same_history():
  orders = {}
  for policy in (LRU, LFU):
    ledger = make(host=3 * UNIT, policy=policy)
    for unit in range(3):
      install(ledger, unit)
    for unit in (0, 0, 1, 2):
      ledger.get(HOST, unit)
    orders[policy] = ledger.reserve(HOST, 9, 3 * UNIT).evicted
  assert orders[LRU] == (0, 1, 2)
  assert orders[LFU] == (1, 2, 0)


def test_lfu_prefetched_unused_entry_goes_first():
  ledger = make(host=3 * UNIT, policy=LFU)
  install(ledger, 0)
  install(ledger, 1)
  install(ledger, 2, prefetched=True)  # newest, but zero uses
  assert ledger.reserve(HOST, 9, 3 * UNIT).evicted == (2, 0, 1)
  lru = make(host=3 * UNIT, policy=LRU)
  for unit in range(3):
    install(lru, unit, prefetched=unit == 2)
  assert lru.reserve(HOST, 9, 3 * UNIT).evicted == (0, 1, 2)


# --- exact counters --------------------------------------------------------------


@pytest.mark.parametrize("policy", [LRU, LFU])
def test_sequential_scan_twice_thrashes(policy):
  ledger = make(host=3 * UNIT, policy=policy)
  ledger.begin_pass()
  for _ in range(2):
    for unit in range(8):
      demand(ledger, unit)
  assert ledger.end_pass().host == TierMetrics(
    requests=16,
    hits=0,
    misses=16,
    evictions=13,
    evicted_bytes=1300,
    peak_units=3,
    peak_bytes=300,
  )
  assert resident(ledger) == (5, 6, 7)


@pytest.mark.parametrize(
  ("policy", "expected"),
  [(LRU, (0, 2, 3)), (LFU, (0, 1, 2))],
)
def test_exact_counters_on_a_mixed_pattern(policy, expected):
  ledger = make(host=3 * UNIT, policy=policy)
  for unit in (0, 1, 2, 0, 1, 2, 3, 0):
    demand(ledger, unit)
  # 3 cold misses, 3 hits, then 3 misses and evicts 0 under both policies; 0
  # misses again: LRU evicts 1 (least recent), LFU evicts 3 (one use against two).
  metrics = ledger.end_pass().host
  assert (metrics.requests, metrics.hits, metrics.misses) == (8, 3, 5)
  assert (metrics.evictions, metrics.evicted_bytes) == (2, 200)
  assert metrics.hit_rate == pytest.approx(3 / 8)
  assert resident(ledger) == expected


# --- telemetry -------------------------------------------------------------------


def test_peaks_include_pending_bytes_and_restart_each_pass():
  ledger = make(host=10 * UNIT)
  ledger.begin_pass()
  install(ledger, 0)
  with ledger.reserve(HOST, 1, 3 * UNIT):
    pass  # released: never resident, but charged while pending
  install(ledger, 2)
  first = ledger.end_pass().host
  assert first.peak_bytes == 4 * UNIT
  assert first.peak_units == 2
  ledger.begin_pass()  # peaks start at the current occupancy
  second = ledger.end_pass().host
  assert (second.peak_units, second.peak_bytes) == (2, 2 * UNIT)
  with ledger.reserve(HOST, 5, 10 * UNIT) as r:  # evicts 0 and 2, then gives the bytes back
    assert r.evicted == (0, 2)
  third = ledger.end_pass().host
  assert (third.peak_units, third.peak_bytes, third.evictions) == (2, 10 * UNIT, 2)
  assert ledger.end_pass().host.peak_units == 0


def test_pass_metrics_merge_over_passes():
  ledger = make(host=UNIT, device=UNIT)
  ledger.begin_pass()
  demand(ledger, 0)
  ledger.get(DEVICE, 0)
  ok = ledger.end_pass()
  ledger.begin_pass()
  demand(ledger, 1)
  failed = ledger.end_pass()
  assert failed.host.requests == 1 and failed.host.evictions == 1
  assert ok[HOST] is ok.host and ok[DEVICE].misses == 1
  ledger.begin_pass()
  ledger.get(HOST, 1)
  later = ledger.end_pass()
  assert later.host.hits == 1
  assert (ok + later).host == TierMetrics(
    requests=2, hits=1, misses=1, evictions=0, evicted_bytes=0, peak_units=1, peak_bytes=UNIT
  )
  assert (ok + later).device == ok.device + later.device


def test_metrics_snapshots_are_immutable():
  snapshot = make().end_pass()
  assert isinstance(snapshot, LedgerMetrics)
  with pytest.raises(dataclasses.FrozenInstanceError):
    snapshot.host.hits = 3  # type: ignore[misc]


def test_on_evict_reports_evicted_before_use():
  events = Recorder()
  ledger = make(host=2 * UNIT, on_evict=events)
  install(ledger, 0, prefetched=True)  # never used
  install(ledger, 1, prefetched=True)
  assert ledger.get(HOST, 1) is not None  # used by a hit
  install(ledger, 2)  # evicts 0
  install(ledger, 3)  # evicts 1
  install(ledger, 4)  # evicts 2 (a demand install is a use)
  assert events.events == [
    Eviction(tier=HOST, unit=0, nbytes=UNIT, used=False),
    Eviction(tier=HOST, unit=1, nbytes=UNIT, used=True),
    Eviction(tier=HOST, unit=2, nbytes=UNIT, used=True),
  ]
  ledger.discard_all()  # a reset, not an eviction
  assert len(events.events) == 3


def test_failing_on_evict_hook_releases_the_reservation():
  def hook(eviction):
    raise KeyError("hook")

  ledger = make(host=UNIT, on_evict=hook)
  install(ledger, 0)
  with pytest.raises(KeyError):
    ledger.reserve(HOST, 1, UNIT)
  assert charged(ledger) == 0
  assert not ledger.is_pending(HOST, 1)


# --- freeing -----------------------------------------------------------------------


class Blob:
  pass


@pytest.mark.parametrize("kind", ["numpy", "object"])
def test_eviction_drops_the_reference(kind):
  ledger = make(host=UNIT)
  value = np.ones(UNIT // 8) if kind == "numpy" else Blob()
  ref = weakref.ref(value)
  install(ledger, 0, value=value)
  assert ledger.get(HOST, 0) is value
  del value
  gc.collect()
  assert ref() is not None  # the ledger keeps it alive
  install(ledger, 1)  # evicts 0
  assert ref() is None  # freed by refcounting, no gc.collect needed


def test_evict_discard_and_close_drop_references():
  ledger = make(host=2 * UNIT, device=None)
  refs = []
  for unit, tier in [(0, HOST), (1, HOST), (0, DEVICE)]:
    value = np.zeros(4)
    refs.append(weakref.ref(value))
    install(ledger, unit, tier=tier, value=value)
    del value
  with ledger.reserve(HOST, 2, UNIT):  # evicts 0, then gives the bytes back
    assert refs[0]() is None
  assert ledger.discard_all() == 2
  assert refs[1]() is None and refs[2]() is None
  assert ledger.end_pass().host.evictions == 1


# --- closing -----------------------------------------------------------------------


def test_close_rejects_use_and_drops_late_commits():
  ledger = make(host=2 * UNIT)
  install(ledger, 0)
  late = ledger.reserve(HOST, 1, UNIT)
  ledger.close()
  ledger.close()  # idempotent
  assert resident(ledger) == ()
  value = Blob()
  ref = weakref.ref(value)
  with pytest.raises(ClosedError):
    late.commit(value)
  del value
  assert ref() is None
  assert charged(ledger) == 0
  for call in (
    lambda: ledger.reserve(HOST, 2, UNIT),
    lambda: ledger.get(HOST, 0),
  ):
    with pytest.raises(ClosedError):
      call()


# --- properties ----------------------------------------------------------------------


class Model:
  """A reference model of one tier: the eviction rules written out plainly."""

  def __init__(self, budget, policy):
    self.budget, self.policy = budget, policy
    self.entries: dict[int, list[int]] = {}  # unit -> [nbytes, last_use, uses]
    self.clock = 0
    self.protected: set[int] = set()

  def victims(self, nbytes):
    if self.budget == 0:
      return None
    excess = sum(e[0] for e in self.entries.values()) + nbytes - self.budget
    candidates = [u for u in self.entries if u not in self.protected]
    if self.policy is LFU:
      candidates.sort(key=lambda u: (self.entries[u][2], self.entries[u][1], u))
    else:
      candidates.sort(key=lambda u: (self.entries[u][1], u))
    chosen = []
    for u in candidates:
      if excess <= 0:
        break
      chosen.append(u)
      excess -= self.entries[u][0]
    return chosen if excess <= 0 else None


operations = st.lists(
  st.one_of(
    st.tuples(st.just("get"), st.integers(0, 7)),
    st.tuples(st.just("put"), st.integers(0, 7), st.integers(0, 5), st.booleans()),
    st.tuples(st.just("protect"), st.sets(st.integers(0, 7), max_size=3)),
  ),
  max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(
  budget=st.integers(0, 12),
  policy=st.sampled_from([LRU, LFU]),
  ops=operations,
)
def test_ledger_matches_reference_model(budget, policy, ops):
  ledger = make(host=budget, policy=policy)
  model = Model(budget, policy)
  installs = misses = hits = 0
  for op in ops:
    if op[0] == "get":
      unit = op[1]
      found = ledger.get(HOST, unit)
      assert (found is not None) == (unit in model.entries)
      if found is not None:
        hits += 1
        model.clock += 1
        model.entries[unit][1] = model.clock
        model.entries[unit][2] += 1
      else:
        misses += 1
    elif op[0] == "put":
      _, unit, nbytes, prefetched = op
      if unit in model.entries:
        with pytest.raises(AdmissionError):
          ledger.reserve(HOST, unit, nbytes)
        continue
      expected = model.victims(nbytes)
      before = resident(ledger)
      if expected is None:
        with pytest.raises(AdmissionError):
          ledger.reserve(HOST, unit, nbytes)
        assert resident(ledger) == before
        continue
      with ledger.reserve(HOST, unit, nbytes) as r:
        assert list(r.evicted) == expected
        r.commit(unit, prefetched=prefetched)
      installs += 1
      for victim in expected:
        del model.entries[victim]
      model.clock += 1
      model.entries[unit] = [nbytes, model.clock, 0 if prefetched else 1]
    else:
      ledger.protect(HOST, op[1])
      model.protected = set(op[1])
    assert resident(ledger) == tuple(sorted(model.entries))
    assert charged(ledger) <= budget
  metrics = ledger.end_pass().host
  assert (metrics.hits, metrics.misses, metrics.requests) == (hits, misses, hits + misses)
  assert metrics.evictions == installs - len(model.entries)


def test_concurrent_use_keeps_the_budget():
  budget = 5 * UNIT
  ledger = make(host=budget, policy=LFU)
  errors: list[BaseException] = []
  start = threading.Barrier(4)

  def worker(seed):
    rng = np.random.default_rng(seed)
    start.wait(10)
    try:
      for _ in range(400):
        unit = int(rng.integers(0, 12))
        value = ledger.get(HOST, unit)
        if value is None:
          try:
            with ledger.reserve(HOST, unit, UNIT) as r:
              assert charged(ledger) <= budget
              r.commit(unit)
          except AdmissionError:
            pass  # resident/pending from another thread
        else:
          assert value == unit
    except BaseException as e:  # noqa: BLE001  # pragma: no cover - reported below
      errors.append(e)

  threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(30)
  assert not errors
  metrics = ledger.end_pass().host
  assert metrics.requests == metrics.hits + metrics.misses == 1600
  assert metrics.peak_bytes <= budget and charged(ledger) <= budget
