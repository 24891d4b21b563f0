"""What a placement reports: `PassReport` for one pass, `Totals` over passes, and
`Report`, the immutable view ``placed.report()`` returns (docs/design.md, section 6).

`telemetry.py` collects them as passes run; these are the frozen records.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

from jax_residency._src.report import text
from jax_residency._src.report.metrics import Metrics, StackPass, freeze, peak, plain, total
from jax_residency._src.report.speculation import SpeculationTotals
from jax_residency._src.report.stream_metrics import ExpertMetrics, TierMetrics, WorkerMetrics

PREFILL = "prefill"
DECODE = "decode"

#: How many recent passes a report keeps individually (totals cover all).
DEFAULT_PASS_HISTORY = 256


@dataclasses.dataclass
class PassCounters:
  """Byte and stall counters an engine accumulates during one pass."""

  disk_to_host_bytes: int = 0
  disk_to_device_bytes: int = 0
  host_to_device_bytes: int = 0
  stalls: int = 0
  stall_seconds: float = 0.0
  peak_buffer_bytes: int = 0
  mapped_bytes: int = 0
  fetched_bytes: int = 0
  step_temp_bytes: int = 0
  timeline: list[TimelinePoint] = dataclasses.field(default_factory=list)
  stacks: dict[str, StackPass] = dataclasses.field(default_factory=dict)
  experts: ExpertMetrics | None = None


@dataclasses.dataclass(frozen=True)
class TimelinePoint:
  """Where unit bytes were when a step of the unit loop got its unit.

  Attributes:
    seconds: time since the pass started.
    unit: the unit the step runs.
    host_bytes: unit bytes held in the host cache.
    device_bytes: unit bytes held on the device.

  ``PassReport.timeline`` holds one per step (its example runs a pass).

  Example:
    >>> import jax_residency as jr
    >>> point = jr.TimelinePoint(seconds=0.125, unit=1, host_bytes=3 << 20, device_bytes=2 << 20)
    >>> point.unit, point.seconds, point.device_bytes >> 20  # MiB on the device
    (1, 0.125, 2)
  """

  seconds: float
  unit: int
  host_bytes: int
  device_bytes: int


class _Moved:
  """What a pass report and a total share: bytes read, and a JSON form."""

  disk_to_host_bytes: int
  disk_to_device_bytes: int

  @property
  def bytes_read(self) -> int:
    """Bytes read from disk (into host memory or straight to a device)."""
    return self.disk_to_host_bytes + self.disk_to_device_bytes

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dictionary."""
    d = plain(self)
    d["bytes_read"] = self.bytes_read
    return d


