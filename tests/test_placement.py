"""FullyResident and LayerwiseHost execution (docs/design.md, sections 2, 3 and 8):
parity, memory kinds, errors.

Every policy is compared with the plain, unwrapped model (accelerate
``tests/test_big_modeling.py`` style): outputs must be bit-identical on CPU,
for NNX and Linen, unsharded and sharded over a ``model`` mesh axis, and the
gradients with respect to the inputs must match too.
"""

from __future__ import annotations

import collections
import gc
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh, PartitionSpec
from policies import one_program
from user_env import run_script, user_env

import jax_residency as jr
from jax_residency import testing
from jax_residency.toy import ToyTransformer

REPO = pathlib.Path(__file__).resolve().parents[1]


def layerwise(depth: int) -> jr.LayerwiseHost:
  return jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=depth)))


POLICIES: dict[str, jr.LayerWeightResidency] = {
  "fully_resident": jr.FullyResident(),
  "layerwise_k1": layerwise(1),
  "layerwise_k2": layerwise(2),
  "layerwise_k3": layerwise(3),
}


def plain_jit(model: nnx.Module, x: jax.Array) -> jax.Array:
  return nnx.jit(lambda m, x: m(x))(model, x)


def tensor_type(shape: tuple[int, ...], dtype: str = "f32") -> str:
  return f"tensor<{''.join(f'{d}x' for d in shape)}{dtype}>"


# --- the cases: (model, place kwargs, input, plain outputs) -------------------


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest, tokens: jax.Array) -> Callable[[str], dict[str, Any]]:
  """``case(variant)`` → the model, ``place`` kwargs and the plain model's outputs (cached)."""
  cache: dict[str, dict[str, Any]] = {}

  # Eager references only for the unsharded models: eager sharded runs are slow, and the
  # jitted reference is the one with the same compiled math.
  def nnx_case(model: nnx.Module, mesh: Mesh | None) -> dict[str, Any]:
    if mesh is None:
      eager, jitted = model(tokens), plain_jit(model, tokens)
    else:
      with jax.set_mesh(mesh):
        eager, jitted = None, plain_jit(model, tokens)
    return dict(model=model, kwargs=dict(mesh=mesh), x=tokens, eager=eager, jit=jitted)

  def linen_case(model: nn.Module, variables: Any, mesh: Mesh | None, rules: Any = None):
    plain = nn.meta.unbox(variables)
    if mesh is not None:
      specs = nn.get_partition_spec(variables)
      if rules:
        shardings = nn.logical_to_mesh_sharding(specs, mesh, rules)
      else:
        shardings = nn.get_sharding(variables, mesh)
      plain = jax.device_put(plain, shardings)
    return dict(
      model=model,
      kwargs=dict(params=variables, mesh=mesh, rules=rules),
      x=tokens,
      eager=model.apply(plain, tokens) if mesh is None else None,
      jit=jax.jit(model.apply)(plain, tokens),
    )

  def build(variant: str) -> dict[str, Any]:
    fx = request.getfixturevalue
    match variant:
      case "nnx":
        return nnx_case(fx("nnx_toy"), None)
      case "linen":
        model, variables = fx("linen_toy")
        return linen_case(model, variables, None)
      case "nnx_toy_sharded_data2_model4":
        return nnx_case(fx("nnx_toy_sharded"), fx("mesh_2x4"))
      case "linen_sharded_model8":
        model, variables = fx("linen_sharded_toy")
        return linen_case(model, variables, fx("mesh_8"))
    raise AssertionError(variant)

  def get(variant: str) -> dict[str, Any]:
    if variant not in cache:
      cache[variant] = build(variant)
    return cache[variant]

  return get


@pytest.fixture(scope="module")
def placed_output(case: Callable[[str], dict[str, Any]]) -> Callable[..., jax.Array]:
  """``placed_output(variant, policy, program="views")``: the placed model's output
  (compiled once per case), from the program over its units' views it runs on CPU, or
  (``"one program"``) from the stacked program accelerators run (`policies.one_program`)."""
  cache: dict[tuple[str, str, str], jax.Array] = {}

  def get(variant: str, policy: str, program: str = "views") -> jax.Array:
    if (variant, policy, program) not in cache:
      c = case(variant)
      with jr.place(c["model"], POLICIES[policy], **c["kwargs"]) as placed:
        if program == "one program":
          one_program(placed)
        cache[variant, policy, program] = placed(c["x"])
    return cache[variant, policy, program]

  return get


