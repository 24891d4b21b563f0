"""The shape of the compiled programs (docs/design.md, sections 3 and 4), checked on a
CPU-only machine.

On CPU, XLA erases host↔device copies, so LayerwiseHost's pipeline is checked by
lowering for ``cuda`` and ``tpu`` (which works without those devices): unit
parameters must be ``pinned_host`` arguments, and every unit must be placed on
the device inside the layer loop — once per step, plus ``k - 1`` placements
before the loop whose results ride in the loop's carry. The same structure is
checked on the jaxpr, and the forward must compile once per input shape.
"""

from __future__ import annotations

import collections
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec
from policies import compiled_text, one_program

import jax_residency as jr


def layerwise(depth: int) -> jr.LayerwiseHost:
  return jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=depth)))


def tensor_type(shape: tuple[int, ...], dtype: str = "f32") -> str:
  return f"tensor<{''.join(f'{d}x' for d in shape)}{dtype}>"


def unit_leaves(model: nnx.Module) -> list[jax.Array]:
  return jax.tree.leaves(nnx.state(model)["layers"])


def spec_key(spec: PartitionSpec) -> tuple[Any, ...]:
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return tuple(parts)


@pytest.fixture(scope="module")
def toy_on(request: pytest.FixtureRequest) -> Any:
  """``toy_on(layout)`` → (model, mesh): ``"1dev"`` unsharded on one device, ``"sharded"``
  with units sharded over ``model`` of a (data=2, model=4) mesh."""

  def get(layout: str) -> tuple[nnx.Module, Any]:
    if layout == "1dev":
      return request.getfixturevalue("nnx_toy"), request.getfixturevalue("mesh1")
    return request.getfixturevalue("nnx_toy_sharded"), request.getfixturevalue("mesh_2x4")

  return get


# --- StableHLO for accelerators -------------------------------------------------


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize(
  "depth, layout", [(1, "1dev"), (2, "1dev"), (3, "1dev"), (2, "sharded"), (3, "sharded")]
)
def test_layerwise_places_each_unit_inside_the_loop(toy_on, tokens, mlir, platform, depth, layout):
  model, mesh = toy_on(layout)
  units = unit_leaves(model)
  n_leaves = len(units)
  with jr.place(model, layerwise(depth), mesh=mesh) as placed:
    m = mlir(placed.lower(tokens, platforms=(platform,)).as_text())

  # The stacked unit parameters are pinned-host arguments of @main; everything else is on device.
  args = m.main_args()
  pinned = [a for a in args if a.memory_kind == "pinned_host"]
  assert [a.type for a in pinned] == [tensor_type(u.shape) for u in units]
  assert {a.memory_kind for a in args if a.memory_kind != "pinned_host"} == {"device"}
  if layout == "sharded":
    specs = jax.tree.leaves(
      nnx.get_partition_spec(nnx.state(model)["layers"]),
      is_leaf=lambda x: isinstance(x, PartitionSpec),
    )
    assert [a.spec for a in pinned] == [spec_key(s) for s in specs]
    assert any("model" in a.spec for a in pinned)

  # One host→device placement per unit leaf in each loop step; k-1 units placed before the loop.
  outside, inside = m.placements()
  assert inside == n_leaves
  assert outside == (depth - 1) * n_leaves

  # The loop carries the k-1 units placed ahead of it: device buffers of one unit's shapes.
  (loop,) = m.loops()
  placed_ahead = m.annotated_values()
  carried = [t for v, t in zip(loop.operands, loop.types, strict=True) if v in placed_ahead]
  one_unit = collections.Counter(tensor_type(u.shape[1:]) for u in units)
  assert collections.Counter(carried) == collections.Counter(
    {t: c * (depth - 1) for t, c in one_unit.items()}
  )
  assert len(carried) == (depth - 1) * n_leaves


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("depth", [1, 2, 3])
def test_reversed_loop_keeps_the_pipeline(reversed_stack, mlir, mesh1, platform, depth):
  """A reversed layer loop has the same structure: unit moves inside it, k-1 before it."""
  model = reversed_stack
  n_leaves = len(unit_leaves(model))
  with jr.place(model, layerwise(depth), mesh=mesh1) as placed:
    m = mlir(placed.lower(jnp.ones((2, 16)), platforms=(platform,)).as_text())
  assert sum(a.memory_kind == "pinned_host" for a in m.main_args()) == n_leaves
  outside, inside = m.placements()
  assert (outside, inside) == ((depth - 1) * n_leaves, n_leaves)
  assert len(m.loops()) == 1


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_fully_resident_lowering_has_no_host_memory(nnx_toy, mesh1, tokens, mlir, platform):
  with jr.place(nnx_toy, jr.FullyResident(), mesh=mesh1) as placed:
    text = placed.lower(tokens, platforms=(platform,)).as_text()
  m = mlir(text)
  assert {a.memory_kind for a in m.main_args()} == {"device"}
  assert "pinned_host" not in text
  assert "annotate_device_placement" not in text
  assert m.placements() == (0, 0)
  assert len(m.loops()) == 1  # the layers still run as one scan


