"""The placement plan: byte arithmetic, the load-time budget check, metadata.

Everything here is decided before a single parameter moves: how many bytes the
static parameters take on a device, how large each unit is on a device and in
host memory, how deep the device window is, and whether that fits the policy's
budgets (SPEC §2). The result is also what ``placed.metadata`` reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax

from jax_residency._src.placement import shardings as pl
from jax_residency._src.placement.split import SplitModel
from jax_residency._src.policy.errors import DeviceBudgetTooSmallError, HostBudgetTooSmallError
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.policy.types import (
  DenseDiskStream,
  ExecutionResidency,
  LayerWeightResidency,
  LayerwiseHost,
)

#: Bytes of decoded OCDBT index nodes an open store may cache: the one cache a
#: store keeps besides the unit buffers the budgets hold.
STORE_INDEX_CACHE_BYTES = 16 << 20

DEVICE_BUDGET = "device budget"
HOST_BUDGET = "host budget"
OVERHEAD = "overhead"


@dataclasses.dataclass(frozen=True, kw_only=True)
class MemoryItem:
  """One thing a placement holds in memory, and what pays for it.

  Attributes:
    name: what it is ("static parameters", "device window", "host cache", ...).
    memory: ``"device"`` or ``"host"``: where the bytes live. On a CPU backend
      device memory is host memory too.
    nbytes: the most bytes it holds at once (per device for device items).
    counted_in: ``"device budget"``, ``"host budget"``, or ``"overhead"`` (a
      named, bounded cost outside the budgets).
    note: how the bound comes about.

  Example:
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> with jr.place(model, jr.LayerwiseHost(prefetch_depth=1)) as placed:
    ...   item = placed.metadata.memory[-1]
    >>> item.name, item.memory, item.counted_in
    ('host units', 'host', 'host budget')
    >>> item.nbytes == sum(placed.metadata.unit_bytes)  # every unit, in pinned host memory
    True
  """

  name: str
  memory: str
  nbytes: int
  counted_in: str
  note: str = ""

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def largest_window(unit_bytes: Sequence[int], depth: int) -> int:
  """Bytes of the ``depth`` consecutive units that weigh the most."""
  n = len(unit_bytes)
  if n == 0 or depth <= 0:
    return 0
  depth = min(depth, n)
  window = sum(unit_bytes[:depth])
  best = window
  for i in range(depth, n):
    window += unit_bytes[i] - unit_bytes[i - depth]
    best = max(best, window)
  return best


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelMetadata:
  """A placed model's size and placement, as decided at load time.

  Attributes:
    layer_count: number of units in the layer stack.
    static_device_bytes: bytes of static parameters held by one device.
    unit_bytes: bytes of each unit (all shards together).
    largest_device_unit_bytes: the largest unit's bytes on one device.
    largest_host_unit_bytes: the largest unit's bytes in this process's host memory.
    device_window_units: units on a device at once (``policy.device_depth``).
    device_window_bytes: bytes of the heaviest such window on one device.
    device_unit_capacity: how many units the device budget could hold next to
      the static parameters (``None`` when the budget is unbounded).
    policy: the policy.
    memory: every item the placement holds, with what pays for it (see
      :class:`MemoryItem` and ``docs``: "Where the bytes go" in the README).
    device_is_host: the devices' memory is this process's memory (CPU), so
      device items count in the process's RSS too.

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
    d["planned_device_bytes"] = self.planned_device_bytes
    d["planned_host_bytes"] = self.planned_host_bytes
    d["overhead_bytes"] = self.overhead_bytes
    d["planned_process_bytes"] = self.planned_process_bytes
    return d

  def __str__(self) -> str:
    rows = [
      ("policy", self.policy.name),
      ("layers", str(self.layer_count)),
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


def staging_bytes(policy: LayerWeightResidency, unit_bytes: int, *, device_is_host: bool) -> int:
  """Host bytes a dense stream holds for a unit on its way to the device.

  A unit read from disk lands in one host buffer. Where device memory is host
  memory (CPU), that buffer becomes the device array without a copy, so it is
  a device-window unit, not an extra one. On an accelerator it is an extra
  unit of host memory until the copy is done: it counts against the host budget
  when there is one (the host cache gets the rest) and is a named overhead in
  direct disk-to-device mode.
  """
  if not isinstance(policy, DenseDiskStream) or device_is_host:
    return 0
  return unit_bytes


def memory_items(
  policy: LayerWeightResidency,
  *,
  static_device_bytes: int,
  device_window: tuple[int, int],
  host_unit_bytes: Sequence[int],
  device_is_host: bool,
) -> tuple[MemoryItem, ...]:
  """Every item a placement of ``policy`` holds, each with its bound and who pays.

  ``device_window`` is ``(units, bytes)``; ``host_unit_bytes`` what this
  process holds of each unit in host memory.
  """
  depth, window = device_window
  n = len(host_unit_bytes)
  items = [
    MemoryItem(
      name="static parameters",
      memory="device",
      nbytes=static_device_bytes,
      counted_in=DEVICE_BUDGET,
      note="embeddings, norms, head: always on the device",
    ),
    MemoryItem(
      name="device window" if depth < n or not policy.is_fully_resident else "units",
      memory="device",
      nbytes=window,
      counted_in=DEVICE_BUDGET,
      note=f"{depth} of {n} units",
    ),
  ]
  if isinstance(policy, LayerwiseHost):
    items.append(
      MemoryItem(
        name="host units",
        memory="host",
        nbytes=sum(host_unit_bytes),
        counted_in=HOST_BUDGET,
        note=f"all {n} units in pinned_host memory",
      )
    )
  dense = policy.dense
  if dense is None:
    return tuple(items)
  largest = max(host_unit_bytes, default=0)
  staging = staging_bytes(policy, largest, device_is_host=device_is_host)
  host_budget = dense.host_budget_bytes
  if host_budget != 0:
    everything = sum(host_unit_bytes)
    cache = everything if host_budget is None else min(host_budget - staging, everything)
    items.append(
      MemoryItem(
        name="host cache",
        memory="host",
        nbytes=cache,
        counted_in=HOST_BUDGET,
        note="cached units and reads in flight (each read is reserved in it before it starts)",
      )
    )
  if device_is_host:
    note = "0: mapped chunks (or a read buffer) become the device arrays, no copy (a window unit)"
  else:
    note = "one unit's host buffer while it is copied to the device"
  items.append(
    MemoryItem(
      name="staging",
      memory="host",
      nbytes=staging,
      counted_in=HOST_BUDGET if host_budget != 0 else OVERHEAD,
      note=note,
    )
  )
  items.append(
    MemoryItem(
      name="mapped store pages",
      memory="host",
      nbytes=largest,
      counted_in=OVERHEAD,
      note="page cache a copying read maps (so in RSS) until it is done; reclaimable",
    )
  )
  items.append(
    MemoryItem(
      name="store index cache",
      memory="host",
      nbytes=STORE_INDEX_CACHE_BYTES,
      counted_in=OVERHEAD,
      note="decoded OCDBT index nodes (bounded; usually a few KiB)",
    )
  )
  return tuple(items)


def check_budgets(
  policy: LayerWeightResidency,
  *,
  static_device_bytes: int,
  unit_bytes: Sequence[int],
  device_unit_bytes: Sequence[int],
  host_unit_bytes: Sequence[int],
  device_is_host: bool = True,
) -> ModelMetadata:
  """Checks the policy's budgets against the model and returns the metadata.

  ``unit_bytes`` are whole units; ``device_unit_bytes`` what one device holds of
  each; ``host_unit_bytes`` what this process's host memory holds of each.
  ``device_is_host``: the devices are CPU devices, whose memory is host memory
  (a dense stream's read buffers then become device arrays without a copy).

  Raises:
    DeviceBudgetTooSmallError: static bytes plus the heaviest device window
      exceed the device budget.
    HostBudgetTooSmallError: the heaviest host window (``host_lookahead`` units
      for a dense stream, plus the staging unit on an accelerator; every unit for
      ``LayerwiseHost``) exceeds the host budget.
  """
  offload = policy.offload()
  n = len(device_unit_bytes)
  depth = min(policy.device_depth(n), n)
  window = largest_window(device_unit_bytes, depth)
  budget = offload.device_budget_bytes
  if budget is not None and static_device_bytes + window > budget:
    required = static_device_bytes + window
    raise DeviceBudgetTooSmallError(
      f"device_budget_bytes={budget} ({format_bytes(budget)}) is too small for {policy.name}: "
      f"static={static_device_bytes} ({format_bytes(static_device_bytes)}) + "
      f"window={window} ({format_bytes(window)}, depth={depth} units) = "
      f"required={required} ({format_bytes(required)}); raise the device budget to at least "
      f"{required} bytes, or lower the prefetch depth",
      static=static_device_bytes,
      window=window,
      depth=depth,
      required=required,
      budget=budget,
    )
  host_budget = offload.host_budget_bytes
  dense = policy.dense
  # For a dense stream a zero host budget means direct disk-to-device loading;
  # for LayerwiseHost it means nothing fits in host memory.
  if host_budget is not None and (host_budget > 0 or isinstance(policy, LayerwiseHost)):
    staging = 0
    if isinstance(policy, DenseDiskStream) and dense is not None:
      host_depth = dense.host_lookahead
      host_window = largest_window(host_unit_bytes, host_depth)
      staging = staging_bytes(
        policy, max(host_unit_bytes, default=0), device_is_host=device_is_host
      )
      what = f"host_lookahead={host_depth} units"
    elif isinstance(policy, LayerwiseHost):
      host_depth = n
      host_window = sum(host_unit_bytes)
      what = f"all {n} units (LayerwiseHost keeps every unit in host memory)"
    else:
      host_window = 0
    required = host_window + staging
    if required > host_budget:
      arithmetic = f"window={host_window} ({format_bytes(host_window)}, {what})"
      if staging:
        arithmetic += (
          f" + staging={staging} ({format_bytes(staging)}, one unit's host buffer on its way "
          f"to the device) = required={required} ({format_bytes(required)})"
        )
      raise HostBudgetTooSmallError(
        f"host_budget_bytes={host_budget} ({format_bytes(host_budget)}) is too small for "
        f"{policy.name}: {arithmetic}; raise the host budget to at least {required} bytes"
        + (", or lower host_lookahead" if isinstance(policy, DenseDiskStream) else ""),
        window=host_window,
        staging=staging,
        required=required,
        budget=host_budget,
      )
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
    ),
    device_is_host=device_is_host,
  )


