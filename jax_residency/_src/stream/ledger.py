"""The residency ledger: which units have a copy on the host and on the device.

A dense stream (docs/design.md, section 4.3) keeps, per tier, a byte-bounded cache of unit copies.
The ledger is the bookkeeping of that cache and nothing else: it never reads or
moves data. Values are opaque (numpy dicts, jax arrays); their byte size is
whatever the caller charges for them.

* **Admission is atomic.** `reserve` either makes room by evicting unprotected
  entries in policy order and holds the bytes, or raises `AdmissionError`
  naming every blocking unit and changes nothing.
* **Reservations are context managers** (orbax `LimitInFlightBytes` style):
  bytes are charged while pending, `commit(value)` installs the entry, leaving
  the block without committing gives the bytes back.
* **Protected windows** pin entries: one in the protected window (current +
  next on device, the lookahead on host) is never evicted.
* **Telemetry** (docs/design.md, section 6) is kept per pass: `begin_pass()` starts a fresh
  accumulator, `end_pass()` returns an immutable snapshot.

Everything is guarded by one lock.
"""

from __future__ import annotations

import dataclasses
import operator
import threading
from collections.abc import Callable, Iterable
from typing import Any

from jax_residency._src.errors import (
  AdmissionError,
  ClosedError,
  InvalidBudgetError,
  ResidencyRuntimeError,
  WeightResidencyPolicyError,
)
from jax_residency._src.policy.options import CacheEvictionPolicy
from jax_residency._src.report.metrics import Tally
from jax_residency._src.report.stream_metrics import LedgerMetrics, Tier, TierMetrics


@dataclasses.dataclass(frozen=True)
class Eviction:
  """What the `on_evict` hook is told. Holds no reference to the value.

  Attributes:
    tier: the tier the entry left.
    unit: the unit id.
    nbytes: the bytes it was charged.
    used: False if it was installed with `commit(..., prefetched=True)` and no
      `get` ever hit it, i.e. it was evicted before use.
  """

  tier: Tier
  unit: int
  nbytes: int
  used: bool


@dataclasses.dataclass(slots=True)
class _Entry:
  value: Any
  nbytes: int
  last_use: int  # logical clock of the install or the latest hit
  uses: int  # hits, plus one for a demand install
  used: bool  # False until the first hit of a prefetched install


class _TierState:
  __slots__ = ("budget", "entries", "pending", "protected", "counters")

  def __init__(self, budget: int | None):
    self.budget = budget
    self.entries: dict[int, _Entry] = {}
    self.pending: dict[int, int] = {}  # unit -> reserved bytes
    self.protected: frozenset[int] = frozenset()
    self.counters = Tally(TierMetrics)

  def resident_bytes(self) -> int:
    return sum(e.nbytes for e in self.entries.values())

  def charged_bytes(self) -> int:
    return self.resident_bytes() + sum(self.pending.values())

  def note_peaks(self) -> None:
    self.counters.raise_to(peak_units=len(self.entries), peak_bytes=self.charged_bytes())

  def fresh_counters(self) -> None:
    self.counters = Tally(TierMetrics)
    self.note_peaks()


def _check_budget(name: str, value: int | None) -> int | None:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int) or value < 0:
    raise InvalidBudgetError(
      f"{name}={value!r} is not a byte budget; pass a non-negative int (0 disables the tier) "
      "or None for an unbounded tier."
    )
  return value