VARIANTS = [
  "nnx",
  "linen",
  "nnx_toy_sharded_data2_model4",
  "linen_sharded_model8",
]


def _exact_params() -> list[Any]:
  """On CPU each policy runs one program over its units' views (docs/design.md, section
  3.1); ``"one program"`` is the stacked program accelerators run
  (`policies.one_program`: for LayerwiseHost its depth's pipeline). Both are held to the
  jitted plain model's bits on every variant, sharded ones included."""
  views = [(v, p, "views") for v in VARIANTS for p in POLICIES]
  one = [(v, p, "one program") for v in VARIANTS for p in POLICIES]
  return [pytest.param(*c, id="-".join(c).replace(" ", "_")) for c in views + one]


def test_eight_cpu_devices():
  assert len(jax.devices()) == 8
  assert {d.platform for d in jax.devices()} == {"cpu"}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_parity_close(case, placed_output, variant: str, policy: str):
  """Every policy matches the plain model (jitted and eager) to float32 rounding."""
  c = case(variant)
  out = placed_output(variant, policy)
  assert out.shape == c["jit"].shape and out.dtype == c["jit"].dtype
  np.testing.assert_allclose(out, c["jit"], rtol=1e-5, atol=1e-5)
  if c["eager"] is not None:
    np.testing.assert_allclose(out, c["eager"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant, policy, program", _exact_params())
def test_parity_bit_identical(case, placed_output, variant: str, policy: str, program: str):
  """One program, over the units' views or the stacked units: the same bits as the
  jitted plain model (and eager, where they agree)."""
  c = case(variant)
  out = placed_output(variant, policy, program)
  np.testing.assert_array_equal(out, c["jit"])
  if c["eager"] is not None and np.array_equal(c["eager"], c["jit"]):
    np.testing.assert_array_equal(out, c["eager"])


# --- gradients with respect to the inputs --------------------------------------


@pytest.fixture(scope="module")
def features() -> jax.Array:
  return jax.random.normal(jax.random.key(2), (3, 8))


def _loss(f: Callable[[jax.Array], jax.Array]) -> Callable[[jax.Array], jax.Array]:
  return lambda x: jnp.sum(f(x) ** 2)


def _plain_grad(model: nnx.Module, x: jax.Array) -> jax.Array:
  return nnx.grad(lambda x, m: jnp.sum(m(x) ** 2))(x, model)


@pytest.fixture(scope="module")
def plain_grad(float_net, features) -> dict[str, jax.Array]:
  """The unplaced model's input gradient, jitted and eager."""
  return {
    "jit": nnx.jit(_plain_grad)(float_net, features),
    "eager": _plain_grad(float_net, features),
  }


@pytest.fixture(scope="module")
def placed_grad(float_net, features) -> Callable[[str], jax.Array]:
  cache: dict[str, jax.Array] = {}

  def get(policy: str) -> jax.Array:
    if policy not in cache:
      with jr.place(float_net, POLICIES[policy]) as placed:
        cache[policy] = jax.grad(_loss(placed))(features)
    return cache[policy]

  return get


def test_plain_grad_is_not_trivial(plain_grad):
  assert float(jnp.abs(plain_grad["jit"]).max()) > 1e-3
  np.testing.assert_allclose(plain_grad["eager"], plain_grad["jit"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("policy", POLICIES)
def test_grad_wrt_inputs_matches_plain_model(plain_grad, placed_grad, policy):
  """``jax.grad`` of ``sum(placed(x) ** 2)`` w.r.t. a float input matches the plain model's."""
  for ref in plain_grad.values():
    np.testing.assert_allclose(placed_grad(policy), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  "policy",
  [
    "fully_resident",
    "layerwise_k1",
    "layerwise_k2",
    "layerwise_k3",
  ],
)
def test_grad_wrt_inputs_bit_identical(plain_grad, placed_grad, policy):
  np.testing.assert_array_equal(placed_grad(policy), plain_grad["jit"])
  if np.array_equal(plain_grad["eager"], plain_grad["jit"]):
    np.testing.assert_array_equal(placed_grad(policy), plain_grad["eager"])


# --- memory kinds and bytes ---------------------------------------------------
#
# PlacedModel has no public accessor for the arrays it holds, so these tests find
# them among jax.live_arrays(): the arrays that appear when a model is placed.


def _param_leaves(model: nnx.Module) -> tuple[list[jax.Array], list[jax.Array]]:
  """(static leaves, unit leaves) of the toy, straight from its parameter tree."""
  state = nnx.state(model)
  units = jax.tree.leaves(state["layers"])
  unit_ids = {id(a) for a in units}
  return [a for a in jax.tree.leaves(state) if id(a) not in unit_ids], units


def _shapes(arrays: list[Any]) -> collections.Counter:
  return collections.Counter((tuple(a.shape), np.dtype(a.dtype)) for a in arrays)


def _nbytes(arrays: list[Any]) -> int:
  """Bytes held, counting every addressable shard (replicas included)."""
  return sum(s.data.nbytes for a in arrays for s in a.addressable_shards)


class NewArrays:
  """Live arrays created inside the ``with`` block, by memory kind (views excluded)."""

  def __enter__(self) -> NewArrays:
    gc.collect()
    self._before = list(jax.live_arrays())  # strong refs: no id is reused meanwhile
    return self

  def __exit__(self, *exc: object) -> None:
    gc.collect()
    before = {id(a) for a in self._before}
    self.arrays = [a for a in jax.live_arrays() if id(a) not in before]
    self._old, self._before = self._before, []

  def kind(self, kind: str) -> list[jax.Array]:
    """The new arrays of a memory kind with a buffer of their own (`copies`)."""
    return [a for a in self.copies(self.arrays) if a.sharding.memory_kind == kind]

  def copies(self, within: list[jax.Array] | None = None) -> list[jax.Array]:
    """The new arrays with a buffer of their own: not a view inside an array that was
    live before, or (with ``within``) inside another of those (a placement's per-unit
    views on CPU, docs/design.md, 3.1). Of arrays on exactly the same buffers (a stack
    and its shards' own arrays) the one with the most shards, then the oldest, counts."""
    pool = [*self._old, *(within or [])]
    rank = {id(a): (-len(a.addressable_shards), i) for i, a in enumerate(pool)}
    spans = [
      (rank[id(a)], s.data.unsafe_buffer_pointer(), s.data.unsafe_buffer_pointer() + s.data.nbytes)
      for a in pool
      for s in a.addressable_shards
    ]

    def inside(x: jax.Array, shard: Any) -> bool:
      at = shard.data.unsafe_buffer_pointer()
      end = at + shard.data.nbytes
      mine = rank.get(id(x), (-len(x.addressable_shards), len(pool)))
      return any(
        lo <= at and end <= hi and ((lo, hi) != (at, end) or r < mine) for r, lo, hi in spans
      )

    return [x for x in self.arrays if not all(inside(x, s) for s in x.addressable_shards)]


@pytest.mark.parametrize("depth", [1, 2])
def test_layerwise_units_in_pinned_host_static_on_device(nnx_toy, mesh1, tokens, mlir, depth):
  static, units = _param_leaves(nnx_toy)
  with NewArrays() as new:
    placed = jr.place(nnx_toy, layerwise(depth), mesh=mesh1)
  with placed:
    held = placed.arrays()
    on_device = [a for p, a in held.items() if not p.startswith("layers.")]
    on_host = [a for p, a in held.items() if p.startswith("layers.")]
    # Every unit leaf, and only those, went to pinned host memory (new arrays); every
    # static leaf stays on device (already there: used as it is, not copied).
    assert _shapes(new.kind("pinned_host")) == _shapes(units) == _shapes(on_host)
    assert new.kind("device") == []
    # Held: every unit leaf in pinned host memory, every static leaf on the device.
    assert testing.assert_memory_kinds(placed) == {
      "pinned_host": len(units),
      "device": len(static),
    }
    assert _shapes(on_device) == _shapes(static)
    # Bytes per memory kind match the metadata, and the metadata matches the shapes.
    md = placed.metadata
    static_bytes = sum(a.size * a.dtype.itemsize for a in static)
    unit_bytes = sum(a.size * a.dtype.itemsize for a in units)
    assert _nbytes(on_device) == md.static_device_bytes == static_bytes
    assert _nbytes(new.kind("pinned_host")) == md.total_unit_bytes == unit_bytes
    assert md.unit_bytes == (unit_bytes // 4,) * 4
    assert md.largest_host_unit_bytes == md.largest_device_unit_bytes == unit_bytes // 4
    assert md.device_window_units == depth
    assert md.device_window_bytes == depth * unit_bytes // 4
    # The jitted forward takes them from the same memories, leaf by leaf: @main(static, units, x).
    args = mlir(placed.lower(tokens).as_text()).main_args()
    assert [a.memory_kind for a in args] == (
      ["device"] * len(static) + ["pinned_host"] * len(units) + ["device"]
    )
    assert [a.type for a in args[len(static) : -1]] == [tensor_type(u.shape) for u in units]


def test_fully_resident_everything_on_device(nnx_toy, mesh1):
  static, units = _param_leaves(nnx_toy)
  with NewArrays() as new:
    placed = jr.place(nnx_toy, jr.FullyResident(), mesh=mesh1)
  with placed:
    # The model is already on this one device: placing it copies nothing (on CPU it
    # makes per-unit views of the stacked units, which hold no memory of their own).
    assert new.copies() == []
    assert len(new.arrays) == sum(a.shape[0] for a in units)  # one view per unit and leaf
    held = list(placed.arrays().values())
    assert testing.assert_memory_kinds(placed) == {"device": len(held)}
    assert _shapes(held) == _shapes(static + units)
    md = placed.metadata
    assert _nbytes(held) == md.static_device_bytes + md.total_unit_bytes
    assert md.largest_host_unit_bytes == 0
    assert md.device_window_units == 4


class _StackUsedOutsideTheLoop(nnx.Module):
  """Reads its stacked kernels outside the unit loop too (a per-layer norm of them)."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    keys = jax.random.split(rngs.params(), 3)
    self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(keys)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)
    return h * jnp.sum(self.layers.kernel[...] ** 2)


def test_fully_resident_runs_jitted_where_per_unit_steps_cannot(mesh1):
  """docs/design.md, section 3.1: a forward whose stacked weights are used outside
  scan_units has no per-unit form; on CPU FullyResident then runs the jitted program
  (the jitted model's bits), where a dense stream refuses."""
  model = _StackUsedOutsideTheLoop(nnx.Rngs(0))
  x = jnp.ones((2, 8))
  with jr.place(model, jr.FullyResident(), mesh=mesh1) as placed:
    np.testing.assert_array_equal(placed(x), nnx.jit(lambda m, x: m(x))(model, x))


def test_layerwise_host_bytes_count_every_replica(nnx_toy):
  """Replicated over 8 devices, each device addresses its own host copy."""
  _, units = _param_leaves(nnx_toy)
  unit_bytes = sum(a.size * a.dtype.itemsize for a in units)
  replicated = Mesh(np.array(jax.devices()), ("devices",))
  with NewArrays() as new:
    placed = jr.place(nnx_toy, layerwise(2), mesh=replicated)
  with placed:
    assert placed.mesh.devices.size == 8
    assert _nbytes(new.kind("pinned_host")) == 8 * unit_bytes
    assert placed.metadata.largest_host_unit_bytes * 4 == 8 * unit_bytes
    assert placed.metadata.total_unit_bytes == unit_bytes


def test_default_mesh_is_where_the_plain_model_runs(nnx_toy, tokens):
  """No mesh given: the one device the model's arrays are on, as the plain model runs.

  conftest.py gives this process 8 devices; replicating over all of them would
  keep 8 host copies of every unit.
  """
  on_3 = jax.device_put(nnx_toy, jax.devices()[3])
  with NewArrays() as new:
    placed = jr.place(on_3, layerwise(2))
  with placed:
    assert list(placed.mesh.devices.flat) == [jax.devices()[3]]
    np.testing.assert_array_equal(placed(tokens), plain_jit(on_3, tokens))  # one program
    assert {d for a in new.arrays for d in a.sharding.device_set} == {jax.devices()[3]}
    assert _nbytes(new.kind("pinned_host")) == sum(placed.metadata.unit_bytes)  # one copy


def test_default_mesh_of_an_abstract_model_is_the_default_device(nnx_toy, cfg, tmp_path):
  path = str(tmp_path / "store")
  jr.save(nnx_toy, path, progress=False)
  abstract = nnx.eval_shape(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0)))
  with jax.default_device(jax.devices()[5]):
    with jr.place(abstract, jr.FullyResident(), store=path) as placed:
      assert list(placed.mesh.devices.flat) == [jax.devices()[5]]
  with jr.place(abstract, jr.FullyResident(), store=path) as placed:
    assert list(placed.mesh.devices.flat) == [jax.local_devices()[0]]


def test_default_mesh_follows_set_mesh_and_sharded_arrays(nnx_toy_sharded, mesh_2x4, tokens):
  """The mesh set with ``jax.set_mesh`` wins; else the mesh the model is already sharded over."""
  with jax.set_mesh(mesh_2x4):
    with jr.place(nnx_toy_sharded, jr.FullyResident()) as placed:
      assert placed.mesh == mesh_2x4
  on_mesh = {
    a.sharding.mesh for a in jax.tree.leaves(nnx.state(nnx_toy_sharded)) if isinstance(a, jax.Array)
  }
  assert on_mesh == {mesh_2x4}  # how the fixture built it, so the default follows it
  with jr.place(nnx_toy_sharded, layerwise(2)) as placed:
    assert placed.mesh == mesh_2x4
    np.testing.assert_allclose(
      placed(tokens), nnx.jit(lambda m, t: m(t))(nnx_toy_sharded, tokens), rtol=1e-5, atol=1e-5
    )


def test_default_mesh_keeps_a_one_device_mesh_the_model_is_sharded_over(cfg, tokens, toy_model):
  """Partitioning names resolve against the mesh the model was built on, even one device."""
  mesh = Mesh(np.array(jax.devices()[2:3]), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  model = toy_model(cfg, mesh=mesh, seeded=True)  # built under jax.set_mesh(mesh)
  with jr.place(model, layerwise(2)) as placed:
    assert placed.mesh == mesh
    np.testing.assert_array_equal(placed(tokens), plain_jit(model, tokens))  # one program


def _spec_key(spec: PartitionSpec) -> tuple[Any, ...]:
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return tuple(parts)


@pytest.mark.parametrize("policy", ["fully_resident", "layerwise_k2"])
@pytest.mark.parametrize("variant", ["nnx_toy_sharded", "linen_sharded", "linen_logical"])
def test_units_keep_their_partitioning(request, mlir, tokens, variant, policy):
  """Each unit leaf is sharded over ``model`` as its metadata says, in the policy's memory.

  Read from the jitted forward's arguments (FullyResident may alias the caller's
  arrays, so live arrays cannot tell what it holds).
  """
  fx = request.getfixturevalue
  if variant == "nnx_toy_sharded":
    model, mesh = fx("nnx_toy_sharded"), fx("mesh_2x4")
    kwargs: dict[str, Any] = dict(mesh=mesh)
    stack = nnx.state(model)["layers"]
    specs = nnx.get_partition_spec(stack)
  else:
    (model, variables), mesh = fx(f"{variant}_toy"), fx("mesh_8")
    rules = fx("logical_rules") if variant == "linen_logical" else None
    kwargs = dict(params=variables, mesh=mesh, rules=rules)
    stack = nn.meta.unbox(variables["params"]["layers"])
    specs = nn.get_partition_spec(variables)["params"]["layers"]
    if rules:
      specs = nn.logical_to_mesh(specs, rules)
  units = jax.tree.leaves(stack)
  spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
  kind = "device" if policy == "fully_resident" else "pinned_host"
  expected = [
    (tensor_type(a.shape), kind, _spec_key(s)) for a, s in zip(units, spec_leaves, strict=True)
  ]
  assert any("model" in spec for _, _, spec in expected)  # the case really is sharded
  with jr.place(model, POLICIES[policy], **kwargs) as placed:
    args = mlir(placed.lower(tokens).as_text()).main_args()
  n_static = len(args) - len(units) - 1  # @main(static..., units..., tokens)
  got = [(a.type, a.memory_kind, a.spec) for a in args[n_static : n_static + len(units)]]
  assert got == expected
  assert {a.memory_kind for a in args[:n_static]} == {"device"}


def test_placed_model_holds_only_its_own_copies(nnx_toy, mesh1):
  static, units = _param_leaves(nnx_toy)
  static_bytes = sum(a.size * a.dtype.itemsize for a in static)
  with NewArrays() as new:
    fresh = nnx.clone(nnx_toy)
    nnx.update(fresh, jax.tree.map(jnp.copy, nnx.state(fresh)))  # arrays nobody else holds
    placed = jr.place(fresh, layerwise(2), mesh=mesh1)
    del fresh  # the caller lets go of its model
  with placed:
    assert _nbytes(new.kind("pinned_host")) == placed.metadata.total_unit_bytes
    assert _nbytes(new.kind("device")) == static_bytes == placed.metadata.static_device_bytes


# --- errors ----------------------------------------------------------------------


def test_unknown_units_lists_the_candidates(nnx_toy):
  with pytest.raises(jr.UnitSelectionError) as info:
    jr.place(nnx_toy, layerwise(1), units="nope")
  msg = str(info.value)
  assert "units='nope'" in msg and "layers" in msg
  assert isinstance(info.value, jr.PlacementError) and isinstance(info.value, ValueError)


def test_units_must_be_a_layer_stack(nnx_toy):
  with pytest.raises(jr.UnitSelectionError, match="not a layer stack"):
    jr.place(nnx_toy, layerwise(1), units="head")


class ScanNet(nnx.Module):
  """Runs its stacked layers with nnx.scan, not jr.scan_units: no policy can place them."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    make = nnx.vmap(lambda key: nnx.Linear(4, 4, rngs=nnx.Rngs(key)))
    self.layers = make(jax.random.split(rngs.params(), 3))

  def __call__(self, x: jax.Array) -> jax.Array:
    step = nnx.scan(
      lambda h, layer: (jnp.tanh(layer(h)), None), in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0)
    )
    return step(x, self.layers)[0]


@pytest.fixture(scope="module")
def scan_net() -> ScanNet:
  return ScanNet(nnx.Rngs(0))


@pytest.mark.parametrize(
  "policy",
  [
    "fully_resident",
    "layerwise_k1",
    "layerwise_k2",
  ],
)
def test_forward_without_scan_units_raises_placement_error(scan_net, policy):
  with jr.place(scan_net, POLICIES[policy]) as placed:
    with pytest.raises(jr.PlacementError, match="scan_units"):
      placed(jnp.ones((2, 4)))


def test_linen_needs_params(linen_toy):
  model, variables = linen_toy
  with pytest.raises(jr.UnitSelectionError, match="params="):
    jr.place(model, layerwise(1))
  with pytest.raises(jr.UnitSelectionError, match="'params'"):
    jr.place(model, layerwise(1), params={"batch_stats": variables["params"]})


def test_nnx_rejects_params(nnx_toy, linen_toy):
  with pytest.raises(jr.UnitSelectionError, match="params= is for Linen"):
    jr.place(nnx_toy, layerwise(1), params=linen_toy[1])


def test_closed_model_refuses_to_run(nnx_toy, mesh1, tokens):
  placed = jr.place(nnx_toy, layerwise(1), mesh=mesh1)
  placed.close()
  placed.close()  # idempotent
  with pytest.raises(jr.ClosedError):
    placed(tokens)
  assert "closed" in repr(placed)
  with jr.place(nnx_toy, jr.FullyResident(), mesh=mesh1) as other:
    pass
  with pytest.raises(jr.ClosedError):
    other(tokens)


def test_closed_model_refuses_to_lower(nnx_toy, mesh1, tokens):
  placed = jr.place(nnx_toy, layerwise(1), mesh=mesh1)
  placed.close()
  with pytest.raises(jr.ClosedError):
    placed.lower(tokens)


# --- the example -------------------------------------------------------------------


def test_example_runs_and_matches(zygote, tmp_path):
  """examples/layerwise_host.py (LayerwiseHost, prefetch_depth=2) prints its check and exits 0."""
  proc = run_script(
    [sys.executable, str(REPO / "examples" / "layerwise_host.py")],
    zygote,
    env=user_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=120,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  out = proc.stdout
  assert "policy: layerwise_host, prefetch_depth=2" in out
  assert "device window          2 units" in out
  assert "max abs diff: 0\n" in out
  assert "equal: True" in out
