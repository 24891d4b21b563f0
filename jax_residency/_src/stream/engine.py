"""The dense disk stream: units cold on disk, through bounded host and device caches.

:class:`DenseStreamEngine` runs a staged forward (:mod:`.staged`) and answers
its ``fetch(i)`` calls:

* the **device tier** of the :class:`~.ledger.ResidencyLedger` holds at most
  the window of ``DENSE_TRANSFER_WINDOW`` units (current + next) within
  ``device_budget_bytes`` minus the static bytes; after unit *i* is dispatched,
  unit *i + 1* is moved in while *i* computes;
* a unit not on the device comes from the engine's loader (`.loaders`), chosen once:
  with a host budget, the `CachedLoader` (the ledger's **host tier**, filled ahead by a
  `PrefetchWorker`); with ``host_budget_bytes == 0``, the `DirectLoader` (straight from
  the store, the unit after next asked for ahead while reads come from disk).

The engine keeps a pass's lifecycle: staging, the device window, the counters of the
pass (`.tally`), committed only when the pass succeeds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax

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
from jax_residency._src.report.stream_metrics import Tier
from jax_residency._src.report.telemetry import Telemetry
from jax_residency._src.store.unit_reader import UnitReader
from jax_residency._src.stream.device_window import DeviceWindow
from jax_residency._src.stream.expert_cache import ExpertStream
from jax_residency._src.stream.kept import KeptUnits
from jax_residency._src.stream.ledger import Eviction, ResidencyLedger
from jax_residency._src.stream.loaders import CachedLoader, DirectLoader, UnitLoader
from jax_residency._src.stream.staged import StagedForward, run_staged, trace
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.stream.tally import PassTally
from jax_residency._src.stream.unit_source import UnitReads, tune_source
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
    source: UnitReader,
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
    self._telemetry = telemetry
    self._stacks = [
      StreamedStack.of(split, stack, self._unit_shardings[stack.leaf_slice], meta)
      for stack, meta in zip(split.stacks, metadata.stacks, strict=True)
    ]
    self._owner = [st for st in self._stacks for _ in range(st.count)]
    self._experts = self._expert_stream(opts.experts)
    self._tally = PassTally([st.name for st in self._stacks])
    reads = UnitReads(source, self._owner, self._skip, self._tally)
    host_enabled = opts.host_budget_bytes != 0
    # On an accelerator one unit of the host budget is the staging buffer of the
    # unit in transit (see plan.staging_bytes); the host cache gets the rest.
    staging = metadata.item_bytes("staging")
    host_budget = opts.host_budget_bytes
    if host_enabled and host_budget is not None:
      host_budget -= staging + metadata.resident.host_bytes
    # The device tier holds the window (current + next unit), within the budget left
    # after the static parameters (the load-time check made sure it fits).
    self.ledger = ResidencyLedger(
      host_budget_bytes=host_budget if host_enabled else 0,
      device_budget_bytes=metadata.device_window_bytes,
      eviction_policy=opts.eviction_policy,
      on_evict=self._on_evict,
    )
    # Bytes of one unit as this process reads and holds it (its boxes only, on a
    # multi-process mesh); the load-time budget check counted whole units.
    tune_source(
      source,
      metadata,
      staging=staging,
      unit_bytes=max(st.host_bytes for st in self._stacks),
      multiprocess=any(st.read_index is not None for st in self._stacks),
      map_reads=not host_enabled,
    )
    self._loader: UnitLoader = (
      CachedLoader(
        reads,
        self.ledger,
        lookahead=opts.host_lookahead,
        capacity=opts.background_queue_capacity,
      )
      if host_enabled
      else DirectLoader(reads, experts=self._experts is None)
    )
    self._staged: dict[Any, StagedForward] = {}
    self._at_start = source.read_counters()
    self._run_lock = threading.Lock()
    # Units kept resident (device_resident_units, host_resident_units): read now, once.
    self._kept = KeptUnits(metadata.resident, self._owner, reads.read)
    self._window = DeviceWindow(
      self.ledger, self._kept, self._owner, self._loader, source, self._tally
    )

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

  def _skip(self, i: int) -> tuple[ParamPath, ...]:
    """The tensors of unit ``i`` a unit read leaves out: with expert residency, its experts."""
    return () if self._experts is None else self._experts.skip(i)

  # --- a pass ----------------------------------------------------------------

  def run(self, *args: Any, **kwargs: Any) -> Any:
    """One forward pass; counters are committed only if it succeeds."""
    with self._run_lock:
      staged = self._stage(args, kwargs)
      start = time.perf_counter()
      self._begin_pass(start)
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
        self._tally.step_temp(staged.step_temp_bytes or 0)
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
      staged = trace(
        self._forward, self._static, unit_specs, (args, kwargs), split.stacks, split.activations
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

  def _begin_pass(self, start: float) -> None:
    self._window.begin_pass(start)
    self.ledger.begin_pass()
    if self._experts is not None:
      self._experts.begin_pass()
    self._loader.begin_pass()
    self._tally.restart()
    self._source.reset_buffer_peak()
    self._at_start = self._source.read_counters()

  def _end_pass(self, ok: bool, args: tuple[Any, ...], seconds: float) -> None:
    if not ok:
      self._loader.cancel()
    # A failed pass leaves no leases behind; clear the windows either way.
    self.ledger.protect(Tier.DEVICE, ())
    self.ledger.protect(Tier.HOST, ())
    ledger_metrics = self.ledger.end_pass()
    worker_metrics = self._loader.end_pass()
    counters = self._tally.counters()
    now, then = self._source.read_counters(), self._at_start
    counters.peak_buffer_bytes = now.buffer_peak_bytes
    counters.mapped_bytes = now.mapped_bytes - then.mapped_bytes
    counters.fetched_bytes = now.fetched_bytes - then.fetched_bytes
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

  # --- the unit loop's callbacks ---------------------------------------------

  def _fetch(self, i: int, upcoming: Sequence[int]) -> list[Any]:
    return self._window.fetch(i, upcoming)

  def _after_step(self, i: int, upcoming: Sequence[int]) -> None:
    self._window.after_step(i, upcoming)

  def _on_evict(self, eviction: Eviction) -> None:
    self._loader.note_evicted(eviction)

  def clear_caches(self) -> None:
    """Drops every cached unit copy (host and device); counters are kept, and so are
    the resident units, which are not a cache's."""
    with self._run_lock:
      self._loader.cancel()
      self.ledger.discard_all()
      if self._experts is not None:
        self._experts.clear()

  def close(self) -> None:
    if self._experts is not None:
      self._experts.close()
    self._loader.close()
    self.ledger.close()
    self._kept.close()
    self._static = []
    self._staged.clear()
