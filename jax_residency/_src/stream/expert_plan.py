"""What expert residency plans (docs/design.md, 4.9): each stack's expert tensors and
one expert's bytes (`StackExperts`), and the expert caches as items of the placement's
memory plan, checked against its device budget (`with_expert_caches`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from jax_residency._src.errors import DeviceBudgetTooSmallError
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.plan.memory import MemoryItem
from jax_residency._src.policy.experts import ExpertResidency
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.store.stored_stack import per_expert
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StackExperts:
  """One stack's expert tensors.

  Attributes:
    leaves: their positions among the stack's leaves.
    rel_paths: their paths relative to the stack, in leaf order.
    count: experts per unit.
    shardings: where each whole tensor (``(experts, ...)`` per unit) goes.
    parts: where one expert's part of each goes (the expert axis dropped).
    expert_bytes: bytes of one expert (its part of every expert tensor).
  """

  leaves: tuple[int, ...]
  rel_paths: tuple[ParamPath, ...]
  count: int
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  shardings: tuple[jax.sharding.Sharding, ...]
  parts: tuple[jax.sharding.Sharding, ...]
  expert_bytes: int

  @classmethod
  def of(cls, st: StreamedStack, stored: Any) -> StackExperts | None:
    found = [
      (k, rel) for k, rel in enumerate(st.rel_paths) if per_expert(stored.arrays[tuple(rel)])
    ]
    if not found:
      return None
    leaves = tuple(k for k, _ in found)
    shapes = tuple(st.shapes[k] for k in leaves)
    dtypes = tuple(np.dtype(stored.arrays[tuple(rel)].dtype) for _, rel in found)
    return cls(
      leaves=leaves,
      rel_paths=tuple(tuple(rel) for _, rel in found),
      count=stored.experts,
      shapes=shapes,
      dtypes=dtypes,
      shardings=tuple(st.shardings[k] for k in leaves),
      parts=tuple(part_sharding(st.shardings[k]) for k in leaves),
      expert_bytes=sum(math.prod(s[1:]) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)),
    )


def part_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of one expert's part of a tensor sharded as ``s`` (its first axis gone)."""
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
  return s


def with_expert_caches(metadata: ModelMetadata, policy: ExpertResidency | None) -> ModelMetadata:
  """The plan with the expert caches in it, checked against the device budget: the
  device expert cache is paid from ``device_budget_bytes`` beside the static weights and
  the window (whose units are planned whole, so one unit's assembled experts fit)."""
  if policy is None:
    return metadata
  budgets = (("device", policy.device_budget_bytes), ("host", policy.host_budget_bytes))
  items = [
    MemoryItem(
      name=f"{memory} expert cache",
      memory=memory,
      nbytes=nbytes,
      counted_in=f"{memory} budget",
      note=f"ExpertResidency.{memory}_budget_bytes",
    )
    for memory, nbytes in budgets
    if nbytes  # an unbounded cache (None) is no planned item, and 0 is none
  ]
  out = dataclasses.replace(metadata, memory=(*metadata.memory, *items))
  budget = metadata.policy.offload().device_budget_bytes
  cache = policy.device_budget_bytes
  if budget is not None and cache is None:
    raise DeviceBudgetTooSmallError(
      f"DenseDiskStream(device_budget_bytes={budget}) bounds the device, but "
      "ExpertResidency(device_budget_bytes=None) lets the expert cache grow without bound; "
      "give the expert cache a budget, or the policy device_budget_bytes=None.",
      budget=budget,
    )
  if budget is not None and out.planned_device_bytes > budget:
    before = metadata.planned_device_bytes
    raise DeviceBudgetTooSmallError(
      f"DenseDiskStream(device_budget_bytes={budget}) ({format_bytes(budget)}) cannot hold "
      f"the static weights and the unit window ({before} B) plus the device expert cache "
      f"({cache} B): {before} + {cache} = {out.planned_device_bytes} B "
      f"({format_bytes(out.planned_device_bytes)}). Raise device_budget_bytes to at least "
      f"that, or shrink ExpertResidency.device_budget_bytes to {max(0, budget - before)} B.",
      required=out.planned_device_bytes,
      budget=budget,
      window=metadata.device_window_bytes,
      static=metadata.static_device_bytes,
    )
  return out
