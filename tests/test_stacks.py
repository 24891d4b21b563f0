"""One placement, several layer stacks (docs/design.md, section 2.1): the two-stack
toys of ``two_stack.py``.

Each model runs stack A ``towers`` (3 units) and then stack B ``mixer`` (2 units of
another size), with a static ``mid_norm`` between them whose leaves share a leading
axis (not a stack). Under every policy the placed model must give the plain model's
outputs bit for bit on CPU: a dense stream runs a step per layer there, and gives the
eager plain model's outputs; ``FullyResident`` and ``LayerwiseHost`` run one program
(over their units' views on CPU; stacked, as on accelerators, through
``policies.one_program``) and give those of the plain model under ``jax.jit``. The
reference outputs of the two differ for these models, so each comparison tells the two
apart. Besides
parity: the stacks found by tracing the forward, a call that runs only the mixer, a
placement of one stack while the forward loops over both, stores holding both stacks,
per-stack metadata and reports.

``model(tokens, encoded=e)`` runs only the mixer (see ``two_stack.py``: the choice is
static because it is the call's pytree structure).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from policies import one_program
from two_stack import (
  ENCODED,
  MIXER_LAYERS,
  MIXER_UNIT_BYTES,
  STACKS,
  TOKENS,
  TOWER_LAYERS,
  TOWER_UNIT_BYTES,
  abstract_nnx,
  make_linen,
  make_nnx,
)

import jax_residency as jr

POLICIES: dict[str, Callable[[], jr.LayerWeightResidency]] = {
  "fully_resident": lambda: jr.FullyResident(),
  "layerwise_k1": lambda: jr.LayerwiseHost(prefetch_depth=1),
  "layerwise_k2": lambda: jr.LayerwiseHost(prefetch_depth=2),
  # The first unit of each stack in device memory: the mixer's loop is then one unit
  # kept and one moved.
  "layerwise_resident": lambda: jr.LayerwiseHost(prefetch_depth=2, device_resident_units=1),
  "dense_host": lambda: jr.DenseDiskStream(host_budget_bytes="1MiB"),
  "dense_direct": lambda: jr.DenseDiskStream(host_budget_bytes=0),
  # The first unit of each stack kept on the device, the next in host memory: the mixer
  # (2 units) streams none, the towers (3) one.
  "dense_resident": lambda: jr.DenseDiskStream(
    host_budget_bytes="1MiB", device_resident_units=1, host_resident_units=1
  ),
}
DENSE = ("dense_host", "dense_direct", "dense_resident")
STREAMED = ("layerwise_k1", "layerwise_k2", "layerwise_resident", *DENSE)

#: (model, mesh) variants: every policy runs on both meshes for NNX; Linen on the
#: 8-device mesh runs a subset (one policy of each kind) to keep the module fast.
VARIANTS: dict[str, tuple[str, ...]] = {
  "nnx-1dev": tuple(POLICIES),
  "nnx-8dev": tuple(POLICIES),
  "linen-1dev": tuple(POLICIES),
  "linen-8dev": ("fully_resident", "layerwise_k2", "dense_direct"),
}
UNIT_BYTES = {"towers": TOWER_UNIT_BYTES, "mixer": MIXER_UNIT_BYTES}
LAYERS = {"towers": TOWER_LAYERS, "mixer": MIXER_LAYERS}


def _cases(variants: tuple[str, ...] = tuple(VARIANTS)) -> list[Any]:
  return [pytest.param(v, p, id=f"{v}-{p}") for v in variants for p in VARIANTS[v]]


def paths(placed: jr.PlacedModel) -> list[str]:
  return [s.path for s in placed.metadata.stacks]


# --- the plain models, their stores and their reference outputs ----------------------


class Case:
  """A variant's model, ``place`` kwargs, store and (lazily) its plain outputs."""

  def __init__(self, variant: str, mesh: Mesh, stores: dict[str, str]) -> None:
    self.kind = variant.split("-")[0]
    self.mesh, self._stores = mesh, stores
    self._refs: dict[tuple[str, bool], jax.Array] = {}
    if self.kind == "nnx":
      self.model: Any = make_nnx()
      self.kwargs: dict[str, Any] = {}
    else:
      self.model, self.variables = make_linen()
      self.kwargs = {"params": self.variables}

  def store(self) -> str:
    """The model's store holding both stacks (written on first use, once per module)."""
    if self.kind not in self._stores:
      path = f"{self._stores['root']}/{self.kind}"
      jr.save(self.model, path, units=STACKS, progress=False, **self.kwargs)
      self._stores[self.kind] = path
    return self._stores[self.kind]

  def _eager(self, encoded: jax.Array | None) -> jax.Array:
    if self.kind == "nnx":
      return self.model(TOKENS, encoded)
    return self.model.apply(self.variables, TOKENS, encoded)

  def _jit(self, encoded: jax.Array | None) -> jax.Array:
    """The plain model under ``jax.jit``, its weights replicated over the case's mesh."""
    replicated = NamedSharding(self.mesh, PartitionSpec())
    if self.kind == "nnx":
      graphdef, state = nnx.split(self.model)
      state = jax.device_put(state, replicated)
      return jax.jit(lambda s, t, e: nnx.merge(graphdef, s)(t, e))(state, TOKENS, encoded)
    variables = jax.device_put(self.variables, replicated)
    return jax.jit(self.model.apply)(variables, TOKENS, encoded)

  def reference(self, policy: str, *, only_mixer: bool = False) -> jax.Array:
    """What a placement under ``policy`` must match bit for bit: eager for a dense stream's
    steps per layer, jitted for the one program of the others (docs/parity.md)."""
    eager = policy in DENSE
    key = ("eager" if eager else "jit", only_mixer)
    if key not in self._refs:
      encoded = ENCODED if only_mixer else None
      self._refs[key] = self._eager(encoded) if eager else self._jit(encoded)
    return self._refs[key]

  def place(self, policy: str, **kwargs: Any) -> jr.PlacedModel:
    """The model placed under ``policy`` on the case's mesh; a dense stream reads the
    case's store unless ``store=`` is given."""
    if policy in DENSE and "store" not in kwargs:
      kwargs["store"] = self.store()
    return jr.place(self.model, POLICIES[policy](), mesh=self.mesh, **self.kwargs, **kwargs)


