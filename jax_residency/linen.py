"""Linen support: the transform that stands in for ``nn.scan`` over a layer stack.

Build the layer stack with `scan` where you would call ``nn.scan``: the model
initialises and runs as before, and ``jr.place(model, policy, params=variables)``
runs the stack's layers through the policy's layer loop.

Example:
  >>> import jax, jax.numpy as jnp
  >>> from flax import linen as nn
  >>> import jax_residency as jr
  >>> class Block(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, h, _):
  ...     return jnp.tanh(nn.Dense(8)(h)), None
  >>> class Net(nn.Module):
  ...   @nn.compact
  ...   def __call__(self, x):
  ...     stack = jr.linen.scan(Block, variable_axes={"params": 0},
  ...                           split_rngs={"params": True}, length=4)
  ...     h, _ = stack(name="layers")(x, None)
  ...     return nn.Dense(2, name="head")(h)
  >>> net, x = Net(), jnp.ones((2, 8))
  >>> variables = net.init(jax.random.key(0), x)
  >>> with jr.place(net, jr.LayerwiseHost(prefetch_depth=2), params=variables) as placed:
  ...   same = bool(jnp.allclose(placed(x), net.apply(variables, x)))
  >>> same, placed.unit_count, placed.unit_prefix
  (True, 4, ('layers',))
"""

from ._src.loop.linen import scan as scan

__all__ = ["scan"]
