"""Each unit's rows as arrays of their own, for ``FullyResident`` and ``LayerwiseHost`` on
a CPU backend.

XLA's CPU backend copies a layer's slice out of the stacked weights inside a scanned
layer loop (a dynamic slice feeding a matmul is materialized): a pass reads every unit's
bytes three times (read, write the copy, read it) where one would do. On a CPU backend
the placement keeps its stacked arrays and adds, for each unit, arrays that view that
unit's rows of them (`unit_views`: device memory is host memory, so no copy and no
memory), and its pass is still one program: the views are its arguments and the layer
loop applies the layer to each unit's own arrays in turn (`unit_loop.StackLoop.apart`).
``LayerwiseHost``'s units sit in ``pinned_host`` memory, which on CPU is the memory the
device computes from: their views (and those of its device-resident units) feed the
program as they are, where its accelerator program would copy each unit into its window.

Under a JAX transformation and in `lower`, the program takes the stacked arrays, as on
accelerators.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np

from jax_residency._src.plan.split import SplitModel


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
) -> list[list[list[jax.Array]]] | None:
  """Per stack, per unit in order, the views of the unit's rows of each of the stack's
  leaves (``[stack][unit][leaf]``); None if any leaf cannot be viewed. With ``kept``
  (LayerwiseHost's device-resident units: each stack's first units, stacked apart), a
  stack's first rows come from those arrays."""
  views = []
  for stack in split.stacks:
    leaves, leaf_shardings = units[stack.leaf_slice], shardings[stack.leaf_slice]
    first = kept[stack.leaf_slice] if kept else []
    n = first[0].shape[0] if first else 0
    per_unit = []
    for j in range(stack.count):
      rows = zip(first if j < n else leaves, leaf_shardings, strict=True)
      row = [unit_view(a, j if j < n else j - n, s) for a, s in rows]
      if any(v is None for v in row):
        return None
      per_unit.append([v for v in row if v is not None])
    views.append(per_unit)
  return views
