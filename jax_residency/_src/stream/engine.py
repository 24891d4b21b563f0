"""The dense disk stream: units cold on disk, through bounded host and device caches.

:class:`DenseStreamEngine` runs a staged forward (:mod:`.staged`) and answers
its ``fetch(i)`` calls:

* the **device tier** of the :class:`~.ledger.ResidencyLedger` holds at most
  the window of ``DENSE_TRANSFER_WINDOW`` units (current + next) within
  ``device_budget_bytes`` minus the static bytes; after unit *i* is dispatched,
  unit *i + 1* is moved in while *i* computes;
* the **host tier** holds numpy copies within ``host_budget_bytes``, filled
  ahead by the :class:`~.prefetch.PrefetchWorker` (``host_lookahead`` units
  protected ahead of the current one);
* with ``host_budget_bytes == 0`` there is no host tier and no thread: units go
  straight from the store to the device, and while they come from disk the unit
  after next is read ahead (into the page cache only).

Counters are per pass and committed only when the pass succeeds.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_residency._src.errors import AdmissionError
from jax_residency._src.loop.unit_loop import (
  LoopContext,
  StackLoop,
  not_looped_error,
  run_in_loop,
)
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.experts import ExpertResidency
from jax_residency._src.policy.types import DenseDiskStream
from jax_residency._src.report.compile_time import signature
from jax_residency._src.report.metrics import StackPass
from jax_residency._src.report.records import PassCounters, TimelinePoint
from jax_residency._src.report.stream_metrics import Tier
from jax_residency._src.report.telemetry import Telemetry
from jax_residency._src.store.buffers import release_dropped_buffers
from jax_residency._src.stream.expert_cache import ExpertStream
from jax_residency._src.stream.kept import KeptUnits
from jax_residency._src.stream.ledger import Eviction, Reservation, ResidencyLedger
from jax_residency._src.stream.prefetch import CancelToken, PrefetchWorker
from jax_residency._src.stream.stack_units import StackUnits
from jax_residency._src.stream.staged import StackSpan, StagedForward, run_staged, trace
from jax_residency._src.stream.unit_source import (
  UnitSource,
  read_unit,
  retire_finished,
  start_read,
  tune_source,
)
from jax_residency._src.typing import ParamPath

#: Platforms whose unit steps run inside a one-trip while loop. On CPU that
#: compiles each step as the plain model's scanned loop body, bit for bit; on
#: accelerators a plain per-step program avoids the loop control. A quantized
#: store's steps are plain programs everywhere (docs/quantization.md, "Reading
#: codes once").
STEP_IN_LOOP_PLATFORMS = frozenset({"cpu"})


class DenseStreamEngine:
  """Feeds a staged forward's unit loop from a store through the ledger."""

  def __init__(
    self,
    *,
    split: SplitModel,
    policy: DenseDiskStream,
    source: UnitSource,
    static: list[jax.Array],
    unit_shardings: Sequence[jax.sharding.Sharding],
    metadata: ModelMetadata,
    telemetry: Telemetry,
    on_trace: Callable[[LoopContext], None] = lambda ctx: None,
  ) -> None:
    opts = policy.options
    self._on_trace = on_trace
    self._split = split
    self._policy = policy
    self._source = source
    self._static = static
    self._unit_shardings = list(unit_shardings)
    device: Any = next(iter(self._unit_shardings[0].device_set))
    self._platform = str(device.platform)
    self._metadata = metadata
    self._telemetry = telemetry
    self._stacks = [
      StackUnits.of(split, stack, self._unit_shardings[stack.leaf_slice], meta)
      for stack, meta in zip(split.stacks, metadata.stacks, strict=True)
    ]
    self._owner = [st for st in self._stacks for _ in range(st.count)]
    self._experts = self._expert_stream(opts.experts)
    # Bytes of one unit as this process reads and holds it (its boxes only, on a
    # multi-process mesh); the load-time budget check counted whole units.
    self._host_unit_bytes = max(st.host_bytes for st in self._stacks)
    self._multiprocess = any(st.read_index is not None for st in self._stacks)
    self._lookahead = opts.host_lookahead
    self._host_enabled = opts.host_budget_bytes != 0
    # The device tier holds the window (current + next unit), within the budget
    # left after the static parameters (the load-time check made sure it fits).
    unit_device_budget = metadata.device_window_bytes
    # On an accelerator one unit of the host budget is the staging buffer of the
    # unit in transit (see plan.staging_bytes); the host cache gets the rest.
    staging = metadata.item_bytes("staging")
    host_budget = opts.host_budget_bytes
    if self._host_enabled and host_budget is not None:
      host_budget -= staging + metadata.resident.host_bytes  # the cache gets the rest
    self.ledger = ResidencyLedger(
      host_budget_bytes=host_budget if self._host_enabled else 0,
      device_budget_bytes=unit_device_budget,
      eviction_policy=opts.eviction_policy,
      on_evict=self._on_evict,
    )
    tune_source(
      source,
      metadata,
      staging=staging,
      unit_bytes=self._host_unit_bytes,
      multiprocess=self._multiprocess,
    )
    # Direct loading hints the kernel to read the unit after next while reads come from
    # disk (`_after_step`); a source without local raw chunks has nothing to hint.
    self._advise = None if self._host_enabled else getattr(source, "advise_unit", None)
    if self._advise is not None and self._experts is not None:
      self._advise = functools.partial(self._advise, experts=False)  # experts: only if picked
    self._from_disk = False  # the last direct read's pages came from disk
    self._asked_ahead: set[int] = set()  # units a hint found out of the page cache
    self.worker: PrefetchWorker | None = None
    if self._host_enabled:
      self.worker = PrefetchWorker(self._prefetch, capacity=opts.background_queue_capacity)
    self._counters = self._new_counters()
    self._counters_lock = threading.Lock()
    self._ahead: dict[int, tuple[Reservation, Callable[[], Mapping[ParamPath, np.ndarray]]]] = {}
    self._ahead_lock = threading.Lock()
    self._staged: dict[Any, StagedForward] = {}
    self._pass_start = time.perf_counter()
    self._at_start = (0, 0)
    self._run_lock = threading.Lock()
    # Units kept resident (device_resident_units, host_resident_units): read now, once.
    self._kept = KeptUnits(metadata.resident, self._owner, self._read)

  def _expert_stream(self, policy: ExpertResidency | None) -> ExpertStream | None:
    """With expert residency, the expert caches; units are then read and charged
    without their experts."""
    if policy is None:
      return None
    experts, self._stacks = ExpertStream.for_stacks(
      policy, self._source, self._stacks, self._ordinary_on_device, self._platform
    )
    self._owner = [st for st in self._stacks for _ in range(st.count)]
    return experts

  def _ordinary_on_device(self, unit: int) -> list[jax.Array] | None:
    kept = self._kept.on_device(unit)
    return kept if kept is not None else self.ledger.peek(Tier.DEVICE, unit)

  # --- a pass ----------------------------------------------------------------

  def run(self, *args: Any, **kwargs: Any) -> Any:
    """One forward pass; counters are committed only if it succeeds."""
    with self._run_lock:
      staged = self._stage(args, kwargs)
      self._begin_pass()
      start = self._pass_start = time.perf_counter()
      ok = False
      try:
        out = run_staged(
          staged,
          self._static,
          (args, kwargs),
          fetch=self._fetch,
          after_step=self._after_step,
          experts=self._experts,
        )
        out = jax.block_until_ready(out)
        with self._counters_lock:
          self._counters.step_temp_bytes = staged.step_temp_bytes or 0
        ok = True
        return out
      finally:
        self._end_pass(ok, args, time.perf_counter() - start)

  def _stage(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> StagedForward:
    key = signature(args, kwargs)
    staged = self._staged.get(key)
    if staged is None:
      split = self._split
      unit_specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in split.unit_leaves()]
      spans = [StackSpan(s.offset, s.count, s.first, len(s.index)) for s in split.stacks]
      staged = trace(
        self._forward, self._static, unit_specs, (args, kwargs), spans, split.activations
      )
      # A quantized unit's decode depends only on the unit, so inside a loop XLA hoists
      # it out of the matmul and writes the float unit; a plain step keeps it fused.
      quantized = self._split.quantization is not None
      staged.in_loop = self._platform in STEP_IN_LOOP_PLATFORMS and not quantized
      if staged.unit_loop_count == 0:
        raise not_looped_error([s.name for s in self._split.stacks])
      self._staged[key] = staged
    return staged

  def _forward(self, static: list[Any], units: list[Any], args: Any, kwargs: Any) -> Any:
    bound = self._split.bind(self._split.join(static, units))
    loops = [
      StackLoop(ref, st.shardings, depth=2)
      for ref, st in zip(bound.units, self._stacks, strict=True)
    ]
    names, activations = [st.name for st in self._stacks], self._split.activations
    kind = self._policy.execution_residency
    out, ctx = run_in_loop(
      bound,
      loops,
      kind=kind,
      activations=activations,
      names=names,
      args=tuple(args),
      kwargs=dict(kwargs),
    )
    self._on_trace(ctx)
    return out

  def _new_counters(self) -> PassCounters:
    return PassCounters(stacks={st.name: StackPass() for st in self._stacks})

  def _begin_pass(self) -> None:
    self._ran: tuple[int | None, int | None] = (None, None)  # see `_fetch`
    self.ledger.begin_pass()
    if self._experts is not None:
      self._experts.begin_pass()
    if self.worker is not None:
      self.worker.begin_pass()
    with self._counters_lock:
      self._counters = self._new_counters()
    reset = getattr(self._source, "reset_buffer_peak", None)
    if reset is not None:
      reset()
    self._at_start = self._source_totals()

  def _source_totals(self) -> tuple[int, int]:
    """The source's bytes mapped and bytes fetched so far (0 where it does not count)."""
    names = ("mapped_bytes_total", "fetched_bytes_total")
    return tuple(int(getattr(self._source, n, 0)) for n in names)  # type: ignore[return-value]

  def _end_pass(self, ok: bool, args: tuple[Any, ...], seconds: float) -> None:
    if not ok and self.worker is not None:
      self.worker.cancel(wait=True)
      self._drop_read_ahead()
    # A failed pass leaves no leases behind; clear the windows either way.
    self.ledger.protect(Tier.DEVICE, ())
    self.ledger.protect(Tier.HOST, ())
    ledger_metrics = self.ledger.end_pass()
    worker_metrics = self.worker.end_pass() if self.worker is not None else None
    with self._counters_lock:
      counters = self._counters
    counters.peak_buffer_bytes = int(getattr(self._source, "buffer_peak_bytes", 0))
    (mapped, fetched), (mapped0, fetched0) = self._source_totals(), self._at_start
    counters.mapped_bytes, counters.fetched_bytes = mapped - mapped0, fetched - fetched0
    if self._experts is not None:
      counters.experts = self._experts.end_pass()
      counters.disk_to_device_bytes += counters.experts.bytes_read
    if ok:
      # The caches' peaks (the ledger's), plus the resident units, measured as held.
      dev_units, dev_bytes, host_units, host_bytes = self._kept.held()
      dev, host = ledger_metrics[Tier.DEVICE], ledger_metrics[Tier.HOST]
      self._telemetry.commit_pass(
        args=args,
        seconds=seconds,
        ledger=ledger_metrics,
        worker=worker_metrics,
        counters=counters,
        peak_device_units=dev.peak_units + dev_units,
        peak_device_bytes=dev.peak_bytes + dev_bytes,
        peak_host_units=host.peak_units + host_units,
        peak_host_bytes=host.peak_bytes + host_bytes,
      )

  # --- the unit loop's callbacks --------------------------------------------

  def _fetch(self, i: int, upcoming: Sequence[int]) -> list[Any]:
    arrays = self._kept.on_device(i)
    self._ran = (self._ran[1], i)  # the unit run before this one, and this one
    if arrays is None:
      self.ledger.protect(Tier.DEVICE, (i, *self._next_in_stack(i, upcoming)))
      arrays = self.ledger.get(Tier.DEVICE, i)
      if arrays is None:
        arrays = self._load_device(i)
    with self._counters_lock:
      self._counters.stacks[self._owner[i].name] += StackPass(units_run=1)
    point = TimelinePoint(
      seconds=time.perf_counter() - self._pass_start,
      unit=i,
      host_bytes=self.ledger.resident_bytes(Tier.HOST),
      device_bytes=self.ledger.resident_bytes(Tier.DEVICE),
    )
    with self._counters_lock:
      self._counters.timeline.append(point)
    return arrays

  def _next_in_stack(self, i: int, upcoming: Sequence[int]) -> tuple[int, ...]:
    """The unit the device window moves in after ``i``: the next one not kept on the
    device, if it is of ``i``'s stack (the window of a stack holds only its units)."""
    for j in upcoming:
      if self._kept.on_device(j) is None:
        return (j,) if self._owner[j] is self._owner[i] else ()
    return ()

  def _after_step(self, i: int, upcoming: Sequence[int]) -> None:
    # The host cache is shared: read-ahead follows the forward, into the next stack.
    ahead = self._kept.streamed(upcoming, self._lookahead)
    if self.worker is not None:
      self.ledger.protect(Tier.HOST, ahead)
      for j in ahead:
        if not (self.ledger.contains(Tier.HOST, j) or self.ledger.is_pending(Tier.HOST, j)):
          self.worker.submit(j)
    streamed = self._kept.streamed(upcoming, 2)
    if self._from_disk and self._advise is not None and len(streamed) > 1:
      # Into the page cache only: the disk reads on while the next steps' checks, moves
      # and dispatches run, and the next read finds its pages on the way.
      if self._advise(streamed[1]):
        self._asked_ahead.add(streamed[1])
    for j in self._next_in_stack(i, upcoming):
      if not self.ledger.contains(Tier.DEVICE, j):
        self.ledger.protect(Tier.DEVICE, (i, j))
        self._load_device(j, finished=self._ran[0])  # its step is done (run_staged)

  # --- moving units ------------------------------------------------------------

  def _load_device(self, i: int, finished: int | None = None) -> list[Any]:
    """Reads (or takes from the host tier) unit ``i`` and moves it to the device tier.

    The device bytes are reserved first, so the unit that makes room is gone
    before the read lands: on CPU the read buffer is the device array (no copy),
    and the device tier never holds more than its window, reads included. An evicted
    ``finished`` unit (its step done) no host cache holds is unmapped now (`retire_finished`).
    """
    st = self._owner[i]
    done = None if finished is None else self.ledger.peek(Tier.DEVICE, finished)
    with self.ledger.reserve(Tier.DEVICE, i, st.device_bytes) as reservation:
      if finished in reservation.evicted and not self.ledger.contains(Tier.HOST, finished):
        retire_finished(self._source, done)
      del done
      if reservation.evicted:
        release_dropped_buffers()
      kept = self._kept.in_host(i)
      if kept is not None or self._host_enabled:
        host = kept if kept is not None else self._host_unit(i)
        source = "host"
      else:
        asked = self._advised()
        host = self._read_blocking(i)
        self._from_disk = self._advised() != asked or i in self._asked_ahead
        self._asked_ahead.discard(i)
        source = "disk"
      arrays = st.to_device(host, alias=True, in_place=True)
      del host
      reservation.commit(arrays)
    with self._counters_lock:
      if source == "host":
        self._counters.host_to_device_bytes += st.host_bytes
      else:
        self._counters.disk_to_device_bytes += st.host_bytes
      self._counters.stacks[st.name] += StackPass(bytes_moved=st.host_bytes)
    return arrays

  def _host_unit(self, i: int) -> Mapping[ParamPath, np.ndarray]:
    assert self.worker is not None
    if self.worker.is_pending(i):
      start = time.perf_counter()
      self.worker.wait(i)  # raises the read's StoreError (or PrefetchError) if it failed
      self._note_stall(time.perf_counter() - start)
    host = self.ledger.get(Tier.HOST, i)
    if host is not None:
      return host
    try:
      reservation = self.ledger.reserve(Tier.HOST, i, self._owner[i].host_bytes)
    except AdmissionError:
      # Everything cached is pinned; read this unit without caching it.
      return self._read_blocking(i)
    with reservation:
      data = self._read_blocking(i, count_as="disk_to_host")
      reservation.commit(data)
    return data

  def _read_blocking(
    self, i: int, *, count_as: str = "disk_to_device"
  ) -> Mapping[ParamPath, np.ndarray]:
    start = time.perf_counter()
    data = self._read(i)
    self._note_stall(time.perf_counter() - start)
    with self._counters_lock:
      if count_as == "disk_to_host":
        self._counters.disk_to_host_bytes += self._owner[i].host_bytes
    return data

  def _read(self, i: int) -> Mapping[ParamPath, np.ndarray]:
    return read_unit(self._source, i, self._owner[i].read_index, self._skip(i))

  def _start_read(self, i: int) -> Callable[[], Mapping[ParamPath, np.ndarray]]:
    """Issues the read of unit ``i``; the returned callable waits for it."""
    return start_read(self._source, i, self._owner[i].read_index, self._skip(i))

  def _skip(self, i: int) -> tuple[ParamPath, ...]:
    """The tensors of unit ``i`` a unit read leaves out: with expert residency, its experts."""
    return () if self._experts is None else self._experts.skip(i)

  def _prefetch(self, i: int, token: CancelToken) -> None:
    """Runs on the worker thread: reads unit ``i`` into the host tier.

    While unit ``i`` is read, the read of the next queued unit is issued too
    (its host bytes reserved first), so two unit reads are in flight.
    """
    with self._ahead_lock:
      started = self._ahead.pop(i, None)
    if started is None:
      if (
        token.cancelled
        or self.ledger.contains(Tier.HOST, i)
        or self.ledger.is_pending(Tier.HOST, i)
      ):
        return
      try:
        reservation = self.ledger.reserve(Tier.HOST, i, self._owner[i].host_bytes)
      except AdmissionError:
        return  # no room right now; demand will read it
      started = (reservation, self._start_read(i))
    self._read_ahead()
    reservation, finish = started
    with reservation:
      data = finish()
      if token.cancelled:
        return
      reservation.commit(data, prefetched=True)
    with self._counters_lock:
      self._counters.disk_to_host_bytes += self._owner[i].host_bytes

  def _read_ahead(self) -> None:
    assert self.worker is not None
    for j in self.worker.queued_units()[:1]:
      with self._ahead_lock:
        if j in self._ahead:
          continue
      if self.ledger.contains(Tier.HOST, j) or self.ledger.is_pending(Tier.HOST, j):
        continue
      try:
        reservation = self.ledger.reserve(Tier.HOST, j, self._owner[j].host_bytes)
      except AdmissionError:
        continue
      with self._ahead_lock:
        self._ahead[j] = (reservation, self._start_read(j))

  def _drop_read_ahead(self) -> None:
    """Waits out and releases reads issued ahead for requests that were dropped."""
    with self._ahead_lock:
      started, self._ahead = list(self._ahead.values()), {}
    for reservation, finish in started:
      with contextlib.suppress(Exception):
        finish()
      reservation.release()

  def _advised(self) -> int:
    """Bytes the source's reads and hints have asked the kernel to read so far."""
    return int(getattr(self._source, "advised_bytes", 0))

  def _note_stall(self, seconds: float) -> None:
    with self._counters_lock:
      self._counters.stalls += 1
      self._counters.stall_seconds += seconds

  def _on_evict(self, eviction: Eviction) -> None:
    if eviction.tier is Tier.HOST and not eviction.used and self.worker is not None:
      self.worker.note_evicted_before_use()

  def clear_caches(self) -> None:
    """Drops every cached unit copy (host and device); counters are kept, and so are
    the resident units, which are not a cache's."""
    with self._run_lock:
      if self.worker is not None:
        self.worker.cancel(wait=True)
        self._drop_read_ahead()
      self.ledger.discard_all()
      if self._experts is not None:
        self._experts.clear()

  def close(self) -> None:
    if self._experts is not None:
      self._experts.close()
    if self.worker is not None:
      self.worker.close()
      self._drop_read_ahead()
    self.ledger.close()
    self._kept.close()
    self._static = []
    self._staged.clear()
