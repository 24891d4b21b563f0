"""``FullyResident`` and ``LayerwiseHost``: the whole forward as one jitted program.

`JittedExecutor` places the static leaves and the unit stack (units in device
memory, or in ``pinned_host`` memory moved through the unit loop's device
window), and runs the forward as one XLA program per input signature, compiled
ahead of its first call so each pass reports its temporaries. Called under a
JAX transformation (``jax.grad``, ``jax.make_jaxpr``, an outer ``jit``) the
forward is traced instead, so input gradients work. On a CPU backend a pass's
program takes each unit's rows as arrays of their own, views of the stacks
(`unit_views`, docs/design.md, 3.1), so no layer is copied out of its stack.

A pass's ``peak_*`` unit figures are not a measured peak but the unit arrays the
placement holds when the pass ends (`held_units`), still alive (not deleted), by memory
kind, per device. These placements hold every unit for their whole life, so what they hold at
the end of a pass is what they held during it. ``LayerwiseHost``'s device window is
not an array the placement holds: it lives inside the compiled program, among its
temporaries (``step_temp_bytes``, from XLA's memory analysis); the planned window is
``metadata.device_window_bytes``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_residency._src.errors import PlacementError
from jax_residency._src.loop.unit_loop import LoopContext, StackLoop, run_in_loop
from jax_residency._src.plan import shardings as pl
from jax_residency._src.plan.budget import ModelMetadata, metadata_for
from jax_residency._src.plan.memory import OVERHEAD, MemoryItem
from jax_residency._src.plan.shardings import held_units
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.types import ExecutionResidency, LayerWeightResidency
from jax_residency._src.quant.fused import fenced, kernels_for
from jax_residency._src.report.compile_time import signature, temp_bytes
from jax_residency._src.report.metrics import StackPass
from jax_residency._src.report.records import PassCounters
from jax_residency._src.report.telemetry import Telemetry
from jax_residency._src.run import unit_views
from jax_residency._src.run.executor import note_unplaced
from jax_residency._src.store.loading import StoreSource, open_for, read_all, transit_bytes
from jax_residency._src.typing import path_str


class JittedExecutor:
  """Runs ``FullyResident`` / ``LayerwiseHost`` placements (see `executor.Executor`)."""

  def __init__(
    self,
    split: SplitModel,
    policy: LayerWeightResidency,
    *,
    mesh: Mesh,
    rules: pl.Rules | None,
    sequence_axis: int = 1,
    store: StoreSource | None = None,
  ) -> None:
    self._layerwise = policy.execution_residency is ExecutionResidency.LAYERWISE_HOST
    if self._layerwise:
      pl.require_memory_kind(mesh, pl.PINNED_HOST)
    placed_at = pl.layout(
      split, mesh, rules, unit_kind=pl.PINNED_HOST if self._layerwise else pl.DEVICE
    )
    self.metadata: ModelMetadata = metadata_for(
      split, policy, placed_at.static, placed_at.unit_slices
    )
    shardings = dict(zip(split.static_index, placed_at.static, strict=True))
    shardings.update(zip(split.unit_index, placed_at.units, strict=True))
    values, own_reads = self._weights(split, policy, store, shardings)
    split.values = []  # the placement holds its own copies, not the caller's arrays
    self._static = pl.put([values[i] for i in split.static_index], placed_at.static)
    self._place_units([values[i] for i in split.unit_index], placed_at.units, len(split.stacks))
    del values
    self._split = split
    self._stacked_extra, self._extra = self._program_extras(mesh, placed_at.unit_slices)
    loops = [
      StackLoop(None, tuple(placed_at.unit_slices[s.leaf_slice]), policy.device_depth(s.count))
      for s in split.stacks
    ]
    names = [s.name for s in split.stacks]
    self._last_trace: LoopContext | None = None
    self._traced_shares: dict[str, StackPass] = {}

    def forward(static: list[Any], units: list[Any], extra: Any, *args: Any, **kwargs: Any) -> Any:
      # extra: {} or {"resident": device-resident units, "one": int32 1} or, on CPU,
      # {"apart": per stack, each unit's arrays, "one": int32 1} (`unit_loop.StackLoop`).
      bound = split.bind(split.join(static, units))
      resident, apart = extra.get("resident"), extra.get("apart")
      stacks = [
        dataclasses.replace(
          loop,
          ref=ref,
          resident=resident[s.leaf_slice] if resident else None,
          apart=apart[k] if apart else None,
          one=extra.get("one"),
        )
        for k, (loop, ref, s) in enumerate(zip(loops, bound.units, split.stacks, strict=True))
      ]
      kind, activations = policy.execution_residency, split.activations
      out, self._last_trace = run_in_loop(
        bound, stacks, kind=kind, activations=activations, names=names, args=args, kwargs=kwargs
      )
      return out

    if split.quantization is not None:
      # Static tensors' decodes too, each inside the operation that uses it (as the unit
      # loop's steps are): a one-token head reads its codes once (quant/fused.py).
      plain, kernels = forward, kernels_for(mesh.devices.flat, split.activations)

      def forward(
        static: list[Any], units: list[Any], extra: Any, *args: Any, **kwargs: Any
      ) -> Any:
        call = lambda s, u, e, a, kw: plain(s, u, e, *a, **kw)  # noqa: E731
        return fenced(call, static, units, extra, args, kwargs, kernels=kernels)

    self._jitted = jax.jit(forward)
    self.telemetry = Telemetry.for_policy(
      policy=policy, metadata=self.metadata, sequence_axis=sequence_axis
    )
    if store is not None:  # every weight was read at placement; passes read nothing
      self.telemetry.fetched = lambda: store.fetched.total() + own_reads
    # One program per input signature: its temporaries and each stack's share of a pass.
    self._compiled: dict[Any, tuple[Any, int, dict[str, StackPass]]] = {}

  def _program_extras(
    self, mesh: Mesh, unit_slices: Sequence[jax.sharding.Sharding]
  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """What the program takes besides the static leaves and the stacked units: the form
    accelerators run (``{}``, or LayerwiseHost's device-resident units and the int32 1),
    and the form a pass here runs. On CPU that is each unit's rows as arrays of their own
    (views of the stacks: no per-layer copy; for LayerwiseHost no move either, pinned_host
    memory being the device's memory there), where every leaf can be viewed."""
    stacked: dict[str, Any] = {"resident": self._resident, "one": np.int32(1)} if self._kept else {}
    if not unit_views.applies(mesh):
      return stacked, stacked
    on_device = [s.with_memory_kind(pl.DEVICE) for s in unit_slices]
    views = unit_views.unit_views(self._split, self._units, on_device, self._resident)
    if views is None:
      return stacked, stacked
    return stacked, {"apart": views, "one": np.int32(1)}

  def _place_units(self, values: list[Any], shardings: Sequence[Any], stacks: int) -> None:
    """Places the unit leaves. LayerwiseHost's device-resident units: each stack's first
    `kept` units are arrays of their own in device memory; the pinned_host arrays hold
    the rest (docs/design.md, 4.6)."""
    self._kept = len(self.metadata.resident.device) // max(stacks, 1)
    kept = self._kept
    self._resident = pl.put(
      [v[:kept] for v in values] if kept else [],
      [s.with_memory_kind(pl.DEVICE) for s in shardings] if kept else [],
    )
    self._units = pl.put([v[kept:] for v in values] if kept else values, list(shardings))

  def _shares(self, ctx: LoopContext | None) -> dict[str, StackPass]:
    """Each stack's units run and bytes moved by a program traced with ``ctx``;
    notes the stacks it loops over that are not placed."""
    if ctx is None:
      return {}
    note_unplaced(self, ctx)
    shares = {}
    for stack, loop, meta in zip(self._split.stacks, ctx.stacks, self.metadata.stacks, strict=True):
      run = loop.loops * stack.count
      moved = loop.loops * (stack.count - self._kept) * meta.unit_bytes if self._layerwise else 0
      shares[stack.name] = StackPass(units_run=run, bytes_moved=moved)
    return shares

  def _program(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[Any, int, dict[str, StackPass]]:
    key = signature(args, kwargs)
    found = self._compiled.get(key)
    if found is None:
      traced = self._jitted.trace(self._static, self._units, self._extra, *args, **kwargs)
      shares = self._shares(self._last_trace)
      exe = traced.lower().compile()
      found = self._compiled[key] = (exe, temp_bytes(exe) or 0, shares)
    return found

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
      # Under a transformation (grad, make_jaxpr, an outer jit) the forward is traced.
      self._last_trace = None
      # No runtime trip count there: reverse-mode AD cannot run a while loop with one,
      # so a part of the loop one unit long is a plain scan (close, not bit for bit).
      extra = {"resident": self._resident} if self._kept else {}
      out = self._jitted(self._static, self._units, extra, *args, **kwargs)
      if self._last_trace is not None:  # else jit reused a trace: the shares are as before
        self._traced_shares = self._shares(self._last_trace)
      temp, shares = 0, self._traced_shares
    else:
      exe, temp, shares = self._program(args, kwargs)
      out = exe(self._static, self._units, self._extra, *args, **kwargs)
    out = jax.block_until_ready(out)
    moved = sum(s.bytes_moved for s in shares.values())
    held = self._held()
    self.telemetry.commit_pass(
      args=args,
      seconds=time.perf_counter() - start,
      counters=PassCounters(host_to_device_bytes=moved, step_temp_bytes=temp, stacks=shares),
      peak_device_units=held[pl.DEVICE][0],
      peak_device_bytes=held[pl.DEVICE][1],
      peak_host_units=held[pl.PINNED_HOST][0],
      peak_host_bytes=held[pl.PINNED_HOST][1],
    )
    return out

  def lower(self, *args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    # The program an accelerator runs: the stacked units (and device-resident ones).
    traced = self._jitted.trace(self._static, self._units, self._stacked_extra, *args, **kwargs)
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

  def _held(self) -> dict[str, tuple[int, int]]:
    """The unit arrays held now, by memory kind (`held_units`), device-resident ones too."""
    stacks = self._split.stacks
    n = len(self._units)
    spans = [(s.leaf_slice, s.count - self._kept) for s in stacks]
    if self._resident:
      shift = [slice(s.leaf_slice.start + n, s.leaf_slice.stop + n) for s in stacks]
      spans += [(leaves, self._kept) for leaves in shift]
    return held_units([*self._units, *self._resident], spans)

  def arrays(self) -> dict[str, jax.Array]:
    leaves = self._split.join(self._static, self._units)
    out = {path_str(leaf.path): a for leaf, a in zip(self._split.leaves, leaves, strict=True)}
    units = [self._split.leaves[i] for i in self._split.unit_index]
    for leaf, a in zip(units, self._resident, strict=False):  # none without resident units
      out[f"{path_str(leaf.path)}[:{self._kept}]"] = a
    return out

  def clear_caches(self) -> None:
    """Every unit stays placed: nothing to drop."""

  def close(self) -> None:
    # Dropping the references frees the copies; deleting them outright could free
    # buffers shared with the caller's model (device_put to an equal sharding aliases).
    self._static, self._units, self._resident = [], [], []
    self._extra, self._stacked_extra = {}, {}
    self._compiled.clear()

  def _weights(
    self,
    split: SplitModel,
    policy: LayerWeightResidency,
    store: StoreSource | None,
    shardings: dict[int, Any],
  ) -> tuple[list[Any], int]:
    """The model's own weights, or (with ``store``) the weights read from the store,
    each placed before the next is read; and the bytes the store counted itself."""
    if store is None:
      return _own_weights(split), 0

    def place(i: int, value: np.ndarray) -> jax.Array:
      return jax.block_until_ready(jax.device_put(value, shardings[i]))

    with open_for(
      split, store, strict=policy.strict_loading, max_cached_shards=policy.max_cached_shards
    ) as opened:
      values = read_all(split, opened, place=place)
      loading = MemoryItem(
        name="loading",
        memory="host",
        nbytes=transit_bytes(split, opened),
        counted_in=OVERHEAD,
        note="at placement only: one stored array read and on its way to its memory, "
        "TensorStore's buffers of its chunks (and the decode of a chunk of several units)",
      )
      self.metadata = dataclasses.replace(self.metadata, memory=(*self.metadata.memory, loading))
      return values, opened.own_read_bytes


def _own_weights(split: SplitModel) -> list[Any]:
  """The model's own weights; an abstract model (no values) raises `PlacementError`."""
  abstract = [
    path_str(leaf.path)
    for leaf, v in zip(split.leaves, split.values, strict=True)
    if isinstance(v, jax.ShapeDtypeStruct)
  ]
  if abstract:
    raise PlacementError(
      f"the model is abstract ({len(abstract)} parameters have no values, e.g. "
      f"{abstract[0]!r}); pass store=<path> written by jax_residency.save to read its weights"
    )
  return split.values
