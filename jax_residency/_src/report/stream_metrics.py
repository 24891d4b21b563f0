"""The counters a dense stream keeps per pass: its two cache tiers and its read worker.

They are report types: the stream's ledger and worker fill them, `PassReport`
carries them, and `+` merges passes into totals.
"""

from __future__ import annotations

import dataclasses
import enum

from jax_residency._src.report.metrics import Metrics, peak, total


class Tier(enum.Enum):
  """A tier of the residency ledger."""

  HOST = "host"
  DEVICE = "device"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TierMetrics(Metrics):
  """Cache counters of one tier over one pass (or over passes, merged with `+`).

  Attributes:
    requests: `get` calls.
    hits: `get` calls that found the unit.
    misses: `get` calls that did not.
    evictions: entries removed to make room.
    evicted_bytes: charged bytes of those entries.
    peak_units: most resident entries at once.
    peak_bytes: most charged bytes at once, pending reservations included.

  A dense stream's ``placed.report().last.host`` and ``.device`` are two of these.

  Example:
    >>> import jax_residency as jr
    >>> first = jr.TierMetrics(requests=4, hits=3, misses=1, peak_units=2, peak_bytes=200)
    >>> second = jr.TierMetrics(requests=2, hits=2, peak_units=3, peak_bytes=150)
    >>> both = first + second  # counts add up, peaks take the larger
    >>> both.requests, both.hits + both.misses, both.peak_units, both.peak_bytes
    (6, 6, 3, 200)
    >>> round(both.hit_rate, 3), jr.TierMetrics().hit_rate  # None: nothing was requested
    (0.833, None)
  """

  requests: int = total()
  hits: int = total()
  misses: int = total()
  evictions: int = total()
  evicted_bytes: int = total()
  peak_units: int = peak()
  peak_bytes: int = peak()

  @property
  def hit_rate(self) -> float | None:
    """`hits / requests`, or `None` when nothing was requested."""
    return self.hits / self.requests if self.requests else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class LedgerMetrics(Metrics):
  """`TierMetrics` of both tiers; `metrics[Tier.HOST]` works too."""

  host: TierMetrics = total(TierMetrics())
  device: TierMetrics = total(TierMetrics())

  def __getitem__(self, tier: Tier) -> TierMetrics:
    return self.host if tier is Tier.HOST else self.device


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerMetrics(Metrics):
  """Counters of the prefetch worker over one pass (or over passes, merged with `+`).

  Attributes:
    submitted: requests queued by `submit`.
    coalesced: `submit` calls for a unit already queued or in flight.
    rejected: `submit(block=False)` (or timed-out) calls that found the queue full.
    completed: loads that returned normally in their own epoch.
    cancelled: requests dropped or fenced by `cancel()`/`close()`: queued, in
      flight, or blocked in `submit`.
    failed: loads that raised in their own epoch.
    peak_queue_occupancy: most requests waiting at once (in flight excluded).
    backpressure_count: `submit` calls that blocked on a full queue.
    backpressure_seconds: time spent blocked there.
    demand_waits: `wait` calls that had to block for a queued/in-flight unit.
    demand_wait_seconds: time spent blocked there.
    ready_before_demand: requests already completed when first waited for.
    evicted_before_use: prefetched units evicted before any use (reported by
      the engine through `note_evicted_before_use`).

  A dense stream's ``placed.report().last.worker`` is one of these (``None``
  without a host cache: no thread reads ahead then).

  Example:
    >>> import jax_residency as jr
    >>> one = jr.WorkerMetrics(submitted=3, completed=3, ready_before_demand=2,
    ...                        peak_queue_occupancy=2)
    >>> two = jr.WorkerMetrics(submitted=2, coalesced=1, completed=1, demand_waits=1,
    ...                        demand_wait_seconds=0.25, peak_queue_occupancy=1)
    >>> both = one + two  # counts and seconds add up, the queue's peak takes the larger
    >>> both.submitted, both.completed, both.demand_wait_seconds, both.peak_queue_occupancy
    (5, 4, 0.25, 2)
  """

  submitted: int = total()
  coalesced: int = total()
  rejected: int = total()
  completed: int = total()
  cancelled: int = total()
  failed: int = total()
  peak_queue_occupancy: int = peak()
  backpressure_count: int = total()
  backpressure_seconds: float = total(0.0)
  demand_waits: int = total()
  demand_wait_seconds: float = total(0.0)
  ready_before_demand: int = total()
  evicted_before_use: int = total()


@dataclasses.dataclass(frozen=True, kw_only=True)
class ExpertMetrics(Metrics):
  """What a dense stream with expert residency did with experts over one pass (or over
  passes, merged with `+`): ``placed.report().last.experts`` (``None`` without
  `ExpertResidency`). Expert bytes count in the pass's ``bytes_read`` too; these say
  which part of it the experts were.

  Attributes:
    selected: experts the routers picked, each layer's distinct picks counted once.
    hits: picks found in the device expert cache.
    misses: picks that had to come from the host expert cache or the store.
    host_hits: of the misses, those the host expert cache held.
    bytes_read: expert bytes read from the store (the speculative reads included).
    bytes_moved: expert bytes moved to the device.
    predicted: experts the speculative prefetch read ahead (or found cached) for the
      next layer.
    predicted_used: of those, the ones the next layer's router picked.
    read_ahead: experts the speculative prefetch read from the store (so
      ``bytes_read`` is ``misses - host_hits + read_ahead`` experts' bytes).
    device, host: the expert caches' counters (``host`` is None without a host expert
      cache); their ``peak_bytes`` are the caches' peaks.

  Example:
    >>> import jax_residency as jr
    >>> one = jr.ExpertMetrics(selected=4, hits=1, misses=3, predicted=4, predicted_used=3)
    >>> (one + one).selected, one.precision
    (8, 0.75)
  """

  selected: int = total()
  hits: int = total()
  misses: int = total()
  host_hits: int = total()
  bytes_read: int = total()
  bytes_moved: int = total()
  predicted: int = total()
  predicted_used: int = total()
  read_ahead: int = total()
  device: TierMetrics = total(TierMetrics())
  host: TierMetrics | None = total(None)

  @property
  def precision(self) -> float | None:
    """``predicted_used / predicted``: how often a speculative read was a pick (None:
    nothing predicted)."""
    return self.predicted_used / self.predicted if self.predicted else None
