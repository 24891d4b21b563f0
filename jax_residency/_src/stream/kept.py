"""The units a dense stream keeps resident from placement on (docs/design.md, 4.6).

`KeptUnits` reads them once, when the placement is made: the device-resident ones
onto the devices, the host-resident ones into host memory the process owns (a copy,
not a view of the page cache or of a reusable read buffer). The engine serves them
without its ledger: they are never evicted, never read again, and never counted as a
cache's hits or misses. Streamed units are everything else; read-ahead skips the kept
ones, so a pass's reads begin with its first streamed unit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import jax
import numpy as np

from jax_residency._src.plan.resident import ResidentPlan
from jax_residency._src.plan.shardings import DEVICE, held_units
from jax_residency._src.store.buffers import anonymous_slab, buffer_layout
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.typing import ParamPath, path_str

Read = Callable[[int], Mapping[ParamPath, np.ndarray]]


class KeptUnits:
  """The resident units of one placement, read at construction.

  Args:
    resident: which units, by tier (`plan.resident.resident_units`).
    owner: the stack of each unit id.
    read: reads one unit from the store.
  """

  def __init__(self, resident: ResidentPlan, owner: Sequence[StreamedStack], read: Read) -> None:
    self.resident = resident
    self._device: dict[int, list[jax.Array]] = {}
    self._host: dict[int, dict[ParamPath, np.ndarray]] = {}
    for i in resident.device:
      # The unit's own copy: never a view of the store's mapped pages or of a read
      # buffer the store reuses. jax.device_put on CPU aliases a large numpy buffer
      # even with may_alias=False (JAX 0.10), so the copy is made here, and on CPU it
      # becomes the device array as it is.
      self._device[i] = owner[i].to_device(_copied(read(i)), alias=True)
    for i in resident.host:
      self._host[i] = _copied(read(i))
    self._kept = frozenset(self._device) | frozenset(self._host)

  def on_device(self, i: int) -> list[jax.Array] | None:
    """Unit ``i``'s device arrays if it is device-resident, else None."""
    return self._device.get(i)

  def in_host(self, i: int) -> Mapping[ParamPath, np.ndarray] | None:
    """Unit ``i``'s host tensors if it is host-resident, else None."""
    return self._host.get(i)

  def streamed(self, units: Sequence[int], most: int) -> list[int]:
    """The first ``most`` of ``units`` that are not kept, in order."""
    if not self._kept:
      return list(units[:most])
    out: list[int] = []
    for j in units:
      if len(out) >= most:
        break
      if j not in self._kept:
        out.append(j)
    return out

  def held(self) -> tuple[int, int, int, int]:
    """What the kept units hold now, measured from their live arrays (`held_units`):
    device units and the most bytes of them on one device, host units and their bytes."""
    arrays = [a for unit in self._device.values() for a in unit]
    width = len(arrays) // len(self._device) if self._device else 0
    units = [(slice(k * width, (k + 1) * width), 1) for k in range(len(self._device))]
    device_units, device_bytes = held_units(arrays, units)[DEVICE]
    host = sum(a.nbytes for unit in self._host.values() for a in unit.values())
    return device_units, device_bytes, len(self._host), host

  def close(self) -> None:
    self._device.clear()
    self._host.clear()


def _copied(unit: Mapping[ParamPath, np.ndarray]) -> dict[ParamPath, np.ndarray]:
  """The unit's own copy, its tensors in one page-aligned anonymous mapping (huge pages
  where the kernel gives them), as the store's read buffers are: XLA's CPU client uses
  such a buffer in place, where it copies a malloc'd numpy array (16-byte aligned) on
  every move. Measured on the planner benchmark's 192 MiB units: a host-resident unit
  in a numpy copy added 80 ms to each pass, the fresh pages each move faulted in."""
  layout, total = buffer_layout([(path_str(p), a.shape, a.dtype) for p, a in unit.items()])
  slab = anonymous_slab(max(total, 1))
  out = {}
  for (path, a), (_, shape, dtype, offset) in zip(unit.items(), layout, strict=True):
    view = np.frombuffer(slab, dtype, count=math.prod(shape), offset=offset).reshape(shape)
    view[...] = a
    out[path] = view
  return out
