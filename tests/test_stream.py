"""DenseDiskStream end to end: parity with the plain model, exact counters, failures."""

from __future__ import annotations

import threading
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from policies import dense
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency import testing
from jax_residency.toy import LinenToyTransformer, ToyConfig, ToyTransformer

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=8)
UNIT = CFG.unit_bytes()
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))


model, tokens, store = toy_fixtures(CFG, seeded=True)


@pytest.mark.parametrize(
  "host_units, lookahead, lfu",
  [(0, 0, False), (1, 1, False), (8, 2, False), (3, 2, True), (3, 3, False), (2, 1, True)],
)
def test_parity_with_plain_model(model, tokens, store, host_units, lookahead, lfu):
  expected = model(tokens)
  with jr.place(
    model, dense(host_units * UNIT, lookahead, lfu=lfu), store=store, mesh=MESH1
  ) as placed:
    for _ in range(2):  # cold, then with whatever the caches kept
      np.testing.assert_array_equal(placed(tokens), expected)


def test_parity_linen(tokens, seeded_linen, saved_store):
  lm = LinenToyTransformer(CFG)
  variables = seeded_linen(lm, tokens)
  path = saved_store("test_stream-linen", lm, params=variables).path
  with jr.place(lm, dense(3 * UNIT, 2), params=variables, store=path, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), lm.apply(variables, tokens))


@pytest.fixture(scope="module")
def mesh_2x4():
  return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_parity_on_a_sharded_mesh(tokens, mesh_2x4, toy_model, toy_store):
  mesh = mesh_2x4
  sharded = toy_model(CFG, mesh=mesh, seeded=True)
  path = toy_store(CFG, mesh=mesh, seeded=True)
  expected = sharded(tokens)
  with jr.place(sharded, dense(3 * UNIT, 2), store=path, mesh=mesh) as placed:
    out = placed(tokens)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("host_units, lookahead", [(0, 0), (3, 2)])
def test_accelerator_step_path_keeps_parity(
  model, tokens, store, host_units, lookahead, monkeypatch
):
  """Off CPU each unit step is a plain jitted program (no one-trip while loop).

  This machine has no accelerator, so run that path on CPU: it compiles the
  step on its own, so parity is to rounding rather than bit for bit.
  """
  from jax_residency._src.stream import engine as stream
  from jax_residency._src.stream import staged

  monkeypatch.setattr(stream, "STEP_IN_LOOP_PLATFORMS", frozenset())
  whiles = []
  compile_step = staged._compile_step

  def spy(*args, in_loop):
    whiles.append(in_loop)
    return compile_step(*args, in_loop=in_loop)

  monkeypatch.setattr(staged, "_compile_step", spy)
  expected = model(tokens)
  with jr.place(model, dense(host_units * UNIT, lookahead), store=store, mesh=MESH1) as placed:
    for _ in range(2):
      np.testing.assert_allclose(placed(tokens), expected, rtol=1e-5, atol=1e-5)
  assert whiles == [False]  # one step program, compiled once, without the loop


def test_memory_store_and_abstract_model(model, tokens):
  path = "memory://stream-test/toy"
  jr.save(model, path, progress=False)
  abstract = nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))
  with jr.place(abstract, dense(2 * UNIT, 1), store=path, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), model(tokens))


