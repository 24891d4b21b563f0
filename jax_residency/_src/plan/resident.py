"""Units a streaming placement keeps resident for its whole life (docs/design.md, 4.6).

A `DenseDiskStream` with ``device_resident_units=d`` and ``host_resident_units=h``
keeps the first ``d`` units of each stack on the device and the next ``h`` in host
memory, read once at placement; the rest stream through the window and the cache.
A `LayerwiseHost` with ``device_resident_units=d`` keeps the first ``d`` in device
memory instead of ``pinned_host``.
`resident_units` says which units those are (global unit ids, in the forward's order)
and what they cost per device and in host memory, for the budgets, the memory items
and the engine alike.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from jax_residency._src.errors import PlacementError
from jax_residency._src.policy.types import LayerWeightResidency


@dataclasses.dataclass(frozen=True)
class ResidentPlan:
  """The units kept resident, by tier, and their bytes.

  Attributes:
    device: global ids of the units kept on the device.
    host: global ids of the units kept in host memory.
    device_bytes: what the device-resident units take on one device.
    host_bytes: what the host-resident units take in this process's memory.
  """

  device: tuple[int, ...] = ()
  host: tuple[int, ...] = ()
  device_bytes: int = 0
  host_bytes: int = 0

  def __bool__(self) -> bool:
    return bool(self.device or self.host)


#: A placement that keeps no unit resident.
NO_RESIDENT_UNITS = ResidentPlan()


def resident_units(
  policy: LayerWeightResidency,
  stacks: Sequence[tuple[str, int]],
  device_unit_bytes: Sequence[int],
  host_unit_bytes: Sequence[int],
) -> ResidentPlan:
  """Which units ``policy`` keeps resident, for ``stacks`` ``(path, count)`` that
  partition the units in order.

  Raises:
    PlacementError: a stack has fewer units than the policy keeps resident of each.

  Example:
    >>> import jax_residency as jr
    >>> policy = jr.DenseDiskStream(device_resident_units=2, host_resident_units=1)
    >>> r = resident_units(policy, [("enc", 4), ("dec", 3)], [10] * 7, [10] * 7)
    >>> r.device, r.host, r.device_bytes, r.host_bytes
    ((0, 1, 4, 5), (2, 6), 40, 20)
  """
  options = getattr(policy, "options", None)  # FullyResident has none (all resident)
  d = getattr(options, "device_resident_units", 0)
  h = getattr(options, "host_resident_units", 0)
  if not (d or h):
    return NO_RESIDENT_UNITS
  short = [(path, count) for path, count in stacks if d + h > count]
  if short:
    listed = ", ".join(f"{path or 'the stack'!s} has {count}" for path, count in short)
    kept = f"device_resident_units={d}"
    if h:
      kept += f" + host_resident_units={h} = {d + h}"
    raise PlacementError(
      f"{policy.name} keeps {kept} units of each stack resident, but {listed}. Lower "
      f"{'them' if h else 'it'} to at most {min(c for _, c in short)}"
      f"{' in all' if h else ''}, or use FullyResident to keep every unit on the device."
    )
  device: list[int] = []
  host: list[int] = []
  start = 0
  for _, count in stacks:
    device += range(start, start + d)
    host += range(start + d, start + d + h)
    start += count
  return ResidentPlan(
    device=tuple(device),
    host=tuple(host),
    device_bytes=sum(device_unit_bytes[i] for i in device),
    host_bytes=sum(host_unit_bytes[i] for i in host),
  )
