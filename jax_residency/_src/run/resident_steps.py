"""``FullyResident`` and ``LayerwiseHost`` on a CPU backend: each unit's rows as arrays of
their own, run step by step.

XLA's CPU backend copies a layer's slice out of the stacked weights inside a scanned
layer loop (a dynamic slice feeding a matmul is materialized): on the decode benchmark,
192 MiB per layer per step, which made ``FullyResident`` slower than a dense stream with
every unit cached. On a CPU backend the placement keeps its stacked arrays and adds, for
each unit, arrays that view that unit's rows of them (`unit_views`: device memory is host
memory, so no copy and no memory), and runs a pass as the dense stream does: the forward
traced once per input signature (`stream.staged`), each unit loop one compiled step per
unit, fed that unit's views. The steps run inside a loop bounded at run time
(`StagedForward.in_loop`), so the outputs are the scanned forward's bit for bit.
``LayerwiseHost``'s units sit in ``pinned_host`` memory, which on CPU is the memory the
device computes from: their views (and those of its device-resident units) feed the
steps as they are, where its one program would copy each unit into its window.

A forward the staged form cannot run (stacked parameters used outside
`jax_residency.scan_units`, or no unit loop at all) runs as one jitted program, as on
accelerators; so do calls under a JAX transformation and `lower`.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jax_residency._src.loop.unit_loop import LoopContext, StackLoop, run_in_loop
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.types import ExecutionResidency
from jax_residency._src.report.compile_time import signature
from jax_residency._src.stream.staged import StackSpan, StagedForward, run_staged, trace


def applies(mesh: jax.sharding.Mesh) -> bool:
  """Whether a mesh's devices are this process's CPU devices (where per-unit views exist)."""
  return jax.process_count() == 1 and all(d.platform == "cpu" for d in mesh.devices.flat)


def unit_view(stacked: jax.Array, j: int, sharding: jax.sharding.Sharding) -> jax.Array | None:
  """Unit ``j`` of a stacked leaf, sharing its memory: each device's shard of the unit is
  a view of that device's shard of the stack, made a device array without a copy
  (``may_alias``). None where that cannot be (the unit axis split across devices, or a
  row XLA cannot use in place)."""
  shards = []
  for shard in stacked.addressable_shards:
    if shard.index and shard.index[0] != slice(None):
      return None
    rows = np.asarray(shard.data)
    if not rows.nbytes or rows.ctypes.data != shard.data.unsafe_buffer_pointer():
      return None  # the NumPy form is a copy of the shard, not a view of it
    row = rows[j]
    on_device = jax.device_put(row, shard.device, may_alias=True)
    if on_device.unsafe_buffer_pointer() != row.ctypes.data:
      return None  # copied, not viewed: it would hold memory the plan does not
    shards.append(on_device)
  return jax.make_array_from_single_device_arrays(stacked.shape[1:], sharding, shards)


def unit_views(
  split: SplitModel,
  units: Sequence[jax.Array],
  shardings: Sequence[jax.sharding.Sharding],
  kept: Sequence[jax.Array] = (),
) -> list[list[jax.Array]] | None:
  """Per unit id, in order, the views of its rows of each of its stack's leaves; None if
  any leaf cannot be viewed. With ``kept`` (LayerwiseHost's device-resident units: each
  stack's first units, stacked apart), a stack's first rows come from those arrays."""
  views = []
  for stack in split.stacks:
    leaves, leaf_shardings = units[stack.leaf_slice], shardings[stack.leaf_slice]
    first = kept[stack.leaf_slice] if kept else []
    n = first[0].shape[0] if first else 0
    for j in range(stack.count):
      rows = zip(first if j < n else leaves, leaf_shardings, strict=True)
      row = [unit_view(a, j if j < n else j - n, s) for a, s in rows]
      if any(v is None for v in row):
        return None
      views.append([v for v in row if v is not None])
  return views


class ResidentSteps:
  """Runs a resident placement's passes as per-unit steps over views of its units.

  Args:
    split: the placed model's split.
    static: the placed static leaves.
    views: `unit_views` of the placed units.
    shardings: one unit of each unit leaf's sharding (the placement's ``unit_slices``).
  """

  def __init__(
    self,
    split: SplitModel,
    static: list[Any],
    views: list[list[jax.Array]],
    shardings: Sequence[jax.sharding.Sharding],
  ) -> None:
    self._split = split
    self._static = static
    self._views = views
    self._shardings = list(shardings)
    # Per input signature: the staged forward and its trace's loops (None: run jitted).
    self._staged: dict[Any, tuple[StagedForward, LoopContext] | None] = {}
    self._ctx: LoopContext | None = None
    self._lock = threading.Lock()  # one trace at a time (it records its loops in _ctx)

  def run(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[Any, int, LoopContext] | None:
    """The pass's outputs, its largest step's temporaries and its trace's loops; None
    where the forward has no staged form (run it jitted)."""
    found = self._stage(args, kwargs)
    if found is None:
      return None
    staged, ctx = found
    out = run_staged(
      staged,
      self._static,
      (args, kwargs),
      fetch=lambda i, upcoming: self._views[i],
      after_step=lambda i, upcoming: None,
    )
    return jax.block_until_ready(out), staged.step_temp_bytes or 0, ctx

  def close(self) -> None:
    self._views, self._static = [], []
    self._staged.clear()

  def _stage(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[StagedForward, LoopContext] | None:
    key = signature(args, kwargs)
    with self._lock:
      if key not in self._staged:
        self._staged[key] = self._trace(args, kwargs)
      return self._staged[key]

  def _trace(
    self, args: tuple[Any, ...], kwargs: dict[str, Any]
  ) -> tuple[StagedForward, LoopContext] | None:
    split = self._split
    unit_specs = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in split.unit_leaves()]
    spans = [StackSpan(s.offset, s.count, s.first, len(s.index)) for s in split.stacks]
    found: tuple[StagedForward, LoopContext] | None = None
    self._ctx = None
    try:
      staged = trace(self._forward, self._static, unit_specs, (args, kwargs), spans)
    except Exception:  # noqa: BLE001 - e.g. stacked weights used outside the unit loop
      # (PlacementError): the jitted program runs it, or raises the model's own error.
      pass
    else:
      if staged.unit_loop_count and self._ctx is not None:
        # As the dense stream's steps: in a run-time loop (the scan's math), except where
        # XLA would hoist a quantized unit's decode out of the matmul.
        staged.in_loop = split.quantization is None
        found = (staged, self._ctx)
    return found

  def _forward(self, static: list[Any], units: list[Any], args: Any, kwargs: Any) -> Any:
    bound = self._split.bind(self._split.join(static, units))
    loops = [
      StackLoop(ref, tuple(self._shardings[s.leaf_slice]), depth=2)
      for ref, s in zip(bound.units, self._split.stacks, strict=True)
    ]
    out, self._ctx = run_in_loop(
      bound,
      loops,
      kind=ExecutionResidency.FULLY_RESIDENT,
      names=[s.name for s in self._split.stacks],
      args=tuple(args),
      kwargs=dict(kwargs),
    )
    return out
