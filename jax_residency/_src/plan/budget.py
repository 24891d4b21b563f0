"""The placement plan: byte arithmetic, the load-time budget check, metadata.

Everything here is decided before a single parameter moves: how many bytes the
static parameters take on a device, how large each unit is on a device and in
host memory, how deep the device window is, and whether that fits the policy's
budgets (docs/design.md, section 2.3). The result is also what ``placed.metadata`` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from jax_residency._src.plan import shardings as pl
from jax_residency._src.plan.budget_checks import check_device_budget, check_host_budget
from jax_residency._src.plan.budget_checks import largest_window as largest_window
from jax_residency._src.plan.memory import DEVICE_BUDGET as DEVICE_BUDGET
from jax_residency._src.plan.memory import HOST_BUDGET as HOST_BUDGET
from jax_residency._src.plan.memory import OVERHEAD, MemoryItem, memory_items
from jax_residency._src.plan.memory import STORE_INDEX_CACHE_BYTES as STORE_INDEX_CACHE_BYTES
from jax_residency._src.plan.quantized import decoded_bytes
from jax_residency._src.plan.resident import NO_RESIDENT_UNITS, ResidentPlan, resident_units
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.policy.types import (
  ExecutionResidency,
  LayerWeightResidency,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackMetadata:
  """One placed layer stack's size and device window.

  Attributes:
    path: the stack's path in the model (``"encoder.layers"``).
    layer_count: its units.
    unit_bytes: bytes of one of its units (all shards together).
    device_unit_bytes: bytes of one of its units on one device.
    device_window_units: its units on a device at once.
    device_window_bytes: bytes of its heaviest such window on one device.

  Example:
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=3), rngs=nnx.Rngs(0))
    >>> with jr.place(model, jr.LayerwiseHost(prefetch_depth=2), units="layers") as placed:
    ...   (stack,) = placed.metadata.stacks
    >>> stack.path, stack.layer_count, stack.device_window_units
    ('layers', 3, 2)
    >>> stack.device_window_bytes == 2 * stack.device_unit_bytes
    True
  """

  path: str
  layer_count: int
  unit_bytes: int
  device_unit_bytes: int
  device_window_units: int
  device_window_bytes: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelMetadata:
  """A placed model's size and placement, as decided at load time.

  Attributes:
    layer_count: number of units over all placed layer stacks.
    static_device_bytes: bytes of static parameters held by one device.
    unit_bytes: bytes of each unit (all shards together).
    largest_device_unit_bytes: the largest unit's bytes on one device.
    largest_host_unit_bytes: the largest unit's bytes in this process's host memory.
    device_window_units: units on a device at once (``policy.device_depth``;
      with several stacks, the window of the stack whose window weighs most).
    device_window_bytes: bytes of the heaviest such window on one device: the
      largest window of any stack, as the stacks run one after another.
    device_unit_capacity: how many units the device budget could hold next to
      the static parameters (``None`` when the budget is unbounded).
    policy: the policy.
    memory: every item the placement holds, with what pays for it (see
      :class:`MemoryItem` and ``docs/memory.md``, "Where the bytes go").
    device_is_host: the devices' memory is this process's memory (CPU), so
      device items count in the process's RSS too.
    stacks: each placed layer stack (:class:`StackMetadata`), in the order the
      forward runs them; ``unit_bytes`` lists their units in that order.
    unplaced_stacks: paths of stacks the forward loops over that this
      placement does not place (their weights are static, on the device);
      filled in as calls find them, each with a warning.
    bytes_read_per_byte_used: for a dense stream, the bytes its reads decode
      for each unit byte they use: 1.0 for a store with one unit per chunk;
      more for a checkpoint whose chunks span several units (Orbax's default),
      which ``jax-residency rechunk`` rewrites. 1.0 for other policies, which
      read each stored array whole, once.
    resident: the units a dense stream keeps on the device or in host memory
      from placement on (``device_resident_units``, ``host_resident_units``).
    prediction: for a placement made by ``Candidate.place`` (`jax_residency.plan`'s
      choice), what the planner predicted for it: ``prefill_seconds``,
      ``decode_seconds``, ``bytes_per_token``, ``regime``, the workload and the
      measurement's date; None for any other placement.

  Example:
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> cfg = ToyConfig(n_layers=2)
    >>> model = ToyTransformer(cfg, rngs=nnx.Rngs(0))
    >>> with jr.place(model, jr.LayerwiseHost(prefetch_depth=1)) as placed:
    ...   meta = placed.metadata  # decided before anything ran
    >>> meta.layer_count, meta.device_window_units, meta.unit_bytes == (cfg.unit_bytes(),) * 2
    (2, 1, True)
    >>> [item.name for item in meta.memory]
    ['static parameters', 'device window', 'host units']
  """

  layer_count: int
  static_device_bytes: int
  unit_bytes: tuple[int, ...]
  largest_device_unit_bytes: int
  largest_host_unit_bytes: int
  device_window_units: int
  device_window_bytes: int
  device_unit_capacity: int | None
  policy: LayerWeightResidency
  memory: tuple[MemoryItem, ...] = ()
  device_is_host: bool = False
  stacks: tuple[StackMetadata, ...] = ()
  unplaced_stacks: tuple[str, ...] = ()
  bytes_read_per_byte_used: float = 1.0
  resident: ResidentPlan = NO_RESIDENT_UNITS
  prediction: Mapping[str, Any] | None = None

  @property
  def total_unit_bytes(self) -> int:
    return sum(self.unit_bytes)

  def item_bytes(self, name: str) -> int:
    """Bytes of the memory item ``name`` (0 when the placement has none)."""
    return sum(m.nbytes for m in self.memory if m.name == name)

  @property
  def planned_device_bytes(self) -> int:
    """Most bytes the placement holds on one device (device budget items)."""
    return sum(m.nbytes for m in self.memory if m.memory == "device")

  @property
  def planned_host_bytes(self) -> int:
    """Most bytes the placement holds in host memory, inside the host budget."""
    return sum(m.nbytes for m in self.memory if m.memory == "host" and m.counted_in != OVERHEAD)

  @property
  def overhead_bytes(self) -> int:
    """Named, bounded host memory outside the budgets."""
    return sum(m.nbytes for m in self.memory if m.counted_in == OVERHEAD)

  @property
  def planned_process_bytes(self) -> int:
    """Most bytes this process holds for the placement: host items and overheads,
    plus the device items where device memory is host memory (CPU)."""
    device = self.planned_device_bytes if self.device_is_host else 0
    return device + self.planned_host_bytes + self.overhead_bytes

  def memory_table(self) -> str:
    """The memory items as a table: item, memory, bytes, paid by, note."""
    rows = [(m.name, m.memory, format_bytes(m.nbytes), m.counted_in, m.note) for m in self.memory]
    # What each budget pays, and what no budget does: the checks against the budgets count
    # the first two; the total adds the overheads.
    rows += [
      ("in the device budget", "device", format_bytes(self.planned_device_bytes), "", ""),
      ("in the host budget", "host", format_bytes(self.planned_host_bytes), "", ""),
      ("outside the budgets", "host", format_bytes(self.overhead_bytes), OVERHEAD, ""),
    ]
    rows.append(
      (
        "total (this process)",
        "host" + (" + device" if self.device_is_host else ""),
        format_bytes(self.planned_process_bytes),
        "",
        "",
      )
    )
    widths = [max(len(r[k]) for r in rows) for k in range(4)]
    lines = [
      ("  ".join(c.ljust(w) for c, w in zip(r[:4], widths, strict=True)) + "  " + r[4]).rstrip()
      for r in rows
    ]
    lines.append(
      "not planned: activations and XLA's compiled programs (the plain model holds them too);"
      " pass reports show a dense step's temporaries (step_temp_bytes) and compile time"
    )
    return "\n".join(lines)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["unit_bytes"] = list(self.unit_bytes)
    d["policy"] = self.policy.to_dict()
    d["total_unit_bytes"] = self.total_unit_bytes
    d["memory"] = [m.to_dict() for m in self.memory]
    d["stacks"] = [dataclasses.asdict(x) for x in self.stacks]
    d["unplaced_stacks"] = list(self.unplaced_stacks)
    d["planned_device_bytes"] = self.planned_device_bytes
    d["planned_host_bytes"] = self.planned_host_bytes
    d["overhead_bytes"] = self.overhead_bytes
    d["planned_process_bytes"] = self.planned_process_bytes
    return d

  def __str__(self) -> str:
    rows = [
      ("policy", self.policy.name),
      ("layers", str(self.layer_count)),
      *(
        (f"  stack {x.path}", f"{x.layer_count} x {format_bytes(x.unit_bytes)}")
        for x in self.stacks
        if len(self.stacks) > 1
      ),
      ("static bytes / device", format_bytes(self.static_device_bytes)),
      ("unit bytes (total)", format_bytes(self.total_unit_bytes)),
      ("largest unit / device", format_bytes(self.largest_device_unit_bytes)),
      ("largest unit / host", format_bytes(self.largest_host_unit_bytes)),
      (
        "device window",
        f"{self.device_window_units} units, {format_bytes(self.device_window_bytes)}",
      ),
      (
        "device unit capacity",
        "unbounded" if self.device_unit_capacity is None else str(self.device_unit_capacity),
      ),
    ]
    width = max(len(k) for k, _ in rows)
    text = "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
    return text + ("\n\nmemory\n" + self.memory_table() if self.memory else "")


def check_budgets(
  policy: LayerWeightResidency,
  *,
  static_device_bytes: int,
  unit_bytes: Sequence[int],
  device_unit_bytes: Sequence[int],
  host_unit_bytes: Sequence[int],
  device_is_host: bool = True,
  stacks: Sequence[tuple[str, int]] = (),
  decoded_bytes: tuple[int, int] = (0, 0),
) -> ModelMetadata:
  """Checks the policy's budgets against the model and returns the metadata.

  ``unit_bytes`` are whole units; ``device_unit_bytes`` what one device holds of
  each; ``host_unit_bytes`` what this process's host memory holds of each.
  ``stacks`` splits the units, in order, into named layer stacks
  ``(path, count)`` (default: one stack). The stacks run one after another,
  so the device window is the largest window of any stack; the host cache is
  shared, so a dense stream's host window may span two stacks.
  ``device_is_host``: the devices are CPU devices, whose memory is host memory
  (a dense stream's read buffers then become device arrays without a copy).
  ``decoded_bytes``: for a quantized store, the float tensors one device holds
  while they are used: the largest static one, and a unit's largest while its step
  runs (temporaries, decoded one at a time, planned in the device budget).

  Raises:
    DeviceBudgetTooSmallError: static bytes plus the heaviest device window
      (plus decoded tensors) exceed the device budget.
    HostBudgetTooSmallError: the heaviest host window (``host_lookahead`` units
      for a dense stream, plus the staging unit on an accelerator; every unit for
      ``LayerwiseHost``) exceeds the host budget.
  """
  offload = policy.offload()
  n = len(device_unit_bytes)
  stacks = stacks or (("", n),)
  per_stack = _stack_windows(policy, stacks, unit_bytes, device_unit_bytes)
  resident = resident_units(policy, stacks, device_unit_bytes, host_unit_bytes)
  depth, window, window_of = _device_window(policy, per_stack)
  budget = offload.device_budget_bytes
  check_device_budget(
    policy, static_device_bytes, window, depth, window_of, sum(decoded_bytes), resident
  )
  check_host_budget(policy, host_unit_bytes, device_is_host=device_is_host, resident=resident)
  largest_dev = max(device_unit_bytes, default=0)
  capacity = None
  if budget is not None:
    spare = max(0, budget - static_device_bytes)
    capacity = n if largest_dev == 0 else min(n, spare // largest_dev)
  return ModelMetadata(
    layer_count=n,
    static_device_bytes=static_device_bytes,
    unit_bytes=tuple(unit_bytes),
    largest_device_unit_bytes=largest_dev,
    largest_host_unit_bytes=max(host_unit_bytes, default=0),
    device_window_units=depth,
    device_window_bytes=window,
    device_unit_capacity=capacity,
    policy=policy,
    memory=memory_items(
      policy,
      static_device_bytes=static_device_bytes,
      device_window=(depth, window),
      host_unit_bytes=host_unit_bytes,
      device_is_host=device_is_host,
      window_of=window_of,
      decoded_bytes=decoded_bytes,
      resident=resident,
    ),
    device_is_host=device_is_host,
    stacks=tuple(per_stack) if per_stack[0].path else (),
    resident=resident,
  )


def _stack_windows(
  policy: LayerWeightResidency,
  stacks: Sequence[tuple[str, int]],
  unit_bytes: Sequence[int],
  device_unit_bytes: Sequence[int],
) -> list[StackMetadata]:
  """Each stack's sizes and device window, for stacks that partition the units in order."""
  n = len(device_unit_bytes)
  if sum(c for _, c in stacks) != n:
    raise ValueError(f"stacks {stacks!r} do not partition {n} units")
  per_stack: list[StackMetadata] = []
  start = 0
  for name, count in stacks:
    k = min(policy.device_depth(count), count)
    dev = device_unit_bytes[start : start + count]
    per_stack.append(
      StackMetadata(
        path=name,
        layer_count=count,
        unit_bytes=max(unit_bytes[start : start + count], default=0),
        device_unit_bytes=max(dev, default=0),
        device_window_units=k,
        device_window_bytes=largest_window(dev, k),
      )
    )
    start += count
  return per_stack


def _device_window(
  policy: LayerWeightResidency, per_stack: Sequence[StackMetadata]
) -> tuple[int, int, str]:
  """The device window as ``(units, bytes, which stack it is, for messages)``.

  ``FullyResident`` holds every unit of every stack; the streaming policies run
  the stacks one after another, so the heaviest stack's window bounds them all.
  """
  if policy.is_fully_resident:
    return sum(x.layer_count for x in per_stack), sum(x.device_window_bytes for x in per_stack), ""
  heaviest = max(per_stack, key=lambda x: (x.device_window_bytes, x.device_window_units))
  window_of = ""
  if len(per_stack) > 1:
    window_of = f" of stack {heaviest.path!r} ({heaviest.layer_count} units; the heaviest window)"
  return heaviest.device_window_units, heaviest.device_window_bytes, window_of


def metadata_for(
  split: SplitModel,
  policy: LayerWeightResidency,
  static_shardings: Sequence[jax.sharding.Sharding],
  slice_shardings: Sequence[jax.sharding.Sharding],
) -> ModelMetadata:
  """The plan of placing ``split`` under ``policy`` with these shardings (see
  `check_budgets`); ``slice_shardings`` hold one unit of each unit leaf."""
  static_bytes = sum(
    pl.per_device_bytes(leaf.shape, leaf.dtype, s)
    for leaf, s in zip(split.static_leaves(), static_shardings, strict=True)
  )
  unit_bytes: list[int] = []
  device_bytes: list[int] = []
  host_bytes: list[int] = []
  for stack in split.stacks:
    leaves = split.stack_leaves(stack)
    one_unit = [(leaf.shape[1:], leaf.dtype) for leaf in leaves]
    slices = slice_shardings[stack.leaf_slice]
    unit_total = sum(leaf.nbytes for leaf in leaves) // max(stack.count, 1)
    device_unit = sum(
      pl.per_device_bytes(shape, dtype, s)
      for (shape, dtype), s in zip(one_unit, slices, strict=True)
    )
    if policy.execution_residency is ExecutionResidency.LAYERWISE_HOST:
      host_unit = sum(
        pl.per_process_bytes(shape, dtype, s)
        for (shape, dtype), s in zip(one_unit, slices, strict=True)
      )
    elif policy.execution_residency is ExecutionResidency.DENSE_DISK_STREAM:
      host_unit = unit_total
    else:
      host_unit = 0
    unit_bytes += [unit_total] * stack.count
    device_bytes += [device_unit] * stack.count
    host_bytes += [host_unit] * stack.count
  devices: set[Any] = {d for s in (*static_shardings, *slice_shardings) for d in s.device_set}
  return check_budgets(
    policy,
    static_device_bytes=static_bytes,
    unit_bytes=unit_bytes,
    device_unit_bytes=device_bytes,
    host_unit_bytes=host_bytes,
    device_is_host=all(d.platform == "cpu" for d in devices),
    stacks=[(s.name, s.count) for s in split.stacks],
    decoded_bytes=decoded_bytes(split, static_shardings, slice_shardings),
  )