def test_cpu_lowering_keeps_units_in_pinned_host(nnx_toy, mesh1, tokens, mlir):
  units = unit_leaves(nnx_toy)
  with jr.place(nnx_toy, layerwise(2), mesh=mesh1) as placed:
    m = mlir(placed.lower(tokens).as_text())
  pinned = [a.type for a in m.main_args() if a.memory_kind == "pinned_host"]
  assert pinned == [tensor_type(u.shape) for u in units]


# --- the jaxpr ---------------------------------------------------------------


def _branch(eqn: Any, platform: str | None) -> list[Any]:
  """The equations of a `lax.platform_dependent` cond's branch for ``platform`` (None:
  the default, every platform not named)."""
  branches = zip(eqn.params["branches_platforms"], eqn.params["branches"], strict=True)
  for platforms, branch in branches:
    if (platforms is None and platform is None) or (platforms and platform in platforms):
      return branch.jaxpr.eqns
  raise AssertionError(f"no branch for {platform}")


def _device_puts(eqns: list[Any], platform: str | None = None) -> list[Any]:
  """device_put equations, looking through nested jit calls and into the ``platform``
  branch of a platform-dependent cond (not through scans)."""
  out = []
  for e in eqns:
    if e.primitive.name == "device_put":
      out.append(e)
    elif e.primitive.name in ("jit", "pjit"):
      out.extend(_device_puts(e.params["jaxpr"].jaxpr.eqns, platform))
    elif e.primitive.name == "cond" and "branches_platforms" in e.params:
      out.extend(_device_puts(_branch(e, platform), platform))
  return out


def _to_device(eqn: Any) -> bool:
  return all(getattr(d, "memory_kind", None) == "device" for d in eqn.params["devices"])


def _scans(eqns: list[Any], platform: str | None = None) -> list[Any]:
  out = []
  for e in eqns:
    if e.primitive.name == "scan":
      out.append(e)
    elif e.primitive.name in ("jit", "pjit"):
      out.extend(_scans(e.params["jaxpr"].jaxpr.eqns, platform))
    elif e.primitive.name == "cond" and "branches_platforms" in e.params:
      out.extend(_scans(_branch(e, platform), platform))
  return out


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_jaxpr_moves_units_inside_the_scan(nnx_toy, mesh1, tokens, depth):
  n_leaves = len(unit_leaves(nnx_toy))
  with jr.place(nnx_toy, layerwise(depth), mesh=mesh1) as placed:
    closed = jax.make_jaxpr(placed)(tokens)
  (forward,) = closed.jaxpr.eqns  # the placed model is one jitted program
  eqns = forward.params["jaxpr"].jaxpr.eqns
  (scan,) = _scans(eqns)
  body_puts = _device_puts(scan.params["jaxpr"].jaxpr.eqns)
  prologue_puts = _device_puts(eqns)
  assert len(body_puts) == n_leaves and all(map(_to_device, body_puts))
  assert len(prologue_puts) == (depth - 1) * n_leaves and all(map(_to_device, prologue_puts))
  assert scan.params["num_carry"] == 1 + (depth - 1) * n_leaves  # hidden state + k-1 units
  # Lowered for CPU (device memory is host memory, the moves are dropped) the loop
  # carries no window at any depth: each unit is taken where it lies, as at depth 1.
  (cpu_scan,) = _scans(eqns, "cpu")
  assert cpu_scan.params["num_carry"] == 1 and _device_puts(eqns, "cpu") == []
  assert len(_device_puts(cpu_scan.params["jaxpr"].jaxpr.eqns)) == n_leaves


