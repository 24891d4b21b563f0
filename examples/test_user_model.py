"""A user's test file: their own model, checked under every policy with jax_residency.testing.

Run it with the plugin, which gives the session eight CPU devices and the
``cpu_mesh8`` fixture::

  python -m pytest -p jax_residency.testing.plugin examples/test_user_model.py

(or put ``pytest_plugins = ["jax_residency.testing.plugin"]`` in your top-level
``conftest.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import testing


class MyModel(nnx.Module):
  """An encoder stack and a decoder stack of different widths, run one after the other."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    keys = jax.random.split(rngs.params(), 5)
    self.encoder = nnx.vmap(lambda k: nnx.Linear(16, 16, rngs=nnx.Rngs(k)))(keys[:3])
    self.decoder = nnx.vmap(lambda k: nnx.Linear(16, 16, rngs=nnx.Rngs(k)))(keys[3:])
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    h = jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.encoder)
    h = jr.scan_units(lambda h, layer: h + jnp.tanh(layer(h)), h, self.decoder)
    return self.head(h)


@pytest.fixture
def model() -> MyModel:
  return MyModel(nnx.Rngs(0))


def test_every_policy_matches_the_plain_model(model):
  x = jnp.ones((2, 16))
  diffs = testing.assert_policy_parity(model, x)  # bit for bit on CPU
  assert set(diffs) == set(testing.default_policies())


def test_every_policy_matches_on_eight_devices(model, cpu_mesh8):
  testing.assert_policy_parity(model, jnp.ones((2, 16)), mesh=cpu_mesh8)


@pytest.mark.parametrize("policy", [jr.FullyResident(), jr.LayerwiseHost(prefetch_depth=2)])
def test_weights_live_where_the_policy_says_and_within_budget(model, policy):
  with jr.place(model, policy) as placed:
    placed(jnp.ones((2, 16)))
    assert placed.stacks == ("encoder", "decoder")  # found by tracing the forward
    kinds = testing.assert_memory_kinds(placed)
    testing.assert_within_budgets(placed)
  assert ("pinned_host" in kinds) == isinstance(policy, jr.LayerwiseHost)
