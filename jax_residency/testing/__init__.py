"""Helpers for a user's own test suite: parity, memory kinds, budgets, and a pytest plugin.

* `assert_policy_parity(model, *args, policies=..., atol=...)`: the plain model
  against the model placed under each policy (a dense stream reads a store
  written for the test); returns the largest difference per policy.
* `assert_memory_kinds(placed)`: every array in the memory its policy says.
* `assert_within_budgets(placed)`: every pass within what the placement planned.
* `serve_store(path, latency_s=..., fail=...)`: a store served read-only over
  loopback HTTP, counting bytes served, to test remote reads (slow or failing
  servers too) without a network.
* ``pytest_plugins = ["jax_residency.testing.plugin"]`` in a ``conftest.py``
  gives eight CPU devices and the ``cpu_mesh8`` fixture (see `plugin`).

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import nnx
  >>> import jax_residency as jr
  >>> from jax_residency import testing
  >>> class Net(nnx.Module):
  ...   def __init__(self, rngs):
  ...     self.layers = nnx.vmap(lambda k: nnx.Linear(4, 4, rngs=nnx.Rngs(k)))(
  ...         jax.random.split(rngs.params(), 2))
  ...   def __call__(self, x):
  ...     return jr.scan_units(lambda h, layer: layer(h), x, self.layers)
  >>> diffs = testing.assert_policy_parity(Net(nnx.Rngs(0)), jnp.ones((1, 4)))
  >>> max(diffs.values())
  0.0
"""

from jax_residency._src.store_server import ServedStore as ServedStore
from jax_residency._src.store_server import serve_store as serve_store
from jax_residency._src.testing import assert_memory_kinds as assert_memory_kinds
from jax_residency._src.testing import assert_policy_parity as assert_policy_parity
from jax_residency._src.testing import assert_within_budgets as assert_within_budgets
from jax_residency._src.testing import default_policies as default_policies

__all__ = [
  "assert_memory_kinds",
  "assert_policy_parity",
  "assert_within_budgets",
  "ServedStore",
  "default_policies",
  "serve_store",
]