def test_fully_resident_jaxpr_moves_nothing(nnx_toy, mesh1, tokens):
  with jr.place(nnx_toy, jr.FullyResident(), mesh=mesh1) as placed:
    closed = jax.make_jaxpr(placed)(tokens)
  eqns = closed.jaxpr.eqns[0].params["jaxpr"].jaxpr.eqns
  (scan,) = _scans(eqns)
  assert _device_puts(eqns) == [] and _device_puts(scan.params["jaxpr"].jaxpr.eqns) == []


# --- compile count -------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 2, 3], ids=["fully_resident", "k1", "k2", "k3"])
def test_forward_compiles_once_per_input_shape(float_net, float_net_cls, depth):
  """A Python side effect in ``__call__`` runs only while tracing: it counts compiles."""
  x = jax.random.normal(jax.random.key(0), (2, 8))
  policy = layerwise(depth) if depth else jr.FullyResident()
  float_net_cls.calls = float_net_cls.block_calls = 0
  with jr.place(float_net, policy) as placed:
    first = placed(x)
    traced = (float_net_cls.calls, float_net_cls.block_calls)
    assert traced[0] == 1
    assert 1 <= traced[1] <= max(1, depth)  # the scan body (+ an unrolled epilogue)
    second = placed(x + 1.0)
    np.testing.assert_array_equal(placed(x), first)
    assert (float_net_cls.calls, float_net_cls.block_calls) == traced  # same shape: cached
    assert not np.array_equal(first, second)
    placed(jnp.ones((5, 8)))  # new batch size: one more trace
    assert (float_net_cls.calls, float_net_cls.block_calls) == (2, 2 * traced[1])
    placed(jnp.zeros((5, 8)))
    assert float_net_cls.calls == 2


# --- the CPU program over each unit's views ------------------------------------------


def _hlo_shape(shape: tuple[int, ...]) -> str:
  return f"f32[{','.join(map(str, shape))}]"


@pytest.mark.parametrize("policy", [jr.FullyResident(), layerwise(2)], ids=["fr", "k2"])
def test_the_cpu_program_takes_each_units_views_and_copies_no_unit(nnx_toy, mesh1, tokens, policy):
  """On CPU a pass is one program whose arguments are each unit's own arrays (views of the
  stacks, docs/design.md 3.1): the largest unit leaf is an entry parameter once per unit,
  and no instruction makes an array of its shape (no copy, slice or fusion of a unit).
  The stacked program accelerators run indexes its unit out of the stack: there the
  same shape is made once per loop body, so the check tells the two apart."""
  largest = max(unit_leaves(nnx_toy), key=lambda a: a.size)
  shape = _hlo_shape(largest.shape[1:])
  n = largest.shape[0]

  def made(text: str) -> list[str]:
    return [
      line
      for line in text.splitlines()
      if f"= {shape}" in line and " parameter(" not in line and "get-tuple-element(" not in line
    ]

  with jr.place(nnx_toy, policy, mesh=mesh1) as placed:
    placed(tokens)
    views = compiled_text(placed)
    one_program(placed)(tokens)
    stacked = compiled_text(placed)
  entry = views[views.index("ENTRY") :]
  params = [line for line in entry.splitlines() if f"{shape}" in line and " parameter(" in line]
  assert len(params) == n, params
  assert made(views) == []
  assert made(stacked), "the stacked program makes no unit-shaped array: the check is void"