@pytest.fixture(scope="module")
def case(
  request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str], Case]:
  """``case(variant)``: the variant's :class:`Case` (cached for the module)."""
  stores = {"root": str(tmp_path_factory.mktemp("two_stack_stores"))}
  cache: dict[str, Case] = {}

  def get(variant: str) -> Case:
    if variant not in cache:
      mesh = request.getfixturevalue("mesh_8" if variant.endswith("8dev") else "mesh1")
      cache[variant] = Case(variant, mesh, stores)
    return cache[variant]

  return get


class Run:
  """One open placement of a case under a policy (both stacks named), with the outputs,
  metadata and report of its passes, each taken once: the full forward, then a call
  that runs only the mixer. A failure is kept and raised to every test that asks."""

  def __init__(self, c: Case, policy: str) -> None:
    self.case, self.policy = c, policy
    self.placed: jr.PlacedModel | None = None
    self._results: dict[str, Any] = {}

  def _placed(self) -> jr.PlacedModel:
    if self.placed is None:
      self.placed = self.case.place(self.policy, units=STACKS)
    return self.placed

  def _call(self, name: str, *args: Any) -> tuple[jax.Array, Any]:
    if name not in self._results:
      try:
        placed = self._placed()
        out = placed(TOKENS, *args)
        self._results[name] = (out, placed.report().last)
      except Exception as e:  # noqa: BLE001 - kept, so every test that needs this pass sees it
        self._results[name] = e
    result = self._results[name]
    if isinstance(result, Exception):
      raise result
    return result

  def full(self) -> tuple[jax.Array, Any]:
    """``(output, report.last)`` of ``placed(TOKENS)`` (the first call)."""
    return self._call("full")

  def only_mixer(self) -> tuple[jax.Array, Any]:
    """``(output, report.last)`` of ``placed(TOKENS, ENCODED)`` (after the full call)."""
    self.full()
    return self._call("only_mixer", ENCODED)

  def close(self) -> None:
    if self.placed is not None:
      self.placed.close()


