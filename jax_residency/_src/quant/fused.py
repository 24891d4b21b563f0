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

* on one CPU device (``kernels``), a single row (one token) times one int8/int4
  tensor's decode is the native kernel's product of the row and the tensor's parts
  (`quant.native`, ``matvec.cc``: the codes read once, in 16-lane vector loops; with
  ``kernels="int8"``, the row rounded to 8-bit blocks and multiplied as integers), under
  ``lax.platform_dependent`` so that a program lowered for an accelerator gets the
  product below instead;
* otherwise, when the other operand is a single row, it is multiplied as a vector,
  and by each block of a kernel decoded in blocks of inputs
  (`encoding.Encoding.decode`) on its own, each a product XLA fuses with its block's
  decode; the products are summed in order;
* the result goes through a no-op rounding (`_fence`), so XLA cannot fuse the add
  after it (a bias, the sum of blocks) into the product instead of the decode;
* a one-token row is copied first (`_materialized`), so the ops that compute it stay
  out of the product's loop;
* a product of several rows (a prefill) decodes its matrix inside a conditional
  (`_rows_product`), so XLA decodes one matrix at a time, right before its product.

Decodes are traced where their value is first needed, not where the step computes
them, which is what lets a product take its decode inside its own program.

None of this changes a value beyond float32 rounding (the pieces' sums associate
differently). Only the step's own equations are followed, and the equations of
`encoding`'s jitted decode (a static tensor's): a decode that reaches a matmul
through any other nested ``jit`` is evaluated as it is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

from jax_residency._src.jaxprs import Evaluation, renamed
from jax_residency._src.quant import native
from jax_residency._src.quant.encoding import is_decode_call, rows_source

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
#: Most bytes of a decoded matrix that a product of several rows decodes at once: a
#: larger one is multiplied in slices of its outputs (`_rows_product`). Smaller slices
#: cost speed: at 32 MiB a 128-token prefill of a 2048/8192 layer took 0.19-0.20 s
#: against 0.15 s, to hold 38 MB of floats instead of 69 MB.
ROWS_CHUNK_BYTES = 64 << 20


def fenced(fn: Callable[..., Any], *args: Any, kernels: str | None = None) -> Any:
  """``fn(*args)``, with every matmul of a decoded operand evaluated as described in the
  module's docstring. ``args`` are pytrees; codes are their int8/uint8 leaves.
  ``kernels``: None, or the step runs on one device, where a CPU one may use the native
  one-row kernels, taking their products as this says (`native.ACTIVATIONS`;
  `kernels_for`)."""
  flat, tree = jax.tree.flatten(args)
  closed, out_shape = jax.make_jaxpr(
    lambda *xs: fn(*jax.tree.unflatten(tree, list(xs))), return_shape=True
  )(*flat)
  jaxpr = closed.jaxpr
  outs = evaluate_eqns(
    [*jaxpr.constvars, *jaxpr.invars],
    jaxpr.eqns,
    jaxpr.outvars,
    [*closed.consts, *flat],
    kernels=kernels,
  )
  return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def kernels_for(devices: Any, activations: str = "exact") -> str | None:
  """``activations`` (`native.ACTIVATIONS`) where a step on these devices may use the
  native kernels: one CPU device, and the kernels built here (`native.available`); else
  None."""
  devices = set(devices)
  usable = len(devices) == 1 and next(iter(devices)).platform == "cpu" and native.available()
  return activations if usable else None


def evaluate_eqns(
  invars: Sequence[Any],
  eqns: Sequence[Any],
  outvars: Sequence[Any],
  args: Sequence[Any],
  *,
  kernels: str | None = None,
) -> list[Any]:
  """Evaluates ``eqns`` (of one jaxpr, in order) on ``args`` for ``invars``, as `fenced`
  does: the int8/uint8 inputs are codes. A static tensor's decode (`encoding`'s jitted
  decode, `encoding.is_decode_call`) is followed inside, like a decode traced in place."""
  env: dict[Any, Any] = dict(zip(invars, args, strict=True))
  state = _State(env, {v for v in invars if np.dtype(v.aval.dtype) in CODE_DTYPES})
  state.kernels = kernels
  state.run(eqns)
  return [state.read(v) for v in outvars]