def metadata_for(
  split: SplitModel,
  policy: LayerWeightResidency,
  static_shardings: Sequence[jax.sharding.Sharding],
  slice_shardings: Sequence[jax.sharding.Sharding],
) -> ModelMetadata:
  static_bytes = sum(
    pl.per_device_bytes(leaf.shape, leaf.dtype, s)
    for leaf, s in zip(split.static_leaves(), static_shardings, strict=True)
  )
  unit_leaves = split.unit_leaves()
  one_unit = [(leaf.shape[1:], leaf.dtype) for leaf in unit_leaves]
  unit_total = sum(leaf.nbytes for leaf in unit_leaves) // max(split.unit_count, 1)
  device_unit = sum(
    pl.per_device_bytes(shape, dtype, s)
    for (shape, dtype), s in zip(one_unit, slice_shardings, strict=True)
  )
  if policy.execution_residency is ExecutionResidency.LAYERWISE_HOST:
    host_unit = sum(
      pl.per_process_bytes(shape, dtype, s)
      for (shape, dtype), s in zip(one_unit, slice_shardings, strict=True)
    )
  elif policy.execution_residency is ExecutionResidency.DENSE_DISK_STREAM:
    host_unit = unit_total
  else:
    host_unit = 0
  n = split.unit_count
  devices: set[Any] = {d for s in (*static_shardings, *slice_shardings) for d in s.device_set}
  return check_budgets(
    policy,
    static_device_bytes=static_bytes,
    unit_bytes=[unit_total] * n,
    device_unit_bytes=[device_unit] * n,
    host_unit_bytes=[host_unit] * n,
    device_is_host=all(d.platform == "cpu" for d in devices),
  )
