"""The memory promise (docs/design.md, section 2.3): the plan names every byte, the
check refuses what would not fit once staging is counted, and passes stay within what
was planned."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx
from policies import dense

import jax_residency as jr
from jax_residency import testing
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.plan import budget as plan
from jax_residency._src.plan import memory
from jax_residency._src.store.buffers import BufferPool, buffer_layout
from jax_residency.toy import ToyConfig, ToyTransformer

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=8)
UNIT = CFG.unit_bytes()
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
UNITS = [1000] * 6


def check(policy: jr.LayerWeightResidency, *, device_is_host: bool) -> plan.ModelMetadata:
  return plan.check_budgets(
    policy,
    static_device_bytes=10,
    unit_bytes=UNITS,
    device_unit_bytes=UNITS,
    host_unit_bytes=UNITS,
    device_is_host=device_is_host,
  )


def test_staging_counts_against_the_host_budget_on_an_accelerator():
  # lookahead 2 units + one unit in transit to the device: exactly enough passes.
  meta = check(dense(3000, device=None), device_is_host=False)
  assert meta.item_bytes("staging") == 1000
  assert meta.item_bytes("host cache") == 2000
  assert meta.planned_host_bytes == 3000  # the whole host budget, no more
  with pytest.raises(jr.HostBudgetTooSmallError) as e:
    check(dense(2999, device=None), device_is_host=False)
  err = e.value
  assert (err.window, err.staging, err.required, err.budget) == (2000, 1000, 3000, 2999)
  assert "staging=1000" in str(err) and "required=3000" in str(err)


def test_on_cpu_a_read_buffer_is_the_device_array_so_there_is_no_staging():
  meta = check(dense(2000, device=None), device_is_host=True)
  assert meta.item_bytes("staging") == 0
  with pytest.raises(jr.HostBudgetTooSmallError) as e:
    check(dense(1999, device=None), device_is_host=True)
  assert (e.value.required, e.value.staging) == (2000, 0)


def test_device_budget_error_carries_its_numbers():
  with pytest.raises(jr.DeviceBudgetTooSmallError) as e:
    check(dense(0, device=10 + 2000 - 1), device_is_host=True)
  err = e.value
  assert (err.static, err.window, err.depth, err.required, err.budget) == (10, 2000, 2, 2010, 2009)


def test_direct_mode_staging_on_an_accelerator_is_a_named_overhead():
  meta = check(dense(0, device=None), device_is_host=False)
  staging = next(m for m in meta.memory if m.name == "staging")
  assert staging.nbytes == 1000 and staging.counted_in == plan.OVERHEAD
  assert meta.overhead_bytes == 1000 + 1000 + plan.STORE_INDEX_CACHE_BYTES  # + mapped pages
  assert meta.planned_host_bytes == 0


@pytest.mark.parametrize(
  "policy, device, host",
  [
    (jr.FullyResident(), 10 + 6000, 0),
    (
      jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=3))),
      3010,
      6000,
    ),
    (dense(None, device=None), 2010, 6000),
    (dense(2500, device=None), 2010, 2500),
  ],
)
def test_planned_bytes_add_up_the_items(policy, device, host):
  meta = check(policy, device_is_host=True)
  assert meta.planned_device_bytes == device
  assert meta.planned_host_bytes == host
  assert meta.planned_process_bytes == device + host + meta.overhead_bytes
  assert {m.counted_in for m in meta.memory} <= {
    plan.DEVICE_BUDGET,
    plan.HOST_BUDGET,
    plan.OVERHEAD,
  }
  table = meta.memory_table()
  assert all(m.name in table for m in meta.memory) and "total (this process)" in table
  # The total splits into what each budget pays and what none does (the overheads).
  for name, nbytes in (
    ("in the device budget", meta.planned_device_bytes),
    ("in the host budget", meta.planned_host_bytes),
    ("outside the budgets", meta.overhead_bytes),
  ):
    row = table.split(name, 1)[1].split("\n")[0]
    assert jr.format_bytes(nbytes) in row, (name, row)
  assert meta.to_dict()["planned_process_bytes"] == meta.planned_process_bytes


@pytest.fixture(scope="module")
def model(toy_model):
  return toy_model(CFG, seeded=True)


@pytest.fixture(scope="module")
def store(toy_store):
  return toy_store(CFG, seeded=True)


def slab_bytes(model) -> int:
  """One unit's read buffer: every tensor rounded up to a page."""
  _, state = nnx.split(model)
  specs = [
    (str(i), leaf.shape[1:], leaf.dtype)
    for i, leaf in enumerate(jax.tree.leaves(state.layers))  # type: ignore[attr-defined]
  ]
  return buffer_layout(specs)[1]


