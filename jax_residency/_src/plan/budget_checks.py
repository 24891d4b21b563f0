"""The load-time budget checks: each tier's arithmetic, and the error that shows it
(docs/design.md, 2.3). `budget.check_budgets` runs them before anything is placed."""

from __future__ import annotations

from collections.abc import Sequence

from jax_residency._src.errors import DeviceBudgetTooSmallError, HostBudgetTooSmallError
from jax_residency._src.plan.memory import staging_bytes
from jax_residency._src.plan.resident import NO_RESIDENT_UNITS, ResidentPlan
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.policy.types import DenseDiskStream, LayerWeightResidency, LayerwiseHost


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


def check_device_budget(
  policy: LayerWeightResidency,
  static: int,
  window: int,
  depth: int,
  window_of: str,
  decoded: int = 0,
  resident: ResidentPlan = NO_RESIDENT_UNITS,
) -> None:
  """Raises `DeviceBudgetTooSmallError` when static bytes + the window (+ a quantized
  unit's decoded tensors, + the device-resident units) exceed the budget."""
  budget = policy.offload().device_budget_bytes
  kept = resident.device_bytes
  required = static + window + decoded + kept
  if budget is None or required <= budget:
    return
  also = f"decoded={decoded} ({format_bytes(decoded)}) + " if decoded else ""
  if kept:
    also += f"device-resident={kept} ({format_bytes(kept)}, {len(resident.device)} units) + "
  raise DeviceBudgetTooSmallError(
    f"device_budget_bytes={budget} ({format_bytes(budget)}) is too small for {policy.name}: "
    f"static={static} ({format_bytes(static)}) + {also}"
    f"window={window} ({format_bytes(window)}, depth={depth} units{window_of}) = "
    f"required={required} ({format_bytes(required)}); raise the device budget to at least "
    f"{required} bytes, or lower the prefetch depth"
    + (" or device_resident_units" if kept else ""),
    static=static,
    window=window,
    depth=depth,
    required=required,
    budget=budget,
    decoded=decoded,
    resident=kept,
  )


def check_host_budget(
  policy: LayerWeightResidency,
  host_unit_bytes: Sequence[int],
  *,
  device_is_host: bool,
  resident: ResidentPlan = NO_RESIDENT_UNITS,
) -> None:
  """Raises `HostBudgetTooSmallError` when the host window (+ staging, + the host-resident
  units) exceeds the budget.

  For a dense stream a zero host budget means direct disk-to-device loading; for
  `LayerwiseHost` it means nothing fits in host memory.
  """
  host_budget = policy.offload().host_budget_bytes
  if host_budget is None or (host_budget == 0 and not isinstance(policy, LayerwiseHost)):
    return
  staging = 0
  dense = policy.dense
  if isinstance(policy, DenseDiskStream) and dense is not None:
    kept = set(resident.device) | set(resident.host)  # read ahead: streamed units only
    streamed = [b for i, b in enumerate(host_unit_bytes) if i not in kept]
    host_window = largest_window(streamed, dense.host_lookahead)
    staging = staging_bytes(policy, max(host_unit_bytes, default=0), device_is_host=device_is_host)
    what = f"host_lookahead={dense.host_lookahead} units"
  elif isinstance(policy, LayerwiseHost):
    on_device = set(resident.device)
    host_window = sum(b for i, b in enumerate(host_unit_bytes) if i not in on_device)
    what = f"all {len(host_unit_bytes)} units (LayerwiseHost keeps every unit in host memory)"
    if on_device:
      what = (
        f"{len(host_unit_bytes) - len(on_device)} units: all but the "
        f"{len(on_device)} device-resident ones"
      )
  else:
    return
  held = resident.host_bytes
  required = host_window + staging + held
  if required <= host_budget:
    return
  arithmetic = f"window={host_window} ({format_bytes(host_window)}, {what})"
  if staging:
    arithmetic += (
      f" + staging={staging} ({format_bytes(staging)}, one unit's host buffer on its way "
      "to the device)"
    )
  if held:
    arithmetic += f" + host-resident={held} ({format_bytes(held)}, {len(resident.host)} units)"
  if staging or held:
    arithmetic += f" = required={required} ({format_bytes(required)})"
  raise HostBudgetTooSmallError(
    f"host_budget_bytes={host_budget} ({format_bytes(host_budget)}) is too small for "
    f"{policy.name}: {arithmetic}; raise the host budget to at least {required} bytes"
    + (", or lower host_lookahead" if isinstance(policy, DenseDiskStream) else "")
    + (" or host_resident_units" if held else ""),
    window=host_window,
    staging=staging,
    required=required,
    budget=host_budget,
    resident=held,
  )
