"""`picked_experts`: where a mixture of experts says which experts its tokens use.

A model applies it to its router's top-k expert ids, before it builds anything from
them. It is the identity everywhere (eagerly, under ``jit``, ``vmap``, ``grad``), so the
plain model and every policy without expert residency run exactly as before. A dense
stream with expert residency (docs/design.md, 4.9) finds it in the unit loop's body:
it runs the part of the step that computes the ids first (the *probe*: attention,
norms and router, never an expert's weights), reads only the experts the ids name, and
runs the step with those ids, so the experts it reads are the experts the step uses.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend import core as jcore
from jax.interpreters import ad, batching, mlir

picked_experts_p = jcore.Primitive("picked_experts")


def picked_experts(ids: jax.Array) -> jax.Array:
  """Marks ``ids`` (integers, ``(..., top_k)``: the last axis holds the experts one token
  picks, e.g. ``(batch, tokens, top_k)``) as the experts a mixture-of-experts layer
  runs; returns them unchanged.

  Call it once per mixture of experts in a layer of a stack that ``scan_units`` runs,
  on the ids that decide which experts' weights the layer reads (an expert not named
  gets weight 0). The ids must not depend on an expert's weights.

  Example:
    >>> import jax.numpy as jnp
    >>> picked_experts(jnp.asarray([[1, 3]])).tolist()
    [[1, 3]]
  """
  if not jnp_integer(ids):
    raise TypeError(f"picked_experts takes integer expert ids, got dtype {ids.dtype}")
  return picked_experts_p.bind(ids)


def jnp_integer(x: Any) -> bool:
  return jax.numpy.issubdtype(jax.numpy.result_type(x), jax.numpy.integer)


picked_experts_p.def_impl(lambda ids: ids)
picked_experts_p.def_abstract_eval(lambda ids: ids)
mlir.register_lowering(picked_experts_p, lambda ctx, ids: [ids])
batching.primitive_batchers[picked_experts_p] = lambda args, dims: (
  picked_experts_p.bind(*args),
  dims[0],
)
ad.primitive_jvps[picked_experts_p] = lambda primals, tangents: (
  picked_experts_p.bind(*primals),
  tangents[0],
)
