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

from .errors import DeviceBudgetTooSmallError, HostBudgetTooSmallError
from .policy import DenseDiskStream, LayerWeightResidency, LayerwiseHost
from .sizes import format_bytes


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

  @property
  def total_unit_bytes(self) -> int:
    return sum(self.unit_bytes)

  def to_dict(self) -> dict[str, Any]:
    d = dataclasses.asdict(self)
    d["unit_bytes"] = list(self.unit_bytes)
    d["policy"] = self.policy.to_dict()
    d["total_unit_bytes"] = self.total_unit_bytes
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
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def check_budgets(
  policy: LayerWeightResidency,
  *,
  static_device_bytes: int,
  unit_bytes: Sequence[int],
  device_unit_bytes: Sequence[int],
  host_unit_bytes: Sequence[int],
) -> ModelMetadata:
  """Checks the policy's budgets against the model and returns the metadata.

  ``unit_bytes`` are whole units; ``device_unit_bytes`` what one device holds of
  each; ``host_unit_bytes`` what this process's host memory holds of each.

  Raises:
    DeviceBudgetTooSmallError: static bytes plus the heaviest device window
      exceed the device budget.
    HostBudgetTooSmallError: the heaviest host window (``host_lookahead`` units
      for a dense stream; every unit for ``LayerwiseHost``) exceeds the host budget.
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
      f"{required} bytes, or lower the prefetch depth"
    )
  host_budget = offload.host_budget_bytes
  dense = policy.dense
  # For a dense stream a zero host budget means direct disk-to-device loading;
  # for LayerwiseHost it means nothing fits in host memory.
  if host_budget is not None and (host_budget > 0 or isinstance(policy, LayerwiseHost)):
    if isinstance(policy, DenseDiskStream) and dense is not None:
      host_depth = dense.host_lookahead
      host_window = largest_window(host_unit_bytes, host_depth)
      what = f"host_lookahead={host_depth} units"
    elif isinstance(policy, LayerwiseHost):
      host_depth = n
      host_window = sum(host_unit_bytes)
      what = f"all {n} units (LayerwiseHost keeps every unit in host memory)"
    else:
      host_window = 0
    if host_window > host_budget:
      raise HostBudgetTooSmallError(
        f"host_budget_bytes={host_budget} ({format_bytes(host_budget)}) is too small for "
        f"{policy.name}: window={host_window} ({format_bytes(host_window)}, {what}); raise the "
        f"host budget to at least {host_window} bytes"
        + (", or lower host_lookahead" if isinstance(policy, DenseDiskStream) else "")
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
  )