def test_exact_counters_two_passes(model, tokens, store):
  """8 units, host budget of 3 units, lookahead 2, device window 2, two passes."""
  with jr.place(model, dense(3 * UNIT, 2), store=store, mesh=MESH1) as placed:
    placed(tokens)
    placed(tokens)
    report = placed.report()
  first, second = report.passes
  for p in (first, second):
    # Device tier: fetch(i) asks once per unit; only unit 0 is not moved in ahead.
    assert (p.device.requests, p.device.hits, p.device.misses) == (8, 7, 1)
    # Host tier: asked once per device load; unit 0 is read on demand, 1..7 prefetched.
    assert (p.host.requests, p.host.hits, p.host.misses) == (8, 7, 1)
    assert p.disk_to_host_bytes == 8 * UNIT
    assert p.host_to_device_bytes == 8 * UNIT
    assert p.disk_to_device_bytes == 0
    assert p.peak_host_units == 3 and p.peak_device_units == 2
    assert p.worker.submitted == 7 and p.worker.completed == 7 and p.worker.failed == 0
  # Pass 1 fills a 3-unit host cache with 8 units: 5 evictions; the device window of
  # 2 evicts units 0..5. Pass 2 starts full on both tiers: every install evicts.
  assert (first.host.evictions, first.device.evictions) == (5, 6)
  assert (second.host.evictions, second.device.evictions) == (8, 8)
  assert first.host.evicted_bytes == 5 * UNIT
  assert report.total.passes == 2 and report.total.bytes_read == 16 * UNIT
  assert report.prefill.passes == 2 and report.decode.passes == 0


def test_host_cache_holding_every_unit_reads_once(model, tokens, store):
  with jr.place(model, dense(8 * UNIT, 2), store=store, mesh=MESH1) as placed:
    placed(tokens)
    placed(tokens[:, :1])  # a decode pass
    report = placed.report()
  first, second = report.passes
  assert first.disk_to_host_bytes == 8 * UNIT
  assert second.disk_to_host_bytes == 0 and second.host.misses == 0
  assert second.phase == "decode" and report.decode.passes == 1


def test_direct_disk_to_device_has_no_thread_and_no_host_cache(model, tokens, store):
  before = {t.name for t in threading.enumerate()}
  with jr.place(model, dense(0, 0), store=store, mesh=MESH1) as placed:
    placed(tokens)
    assert {t.name for t in threading.enumerate()} == before
    p = placed.report().last
  assert p.worker is None
  assert p.disk_to_device_bytes == 8 * UNIT and p.disk_to_host_bytes == 0
  assert p.host.requests == 0 and p.peak_host_units == 0


def test_close_joins_the_worker(model, tokens, store):
  placed = jr.place(model, dense(3 * UNIT, 2), store=store, mesh=MESH1)
  placed(tokens)
  assert any(t.name.startswith("jax-residency") for t in threading.enumerate())
  placed.close()
  assert not any(t.name.startswith("jax-residency") for t in threading.enumerate())
  with pytest.raises(jr.ClosedError):
    placed(tokens)


def test_failed_pass_commits_nothing_and_recovers(model, tokens, store, monkeypatch):
  with jr.place(model, dense(3 * UNIT, 2), store=store, mesh=MESH1) as placed:
    placed(tokens)
    before = placed.report()
    from jax_residency._src.store import unit_store as store_mod

    real = store_mod.UnitStore.read_unit_async  # read_unit goes through it too

    def flaky(self, i, **kw):
      if i == 5:
        raise OSError("disk went away")
      return real(self, i, **kw)

    monkeypatch.setattr(store_mod.UnitStore, "read_unit_async", flaky)
    with pytest.raises((jr.PrefetchError, jr.StoreError)) as info:
      placed(tokens)
    assert "unit 5" in str(info.value)
    after = placed.report()
    assert after.total == before.total and len(after.passes) == 1
    monkeypatch.setattr(store_mod.UnitStore, "read_unit_async", real)
    np.testing.assert_array_equal(placed(tokens), model(tokens))
    assert placed.report().total.passes == 2


def test_budget_checks_before_reading(model, store):
  static = sum(
    int(np.prod(x.shape)) * x.dtype.itemsize
    for path, x in nnx.to_flat_state(nnx.state(model))
    if path[0] != "layers"
  )
  need = static + 2 * UNIT
  with pytest.raises(jr.DeviceBudgetTooSmallError, match=f"required={need}"):
    jr.place(model, dense(3 * UNIT, 2, device=need - 1), store=store, mesh=MESH1)
  jr.place(model, dense(3 * UNIT, 2, device=need), store=store, mesh=MESH1).close()
  with pytest.raises(jr.HostBudgetTooSmallError):
    jr.place(model, dense(2 * UNIT, 3), store=store, mesh=MESH1)