@pytest.mark.parametrize("host_units", [0, 1, 2, 3, 8])
def test_passes_stay_within_the_plan(model, store, host_units):
  """Reported peaks never exceed the plan, and the read buffers (real host
  memory: on CPU they are the device arrays too) never exceed the units the
  plan gives them, at every host budget, over cold, warm and reversed-order passes."""
  x = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab)
  abstract = nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))
  policy = dense(host_units * UNIT, lookahead=min(2, host_units), device=2**30)
  with jr.place(abstract, policy, store=store, mesh=MESH1) as placed:
    expected = model(x)
    for _ in range(3):
      np.testing.assert_array_equal(placed(x), expected)
    placed.clear_caches()
    np.testing.assert_array_equal(placed(x), expected)
    testing.assert_within_budgets(placed)  # every pass's peaks within the planned window and cache
    meta, total = placed.metadata, placed.report().total
  assert meta.device_is_host
  assert meta.device_window_bytes == 2 * UNIT
  assert meta.item_bytes("host cache") == host_units * UNIT
  buffers = meta.device_window_units + host_units
  assert 0 < total.peak_buffer_bytes <= buffers * slab_bytes(model)
  # Nothing hoarded: the buffers held are what the window and cache hold, not more.
  assert total.peak_buffer_bytes >= meta.device_window_units * slab_bytes(model)


def test_pool_keeps_idle_buffers_only_within_its_limit():
  layout, nbytes = buffer_layout([("w", (1024,), np.dtype("float32"))])
  pool = BufferPool(spare=4)
  pool.set_limit(2 * nbytes)
  held = [pool.lease(layout, nbytes) for _ in range(2)]
  assert pool.leased_bytes == 2 * nbytes
  del held
  assert pool.leased_bytes == 0 and pool.idle_bytes == 2 * nbytes  # kept: within the limit
  pool.set_limit(nbytes)
  assert pool.idle_bytes == nbytes  # the cap shrank: one idle buffer unmapped
  assert pool.peak_bytes == 2 * nbytes


def test_a_lease_waits_for_dropped_buffers_to_come_back():
  """Buffers whose arrays died are taken back before a lease goes past the limit."""
  layout, nbytes = buffer_layout([("w", (1024,), np.dtype("float32"))])
  pool = BufferPool(spare=0)
  pool.set_limit(nbytes, reclaim=lambda: None)
  first = pool.lease(layout, nbytes)
  del first
  second = pool.lease(layout, nbytes)
  assert pool.leased_bytes == nbytes and pool.room_waits == 0
  assert second["w"].shape == (1024,)


def test_dense_passes_report_their_compiled_step_temporaries(model, store):
  """The one cost the plan leaves out, activations, is shown per pass from XLA."""
  x = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab)
  with jr.place(model, dense(0, device=2**30), store=store, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(x), model(x))
    last = placed.report().last
  assert last is not None and last.step_temp_bytes > 0
  assert placed.report().total.step_temp_bytes == last.step_temp_bytes


