"""Multi-process meshes: which part of each unit tensor this process reads and places.

On a mesh whose devices span processes, each process reads from the store only
the box of each tensor its own devices hold (`addressable_box`), and builds the
global array from it (`from_local_box`).
"""

from __future__ import annotations

import jax
import numpy as np

from jax_residency._src.typing import tensor_nbytes


def addressable_box(
  sharding: jax.sharding.Sharding, shape: tuple[int, ...]
) -> tuple[slice, ...] | None:
  """The smallest box of an array of ``shape`` covering this process's shards.

  ``None`` when every device of ``sharding`` belongs to this process (read all).
  """
  if sharding.is_fully_addressable:
    return None
  starts, stops = list(shape), [0] * len(shape)
  for index in sharding.addressable_devices_indices_map(shape).values():
    for d, n in enumerate(shape):
      lo, hi, _ = (index[d] if index is not None else slice(None)).indices(n)
      starts[d], stops[d] = min(starts[d], lo), max(stops[d], hi)
  return tuple(slice(lo, hi) for lo, hi in zip(starts, stops, strict=True))


def box_nbytes(shape: tuple[int, ...], dtype: np.dtype, box: tuple[slice, ...]) -> int:
  """Bytes of the part ``box`` of an array of ``shape`` (``()``: the whole array)."""
  return tensor_nbytes(shape if box == () else [b.stop - b.start for b in box], dtype)


def from_local_box(
  local: np.ndarray,
  shape: tuple[int, ...],
  sharding: jax.sharding.Sharding,
  box: tuple[slice, ...],
) -> jax.Array:
  """Builds a global array from the box of it this process read."""
  if box == ():
    return jax.device_put(local, sharding)
  origin = [b.start for b in box]

  def shard(index: tuple[slice, ...] | None) -> np.ndarray:
    full = index if index is not None else (slice(None),) * len(shape)
    local_index = tuple(
      slice(sl.indices(n)[0] - o, sl.indices(n)[1] - o)
      for sl, n, o in zip(full, shape, origin, strict=True)
    )
    return local[local_index]

  return jax.make_array_from_callback(shape, sharding, shard)
