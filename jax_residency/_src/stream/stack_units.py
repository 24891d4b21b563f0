"""What the stream knows of one layer stack's units: tensors, shardings and sizes.

A dense stream moves units of several stacks through one host cache and one
device window; a unit id tells which stack it is of (`split.Stack.units`), and
its stack's `StackUnits` says which tensors to read, what part of each this
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
from jax_residency._src.stream.boxes import addressable_box, box_nbytes, from_local_box
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StackUnits:
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
  """

  name: str
  count: int
  rel_paths: tuple[ParamPath, ...]
  shapes: tuple[tuple[int, ...], ...]
  shardings: tuple[jax.sharding.Sharding, ...]
  read_index: dict[ParamPath, tuple[slice, ...]] | None
  host_bytes: int
  device_bytes: int

  @classmethod
  def of(
    cls,
    split: SplitModel,
    stack: Stack,
    shardings: Sequence[jax.sharding.Sharding],
    meta: StackMetadata,
  ) -> StackUnits:
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
    )

  def to_device(self, host: Mapping[ParamPath, np.ndarray], *, alias: bool) -> list[jax.Array]:
    """One unit's tensors, as read (``host``), put on the devices. With ``alias``, on a
    CPU backend a page-aligned host buffer becomes the device array without a copy;
    accelerators copy host to device either way."""
    if self.read_index is None:
      # A tensor the read left out (an expert tensor, `expert_cache`) is None.
      there = [k for k, p in enumerate(self.rel_paths) if p in host]
      placed = jax.device_put(
        [np.asarray(host[self.rel_paths[k]]) for k in there],
        [self.shardings[k] for k in there],
        may_alias=alias,
      )
      out: list[Any] = [None] * len(self.rel_paths)
      for k, a in zip(there, placed, strict=True):
        out[k] = a
      return out
    return [
      from_local_box(np.asarray(host[p]), shape, s, self.read_index[p])
      for p, shape, s in zip(self.rel_paths, self.shapes, self.shardings, strict=True)
    ]