class _State(Evaluation):
  """An evaluation (`jaxprs.Evaluation`): values (``env``), the variables that hold
  decoded values, and the decodes not computed yet (``pending``). A decode is computed
  where its value is first read, so that a product computes its operand's decode inside
  its own program (`_rows_product`). ``blocks``: a concatenated decode's pieces
  (variables) and axis; ``alias``: an inlined decode's outputs, by the outer variable;
  ``sources``: an int8 or int4 tensor's decoded value (its variable) -> (scheme, whether
  it is a kernel, the variables of its parts); ``kernels``: None, or how one-row
  products use the native kernels (`native.ACTIVATIONS`)."""

  def __init__(self, env: dict[Any, Any], decoded: set[Any], parent: _State | None = None):
    super().__init__(env)
    self.decoded = decoded
    self.pending: dict[Any, Any] = {} if parent is None else parent.pending
    self.blocks: dict[Any, tuple[list[Any], int]] = {} if parent is None else parent.blocks
    self.alias: dict[Any, Any] = {} if parent is None else parent.alias
    self.sources: dict[Any, tuple[str, bool, list[Any]]] = {} if parent is None else parent.sources
    self.kernels: str | None = None if parent is None else parent.kernels

  def fork(self) -> _State:
    """A state whose decodes are computed apart (inside a branch being traced)."""
    return _State(dict(self.env), self.decoded, self)

  def read(self, v: Any) -> Any:
    if isinstance(v, jcore.Literal):
      return v.val
    v = self._resolve(v)
    if v not in self.env:
      self.bind(self.pending[v])
    return self.env[v]

  def run(self, eqns: Sequence[Any]) -> None:
    for eqn in eqns:
      ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
      from_codes = any(self._resolve(v) in self.decoded for v in ins)
      name = eqn.primitive.name
      if from_codes and name == "dot_general":
        self.env[eqn.outvars[0]] = _product(eqn, self)
      elif from_codes and is_decode_call(eqn):
        self._inline(eqn)
      elif from_codes and (found := rows_source(eqn)) is not None:
        self._inline(eqn)
        scheme, kernel = found
        self.sources[self._resolve(eqn.outvars[0])] = (scheme, kernel, list(eqn.invars))
      elif from_codes and name in DECODE_PRIMITIVES:
        self.decoded.update(eqn.outvars)
        self.pending.update(dict.fromkeys(eqn.outvars, eqn))
        if name == "concatenate" and all(self._resolve(v) in self.decoded for v in ins):
          self.blocks[eqn.outvars[0]] = (list(eqn.invars), int(eqn.params["dimension"]))
        if name == "transpose" and len(eqn.params["permutation"]) == 2:
          # A matrix transposed (a tied head's ``embedding.T``) is contracted on its other
          # axis: the same rows, the same kernel.
          if (source := self.sources.get(self._resolve(eqn.invars[0]))) is not None:
            self.sources[eqn.outvars[0]] = (source[0], not source[1], source[2])
      else:
        self.bind(eqn)

  def _resolve(self, v: Any) -> Any:
    while v in self.alias:
      v = self.alias[v]
    return v

  def _inline(self, eqn: Any) -> None:
    """A nested decode, followed equation by equation in this state."""
    closed = eqn.params["jaxpr"]
    inner = renamed(closed.jaxpr)
    self.env.update(zip(inner.constvars, closed.consts, strict=True))
    for outer, v in zip(eqn.invars, inner.invars, strict=True):
      self.alias[v] = outer
      if self._resolve(outer) in self.decoded:
        self.decoded.add(v)
    self.run(inner.eqns)
    for w, outer in zip(inner.outvars, eqn.outvars, strict=True):
      self.alias[outer] = w
      if self._resolve(w) in self.decoded:
        self.decoded.add(outer)
      if self._resolve(w) in self.blocks:
        self.blocks[outer] = self.blocks[self._resolve(w)]