@dataclasses.dataclass(frozen=True, kw_only=True)
class PassReport(_Moved):
  """One successful forward pass.

  Attributes:
    index: 0-based pass number over the placed model's life.
    phase: ``"prefill"`` (more than one token along the sequence axis) or ``"decode"``.
    tokens: tokens along the sequence axis of the first array argument.
    seconds: wall time of the pass, outputs ready.
    compile_seconds: the part of ``seconds`` the pass's thread spent tracing,
      lowering and compiling XLA programs (or loading them from JAX's
      persistent compilation cache); ``0.0`` once every program the pass runs
      is compiled. ``seconds - compile_seconds`` is the time spent running.
    host, device: cache metrics per tier (``None`` where the policy has no
      such cache).
    disk_to_host_bytes, disk_to_device_bytes, host_to_device_bytes: bytes moved.
    stalls, stall_seconds: times the pass waited for a unit, and for how long.
    peak_device_units, peak_device_bytes: most unit copies / bytes on a device:
      for a dense stream, measured as held (its device ledger, plus the units it
      keeps on the device); for ``FullyResident`` / ``LayerwiseHost``, not a
      measured peak but the unit arrays the placement holds in device memory when
      the pass ends (they hold every unit for their whole life; ``LayerwiseHost``'s
      device window is inside its program, in ``step_temp_bytes``).
    peak_host_units, peak_host_bytes: most unit copies / bytes in host memory:
      for a dense stream, measured as held (its host ledger, plus its host-resident
      units); for ``LayerwiseHost``, the unit arrays it holds in ``pinned_host``
      memory when the pass ends, per device; 0 for ``FullyResident``.
    peak_buffer_bytes: for a dense stream, the most bytes of unit read buffers
      (live and idle) the store held at once: the host memory under the host
      cache, staging and (on CPU, where they are the device arrays) the device
      window; each tensor rounded up to a page. Mapped chunk ranges count as
      buffers. 0 for other policies.
    mapped_bytes: of the bytes moved from the store, those a dense stream on a
      CPU backend mapped from the store's files instead of copying (the arrays
      view the page cache; see ``jax_residency/_src/mapped.py``).
    fetched_bytes: for a dense stream, bytes fetched from the store's storage
      during the pass (see ``Report.fetched_bytes``); more than ``bytes_read``
      where a chunk holds several units or is compressed. 0 for other policies.
    step_temp_bytes: the temporaries XLA allocates while the pass's compiled
      program runs (its ``memory_analysis``): for a dense stream, its largest
      unit step; for ``FullyResident`` / ``LayerwiseHost``, the whole jitted
      forward. The plan does not count them, as the plain model needs them
      too. 0 where the backend does not say.
    worker: background prefetch counters (dense stream with a host cache).
    process: with ``sample_process_memory`` on Linux, ``rss_bytes`` when the
      pass ended, ``peak_rss_bytes`` and ``minor_faults`` / ``major_faults``
      since the previous pass ended (for the first pass: since placement);
      ``None`` when not sampled or not on Linux.
    backend: with ``sample_backend_memory``, the devices' ``memory_stats()``,
      or live-array bytes per memory kind where the backend has no stats;
      else ``None``.
    timeline: for a dense stream, one :class:`TimelinePoint` per step of the
      unit loop (where the bytes were over the pass); empty for policies that
      run the loop as one compiled program.
    stacks: each placed layer stack's share of the pass (:class:`StackPass`),
      by its path (``"encoder_layers"``).
    experts: with expert residency, what the pass did with experts
      (:class:`ExpertMetrics`: picks, hits, bytes, speculative precision); else
      ``None``.

  Example:
    >>> import jax.numpy as jnp, jax_residency as jr
    >>> from flax import nnx
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> info = jr.save(model, "memory://pass_report/toy", progress=False)  # or a directory
    >>> with jr.place(model, jr.DenseDiskStream(host_budget_bytes="1MiB"), store=info.path) as p:
    ...   _ = p(jnp.zeros((1, 4), jnp.int32))
    ...   last = p.report().last
    >>> last.index, last.phase, last.tokens, last.bytes_read == info.total_unit_bytes
    (0, 'prefill', 4, True)
    >>> window = p.metadata.device_window_bytes  # one timeline point per step of the unit loop
    >>> [(t.unit, 0 < t.device_bytes <= window) for t in last.timeline]
    [(0, True), (1, True)]
  """

  index: int
  phase: str
  tokens: int
  seconds: float
  compile_seconds: float = 0.0
  host: TierMetrics | None
  device: TierMetrics | None
  disk_to_host_bytes: int
  disk_to_device_bytes: int
  host_to_device_bytes: int
  stalls: int
  stall_seconds: float
  peak_device_units: int
  peak_device_bytes: int
  peak_host_units: int
  peak_host_bytes: int
  peak_buffer_bytes: int = 0
  mapped_bytes: int = 0
  fetched_bytes: int = 0
  step_temp_bytes: int = 0
  worker: WorkerMetrics | None = None
  process: Mapping[str, int] | None = None
  backend: Mapping[str, Any] | None = None
  timeline: tuple[TimelinePoint, ...] = ()
  stacks: Mapping[str, StackPass] = dataclasses.field(default_factory=dict)
  experts: ExpertMetrics | None = None

  def __post_init__(self) -> None:
    object.__setattr__(self, "stacks", types.MappingProxyType(dict(self.stacks)))
    object.__setattr__(self, "process", freeze(self.process))
    object.__setattr__(self, "backend", freeze(self.backend))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Totals(_Moved, Metrics):
  """Counters summed (peaks and ``step_temp_bytes`` maxed) over a set of passes.

  ``peak_rss_bytes``, ``minor_faults`` and ``major_faults`` come from the
  passes' process samples and are ``None`` when no pass had one.

  ``placed.report()`` holds three: ``prefill``, ``decode`` and ``total``.
  ``Totals.of(pass_report)`` is one pass's; ``+`` merges two.

  Example:
    >>> import jax_residency as jr
    >>> prefill = jr.Totals(passes=1, seconds=2.0, disk_to_host_bytes=300, peak_host_bytes=300)
    >>> decode = jr.Totals(passes=2, seconds=0.5, disk_to_host_bytes=600, peak_host_bytes=200)
    >>> both = prefill + decode
    >>> both.passes, both.seconds, both.bytes_read, both.peak_host_bytes
    (3, 2.5, 900, 300)
  """

  passes: int = total()
  seconds: float = total(0.0)
  compile_seconds: float = total(0.0)
  host: TierMetrics | None = total(None)
  device: TierMetrics | None = total(None)
  disk_to_host_bytes: int = total()
  disk_to_device_bytes: int = total()
  host_to_device_bytes: int = total()
  stalls: int = total()
  stall_seconds: float = total(0.0)
  peak_device_units: int = peak()
  peak_device_bytes: int = peak()
  peak_host_units: int = peak()
  peak_host_bytes: int = peak()
  peak_buffer_bytes: int = peak()
  mapped_bytes: int = total()
  fetched_bytes: int = total()
  step_temp_bytes: int = peak()
  worker: WorkerMetrics | None = total(None)
  peak_rss_bytes: int | None = peak(None)
  minor_faults: int | None = total(None)
  major_faults: int | None = total(None)
  experts: ExpertMetrics | None = total(None)

  @classmethod
  def of(cls, p: PassReport) -> Totals:
    """The totals of the single pass ``p``."""
    fields = {f.name for f in dataclasses.fields(cls)} - {"passes", *_PROCESS_FIELDS}
    process = p.process or {}
    values: dict[str, Any] = {name: getattr(p, name) for name in fields}
    values.update((name, process.get(name)) for name in _PROCESS_FIELDS)
    return cls(passes=1, **values)


