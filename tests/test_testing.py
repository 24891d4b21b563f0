"""``jax_residency.testing``: its checks pass on what is right and fail, saying why, on
what is not; the example test file under ``examples/`` passes with the plugin."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from user_env import run_script

import jax_residency as jr
from jax_residency import testing
from jax_residency.toy import ToyConfig

ROOT = Path(__file__).resolve().parents[1]
CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=3)
TOKENS = jnp.zeros((1, 5), jnp.int32)


def test_parity_holds_bit_for_bit_for_nnx_and_linen(linen_toy, tokens, toy_model):
  model = toy_model(CFG, seeded=True)
  assert set(testing.assert_policy_parity(model, TOKENS).values()) == {0.0}
  linen, variables = linen_toy
  diffs = testing.assert_policy_parity(linen, tokens, params=variables)
  assert set(diffs.values()) == {0.0}


def test_parity_fails_naming_the_policy_whose_outputs_differ(toy_model, toy_store):
  model = toy_model(CFG, seeded=True)
  other = toy_store(CFG, seed=1, seeded=True)  # a store of another model of the same shape
  policies = {"resident": jr.FullyResident(), "streamed": jr.DenseDiskStream(host_budget_bytes=0)}
  with pytest.raises(AssertionError, match=r"atol=0\.0 under streamed:") as e:
    testing.assert_policy_parity(model, TOKENS, policies=policies, store=other)
  assert "resident: max |difference| 0" in str(e.value)


def test_parity_never_compares_outputs_of_different_shapes_by_broadcasting():
  from jax_residency._src.testing import _max_diff

  assert _max_diff("lh", jnp.ones((2, 3)), jnp.zeros((2, 3))) == 1.0
  with pytest.raises(AssertionError, match=r"under lh an output has shape \(2, 3\), the plain"):
    _max_diff("lh", jnp.zeros((2, 3)), jnp.zeros(3))


def test_memory_kinds_pass_per_policy_and_fail_on_a_misplaced_array(toy_model):
  model = toy_model(CFG, seeded=True)
  with jr.place(model, jr.FullyResident()) as placed:
    assert set(testing.assert_memory_kinds(placed)) == {"device"}
  with jr.place(model, jr.LayerwiseHost()) as placed:
    arrays = placed.arrays()
    kinds = testing.assert_memory_kinds(placed)
    assert kinds["pinned_host"] == sum(1 for k in arrays if k.startswith("layers."))
    embed = arrays["embed.embedding"]
    host = jax.device_put(embed, embed.sharding.with_memory_kind("pinned_host"))
    fake = types.SimpleNamespace(
      policy=placed.policy,
      stack_array_prefixes=placed.stack_array_prefixes,
      arrays=lambda: {**arrays, "embed.embedding": host},
    )
    with pytest.raises(AssertionError, match=r"embed\.embedding: in 'pinned_host' memory"):
      testing.assert_memory_kinds(fake)


def test_within_budgets_passes_and_fails_on_a_pass_over_the_plan(toy_model):
  model = toy_model(CFG, seeded=True)
  with jr.place(model, jr.LayerwiseHost(prefetch_depth=2)) as placed:
    placed(TOKENS)
    testing.assert_within_budgets(placed)
    report = placed.report()
    meta = placed.metadata
  over = types.SimpleNamespace(
    index=0, peak_device_bytes=meta.device_window_bytes + 1, peak_host_bytes=0
  )
  fake = types.SimpleNamespace(
    metadata=meta,
    report=lambda: types.SimpleNamespace(passes=[*report.passes, over], total=report.total),
  )
  with pytest.raises(AssertionError, match="pass 0: .* unit bytes on a device, planned window"):
    testing.assert_within_budgets(fake)
  # A pass the history no longer keeps still counts: its peak is in the totals.
  total = types.SimpleNamespace(
    peak_device_bytes=0, peak_host_bytes=meta.item_bytes("host units") + 1
  )
  forgot = types.SimpleNamespace(
    metadata=meta, report=lambda: types.SimpleNamespace(passes=report.passes, total=total)
  )
  with pytest.raises(AssertionError, match="a pass before the report's history: .* host memory"):
    testing.assert_within_budgets(forgot)


def test_the_example_user_test_file_passes_with_the_plugin(zygote):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the plugin sets 8 devices
  done = run_script(  # forked from the zygote: JAX imported, no backend yet
    [
      sys.executable,
      "-m",
      "pytest",
      "-q",
      "-p",
      "no:cacheprovider",
      "-p",
      "jax_residency.testing.plugin",
      "examples/test_user_model.py",
    ],
    zygote,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=280,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  assert "4 passed" in done.stdout and "skipped" not in done.stdout


def test_the_plugin_mesh_has_eight_devices():
  from jax_residency.testing import plugin

  devices = jax.devices("cpu")
  mesh = plugin.cpu_mesh8.__wrapped__(devices)  # type: ignore[attr-defined]
  assert mesh.devices.shape == (2, 4) and np.all(mesh.devices.ravel() == np.array(devices[:8]))