def _product(eqn: Any, state: _State) -> Any:
  """One ``dot_general`` with a decoded operand: fenced, and for one row, one product
  per decoded block (`encoding.Encoding.decode`)."""
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  lhs_var, rhs_var = eqn.invars
  lhs_coded = state._resolve(lhs_var) in state.decoded
  rhs_coded = state._resolve(rhs_var) in state.decoded
  params = eqn.primitive.get_bind_params(eqn.params)
  with eqn.ctx.manager:
    if lhs_coded == rhs_coded:
      return _fence(eqn.primitive.bind(state.read(lhs_var), state.read(rhs_var), **params))
    vector_var, vc, matrix_var, mc = (
      (rhs_var, rc, lhs_var, lc) if lhs_coded else (lhs_var, lc, rhs_var, rc)
    )
    vector = state.read(vector_var)
    rows = int(np.prod([n for d, n in enumerate(vector.shape) if d not in vc], dtype=np.int64))
    if len(vc) != 1 or lb or rb:
      return _rows_product(eqn, state, vector, 0 if lhs_coded else 1)
    if rows != 1:
      return _few_rows_product(eqn, state, vector, vc[0], matrix_var, mc[0], lhs_coded, rows)
    matrix_var = state._resolve(matrix_var)
    # The row as a vector (XLA fuses a decode only into a product with a rank-1 result),
    # computed before the product (`_materialized`).
    flat = _materialized(vector.reshape(-1))
    out_shape = eqn.outvars[0].aval.shape
    native_call = _native_product(state, matrix_var, mc[0], flat, eqn.outvars[0].aval)
    if native_call is None:
      return _vector_product(state, matrix_var, mc[0], flat, out_shape, params)
    # The native kernel on CPU; elsewhere (a program lowered for an accelerator) XLA's.
    inner = state.fork()
    return lax.platform_dependent(
      cpu=lambda: native_call().reshape(out_shape),
      default=lambda: _vector_product(inner, matrix_var, mc[0], flat, out_shape, params),
    )


def _few_rows_product(
  eqn: Any,
  state: _State,
  vector: Any,
  axis: int,
  matrix_var: Any,
  matrix_axis: int,
  lhs_coded: bool,
  rows: int,
) -> Any:
  """Up to `native.MAX_ROWS` rows (a speculative round, a tree's depth, a short prompt)
  under ``activations="int8"``: the native kernel, each row rounded and multiplied as a
  one-token step's, the codes read once for all of them (8 rows of SmolLM2's int4 draft:
  31 ms a call, against 10 ms for one and 300 ms to decode the matrices). Exact
  products of several rows, more rows, or where no kernel applies: `_rows_product` (an
  exact kernel's rows cost each a one-row call, more than the decode from 4 rows on)."""
  matrix_at = 0 if lhs_coded else 1
  if rows > native.MAX_ROWS or state.kernels != "int8":
    return _rows_product(eqn, state, vector, matrix_at)
  resolved = state._resolve(matrix_var)
  width = vector.shape[axis]
  block = _materialized(jnp.moveaxis(vector, axis, -1).reshape(rows, width))
  out_aval = eqn.outvars[0].aval
  native_call = _native_product(state, resolved, matrix_axis, block, out_aval)
  if native_call is None:
    return _rows_product(eqn, state, vector, matrix_at)

  def on_cpu() -> Any:
    out = native_call()  # (rows, outputs)
    if lhs_coded:  # the matrix's outputs come first in dot_general's result
      out = out.T
    return out.reshape(out_aval.shape)

  inner = state.fork()
  return lax.platform_dependent(
    cpu=on_cpu, default=lambda: _rows_product(eqn, inner, vector, matrix_at)
  )


def _native_product(
  state: _State, matrix_var: Any, axis: int, flat: Any, out_aval: Any
) -> Callable[[], Any] | None:
  """The native kernel's product of ``flat`` by the decoded matrix ``matrix_var``
  (contracted on ``axis``), as a function to call; None where no kernel applies: the
  kernels are off for this step, the matrix is not one int8/int4 tensor's decode, it is
  contracted on another axis than its input axis, or its shapes or dtypes differ from
  what the kernels take (`native.supports`)."""
  source = state.sources.get(matrix_var)
  if state.kernels is None or source is None or out_aval.dtype != jnp.float32:
    return None
  scheme, kernel, part_vars = source
  if len(matrix_var.aval.shape) != 2 or axis != (0 if kernel else 1):
    return None
  parts = [state.read(v) for v in part_vars]
  if not native.supports(scheme, parts, flat):
    return None
  activations = state.kernels
  return lambda: native.matvec(scheme, flat, parts, activations)


