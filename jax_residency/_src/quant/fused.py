"""A step that uses quantized weights, evaluated so that each decode stays inside the
matmul that consumes it (docs/quantization.md, "Reading codes once").

A unit's codes (int8, or uint8 for int4 and GGML blocks) enter its step as arguments;
the step decodes them (elementwise ops, a broadcast of the scales, a transpose back to
the model's ``(in, out)``) and the layer multiplies by the result. For a one-token
step on CPU, XLA can compute such a product as one loop over the codes, reading them
once (the transpose becomes the loop's indexing), but only when the product is not
first fused with the bias add after it, and the activation vector is under 16 KiB
(XLA's limit for fusing into a matrix-vector product). Otherwise it
writes the whole float matrix and reads it back, moving more bytes than a float
store would.

`fenced` traces a step to a jaxpr and evaluates it equation by equation, as
``jax.core.jaxpr_as_fun`` does, except for each ``dot_general`` with an operand
decoded from codes:

* when the other operand is a single row (one token), it is multiplied as a vector,
  and by each block of a kernel decoded in blocks of inputs
  (`encoding.Encoding.decode`) on its own, each a product XLA fuses with its block's
  decode; the products are summed in order;
* the result goes through a no-op rounding (`_fence`), so XLA cannot fuse the add
  after it (a bias, the sum of blocks) into the product instead of the decode;
* a one-token row is copied first (`_materialized`), so the ops that compute it stay
  out of the product's loop.

None of this changes a value beyond float32 rounding (the pieces' sums associate
differently). Only the step's own equations are followed: a decode that reaches a
matmul through a nested ``jit`` is evaluated as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jax_residency._src.quant.encoding import DECODE_JIT_NAME

#: Primitives a decode is made of: what carries "decoded from codes" to its outputs.
DECODE_PRIMITIVES = frozenset(
  {
    "convert_element_type",
    "bitcast_convert_type",
    "mul",
    "add",
    "sub",
    "and",
    "or",
    "shift_left",
    "shift_right_logical",
    "shift_right_arithmetic",
    "select_n",
    "concatenate",
    "slice",
    "reshape",
    "broadcast_in_dim",
    "transpose",
    "squeeze",
    "expand_dims",
    "copy",
  }
)
#: Dtypes of stored codes.
CODE_DTYPES = (np.dtype(np.int8), np.dtype(np.uint8))


def fenced(fn: Callable[..., Any], *args: Any) -> Any:
  """``fn(*args)``, with every matmul of a decoded operand evaluated as described in the
  module's docstring. ``args`` are pytrees; codes are their int8/uint8 leaves."""
  flat, tree = jax.tree.flatten(args)
  closed, out_shape = jax.make_jaxpr(
    lambda *xs: fn(*jax.tree.unflatten(tree, list(xs))), return_shape=True
  )(*flat)
  outs = _evaluate(closed, flat)
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _evaluate(closed: jcore.ClosedJaxpr, args: Sequence[Any]) -> list[Any]:
  jaxpr = closed.jaxpr
  return evaluate_eqns(
    [*jaxpr.constvars, *jaxpr.invars], jaxpr.eqns, jaxpr.outvars, [*closed.consts, *args]
  )


def evaluate_eqns(
  invars: Sequence[Any], eqns: Sequence[Any], outvars: Sequence[Any], args: Sequence[Any]
) -> list[Any]:
  """Evaluates ``eqns`` (of one jaxpr, in order) on ``args`` for ``invars``, as `fenced`
  does: the int8/uint8 inputs are codes. A static tensor's decode (`encoding`'s jitted
  decode, `DECODE_JIT_NAME`) is followed inside, like a decode traced in place."""
  env: dict[Any, Any] = dict(zip(invars, args, strict=True))
  state = _State(env, {v for v in invars if np.dtype(v.aval.dtype) in CODE_DTYPES}, {})
  state.run(eqns)
  return [state.read(v) for v in outvars]