@pytest.mark.parametrize("policy", [jr.FullyResident(), jr.LayerwiseHost()], ids=["fr", "lh"])
def test_jitted_passes_report_their_program_temporaries(model, policy):
  """FullyResident / LayerwiseHost compile one program per input signature ahead of its
  first call; the temporaries grow with the input, and the programs are reused."""
  small = jax.random.randint(jax.random.key(1), (1, 4), 0, CFG.vocab)
  large = jax.random.randint(jax.random.key(2), (8, 32), 0, CFG.vocab)
  with jr.place(model, policy, mesh=MESH1) as placed:
    for x in (small, large, small):  # one program: the jitted model's bits
      np.testing.assert_array_equal(placed(x), jitted_plain(model, x))
    passes = placed.report().passes
  temps = [p.step_temp_bytes for p in passes]
  assert 0 < temps[0] < temps[1] and temps[2] == temps[0]
  assert passes[2].compile_seconds == 0.0  # the small input's program was reused


# --- the process, measured -------------------------------------------------------------------

_MEASURE = r"""
import ctypes, gc, json, os, sys
import jax, numpy as np
from flax import nnx
import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer

store, cfg = sys.argv[1], ToyConfig(**json.loads(sys.argv[2]))
unit = cfg.unit_bytes()
trim = ctypes.CDLL(None).malloc_trim

def status(key):
  with open("/proc/self/status") as f:
    return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))

abstract = nnx.eval_shape(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0)))
tokens = jax.numpy.zeros((1, 8), jax.numpy.int32)
jax.block_until_ready(tokens)
policies = {
  "dense, host 0": jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=3 * unit),
  "dense, host 2 units": jr.DenseDiskStream(
    host_budget_bytes=2 * unit, device_budget_bytes=3 * unit
  ),
  "dense, 1 unit kept on the device, 1 in host memory": jr.DenseDiskStream(
    host_budget_bytes=3 * unit,
    device_budget_bytes=4 * unit,
    device_resident_units=1,
    host_resident_units=1,
  ),
  "LayerwiseHost": jr.LayerwiseHost(),
  "FullyResident": jr.FullyResident(),
}
out = {}
for name, policy in policies.items():
  gc.collect()
  trim(0)
  with open("/proc/self/clear_refs", "w") as f:  # VmHWM := VmRSS
    f.write("5")
  baseline = status("VmRSS")
  with jr.place(abstract, policy, store=store) as placed:
    jax.block_until_ready(placed(tokens))  # compiles, then runs
    jax.block_until_ready(placed(tokens))
    planned = placed.metadata.planned_process_bytes
  out[name] = {"growth": status("VmHWM") - baseline, "planned": planned}
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_process_grows_by_at_most_its_plan_and_the_runtime_allowance(tmp_path, seeded_nnx):
  """docs/memory.md, "Process memory beside the plan": a model with 48 MiB units placed
  from its store under each policy, in a fresh process, twice run: the process's peak
  RSS (``VmHWM``, reset before each placement) grows by at most the placement's
  ``planned_process_bytes`` plus `RUNTIME_ALLOWANCE_BYTES`, and by more than the plan
  less the allowance and two units (the process did hold what the plan names)."""
  cfg = ToyConfig(vocab=256, d_model=1024, n_heads=8, d_ff=4096, n_layers=4)
  assert cfg.unit_bytes() > 3 * memory.RUNTIME_ALLOWANCE_BYTES // 4  # weights dominate
  store = str(tmp_path / "store")
  jr.save(seeded_nnx(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0))), store, progress=False)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  env["JAX_PLATFORMS"] = "cpu"
  done = subprocess.run(
    [sys.executable, "-c", _MEASURE, store, json.dumps(dataclasses.asdict(cfg))],
    capture_output=True,
    text=True,
    timeout=300,
    env=env,
  )
  assert done.returncode == 0, done.stderr[-3000:]
  measured = json.loads(done.stdout.splitlines()[-1])
  allowance = memory.RUNTIME_ALLOWANCE_BYTES
  for name, m in measured.items():
    assert m["growth"] <= m["planned"] + allowance, (name, m, allowance)
    assert m["growth"] >= m["planned"] - allowance - 2 * cfg.unit_bytes(), (name, m)