@pytest.fixture(scope="module")
def run(case: Callable[[str], Case]) -> Iterator[Callable[[str, str], Run]]:
  """``run(variant, policy)``: the case placed under ``policy`` with both stacks (cached)."""
  runs: dict[tuple[str, str], Run] = {}

  def get(variant: str, policy: str) -> Run:
    if (variant, policy) not in runs:
      runs[variant, policy] = Run(case(variant), policy)
    return runs[variant, policy]

  yield get
  for r in runs.values():
    r.close()


# --- the models themselves (no placement) --------------------------------------------


def test_models_have_two_stacks_and_a_static_norm_with_a_shared_leading_axis():
  """The test models are what the tests assume: every towers leaf leads with 3, every
  mixer leaf with 2, and the mid_norm leaves share a leading axis too (of size D)."""
  model = make_nnx()
  state = nnx.state(model)
  for name, n in LAYERS.items():
    leaves = jax.tree.leaves(state[name])
    assert leaves and {a.shape[0] for a in leaves} == {n}
    assert sum(a.nbytes for a in leaves) == n * UNIT_BYTES[name]
  norm = jax.tree.leaves(state["mid_norm"])
  assert len(norm) == 2 and len({a.shape[0] for a in norm}) == 1
  module, variables = make_linen()
  linen_shapes = jax.tree.map(lambda a: a.shape, variables["params"])
  assert linen_shapes == jax.tree.map(lambda a: a.shape, nnx.to_pure_dict(state))


def test_plain_models_run_both_stacks_and_only_the_mixer():
  """The plain NNX and Linen models agree, each path uses its stacks, and eager and jitted
  outputs differ (so the parity tests below tell the two references apart)."""
  model = make_nnx()
  module, variables = make_linen()
  full = model(TOKENS)
  assert full.shape == (2, 8, 64)
  np.testing.assert_array_equal(module.apply(variables, TOKENS), full)
  mixer_only = model(TOKENS, ENCODED)
  np.testing.assert_array_equal(module.apply(variables, TOKENS, ENCODED), mixer_only)
  assert not np.array_equal(full, mixer_only)
  jitted = nnx.jit(lambda m, t: m(t))(model, TOKENS)
  np.testing.assert_allclose(jitted, full, rtol=1e-5, atol=1e-5)
  assert not np.array_equal(jitted, full), "eager and jit agree: parity would not tell them apart"


# --- 1. parity, both stacks placed -----------------------------------------------------


@pytest.mark.parametrize("variant, policy", _cases())
def test_parity_both_stacks(case, run, variant: str, policy: str):
  """Both stacks placed: bit-identical to the plain model (eager, `Case.reference`)."""
  out, _ = run(variant, policy).full()
  np.testing.assert_array_equal(out, case(variant).reference(policy))
  placed = run(variant, policy).placed
  assert paths(placed) == list(STACKS)
  assert tuple(placed.metadata.unplaced_stacks) == ()


@pytest.mark.parametrize(
  "variant, policy", [c for c in _cases() if c.values[1].startswith("layerwise")]
)
def test_layerwise_one_program_over_both_stacks_is_the_jitted_model(case, variant, policy):
  """The program LayerwiseHost runs on accelerators (each stack's pipelined loop, the
  kept units' part), run on CPU: the plain model under ``jax.jit``, bit for bit."""
  c = case(variant)
  with c.place(policy, units=STACKS) as placed:
    np.testing.assert_array_equal(one_program(placed)(TOKENS), c.reference(policy))


