"""What the stream knows of one layer stack's units: tensors, shardings and sizes.

A dense stream moves units of several stacks through one host cache and one
device window; a unit id tells which stack it is of (`split.Stack.units`), and
its stack's `StreamedStack` says which tensors to read, what part of each this
process reads on a multi-process mesh, where each goes, and how many bytes a
unit takes in host and device memory.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_residency._src.plan.budget import StackMetadata
from jax_residency._src.plan.split import SplitModel, Stack
from jax_residency._src.store.mapped import ALIGNMENT
from jax_residency._src.stream.boxes import addressable_box, box_nbytes, from_local_box
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StreamedStack:
  """One stack's units as the stream reads and places them.

  Attributes:
    name: the stack's path.
    count: its units.
    rel_paths: its unit tensors, relative to the stack (the store's read keys).
    shapes: each tensor's per-unit shape.
    shardings: where each tensor of a unit goes on the devices.
    read_index: on a multi-process mesh, the box of each tensor this process
      reads (``None`` when every device is this process's).
    host_bytes: bytes of one unit as this process reads and holds it.
    device_bytes: bytes of one unit on one device.
    host_is_device: every tensor goes to one CPU device, whose memory is host memory
      (`to_device` may hand a step the host arrays themselves).
  """

  name: str
  count: int
  rel_paths: tuple[ParamPath, ...]
  shapes: tuple[tuple[int, ...], ...]
  shardings: tuple[jax.sharding.Sharding, ...]
  read_index: dict[ParamPath, tuple[slice, ...]] | None
  host_bytes: int
  device_bytes: int
  host_is_device: bool = False

  @classmethod
  def of(
    cls,
    split: SplitModel,
    stack: Stack,
    shardings: Sequence[jax.sharding.Sharding],
    meta: StackMetadata,
  ) -> StreamedStack:
    leaves = split.stack_leaves(stack)
    rel = tuple(split.unit_rel_path(leaf) for leaf in leaves)
    shapes = tuple(leaf.shape[1:] for leaf in leaves)
    # Multi-process meshes: each process reads only the box of each tensor that
    # its own devices hold.
    boxes = [addressable_box(s, shape) for s, shape in zip(shardings, shapes, strict=True)]
    read_index = None
    host_bytes = meta.unit_bytes
    if any(b is not None for b in boxes):
      read_index = {p: (b if b is not None else ()) for p, b in zip(rel, boxes, strict=True)}
      host_bytes = sum(
        box_nbytes(leaf.shape[1:], leaf.dtype, read_index[p])
        for p, leaf in zip(rel, leaves, strict=True)
      )
    return cls(
      name=stack.name,
      count=stack.count,
      rel_paths=rel,
      shapes=shapes,
      shardings=tuple(shardings),
      read_index=read_index,
      host_bytes=host_bytes,
      device_bytes=meta.device_unit_bytes,
      host_is_device=all(_one_cpu_device(s.device_set) for s in shardings),
    )

  def to_device(
    self, host: Mapping[ParamPath, np.ndarray], *, alias: bool, in_place: bool = False
  ) -> list[Any]:
    """One unit's tensors, as read (``host``), put on the devices. With ``alias``, on a
    CPU backend a page-aligned host buffer becomes the device array without a copy;
    accelerators copy host to device either way.

    With ``in_place`` too, where the unit goes to one CPU device (`host_is_device`),
    the aligned host arrays are returned as they are, for a step to take as
    arguments: XLA's CPU client uses an aligned NumPy argument of a compiled call in
    place, as ``device_put(..., may_alias=True)`` would, without ``device_put``'s
    Python work per array (tens of microseconds each, 240 arrays a pass for the
    decode benchmark's int4 decoder; `tests/test_mapped.py` checks that a stream hands
    its steps the mapped arrays and that such a call copies nothing).
    """
    if self.read_index is None:
      # A tensor the read left out (an expert tensor, `expert_cache`) is None.
      out: list[Any] = [None] * len(self.rel_paths)
      put = []
      for k, p in enumerate(self.rel_paths):
        if p not in host:
          continue
        a = np.asarray(host[p])
        if alias and in_place and self.host_is_device and _usable_in_place(a):
          out[k] = a
        else:
          put.append((k, a))
      if put:
        placed = jax.device_put(
          [a for _, a in put], [self.shardings[k] for k, _ in put], may_alias=alias
        )
        for (k, _), a in zip(put, placed, strict=True):
          out[k] = a
      return out
    return [
      from_local_box(np.asarray(host[p]), shape, s, self.read_index[p])
      for p, shape, s in zip(self.rel_paths, self.shapes, self.shardings, strict=True)
    ]


def _one_cpu_device(devices: Any) -> bool:
  devices = list(devices)
  return len(devices) == 1 and devices[0].platform == "cpu"


def _usable_in_place(a: np.ndarray) -> bool:
  """Whether a compiled CPU call takes ``a`` without a copy: C-contiguous, aligned, and
  of a dtype JAX keeps as it is (no 64-bit type narrowed)."""
  return (
    a.flags.c_contiguous
    and a.ctypes.data % ALIGNMENT == 0
    and jax.dtypes.canonicalize_dtype(a.dtype) == a.dtype
  )