def _vector_product(
  state: _State, matrix_var: Any, axis: int, flat: Any, out_shape: Any, params: dict[str, Any]
) -> Any:
  """``flat`` times the decoded matrix (contracted on ``axis``) by XLA: one product per
  decoded block, each fused with its block's decode, summed in order."""
  piece_vars, blocks_axis = state.blocks.get(matrix_var, ([matrix_var], axis))
  if blocks_axis != axis:
    piece_vars = [matrix_var]
  pieces = [state.read(v) for v in piece_vars]
  total, start = None, 0
  for block in pieces:
    stop = start + block.shape[axis]
    piece = lax.dot_general(
      flat[start:stop], block, (((0,), (axis,)), ((), ())), precision=params.get("precision")
    )
    piece = _fence(piece.reshape(out_shape))
    total = piece if total is None else total + piece
    start = stop
  return total


def _rows_product(eqn: Any, state: _State, activations: Any, matrix_at: int) -> Any:
  """A product of several rows (a prefill) by a decoded matrix: the float matrix, then
  XLA's matmul. The decode is computed inside a conditional whose predicate XLA cannot
  know (false only for a NaN, and then the other branch computes the same), so each
  matrix is decoded right before its product and its float copy freed after it: a
  step holds one decoded matrix at a time, not its whole unit (XLA would otherwise
  schedule every decode, which depends only on the codes, first). A matrix of more
  than `ROWS_CHUNK_BYTES` as floats (an output head: 2 GiB for a vocabulary of 128K
  by 4096) is decoded and multiplied in slices of its outputs, one conditional each.
  ``matrix_at``: which operand is decoded (0 or 1)."""
  params = eqn.primitive.get_bind_params(eqn.params)
  first = activations.reshape(-1)[0]
  (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
  aval = eqn.invars[matrix_at].aval
  contracted, batch = (lc, lb) if matrix_at == 0 else (rc, rb)
  free = [d for d in range(len(aval.shape)) if d not in contracted and d not in batch]
  nbytes = int(np.prod(aval.shape, dtype=np.int64)) * np.dtype(aval.dtype).itemsize
  if len(free) != 1 or nbytes <= ROWS_CHUNK_BYTES:

    def whole(_: Any) -> Any:
      return _decoded_product(eqn, state, params)

    return lax.cond(first == first, whole, whole, None)
  axis, n = free[0], aval.shape[free[0]]
  # Where the matrix's free axis lands in the product: after the batch axes and, for
  # the right-hand operand, after the left-hand one's free axes.
  other = eqn.invars[1 - matrix_at].aval
  other_free = len(other.shape) - len(lc if matrix_at == 1 else rc) - len(batch)
  out_axis = len(batch) + (other_free if matrix_at == 1 else 0)
  step = max(1, n * ROWS_CHUNK_BYTES // nbytes)
  pieces = []
  for start in range(0, n, step):
    stop = min(n, start + step)

    def piece(_: Any, start: int = start, stop: int = stop) -> Any:
      return _decoded_product(eqn, state, params, (matrix_at, axis, start, stop))

    pieces.append(lax.cond(first == first, piece, piece, None))
  return jnp.concatenate(pieces, axis=out_axis)


def _decoded_product(
  eqn: Any, state: _State, params: dict[str, Any], part: tuple[int, int, int, int] | None = None
) -> Any:
  """The product, its decode traced here (in a fork of ``state``); with ``part``
  (operand, axis, start, stop), of that slice of the decoded operand only (XLA fuses
  the slice into the decode: nothing outside it is decoded)."""
  inner = state.fork()
  operands = [inner.read(eqn.invars[0]), inner.read(eqn.invars[1])]
  if part is not None:
    at, axis, start, stop = part
    operands[at] = lax.slice_in_dim(operands[at], start, stop, axis=axis)
  return _fence(eqn.primitive.bind(*operands, **params))


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