# --- 2. discovery by tracing ------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fully_resident", "layerwise_k2"])
@pytest.mark.parametrize("variant", ["nnx-1dev", "linen-1dev"])
def test_stacks_found_by_tracing(case, variant: str, policy: str):
  """``units=None`` and no store: the first call finds both stacks, in forward order;
  ``mid_norm`` (leaves with a shared leading axis) is not one of them."""
  c = case(variant)
  with c.place(policy) as placed:
    np.testing.assert_array_equal(placed(TOKENS), c.reference(policy))
    assert paths(placed) == ["towers", "mixer"]
    assert "mid_norm" not in paths(placed)
    assert tuple(placed.metadata.unplaced_stacks) == ()
    assert placed.metadata.layer_count == TOWER_LAYERS + MIXER_LAYERS


def test_a_placement_that_finds_its_stacks_on_the_first_call_says_so_before(case):
  """Before the first call there is no plan yet: ``metadata`` and ``report()`` raise a
  PlacementError saying what to do; ``lower(...)`` finds the stacks from its arguments."""
  c = case("nnx-1dev")
  with c.place("layerwise_k2") as placed:
    assert placed.stacks == ()
    for read in (lambda: placed.metadata, placed.report, placed.arrays):
      with pytest.raises(jr.PlacementError, match="first call.*units="):
        read()
    assert "stacks found on the first call" in repr(placed)
    placed.lower(TOKENS)
    assert placed.stacks == STACKS


def test_save_finds_the_stacks_from_an_example_and_refuses_to_guess(case, tmp_path):
  c = case("nnx-1dev")
  with pytest.raises(jr.errors.UnitSelectionError, match="units=.*example="):
    jr.save(c.model, str(tmp_path / "guess"), progress=False)
  assert not (tmp_path / "guess").exists()
  example = (jax.ShapeDtypeStruct(TOKENS.shape, TOKENS.dtype),)  # traced, never run
  info = jr.save(c.model, str(tmp_path / "traced"), example=example, progress=False)
  assert [s.prefix for s in info.stacks] == [("towers",), ("mixer",)]
  assert info.total_unit_bytes == TOWER_LAYERS * TOWER_UNIT_BYTES + MIXER_LAYERS * MIXER_UNIT_BYTES


# --- 3. a call that runs only the mixer -------------------------------------------------


@pytest.mark.parametrize("variant, policy", _cases(("nnx-1dev", "linen-1dev")))
def test_call_running_only_the_mixer(case, run, variant: str, policy: str):
  """After a full pass, ``placed(tokens, encoded)`` runs the mixer alone: the plain
  model's output, no towers unit run or moved, every mixer unit run."""
  out, last = run(variant, policy).only_mixer()
  np.testing.assert_array_equal(out, case(variant).reference(policy, only_mixer=True))
  assert last.stacks["towers"].units_run == 0
  assert last.stacks["towers"].bytes_moved == 0
  assert last.stacks["mixer"].units_run == MIXER_LAYERS


# --- 4. one stack placed, the other looped over -----------------------------------------


@pytest.mark.parametrize(
  "variant, policy",
  [
    ("nnx-1dev", "fully_resident"),
    ("nnx-1dev", "layerwise_k2"),
    ("nnx-1dev", "dense_direct"),
    ("linen-1dev", "layerwise_k2"),
  ],
)
def test_one_stack_placed_the_other_reported(case, tmp_path, variant: str, policy: str):
  """``units="towers"``: the mixer loop still runs, its weights static on the device;
  outputs match the plain model, and the mixer is named as an unplaced stack (and in a
  UserWarning)."""
  c = case(variant)
  kwargs: dict[str, Any] = {"units": "towers"}
  if policy in DENSE:
    kwargs["store"] = str(tmp_path / "towers_only")
    jr.save(c.model, kwargs["store"], units="towers", progress=False, **c.kwargs)
  with contextlib.ExitStack() as stack:
    with pytest.warns(UserWarning, match="mixer"):
      placed = stack.enter_context(c.place(policy, **kwargs))
      out = placed(TOKENS)
    np.testing.assert_array_equal(out, c.reference(policy))
    assert paths(placed) == ["towers"]
    assert tuple(placed.metadata.unplaced_stacks) == ("mixer",)
    assert placed.metadata.layer_count == TOWER_LAYERS


# --- 5. stores holding both stacks -------------------------------------------------------