def test_missing_store_is_a_clear_error(model, tmp_path):
  with pytest.raises(jr.StoreNotFoundError, match="nope"):
    jr.place(model, dense(3 * UNIT, 2), store=str(tmp_path / "nope"), mesh=MESH1)


def test_wrong_model_lists_every_bad_path(tokens, store, toy_model):
  other = toy_model(ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=32, n_layers=8), seeded=True)
  with pytest.raises(jr.CheckpointShapeMismatchError) as info:
    jr.place(other, dense(3 * UNIT, 2), store=store, mesh=MESH1)
  msg = str(info.value)
  assert "up" in msg and "down" in msg


def test_traced_once_per_input_shape(model, tokens, store, monkeypatch):
  """The block's Python code runs only while tracing: once per input shape."""
  from jax_residency._src.models import toy

  traces = {"n": 0}
  real_call = toy.Block.__call__

  def counting(self, x):
    traces["n"] += 1
    return real_call(self, x)

  monkeypatch.setattr(toy.Block, "__call__", counting)
  with jr.place(model, dense(3 * UNIT, 2), store=store, mesh=MESH1) as placed:
    for _ in range(3):
      placed(tokens)
    assert traces["n"] == 1
    placed(jnp.concatenate([tokens, tokens], axis=1))
    assert traces["n"] == 2


class _ProcessView:
  """A sharding seen from a process that owns only some of its devices."""

  def __init__(self, sharding, devices):
    self._sharding, self._devices = sharding, set(devices)
    self.is_fully_addressable = False

  def addressable_devices_indices_map(self, shape):
    full = self._sharding.devices_indices_map(shape)
    return {d: idx for d, idx in full.items() if d in self._devices}


def test_addressable_box_covers_only_this_process_shards():
  from jax_residency._src.stream.boxes import addressable_box

  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model"))
  first_row = list(mesh.devices[0])  # a process owning data=0: every model shard
  assert addressable_box(_ProcessView(sharding, first_row), (6, 16)) == (slice(0, 6), slice(0, 16))
  half = list(mesh.devices[:, :2].flat)  # a process owning model shards 0 and 1
  assert addressable_box(_ProcessView(sharding, half), (6, 16)) == (slice(0, 6), slice(0, 8))
  assert addressable_box(sharding, (6, 16)) is None  # single process: read everything


def test_from_local_box_places_what_the_process_read():
  from jax_residency._src.stream.boxes import from_local_box

  mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("model"))
  full = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
  out = from_local_box(full, (8, 3), sharding, (slice(0, 8), slice(0, 3)))
  np.testing.assert_array_equal(out, full)
  assert out.sharding == sharding


def test_sliced_reads_path_keeps_parity(tokens, mesh_2x4, toy_model, toy_store, monkeypatch):
  """Force the multi-process read path (index reads + per-shard assembly)."""
  from jax_residency._src.stream import streamed_stack

  monkeypatch.setattr(
    streamed_stack, "addressable_box", lambda s, shape: tuple(slice(0, n) for n in shape)
  )
  mesh = mesh_2x4
  sharded = toy_model(CFG, mesh=mesh, seeded=True)
  path = toy_store(CFG, mesh=mesh, seeded=True)
  expected = sharded(tokens)
  for host_units in (0, 3):
    with jr.place(
      sharded, dense(host_units * UNIT, 2 if host_units else 0), store=path, mesh=mesh
    ) as p:
      np.testing.assert_allclose(p(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("policy", ["fully_resident", "layerwise_host"])
def test_every_policy_places_an_abstract_model_from_a_store(model, tokens, store, policy):
  abstract = nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))
  chosen = jr.FullyResident() if policy == "fully_resident" else jr.LayerwiseHost()
  # One program: the jitted model's bits (docs/parity.md).
  graphdef, state = nnx.split(model)
  want = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
  with jr.place(abstract, chosen, store=store, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), want)
    # The units where the policy keeps them, the static parameters on the device.
    kinds = testing.assert_memory_kinds(placed)
  state = nnx.state(model)
  n_units, n_all = len(jax.tree.leaves(state["layers"])), len(jax.tree.leaves(state))
  if policy == "fully_resident":
    assert kinds == {"device": n_all}
  else:
    assert kinds == {"device": n_all - n_units, "pinned_host": n_units}


