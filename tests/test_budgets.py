"""The load-time budget check (docs/design.md, section 2.3), for LayerwiseHost.

Expected byte counts are computed here from the parameter shapes (and the
partitioning metadata, for sharded units), not read back from the metadata:
static bytes plus the ``prefetch_depth`` heaviest consecutive units must fit
the device budget, and every unit must fit the host budget. One byte less
raises, before anything is placed; exactly enough succeeds.
"""

from __future__ import annotations

import gc
import math
from typing import Any

import jax
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import jax_residency as jr


def layerwise(depth: int = 1, **budgets: int | None) -> jr.LayerwiseHost:
  offload = jr.OffloadConfig(prefetch_depth=depth, **budgets)
  return jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=offload))


def nbytes(a: Any) -> int:
  return math.prod(a.shape) * np.dtype(a.dtype).itemsize


def toy_sizes(model: nnx.Module) -> tuple[int, int, int]:
  """(static bytes, bytes of one unit, unit count) of the NNX toy, from its parameter shapes."""
  state = nnx.state(model)
  units = jax.tree.leaves(state["layers"])
  n = units[0].shape[0]
  total = sum(nbytes(a) for a in jax.tree.leaves(state))
  unit_total = sum(nbytes(a) for a in units)
  assert unit_total % n == 0
  return total - unit_total, unit_total // n, n


def live_ids() -> set[int]:
  gc.collect()
  return {id(a) for a in jax.live_arrays()}


def test_toy_sizes_by_hand(nnx_toy, cfg):
  """The shapes give the sizes one would work out on paper."""
  static, unit, n = toy_sizes(nnx_toy)
  d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab
  assert static == 4 * (v * d + 2 * d + d * v + v)  # embedding, final norm, head
  attention = d * 3 * d + 3 * d + d * d + d
  mlp = d * f + f + f * d + d
  assert unit == 4 * (attention + mlp + 2 * 2 * d)  # + two layer norms
  assert n == cfg.n_layers == 4


# --- device budget ---------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 6])
def test_device_budget_one_byte_short_raises(nnx_toy, mesh1, depth):
  static, unit, n = toy_sizes(nnx_toy)
  effective = min(depth, n)  # a window never holds more units than there are
  window = effective * unit
  required = static + window
  budget = required - 1
  before = live_ids()
  with pytest.raises(jr.DeviceBudgetTooSmallError) as info:
    jr.place(nnx_toy, layerwise(depth, device_budget_bytes=budget), mesh=mesh1)
  msg = str(info.value)
  for part in (
    f"device_budget_bytes={budget}",
    f"static={static}",
    f"window={window}",
    f"depth={effective}",
    f"required={required}",
  ):
    assert part in msg, (part, msg)
  assert isinstance(info.value, jr.BudgetTooSmallError)
  assert isinstance(info.value, ValueError)
  assert live_ids() <= before  # raised before anything was placed


@pytest.mark.parametrize("depth", [1, 2, 3, 4, 6])
def test_device_budget_exactly_required_fits(nnx_toy, mesh1, depth):
  static, unit, n = toy_sizes(nnx_toy)
  required = static + min(depth, n) * unit
  with jr.place(nnx_toy, layerwise(depth, device_budget_bytes=required), mesh=mesh1) as placed:
    md = placed.metadata
    assert md.static_device_bytes == static
    assert md.device_window_bytes == required - static
    assert md.device_unit_capacity == min(depth, n)


def test_device_budget_also_checked_for_linen(linen_toy, mesh1, nnx_toy):
  model, variables = linen_toy
  static, unit, _ = toy_sizes(nnx_toy)  # same shapes as the NNX toy
  flat = jax.tree.leaves(variables["params"])
  assert sum(nbytes(a) for a in flat) == static + 4 * unit
  required = static + 2 * unit
  with pytest.raises(jr.DeviceBudgetTooSmallError, match=f"required={required}"):
    jr.place(model, layerwise(2, device_budget_bytes=required - 1), params=variables, mesh=mesh1)
  with jr.place(model, layerwise(2, device_budget_bytes=required), params=variables, mesh=mesh1):
    pass