#: Process-sample keys that :class:`Totals` aggregates (peak maxed, faults summed).
_PROCESS_FIELDS = ("peak_rss_bytes", "minor_faults", "major_faults")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Report:
  """What a placed model did: recent passes and cumulative totals.

  Immutable: the dictionaries are read-only views (``to_dict()`` returns
  plain, JSON-serialisable copies).

  Attributes:
    policy: the policy's ``to_dict()``.
    metadata: the placed model's metadata ``to_dict()``.
    passes: the most recent passes (up to the history length), oldest first.
    prefill, decode, total: cumulative totals over every committed pass.
    fetched_bytes: bytes fetched from the store's storage since ``place`` was
      called (0 without ``store=``): store metadata, chunks, index nodes, and
      for a dense stream every pass's reads and read-ahead. TensorStore's
      per-kind counters (file, HTTP, GCS, S3; none for ``memory://``) count
      them process-wide, so other stores of the same kind read at the same
      time count too; mapped and direct reads of local files are added.
    speculation: what speculative decoding with this placement as the target did,
      summed over its generations (`SpeculationTotals`); None where none ran.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> toy = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> with jr.place(toy, jr.LayerwiseHost()) as placed:
    ...   _ = placed(jnp.zeros((1, 4), jnp.int32))  # 4 tokens: a prefill pass
    ...   _ = placed(jnp.zeros((1, 1), jnp.int32))  # 1 token: a decode pass
    ...   report = placed.report()  # a snapshot: later passes do not change it
    >>> [p.phase for p in report.passes], report.total.passes, report.last is report.passes[-1]
    (['prefill', 'decode'], 2, True)
    >>> report.policy["kind"], report.total.bytes_read, "prefill" in str(report)
    ('layerwise_host', 0, True)
  """

  policy: Mapping[str, Any]
  metadata: Mapping[str, Any]
  passes: tuple[PassReport, ...]
  prefill: Totals
  decode: Totals
  total: Totals
  fetched_bytes: int = 0
  speculation: SpeculationTotals | None = None

  def __post_init__(self) -> None:
    object.__setattr__(self, "policy", freeze(self.policy))
    object.__setattr__(self, "metadata", freeze(self.metadata))
    object.__setattr__(self, "passes", tuple(self.passes))

  @property
  def last(self) -> PassReport | None:
    return self.passes[-1] if self.passes else None

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dictionary."""
    return {
      "policy": plain(self.policy),
      "metadata": plain(self.metadata),
      "passes": [p.to_dict() for p in self.passes],
      "prefill": self.prefill.to_dict(),
      "decode": self.decode.to_dict(),
      "total": self.total.to_dict(),
      "fetched_bytes": self.fetched_bytes,
      "speculation": None if self.speculation is None else self.speculation.to_dict(),
    }

  def __str__(self) -> str:
    return text.render(self)