def test_abstract_model_without_a_store_is_a_clear_error():
  abstract = nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))
  with pytest.raises(jr.PlacementError, match="store="):
    jr.place(abstract, jr.FullyResident(), mesh=MESH1)


class _Layer(nn.Module):
  @nn.compact
  def __call__(self, h: jax.Array, extra: jax.Array) -> tuple[jax.Array, jax.Array]:
    h = jnp.tanh(nn.Dense(h.shape[-1], name="dense")(h) + extra)
    return h, h.sum(axis=-1)  # a per-step output, stacked by the loop


class _ReverseStack(nn.Module):
  """A reversed Linen scan with a per-step input and output beside the units."""

  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  @nn.compact
  def __call__(self, x: jax.Array, extra: jax.Array) -> tuple[jax.Array, jax.Array]:
    stack = jr.linen.scan(
      _Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=5, reverse=True
    )
    return stack(name="layers")(x, extra)


@pytest.fixture(scope="module")
def reverse_stack(seeded_linen, saved_store):
  model = _ReverseStack()
  x = jax.random.normal(jax.random.key(0), (3, 16))
  extra = jax.random.normal(jax.random.key(1), (5, 3, 16))
  variables = seeded_linen(model, x, extra)
  path = saved_store("test_stream-reverse_stack", model, params=variables).path
  unit = sum(a.nbytes for a in jax.tree.leaves(variables)) // 5
  return model, variables, (x, extra), path, unit


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_reversed_loop_under_layerwise_host(reverse_stack, depth):
  """``reverse=True`` runs the pipelined host loop from the last unit down."""
  model, variables, args, _, _ = reverse_stack
  policy = jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=depth)))
  want = jax.jit(model.apply)(variables, *args)
  with jr.place(model, policy, params=variables, mesh=MESH1) as placed:
    got = placed(*args)
  jax.tree.map(np.testing.assert_array_equal, got, want)


def test_reversed_loop_streams_in_loop_order(reverse_stack):
  """Stacked inputs are sliced, outputs written, and units read ahead in the loop's order."""
  model, variables, args, path, unit = reverse_stack
  policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      host_budget_bytes=2 * unit, host_lookahead=1, background_queue_capacity=1
    )
  )
  h, ys = model.apply(variables, *args)
  with jr.place(model, policy, params=variables, store=path, mesh=MESH1) as placed:
    got_h, got_ys = placed(*args)
    report = placed.report().passes[-1]
  assert got_ys.shape == (5, 3)
  np.testing.assert_array_equal(got_ys, ys)
  np.testing.assert_array_equal(got_h, h)
  assert [p.unit for p in report.timeline] == [4, 3, 2, 1, 0]
  assert report.bytes_read == 5 * unit  # nothing read ahead in the wrong direction
  assert report.worker.evicted_before_use == 0
  assert report.worker.submitted >= 3  # units 3..1 were read ahead, not on demand


def test_scan_units_reverse_under_every_policy(reversed_stack, saved_store):
  model = reversed_stack
  x = jax.random.normal(jax.random.key(1), (2, 16))
  h = x  # the loop runs layer 3 first
  for i in reversed(range(4)):
    h = jnp.tanh(h @ model.layers.kernel[i] + model.layers.bias[i])
  np.testing.assert_allclose(model(x), h, rtol=1e-6, atol=1e-6)
  path = saved_store("conftest-reversed_stack", model).path
  policies = [
    jr.FullyResident(),
    jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=2))),
    jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(
        host_budget_bytes=0, host_lookahead=0, background_queue_capacity=0
      )
    ),
  ]
  for policy in policies:
    with jr.place(model, policy, store=path, mesh=MESH1) as placed:
      np.testing.assert_allclose(placed(x), h, rtol=1e-6, atol=1e-6)