def _per_device_unit_bytes(variables: Any, mesh: Mesh) -> tuple[int, int]:
  """(static bytes, one unit's bytes) held by one device when kernels shard over ``model``."""
  params = variables["params"]
  specs = nn.get_partition_spec(variables)["params"]
  static = sum(nbytes(a) for k, v in params.items() if k != "layers" for a in jax.tree.leaves(v))
  unit = 0
  spec_leaves = jax.tree.leaves(specs["layers"], is_leaf=lambda x: isinstance(x, PartitionSpec))
  for a, spec in zip(jax.tree.leaves(params["layers"]), spec_leaves, strict=True):
    elems = math.prod(a.shape[1:])
    for axis in spec[1:]:  # the layer axis is never sharded
      if axis is not None:
        elems //= mesh.shape[axis]
    unit += elems * np.dtype(a.dtype).itemsize
  return static, unit


@pytest.mark.parametrize("depth", [1, 3])
def test_device_budget_counts_one_device_of_sharded_units(linen_sharded_toy, mesh_8, depth):
  model, variables = linen_sharded_toy
  static, unit = _per_device_unit_bytes(variables, mesh_8)
  whole_unit = sum(nbytes(a) for a in jax.tree.leaves(variables["params"]["layers"])) // 4
  assert unit < whole_unit  # sharding really divides the unit
  required = static + depth * unit
  with pytest.raises(jr.DeviceBudgetTooSmallError) as info:
    jr.place(
      model, layerwise(depth, device_budget_bytes=required - 1), params=variables, mesh=mesh_8
    )
  assert f"required={required}" in str(info.value)
  assert f"static={static}" in str(info.value)
  policy = layerwise(depth, device_budget_bytes=required)
  with jr.place(model, policy, params=variables, mesh=mesh_8) as placed:
    assert placed.metadata.largest_device_unit_bytes == unit
    assert placed.metadata.device_unit_capacity == depth


# --- host budget ----------------------------------------------------------------


def test_host_budget_one_byte_short_raises(nnx_toy, mesh1):
  _, unit, n = toy_sizes(nnx_toy)
  all_units = n * unit  # LayerwiseHost keeps every unit in host memory
  budget = all_units - 1
  before = live_ids()
  with pytest.raises(jr.HostBudgetTooSmallError) as info:
    jr.place(nnx_toy, layerwise(2, host_budget_bytes=budget), mesh=mesh1)
  msg = str(info.value)
  for part in (
    f"host_budget_bytes={budget}",
    f"window={all_units}",
    f"all {n} units",
    f"at least {all_units} bytes",
  ):
    assert part in msg, (part, msg)
  assert isinstance(info.value, jr.BudgetTooSmallError)
  assert live_ids() <= before


def test_host_budget_exactly_all_units_fits(nnx_toy, mesh1):
  _, unit, n = toy_sizes(nnx_toy)
  with jr.place(nnx_toy, layerwise(2, host_budget_bytes=n * unit), mesh=mesh1) as placed:
    assert placed.metadata.largest_host_unit_bytes == unit


def test_host_budget_counts_each_device_copy(nnx_toy, mesh_8):
  """Replicated over 8 devices, each device addresses its own host copy."""
  _, unit, n = toy_sizes(nnx_toy)
  replicated = 8 * n * unit
  mesh = jax.sharding.Mesh(mesh_8.devices, ("devices",))  # nothing is sharded over it
  with pytest.raises(jr.HostBudgetTooSmallError, match=f"window={replicated} "):
    jr.place(nnx_toy, layerwise(1, host_budget_bytes=replicated - 1), mesh=mesh)
  with jr.place(nnx_toy, layerwise(1, host_budget_bytes=replicated), mesh=mesh):
    pass


def test_zero_host_budget_rejects_layerwise_host(nnx_toy, mesh1):
  try:
    placed = jr.place(nnx_toy, layerwise(1, host_budget_bytes=0), mesh=mesh1)
  except jr.HostBudgetTooSmallError:
    return
  placed.close()
  raise AssertionError("LayerwiseHost with host_budget_bytes=0 was placed")


def test_both_budgets_exact(nnx_toy, mesh1):
  static, unit, n = toy_sizes(nnx_toy)
  policy = layerwise(3, device_budget_bytes=static + 3 * unit, host_budget_bytes=n * unit)
  with jr.place(nnx_toy, policy, mesh=mesh1) as placed:
    assert placed.metadata.device_window_units == 3