class Reservation:
  """Bytes held on one tier for one unit until committed or released.

  Returned by `ResidencyLedger.reserve`; use it as a context manager so the
  bytes are always released:

    with ledger.reserve(Tier.HOST, unit, nbytes) as r:
      r.commit(read_unit(unit))

  Attributes:
    tier: the tier.
    unit: the unit id.
    nbytes: the reserved (and, after commit, charged) bytes.
    evicted: units evicted to make room, in eviction order.
  """

  __slots__ = ("_ledger", "tier", "unit", "nbytes", "evicted", "_state")

  def __init__(
    self, ledger: ResidencyLedger, tier: Tier, unit: int, nbytes: int, evicted: tuple[int, ...]
  ):
    self._ledger = ledger
    self.tier = tier
    self.unit = unit
    self.nbytes = nbytes
    self.evicted = evicted
    self._state = "pending"  # -> "committed" | "released"

  def commit(self, value: Any, *, prefetched: bool = False) -> None:
    """Installs `value` as the unit's entry, charged `nbytes`.

    Args:
      value: the copy; the ledger keeps the only reference it takes.
      prefetched: True for a speculative install (background prefetch): the
        entry starts with zero uses and counts as unused until a `get` hits it.
        False (a demand install) counts the install itself as one use.

    Raises:
      ResidencyRuntimeError: the reservation was already committed or released.
      ClosedError: the ledger was closed; the bytes are released.
    """
    self._ledger._commit(self, value, prefetched)

  def release(self) -> None:
    """Gives the bytes back unless committed. Idempotent."""
    self._ledger._release(self)

  def __enter__(self) -> Reservation:
    return self

  def __exit__(self, *exc: object) -> None:
    self.release()

  def __repr__(self) -> str:
    return (
      f"Reservation(tier={self.tier.name}, unit={self.unit}, nbytes={self.nbytes}, "
      f"state={self._state})"
    )