def test_bfloat16_model_under_every_policy(tokens, toy_model, toy_store):
  """Half-precision weights are stored, placed and streamed as they are."""
  cfg = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4, dtype="bfloat16")
  model = toy_model(cfg, seeded=True)
  path = toy_store(cfg, seeded=True)
  jitted, eager = nnx.jit(lambda m, t: m(t))(model, tokens), model(tokens)
  unit = cfg.unit_bytes()
  dense_policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      host_budget_bytes=2 * unit, host_lookahead=1, background_queue_capacity=1
    )
  )
  for policy, want in [
    (jr.FullyResident(), jitted),
    (jr.LayerwiseHost(), jitted),
    (dense_policy, eager),
  ]:
    with jr.place(model, policy, store=path, mesh=MESH1) as placed:
      out = placed(tokens)
      assert out.dtype == jnp.bfloat16
      np.testing.assert_array_equal(out, want)
      assert placed.metadata.total_unit_bytes == 4 * unit
    if policy is dense_policy:
      assert placed.report().total.bytes_read == 4 * unit


def test_transformations_are_a_clear_error(model, tokens, store):
  """The dense stream runs its loop from the host: grad/jit/make_jaxpr say so plainly."""
  emb = jnp.ones((2, 6, CFG.d_model))
  with jr.place(model, dense(0, 0), store=store, mesh=MESH1) as placed:
    for transform in (jax.jit(placed), jax.make_jaxpr(placed)):
      with pytest.raises(jr.PlacementError, match="FullyResident or LayerwiseHost"):
        transform(tokens)
    with pytest.raises(jr.PlacementError, match="jax.grad"):
      jax.grad(lambda t: jnp.sum(placed(t).astype(jnp.float32)))(emb)
    np.testing.assert_array_equal(placed(tokens), model(tokens))  # still usable


@pytest.mark.parametrize(
  "policy", [dense(0), dense(8 * UNIT, 2)], ids=["dense_direct", "dense_cached"]
)
def test_the_host_dispatches_each_unit_step_before_it_waits_on_the_one_before(
  model, tokens, store, policy, monkeypatch
):
  """By construction (docs/design.md, 4.1): a pass's unit steps go out one after another,
  and the host waits on step ``s`` only once step ``s + 1`` is dispatched (to release
  what step ``s`` read), never on the step it has just dispatched, so a device always
  has the next step queued. The same Python runs these steps on every backend
  (FullyResident and LayerwiseHost run one program: no host between units)."""
  from jax_residency._src.stream import staged

  events: list[tuple[str, int]] = []
  held: list[object] = []
  compile_step = staged._compile_step

  class Logged:
    def __init__(self, body):
      self._body = body

    def __getattr__(self, name):  # the step's other attributes (its temporaries)
      return getattr(self._body, name)

    def __call__(self, *step_args):
      carry, ys = self._body(*step_args)
      events.append(("dispatch", id(carry)))
      held.append(carry)  # alive until the end: no later object reuses its id
      return carry, ys

  def logged_compile(*args, **kwargs):
    return Logged(compile_step(*args, **kwargs))

  wait = jax.block_until_ready

  def logged_wait(x):
    events.append(("wait", id(x)))
    held.append(x)
    return wait(x)

  monkeypatch.setattr(staged, "_compile_step", logged_compile)
  monkeypatch.setattr(jax, "block_until_ready", logged_wait)
  path = store if isinstance(policy, jr.DenseDiskStream) else None
  with jr.place(model, policy, store=path, mesh=MESH1) as placed:
    placed(tokens)  # compiles the steps
    events.clear()
    held.clear()
    np.testing.assert_array_equal(placed(tokens), model(tokens))
  dispatched = [key for kind, key in events if kind == "dispatch"]
  assert len(dispatched) == CFG.n_layers
  for s, key in enumerate(dispatched[:-1]):
    waited = [n for n, event in enumerate(events) if event == ("wait", key)]
    assert waited, f"step {s} is never awaited on its own"
    assert waited[0] > events.index(("dispatch", dispatched[s + 1])), (s, events)
