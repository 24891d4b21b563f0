"""Where a step's expert tensors live (docs/design.md, 4.9): each whole ``(experts,
...)`` with the picked experts' rows filled and the others zero.

* `ExpertRows` (CPU, one device): a unit's tensors kept between passes; the device
  expert cache's experts are their rows.
* `RowBuffers` (CPU, a mesh of several devices): two buffers a stack's steps take in
  turn, the picked rows copied in, then put on the devices.
* `put_rows` (accelerators): a program that builds the tensor on the device from the
  cached experts.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.store.buffers import anonymous_slab
from jax_residency._src.store.fault_in import region_of

#: Whether a row's whole pages can be handed back to the kernel, reading as zero after
#: (a private anonymous mapping and ``MADV_DONTNEED``); else its bytes are zeroed.
_GIVE_BACK = all(hasattr(mmap, n) for n in ("MAP_PRIVATE", "MAP_ANONYMOUS", "MADV_DONTNEED"))


def zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """A zero array on pages of its own: untouched rows cost no memory, and its start is
  page-aligned (a CPU device array can then use it without a copy)."""
  nbytes = math.prod(shape) * dtype.itemsize
  if not nbytes:
    return np.zeros(shape, dtype)
  # Private: a page given back (`ExpertRows.clear`) reads as zero again.
  return np.frombuffer(anonymous_slab(nbytes), dtype).reshape(shape)


class ExpertRows:
  """One unit's expert tensors, kept whole between passes: each ``(experts, ...)`` on
  zero pages of its own, an expert's part in its row (CPU, one device).

  The device expert cache's experts of this unit are its filled rows: a step uses the
  buffers as its expert tensors without a copy, and an evicted expert's row is given
  back to the kernel (``MADV_DONTNEED``: it reads as zero again and holds no memory).
  A row holds that expert's own weights or zeros, and the layer weighs an unpicked
  expert 0, so a row filled but not picked changes no output.
  """

  def __init__(self, shapes: tuple[tuple[int, ...], ...], dtypes: tuple[np.dtype, ...]) -> None:
    self.buffers = [zeros(s, d) for s, d in zip(shapes, dtypes, strict=True)]

  def row(self, e: int) -> list[np.ndarray]:
    """Expert ``e``'s part of each tensor (views to read into)."""
    return [b[e] for b in self.buffers]

  def clear(self, e: int) -> None:
    """Gives expert ``e``'s rows back: whole pages to the kernel, the rest zeroed."""
    for b in self.buffers:
      region = region_of(b) if _GIVE_BACK else None
      flat = b.reshape(-1).view(np.uint8)
      size = flat.size // b.shape[0]
      start, stop = e * size, (e + 1) * size
      first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
      last = stop // mmap.PAGESIZE * mmap.PAGESIZE
      if region is None or first >= last:
        flat[start:stop] = 0
        continue
      flat[start:first] = 0
      flat[last:stop] = 0
      region.madvise(mmap.MADV_DONTNEED, first, last - first)


class RowBuffers:
  """Two ``(experts, ...)`` buffers of one expert tensor, used in turn by a stack's steps.

  A step's buffer is free again two steps later: before its stack's next step, the loop
  waited for the step before (`staged._run_unit_loop`), and the ids that step's probe
  returned waited for this one. Reuse spares the page faults of fresh memory (copying a
  row into fresh pages took 6x as long as into used ones, here). The rows a buffer's
  last use filled and this one does not are zeroed; the others were never written.
  """

  def __init__(self, shape: tuple[int, ...], dtype: np.dtype) -> None:
    self._shape, self._dtype = shape, dtype
    self._buffers: list[np.ndarray | None] = [None, None]
    self._filled: list[set[int]] = [set(), set()]
    self._turn = 0

  def take(self, rows: Mapping[int, Any]) -> np.ndarray:
    """The next buffer, its rows outside ``rows`` zero (``rows``' are the caller's)."""
    k, self._turn = self._turn, 1 - self._turn
    buf = self._buffers[k]
    if buf is None:
      buf = self._buffers[k] = zeros(self._shape, self._dtype)
    for e in self._filled[k] - set(rows):
      buf[e] = 0
    self._filled[k] = set(rows)
    return buf


@functools.lru_cache(maxsize=64)
def put_rows(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Any:
  """A program that writes rows (each an expert's part) at ids of a zero tensor."""

  def put(ids: jax.Array, rows: list[jax.Array]) -> jax.Array:
    return jnp.zeros(shape, dtype).at[ids].set(jnp.stack(rows))

  return jax.jit(put, out_shardings=sharding)