class ResidencyLedger:
  """Thread-safe host/device residency bookkeeping with atomic admission.

  Args:
    host_budget_bytes: bytes the host tier may charge; None = unbounded, 0 =
      nothing fits (the tier is disabled).
    device_budget_bytes: the same for the device tier.
    eviction_policy: which entry goes first. LRU: least recent use (install or
      hit, on a logical clock). LFU: fewest uses, ties by older use, then unit id.
    on_evict: called with an `Eviction` for every eviction by `reserve` (not
      by `discard_all`), after the ledger's lock is released. It must not
      raise; if it does, the `reserve` that evicted is undone as far as the
      reservation goes (the evictions stay) and the error propagates.

  Semantics: reserving a unit that already has an entry or a pending
  reservation on that tier raises `AdmissionError` (check `contains` /
  `is_pending` first).

  Example:
    >>> from jax_residency._src.policy.options import CacheEvictionPolicy
    >>> ledger = ResidencyLedger(host_budget_bytes=200, device_budget_bytes=None,
    ...                          eviction_policy=CacheEvictionPolicy.LEAST_RECENTLY_USED)
    >>> for unit in range(3):
    ...   with ledger.reserve(Tier.HOST, unit, 100) as r:
    ...     r.commit({"w": unit})
    >>> [unit for unit in range(3) if ledger.contains(Tier.HOST, unit)]
    [1, 2]
    >>> ledger.get(Tier.HOST, 2)
    {'w': 2}
    >>> ledger.end_pass().host.evictions
    1
  """

  def __init__(
    self,
    *,
    host_budget_bytes: int | None,
    device_budget_bytes: int | None,
    eviction_policy: CacheEvictionPolicy = CacheEvictionPolicy.LEAST_RECENTLY_USED,
    on_evict: Callable[[Eviction], None] | None = None,
  ):
    if not isinstance(eviction_policy, CacheEvictionPolicy):
      raise WeightResidencyPolicyError(
        f"eviction_policy={eviction_policy!r} is not a CacheEvictionPolicy; pass "
        "CacheEvictionPolicy.LEAST_RECENTLY_USED or CacheEvictionPolicy.LEAST_FREQUENTLY_USED."
      )
    self._policy = eviction_policy
    self._on_evict = on_evict
    self._lock = threading.Lock()
    self._clock = 0
    self._closed = False
    self._tiers = {
      Tier.HOST: _TierState(_check_budget("host_budget_bytes", host_budget_bytes)),
      Tier.DEVICE: _TierState(_check_budget("device_budget_bytes", device_budget_bytes)),
    }

  def get(self, tier: Tier, unit: int) -> Any | None:
    """The unit's value or None; counts a request and a hit or a miss.

    A hit is a use: it advances the entry's recency and frequency and marks a
    prefetched entry as used.
    """
    with self._lock:
      self._check_open()
      st = self._tiers[tier]
      entry = st.entries.get(unit)
      if entry is None:
        st.counters.add(requests=1, misses=1)
        return None
      st.counters.add(requests=1, hits=1)
      entry.last_use = self._tick()
      entry.uses += 1
      entry.used = True
      return entry.value

  def peek(self, tier: Tier, unit: int) -> Any | None:
    """The unit's value or None, counting no request and no use."""
    with self._lock:
      self._check_open()
      entry = self._tiers[tier].entries.get(unit)
      return None if entry is None else entry.value

  def contains(self, tier: Tier, unit: int) -> bool:
    with self._lock:
      return unit in self._tiers[tier].entries

  def is_pending(self, tier: Tier, unit: int) -> bool:
    """Whether a reservation for the unit is held but not yet committed."""
    with self._lock:
      return unit in self._tiers[tier].pending

  def resident_bytes(self, tier: Tier) -> int:
    """Bytes charged by installed entries."""
    with self._lock:
      return self._tiers[tier].resident_bytes()

  def reserve(self, tier: Tier, unit: int, nbytes: int) -> Reservation:
    """Holds `nbytes` on `tier` for `unit`, evicting by policy to make room.

    Admission happens when `reserve` is called (not on `__enter__`). It is
    atomic: either enough unprotected entries are evicted (fewest needed,
    policy order) and the bytes are held, or nothing changes.

    Args:
      tier: the tier.
      unit: the unit id; it must have no entry and no pending reservation.
      nbytes: bytes to hold; they count against the budget until released.

    Raises:
      AdmissionError: it does not fit even after evicting everything
        evictable (the message lists each blocking unit and why), the tier is
        disabled (budget 0), the unit is already resident or pending, or
        `nbytes` is negative.
      ClosedError: the ledger is closed.
    """
    unit = operator.index(unit)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
      raise AdmissionError(f"reserve(nbytes={nbytes!r}) needs a non-negative int byte count.")
    with self._lock:
      self._check_open()
      st = self._tiers[tier]
      if unit in st.entries or unit in st.pending:
        what = "resident" if unit in st.entries else "already reserved (pending)"
        raise AdmissionError(
          f"cannot reserve unit {unit} on the {tier.value} tier: it is {what}. "
          "Check contains()/is_pending() before reserving; nothing was changed."
        )
      victims = self._plan(st, nbytes)
      if victims is None:
        raise AdmissionError(self._blocked_message(tier, st, unit, nbytes))
      evictions = [self._drop(tier, st, victim) for victim in victims]
      st.pending[unit] = nbytes
      st.note_peaks()
      reservation = Reservation(self, tier, unit, nbytes, tuple(victims))
    try:
      if self._on_evict is not None:
        for eviction in evictions:
          self._on_evict(eviction)
    except BaseException:
      reservation.release()
      raise
    return reservation

  def _plan(self, st: _TierState, nbytes: int) -> list[int] | None:
    """Victims that make `nbytes` fit, in eviction order; None if impossible."""
    if st.budget is None:
      return []
    if st.budget == 0:
      return None
    excess = st.charged_bytes() + nbytes - st.budget
    if excess <= 0:
      return []
    victims: list[int] = []
    for unit in self._eviction_order(st):
      victims.append(unit)
      excess -= st.entries[unit].nbytes
      if excess <= 0:
        return victims
    return None

  def _eviction_order(self, st: _TierState) -> list[int]:
    units = [u for u in st.entries if u not in st.protected]
    if self._policy is CacheEvictionPolicy.LEAST_FREQUENTLY_USED:
      return sorted(units, key=lambda u: (st.entries[u].uses, st.entries[u].last_use, u))
    return sorted(units, key=lambda u: (st.entries[u].last_use, u))

  def _blocked_message(self, tier: Tier, st: _TierState, unit: int, nbytes: int) -> str:
    name = f"{tier.value}_budget_bytes"
    head = f"cannot reserve {nbytes} bytes for unit {unit} on the {tier.value} tier"
    if st.budget == 0:
      return (
        f"{head}: the tier is disabled ({name}=0). Nothing was changed. "
        f"Fix: use a positive {name} or do not stage units on this tier."
      )
    assert st.budget is not None
    evictable = sum(e.nbytes for u, e in st.entries.items() if u not in st.protected)
    charged = st.charged_bytes()
    short = charged - evictable + nbytes - st.budget
    lines = [
      f"{head}: {name}={st.budget}, charged={charged} (resident={st.resident_bytes()}, "
      f"pending={charged - st.resident_bytes()}), evictable={evictable}; even after evicting "
      f"every evictable entry it is {short} bytes short. Nothing was changed."
    ]
    if nbytes > st.budget:
      lines.append(f"The unit alone exceeds the budget. Fix: raise {name} to at least {nbytes}.")
    blockers = [
      (u, f"  unit {u} ({e.nbytes} bytes): in the protected window")
      for u, e in st.entries.items()
      if u in st.protected
    ]
    blockers += [(u, f"  unit {u} ({n} bytes): pending reservation") for u, n in st.pending.items()]
    if blockers:
      lines.append("Blocking units:")
      lines.extend(line for _, line in sorted(blockers))
      lines.append(f"Fix: finish reservations first, shrink the protected window, or raise {name}.")
    return "\n".join(lines)

  def _commit(self, res: Reservation, value: Any, prefetched: bool) -> None:
    with self._lock:
      if res._state != "pending":
        raise ResidencyRuntimeError(f"{res!r} cannot be committed: it is no longer pending.")
      st = self._tiers[res.tier]
      if self._closed:
        self._release_locked(res)
        raise ClosedError(
          f"cannot commit unit {res.unit}: the residency ledger was closed; the value was dropped."
        )
      del st.pending[res.unit]
      res._state = "committed"
      st.entries[res.unit] = _Entry(
        value=value,
        nbytes=res.nbytes,
        last_use=self._tick(),
        uses=0 if prefetched else 1,
        used=not prefetched,
      )
      st.note_peaks()

  def _release(self, res: Reservation) -> None:
    with self._lock:
      self._release_locked(res)

  def _release_locked(self, res: Reservation) -> None:
    if res._state == "pending":
      del self._tiers[res.tier].pending[res.unit]
      res._state = "released"

  def protect(self, tier: Tier, units: Iterable[int]) -> None:
    """Replaces the tier's protected window; entries in it are never evicted."""
    window = frozenset(operator.index(u) for u in units)
    with self._lock:
      self._tiers[tier].protected = window

  def discard_all(self) -> int:
    """Drops every entry of both tiers, whatever pins them; returns how many.

    Not counted as evictions and not reported to `on_evict` (this is a reset,
    e.g. at close). Pending reservations and windows are kept.
    """
    with self._lock:
      dropped = 0
      for st in self._tiers.values():
        dropped += len(st.entries)
        st.entries.clear()
      return dropped

  def close(self) -> None:
    """Discards all entries; afterwards `reserve`, `get` and `commit` raise
    `ClosedError`. Idempotent."""
    with self._lock:
      self._closed = True
      for st in self._tiers.values():
        st.entries.clear()

  def _drop(self, tier: Tier, st: _TierState, unit: int) -> Eviction:
    entry = st.entries.pop(unit)
    st.counters.add(evictions=1, evicted_bytes=entry.nbytes)
    return Eviction(tier=tier, unit=unit, nbytes=entry.nbytes, used=entry.used)

  def begin_pass(self) -> None:
    """Starts a fresh per-pass accumulator; peaks start at the current occupancy."""
    with self._lock:
      for st in self._tiers.values():
        st.fresh_counters()

  def end_pass(self) -> LedgerMetrics:
    """Ends the pass: returns its metrics and starts a fresh accumulator (the placed
    model's telemetry keeps the totals of the passes that succeeded)."""
    with self._lock:
      snapshot = LedgerMetrics(
        host=self._tiers[Tier.HOST].counters.snapshot(),
        device=self._tiers[Tier.DEVICE].counters.snapshot(),
      )
      for st in self._tiers.values():
        st.fresh_counters()
      return snapshot

  def _tick(self) -> int:
    self._clock += 1
    return self._clock

  def _check_open(self) -> None:
    if self._closed:
      raise ClosedError("the residency ledger was used after close().")