@pytest.mark.parametrize("policy", ["dense_host", "dense_direct", "layerwise_k2"])
def test_store_holds_both_stacks(case, tmp_path, policy: str):
  """A store saved with ``units=("towers", "mixer")`` records both stacks; an abstract
  model placed from it with ``units=None`` takes them at ``place()``, before any call."""
  c = case("nnx-1dev")
  path = str(tmp_path / "both")
  jr.save(c.model, path, units=("towers", "mixer"), progress=False)
  with jr.place(abstract_nnx(), POLICIES[policy](), store=path, mesh=c.mesh) as placed:
    assert paths(placed) == ["towers", "mixer"]  # from the store's record
    assert placed.metadata.layer_count == TOWER_LAYERS + MIXER_LAYERS
    np.testing.assert_array_equal(placed(TOKENS), c.reference(policy))
    assert paths(placed) == ["towers", "mixer"]
    assert tuple(placed.metadata.unplaced_stacks) == ()


def test_store_with_fewer_stacks_than_chosen_raises(case, tmp_path):
  """A store of ``towers`` alone cannot serve ``units=("towers", "mixer")``: a StoreError
  that names the store's stacks and the chosen ones."""
  c = case("nnx-1dev")
  path = str(tmp_path / "towers_only")
  jr.save(c.model, path, units="towers", progress=False)
  with pytest.raises(jr.errors.StoreError) as info:
    jr.place(c.model, POLICIES["dense_host"](), units=("towers", "mixer"), store=path, mesh=c.mesh)
  message = str(info.value)
  assert "towers" in message and "mixer" in message


def test_store_of_one_stack_places_that_stack_by_default(case, tmp_path):
  """A store saved with ``units="towers"`` and placed without ``units=`` takes the
  store's stack (it once said "the store is inconsistent"), and the mixer the forward
  also loops over is reported, not silently kept static."""
  c = case("nnx-1dev")
  path = str(tmp_path / "towers_only")
  jr.save(c.model, path, units="towers", progress=False)
  with jr.place(c.model, POLICIES["dense_host"](), store=path, mesh=c.mesh) as placed:
    assert paths(placed) == ["towers"]
    with pytest.warns(UserWarning, match="'mixer'"):
      np.testing.assert_array_equal(placed(TOKENS), c.reference("dense_host"))
    assert placed.metadata.unplaced_stacks == ("mixer",)


def test_inspect_and_verify_cover_every_stack(case, tmp_path, capfd):
  from jax_residency._src.cli import main as cli

  c = case("nnx-1dev")
  path = str(tmp_path / "both")
  jr.save(c.model, path, units=("towers", "mixer"), progress=False)
  assert cli.main(["inspect", path, "--json"]) == 0
  info = json.loads(capfd.readouterr().out)
  assert [(s["prefix"], s["units"], s["unit_bytes"]) for s in info["stacks"]] == [
    ("towers", TOWER_LAYERS, TOWER_UNIT_BYTES),
    ("mixer", MIXER_LAYERS, MIXER_UNIT_BYTES),
  ]
  assert any(k.startswith("mixer.") for k in info["unit_tensors"])
  assert info["total_unit_bytes"] == (
    TOWER_LAYERS * TOWER_UNIT_BYTES + MIXER_LAYERS * MIXER_UNIT_BYTES
  )
  assert cli.main(["verify", path, "--json"]) == 0
  result = json.loads(capfd.readouterr().out)
  assert result["ok"] and result["chunks"] >= len(info["unit_tensors"])


