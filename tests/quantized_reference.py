"""The reference a quantized placement is held to: the plain model whose quantized
tensors hold their decoded values (docs/parity.md; docs/quantization.md, "Parity")."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.plan.split import split_model


def dequantized_reference(
  model: Any, plan: QuantPlan, x: jax.Array, *, jit: bool = True, **kwargs: Any
) -> jax.Array:
  """The plain model whose quantized tensors hold their decoded values, jitted or eager
  (each decoded value keeps the original array's sharding)."""
  params = kwargs.get("params")
  split = split_model(model, params=params)
  tensors = plan.by_path()
  values = []
  for leaf, value in zip(split.leaves, split.values, strict=True):
    t = tensors.get(leaf.path)
    if t is not None:
      parts = t.encoding.encode(np.asarray(value), "reference")
      decoded = jax.jit(t.encoding.decode)(tuple(jnp.asarray(p) for p in parts))
      value = jax.device_put(decoded, value.sharding)
    values.append(value)
  bound = split.bind_stacks(values, ())
  if split.kind == "linen":
    apply = jax.jit(model.apply) if jit else model.apply
    return apply(nn.meta.unbox(bound.call.args[0]), x)
  return nnx.jit(lambda m, x: m(x))(bound.call, x) if jit else bound.call(x)
