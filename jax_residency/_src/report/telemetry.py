"""Per-pass telemetry: what moved, when, and what it cost (docs/design.md, section 6).

A placed model owns one :class:`Telemetry`. Each forward pass that succeeds is
committed as a :class:`PassReport` (a failed pass commits nothing, so totals
stay as they were). ``placed.report()`` returns an immutable :class:`Report`
with the recent passes and cumulative prefill / decode / overall totals.

With the policy's ``sample_process_memory`` / ``sample_backend_memory`` flags,
:meth:`Telemetry.for_policy` adds the samplers of ``report/sampling.py``: each pass
then reports process RSS, peak RSS and page faults (Linux; ``None`` elsewhere)
and the backend's memory. The placed model starts them when it is created and
stops them when it is closed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.policy.types import LayerWeightResidency
from jax_residency._src.report import compile_time
from jax_residency._src.report.records import (
  DECODE,
  DEFAULT_PASS_HISTORY,
  PREFILL,
  PassCounters,
  PassReport,
  Report,
  Totals,
)
from jax_residency._src.report.speculation import SpeculationTotals
from jax_residency._src.report.stream_metrics import LedgerMetrics, Tier, WorkerMetrics


def count_tokens(args: Sequence[Any], sequence_axis: int) -> int:
  """Tokens along ``sequence_axis`` of the first array argument that has it (1 if none).

  A negative axis counts from the end, as in NumPy.
  """
  for a in args:
    shape = getattr(a, "shape", None)
    if shape is not None and -len(shape) <= sequence_axis < len(shape):
      return int(shape[sequence_axis])
  return 1


class Telemetry:
  """Collects committed passes for one placed model. Thread-safe.

  Args:
    policy: the placed model's policy.
    metadata: the placed model's metadata.
    sequence_axis: the axis of the first array argument that counts tokens.
    history: how many recent passes to keep individually.
    samplers: callables returning extra per-pass fields (``process``, ``backend``),
      called when a pass commits. A sampler with ``start()`` / ``close()``
      methods is started by :meth:`start` and closed by :meth:`close`. A
      sampler that raises records ``None`` rather than failing the pass.
  """

  def __init__(
    self,
    *,
    policy: LayerWeightResidency,
    metadata: ModelMetadata,
    sequence_axis: int = 1,
    history: int = DEFAULT_PASS_HISTORY,
    samplers: dict[str, Callable[[], Any]] | None = None,
  ) -> None:
    self._policy = policy
    self._metadata = metadata
    self._sequence_axis = sequence_axis
    self._passes: collections.deque[PassReport] = collections.deque(maxlen=history)
    self._count = 0
    self._totals = {PREFILL: Totals(), DECODE: Totals()}
    self._lock = threading.Lock()
    self._speculation: SpeculationTotals | None = None
    self._samplers = dict(samplers or {})
    #: Bytes fetched from the placement's store since `place` (None: no store).
    self.fetched: Callable[[], int] | None = None
    compile_time.install()  # before the first pass compiles anything

  @classmethod
  def for_policy(
    cls,
    *,
    policy: LayerWeightResidency,
    metadata: ModelMetadata,
    sequence_axis: int = 1,
    history: int = DEFAULT_PASS_HISTORY,
  ) -> Telemetry:
    """The telemetry of a placed model, with the samplers its policy's flags ask for."""
    samplers: dict[str, Callable[[], Any]] = {}
    if policy.sample_process_memory or policy.sample_backend_memory:
      from jax_residency._src.report import sampling  # noqa: PLC0415 - only sampling policies need it

      if policy.sample_process_memory:
        samplers["process"] = sampling.ProcessMemorySampler()
      if policy.sample_backend_memory:
        samplers["backend"] = sampling.backend_memory
    return cls(
      policy=policy,
      metadata=metadata,
      sequence_axis=sequence_axis,
      history=history,
      samplers=samplers,
    )

  @property
  def sequence_axis(self) -> int:
    return self._sequence_axis

  def start(self) -> None:
    """Starts the samplers that run in the background (the process sampler's thread)."""
    for sampler in self._samplers.values():
      start = getattr(sampler, "start", None)
      if callable(start):
        start()

  def close(self) -> None:
    """Stops the background samplers (idempotent); committing still works, unsampled."""
    for sampler in self._samplers.values():
      close = getattr(sampler, "close", None)
      if callable(close):
        close()

  def _sample(self) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for name, sample in self._samplers.items():
      try:
        extra[name] = sample()
      except Exception:  # noqa: BLE001 - a failed sample must not fail a finished pass
        extra[name] = None
    return extra

  def commit_pass(
    self,
    *,
    args: Sequence[Any],
    seconds: float,
    ledger: LedgerMetrics | None = None,
    worker: WorkerMetrics | None = None,
    counters: PassCounters | None = None,
    peak_device_units: int | None = None,
    peak_device_bytes: int | None = None,
    peak_host_units: int | None = None,
    peak_host_bytes: int | None = None,
  ) -> PassReport:
    """Records one successful pass and returns its report.

    Call it on the thread that ran the pass, right after the pass: the pass's
    compile time is what that thread spent compiling in the last ``seconds``.
    Peaks not given are taken from ``ledger`` (0 without one).
    """
    now = time.perf_counter()
    compiling = min(seconds, compile_time.seconds_between(now - seconds, now))
    compile_time.forget_before(now - seconds)
    counters = counters or PassCounters()
    moved = {f.name: getattr(counters, f.name) for f in dataclasses.fields(counters)}
    moved["timeline"] = tuple(counters.timeline)
    moved["stacks"] = dict(counters.stacks)
    peaks: dict[str, Any] = {
      "peak_device_units": peak_device_units,
      "peak_device_bytes": peak_device_bytes,
      "peak_host_units": peak_host_units,
      "peak_host_bytes": peak_host_bytes,
    }
    for name, value in peaks.items():
      if value is None:  # peak_<tier>_<what> of the ledger's tier
        _, tier, what = name.split("_")
        peaks[name] = 0 if ledger is None else getattr(ledger[Tier(tier)], f"peak_{what}")
    tokens = count_tokens(args, self._sequence_axis)
    extra = self._sample()
    with self._lock:
      report = PassReport(
        index=self._count,
        phase=PREFILL if tokens > 1 else DECODE,
        tokens=tokens,
        seconds=seconds,
        compile_seconds=compiling,
        host=None if ledger is None else ledger.host,
        device=None if ledger is None else ledger.device,
        **moved,
        **peaks,
        worker=worker,
        process=extra.get("process"),
        backend=extra.get("backend"),
      )
      self._passes.append(report)
      self._count += 1
      self._totals[report.phase] = self._totals[report.phase] + Totals.of(report)
      return report

  def note_speculation(self, totals: SpeculationTotals) -> None:
    """Adds one speculative generation's totals (this placement the target)."""
    with self._lock:
      self._speculation = totals if self._speculation is None else self._speculation + totals

  def note_metadata(self, metadata: ModelMetadata) -> None:
    """Reports carry ``metadata`` from now on (a call found a stack it does not place)."""
    with self._lock:
      self._metadata = metadata

  def report(self) -> Report:
    with self._lock:
      prefill, decode = self._totals[PREFILL], self._totals[DECODE]
      return Report(
        policy=self._policy.to_dict(),
        metadata=self._metadata.to_dict(),
        passes=tuple(self._passes),
        prefill=prefill,
        decode=decode,
        total=prefill + decode,
        fetched_bytes=self.fetched() if self.fetched else 0,
        speculation=self._speculation,
      )