def test_fully_resident_holds_every_stack_and_plan_agrees(case, tmp_path, capfd):
  """FullyResident keeps both stacks on the device (their sum), the streaming policies
  one stack's window at a time (the largest); ``jax-residency plan`` says the same."""
  from jax_residency._src.cli import main as cli

  c = case("nnx-1dev")
  everything = TOWER_LAYERS * TOWER_UNIT_BYTES + MIXER_LAYERS * MIXER_UNIT_BYTES
  with jr.place(c.model, jr.FullyResident(), units=STACKS, mesh=c.mesh) as placed:
    assert placed.metadata.device_window_bytes == everything
  path = str(tmp_path / "both")
  jr.save(c.model, path, units=STACKS, progress=False)
  assert cli.main(["plan", path, "--json", "--platform", "cpu"]) == 0
  plans = {p["policy"]: p for p in json.loads(capfd.readouterr().out)["plans"]}
  device = {name: p["tiers"][0]["window_bytes"] for name, p in plans.items()}
  assert device["fully_resident"] == everything
  assert device["layerwise_host"] == 2 * MIXER_UNIT_BYTES  # prefetch_depth 2
  assert device["dense_disk_stream"] == 2 * MIXER_UNIT_BYTES
  host = plans["layerwise_host"]["tiers"][1]
  assert host["window_bytes"] == everything  # every unit in pinned host memory


def test_host_cache_reads_ahead_in_forward_order_across_stacks(case, tmp_path):
  """The host cache is shared: while the last towers run, the first mixer unit is
  already asked for, so with a lookahead of 2 every unit but the first is read
  ahead (4 of 5), and each unit is read once; the next pass reads nothing."""
  c = case("nnx-1dev")
  path = str(tmp_path / "both")
  jr.save(c.model, path, units=("towers", "mixer"), progress=False)
  dense = jr.DenseDiskStream(host_budget_bytes="1MiB", host_lookahead=2)
  with jr.place(c.model, dense, store=path, mesh=c.mesh) as placed:
    np.testing.assert_array_equal(placed(TOKENS), c.reference("dense_host"))
    first = placed.report().last
    placed(TOKENS)
    second = placed.report().last
  units = TOWER_LAYERS + MIXER_LAYERS
  assert first.worker is not None and first.worker.submitted == units - 1
  assert [t.unit for t in first.timeline] == list(range(units))  # unit ids, stack after stack
  stored = TOWER_LAYERS * TOWER_UNIT_BYTES + MIXER_LAYERS * MIXER_UNIT_BYTES
  assert first.bytes_read == stored
  assert second.bytes_read == 0 and second.host is not None and second.host.misses == 0


# --- 6. budgets ---------------------------------------------------------------------------


def test_window_is_the_largest_stack_window(run):
  """Stacks run one after another: the device window is the heaviest stack's window."""
  r = run("nnx-1dev", "layerwise_k2")
  r.full()
  meta = r.placed.metadata
  assert meta.layer_count == TOWER_LAYERS + MIXER_LAYERS == 5
  assert [(s.path, s.layer_count, s.unit_bytes) for s in meta.stacks] == [
    ("towers", TOWER_LAYERS, TOWER_UNIT_BYTES),
    ("mixer", MIXER_LAYERS, MIXER_UNIT_BYTES),
  ]
  for s in meta.stacks:  # one device: a window of depth 2 is two units' bytes
    assert s.device_window_units == 2
    assert s.device_window_bytes == 2 * s.unit_bytes
  assert meta.device_window_bytes == max(s.device_window_bytes for s in meta.stacks)
  assert meta.device_window_bytes == 2 * MIXER_UNIT_BYTES


# --- 7. per-stack reports ----------------------------------------------------------------


@pytest.mark.parametrize(
  "policy",
  ["fully_resident", "layerwise_k2", "layerwise_resident", "dense_direct", "dense_resident"],
)
def test_report_per_stack(run, policy: str):
  """A full pass runs every unit of each stack; a streaming policy moves each unit once
  (layer_count × unit_bytes), but for the unit of each stack kept on the device, and
  FullyResident moves none."""
  r = run("nnx-1dev", policy)
  _, last = r.full()
  assert set(last.stacks) == set(STACKS)
  for s in r.placed.metadata.stacks:
    record = last.stacks[s.path]
    assert record.units_run == LAYERS[s.path] == s.layer_count
    moving = s.layer_count - (policy in ("dense_resident", "layerwise_resident"))
    moved = moving * s.unit_bytes if policy in STREAMED else 0
    assert record.bytes_moved == moved
