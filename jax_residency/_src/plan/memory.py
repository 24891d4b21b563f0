"""What a placement holds in memory, item by item, and what pays for each.

`memory_items` lists every bounded thing a placement of a policy holds (static
parameters, the device window, host units or the host cache, staging, mapped
pages, the store's index cache) as `MemoryItem` s; ``placed.metadata.memory``
is that list, and ``docs/design.md`` explains each item.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_residency._src.plan.resident import NO_RESIDENT_UNITS, ResidentPlan
from jax_residency._src.policy.types import DenseDiskStream, LayerWeightResidency, LayerwiseHost

#: Bytes of decoded OCDBT index nodes an open store may cache: the one cache a
#: store keeps besides the unit buffers the budgets hold.
STORE_INDEX_CACHE_BYTES = 16 << 20
#: Threads that read a dense stream's units ahead by faulting them in through
#: short-lived mappings (CPU, host budget 0), and the bytes each maps at a time:
#: read-ahead holds at most their product mapped (the "read-ahead mappings" item).
READ_AHEAD_THREADS = 8
READ_AHEAD_WINDOW = 2 << 20

#: What a process holds beside its placement's plan (docs/memory.md, "Process memory
#: beside the plan"): JAX's runtime after its first compile, the compiled programs and
#: a pass's activations of a small batch. `tests/test_memory_plan.py` places a model
#: under each policy in a fresh process and checks that its peak RSS grows by at most
#: ``metadata.planned_process_bytes`` plus this.
RUNTIME_ALLOWANCE_BYTES = 64 << 20

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
  window_of: str = "",
  decoded_bytes: tuple[int, int] = (0, 0),
  resident: ResidentPlan = NO_RESIDENT_UNITS,
) -> tuple[MemoryItem, ...]:
  """Every item a placement of ``policy`` holds, each with its bound and who pays.

  ``device_window`` is ``(units, bytes)``; ``host_unit_bytes`` what this
  process holds of each unit in host memory; ``decoded_bytes`` the float tensors
  of a quantized store while they are used: the static ones and one unit's
  (``(0, 0)``: nothing is quantized); ``resident`` the units a dense stream keeps
  on the device and in host memory from placement on.
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
      note=f"{depth} units{window_of}" if window_of else f"{depth} of {n} units",
    ),
  ]
  if resident.device:
    items.append(
      MemoryItem(
        name="device-resident units",
        memory="device",
        nbytes=resident.device_bytes,
        counted_in=DEVICE_BUDGET,
        note=f"{len(resident.device)} units read at placement, never moved again",
      )
    )
  static_floats, unit_floats = decoded_bytes
  if static_floats:
    items.append(
      MemoryItem(
        name="decoded static",
        memory="device",
        nbytes=static_floats,
        counted_in=DEVICE_BUDGET,
        note="the largest quantized static tensor as floats: each is decoded inside the "
        "operation that uses it, one at a time (a one-token step only what it reads)",
      )
    )
  if unit_floats:
    items.append(
      MemoryItem(
        name="decoded unit",
        memory="device",
        nbytes=unit_floats,
        counted_in=DEVICE_BUDGET,
        note="a unit's largest quantized tensor as floats while its step runs (a step "
        "temporary: a several-token step decodes one matrix at a time)",
      )
    )
  if isinstance(policy, LayerwiseHost):
    on_device = set(resident.device)
    items.append(
      MemoryItem(
        name="host units",
        memory="host",
        nbytes=sum(b for i, b in enumerate(host_unit_bytes) if i not in on_device),
        counted_in=HOST_BUDGET,
        note=f"{n - len(on_device)} of {n} units in pinned_host memory"
        if on_device
        else f"all {n} units in pinned_host memory",
      )
    )
  if policy.dense is not None:
    items.extend(
      _dense_stream_items(policy, host_unit_bytes, device_is_host=device_is_host, kept=resident)
    )
  return tuple(items)


def _dense_stream_items(
  policy: LayerWeightResidency,
  host_unit_bytes: Sequence[int],
  *,
  device_is_host: bool,
  kept: ResidentPlan,
) -> list[MemoryItem]:
  """A dense stream's host items: its resident units, its cache, the staging buffer,
  mapped store pages, read-ahead's mappings and the store's index cache."""
  assert policy.dense is not None
  items: list[MemoryItem] = []
  largest = max(host_unit_bytes, default=0)
  staging = staging_bytes(policy, largest, device_is_host=device_is_host)
  host_budget = policy.dense.host_budget_bytes
  if kept.host:
    items.append(
      MemoryItem(
        name="host-resident units",
        memory="host",
        nbytes=kept.host_bytes,
        counted_in=HOST_BUDGET,
        note=f"{len(kept.host)} units read at placement, moved to the device each pass",
      )
    )
  if host_budget != 0:
    resident = set(kept.device) | set(kept.host)
    everything = sum(b for i, b in enumerate(host_unit_bytes) if i not in resident)
    room = None if host_budget is None else host_budget - staging - kept.host_bytes
    cache = everything if room is None else min(room, everything)
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
  if device_is_host and host_budget == 0:
    items.append(
      MemoryItem(
        name="read-ahead mappings",
        memory="host",
        nbytes=READ_AHEAD_THREADS * READ_AHEAD_WINDOW,
        counted_in=OVERHEAD,
        note="page cache the read-ahead threads map while they fault the next units in",
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
  return items
