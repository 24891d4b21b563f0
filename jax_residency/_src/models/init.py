"""Seeded random weights for a model, drawn host-side with NumPy so nothing compiles.

``Model(cfg, rngs=nnx.Rngs(seed))`` draws through JAX's RNG and compiles every
initialiser, seconds on a CPU; `seeded_weights` fills an abstract model
(``nnx.eval_shape``) at Flax's default scales instead.
"""

from __future__ import annotations

from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_residency._src.plan.split import normalise_path

M = TypeVar("M", bound=nnx.Module)


def seeded_weights(abstract: M, seed: int = 0) -> M:
  """``abstract`` with seeded weights: Linear kernels ``normal(0, 1/sqrt(fan_in))``,
  biases 0, norm scales 1, anything else (embeddings, bias tables) ``normal(0, 1)``.

  Example:
    >>> model = seeded_weights(nnx.eval_shape(lambda: nnx.Linear(4, 2, rngs=nnx.Rngs(0))))
    >>> model.kernel.shape, float(model.bias.sum())
    ((4, 2), 0.0)
  """
  graphdef, state = nnx.split(abstract)
  rng = np.random.default_rng(seed)

  def draw(path: Any, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    name = normalise_path(path)[-1]
    if name == "bias":
      value = np.zeros(leaf.shape)
    elif name == "scale":
      value = np.ones(leaf.shape)
    elif name == "kernel":
      value = rng.standard_normal(leaf.shape) / np.sqrt(leaf.shape[-2])
    else:
      value = rng.standard_normal(leaf.shape)
    return jnp.asarray(value, leaf.dtype)

  return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(draw, state))