class _State:
  """Values, which variables hold decoded values, and a concatenated decode's blocks
  (their values and the axis they were joined along)."""

  def __init__(self, env: dict[Any, Any], decoded: set[Any], blocks: dict[Any, Any]) -> None:
    self.env, self.decoded, self.blocks = env, decoded, blocks

  def read(self, v: Any) -> Any:
    return v.val if isinstance(v, jcore.Literal) else self.env[v]

  def run(self, eqns: Sequence[Any]) -> None:
    for eqn in eqns:
      ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
      from_codes = any(v in self.decoded for v in ins)
      name = eqn.primitive.name
      if from_codes and name == "dot_general":
        outs = [_product(eqn, self)]
      elif from_codes and name in ("pjit", "jit") and eqn.params.get("name") == DECODE_JIT_NAME:
        outs = self._inline(eqn)
      else:
        with eqn.ctx.manager:
          outs = eqn.primitive.bind(
            *map(self.read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params)
          )
        if not eqn.primitive.multiple_results:
          outs = [outs]
        if from_codes and name in DECODE_PRIMITIVES:
          self.decoded.update(eqn.outvars)
          if name == "concatenate" and all(v in self.decoded for v in ins):
            pieces = [self.read(v) for v in eqn.invars]
            self.blocks[eqn.outvars[0]] = (pieces, int(eqn.params["dimension"]))
      for v, value in zip(eqn.outvars, outs, strict=True):
        self.env[v] = value

  def _inline(self, eqn: Any) -> list[Any]:
    """A nested decode, evaluated equation by equation in this state."""
    closed = eqn.params["jaxpr"]
    inner = closed.jaxpr
    self.env.update(zip(inner.constvars, closed.consts, strict=True))
    for outer, v in zip(eqn.invars, inner.invars, strict=True):
      self.env[v] = self.read(outer)
      if outer in self.decoded:
        self.decoded.add(v)
    self.run(inner.eqns)
    for v, outer in zip(inner.outvars, eqn.outvars, strict=True):
      if v in self.decoded:
        self.decoded.add(outer)
      if v in self.blocks:
        self.blocks[outer] = self.blocks[v]
    return [self.read(v) for v in inner.outvars]


def _product(eqn: Any, state: _State) -> Any:
  """One ``dot_general`` with a decoded operand: fenced, and for one row, one product
  per decoded block (`encoding.Encoding.decode`)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_var, rhs_var = eqn.invars
  lhs, rhs = state.read(lhs_var), state.read(rhs_var)
  lhs_coded, rhs_coded = lhs_var in state.decoded, rhs_var in state.decoded
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    if lhs_coded == rhs_coded:
      return _fence(eqn.primitive.bind(lhs, rhs, **params))
    vector, vc, matrix_var, mc = (rhs, rc, lhs_var, lc) if lhs_coded else (lhs, lc, rhs_var, rc)
    rows = int(np.prod([n for d, n in enumerate(vector.shape) if d not in vc], dtype=np.int64))
    if rows != 1 or len(vc) != 1 or lb or rb:
      return _fence(eqn.primitive.bind(lhs, rhs, **params))
    matrix = state.read(matrix_var)
    pieces, axis = state.blocks.get(matrix_var, ([matrix], mc[0]))
    if axis != mc[0]:
      pieces = [matrix]
    # The row as a vector (XLA fuses a decode only into a product with a rank-1 result),
    # computed before the product (`_materialized`).
    flat = _materialized(vector.reshape(-1))
    out_shape = eqn.outvars[0].aval.shape
    total, start = None, 0
    for block in pieces:
      stop = start + block.shape[mc[0]]
      piece = lax.dot_general(
        flat[start:stop], block, (((0,), (mc[0],)), ((), ())), precision=params.get("precision")
      )
      piece = _fence(piece.reshape(out_shape))
      total = piece if total is None else total + piece
      start = stop
    return total


def _materialized(v: Any) -> Any:
  """``v`` (a vector), copied by a gather of its own positions: an exact copy that XLA
  keeps out of the product it feeds. Otherwise the ops that compute the activation row
  (a norm, a bias, an activation function) are fused into the product's loop and
  recomputed for every output, and a row reshaped from a wider layout is read element
  by element: each costs more than the codes' decode (docs/quantization.md, "Reading
  codes once"). A gather is an op XLA does not duplicate into a consumer that reads
  each element many times; an optimization barrier is removed before fusion on CPU."""
  return v[jnp.arange(v.shape[0])]


def _fence(x: Any) -> Any:
  """``x``, through an op XLA cannot fold into the matmul that made it: rounding to its
  own precision (exact, a no-op on the values). An add that follows a matmul directly
  (a bias, or the sum of a kernel's blocks) is otherwise fused into it as an "output
  fusion", which leaves the decode outside; an optimization barrier does not stop that
  on CPU."""
  if not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  info = jnp.finfo(x.dtype)
  return lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
