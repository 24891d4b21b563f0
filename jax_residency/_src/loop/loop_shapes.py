"""The shapes a placed layer loop takes, as `unit_loop.LoopContext.run` picks them for a
policy: the ``LayerwiseHost`` scan that moves each unit from ``pinned_host`` memory to
the device (pipelined to a depth), a stack's device-resident first units then the moved
rest, a part of the loop one unit long, and the loop over units given as arrays of their
own (`each_unit`, ``FullyResident`` and ``LayerwiseHost`` on a CPU backend).

Each keeps the plain model's scan body as XLA compiles it (docs/design.md, section 3), so
a placed pass gives the jitted plain model's bits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import jaxpr_as_fun

from jax_residency._src.errors import PlacementError

#: One layer's step: ``(carry, unit, x) -> (carry, y)``.
Step = Callable[[Any, Any, Any], tuple[Any, Any]]


def leading_dim(tree: Any) -> int:
  leaves = jax.tree.leaves(tree)
  if not leaves:
    raise PlacementError("the unit stack has no parameters; nothing to loop over")
  return int(leaves[0].shape[0])


def fetch(units: Any, i: Any, shardings: tuple[jax.sharding.Sharding, ...]) -> Any:
  """Moves unit ``i`` of the host-resident stack to device memory."""
  leaves, treedef = jax.tree.flatten(units)
  if len(leaves) != len(shardings):
    raise PlacementError(
      f"the unit stack has {len(leaves)} parameters but was placed with {len(shardings)}; "
      "the model's layer module changed after place() — place it again"
    )
  moved = [
    jax.device_put(lax.dynamic_index_in_dim(a, i, 0, keepdims=False), s)
    for a, s in zip(leaves, shardings, strict=True)
  ]
  return jax.tree.unflatten(treedef, moved)


def resident_then_moved(
  step: Step,
  moved: Callable[[Any, Any, Any], tuple[Any, Any]],
  carry: Any,
  kept: Any,
  units: Any,
  xs: Any,
  *,
  reverse: bool,
  one: Any,
) -> tuple[Any, Any]:
  """The loop of a stack whose first units (``kept``) are in device memory: a plain scan
  over those, and ``moved`` (the pipelined host scan) over the rest (``units``), in the
  loop's order; ``xs`` and the outputs are split and joined along the unit axis."""
  d = leading_dim(kept)
  rest = leading_dim(units)
  xs_kept, xs_rest = jax.tree.map(lambda a: a[:d], xs), jax.tree.map(lambda a: a[d:], xs)

  def resident(c: Any, x: Any) -> tuple[Any, Any]:
    if d == 1 and one is not None:
      return one_trip(lambda c, ux: step(c, *ux), c, (kept, x), one)
    return lax.scan(lambda c, ux: step(c, *ux), c, (kept, x), reverse=reverse)

  if rest == 0:
    return resident(carry, xs_kept)
  if reverse:
    carry, ys_rest = moved(carry, units, xs_rest)
    carry, ys_kept = resident(carry, xs_kept)
  else:
    carry, ys_kept = resident(carry, xs_kept)
    carry, ys_rest = moved(carry, units, xs_rest)
  return carry, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), ys_kept, ys_rest)


def one_trip(f: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any, one: Any) -> Any:
  """``lax.scan(f, carry, xs)`` over one element, as a loop whose trip count (``one``, a
  program argument) XLA cannot see: a loop known to run once is inlined and fused with
  what surrounds it, which rounds differently from the plain model's scanned layer; a
  loop body is compiled as the plain scan's is (as the dense stream's steps,
  stream/staged.py)."""
  first = jax.tree.map(lambda a: a[0], xs)
  y_shape = jax.eval_shape(lambda c, x: f(c, x)[1], carry, first)
  ys = jax.tree.map(lambda s: jnp.zeros((1, *s.shape), s.dtype), y_shape)
  return _trip_at(f, carry, xs, ys, 0, one)


def _trip_at(
  f: Callable[[Any, Any], tuple[Any, Any]], carry: Any, xs: Any, ys: Any, at: int, one: Any
) -> tuple[Any, Any]:
  """One trip of a ``while_loop`` whose trip count (``one``) XLA cannot see, run as a
  scan's body runs at index ``at``: ``f(carry, xs[at])``, its output written into ``ys``
  at ``at``. Returns the carry and ``ys``."""

  def body(state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    t, c, out = state
    i = t + at
    x = jax.tree.map(lambda a: lax.dynamic_index_in_dim(a, i, keepdims=False), xs)
    c, y = f(c, x)
    out = jax.tree.map(lambda b, v: lax.dynamic_update_index_in_dim(b, v, i, 0), out, y)
    return t + 1, c, out

  _, carry, ys = lax.while_loop(lambda s: s[0] < one, body, (jnp.int32(0), carry, ys))
  return carry, ys


def each_unit(
  step: Step,
  carry: Any,
  units: Any,
  apart: Sequence[Sequence[Any]],
  xs: Any,
  *,
  reverse: bool,
  one: Any,
) -> tuple[Any, Any]:
  """``lax.scan(step, carry, (units, xs))`` with unit ``j``'s parameters taken from
  ``apart[j]`` (arrays of their own) rather than indexed out of the stacked ``units``,
  whose tree structure they share: one program, no copy of a unit's rows.

  The step is traced once (a jaxpr, as a scan traces its body) and applied to each unit.
  Each unit's step is a ``while_loop`` whose trip count (``one``, a program argument) XLA
  cannot see, over loop state holding the carry and the stacked outputs, with ``xs``
  indexed and the outputs written at the unit's position as a scan's body does: the
  layer is compiled as the plain model's scan body is (a step XLA knew ran once would be
  inlined and fused with its neighbours, which rounds differently). A quantized unit's
  step too: its decodes stay inside its products, as in the scan body (inlined, XLA
  fuses across units and keeps far larger temporaries).
  """
  treedef = jax.tree.structure(units)
  per_unit = [jax.tree.unflatten(treedef, list(leaves)) for leaves in apart]
  n = len(per_unit)
  order = range(n - 1, -1, -1) if reverse else range(n)
  closed, out_shape = jax.make_jaxpr(step, return_shape=True)(
    carry, per_unit[0], jax.tree.map(lambda a: a[0], xs)
  )
  as_fun, out_tree = jaxpr_as_fun(closed), jax.tree.structure(out_shape)

  def traced(c: Any, u: Any, x: Any) -> tuple[Any, Any]:
    return jax.tree.unflatten(out_tree, as_fun(*jax.tree.leaves((c, u, x))))

  ys = jax.tree.map(lambda s: jnp.zeros((n, *s.shape), s.dtype), out_shape[1])
  for j in order:
    unit_step = lambda c, x, u=per_unit[j]: traced(c, u, x)  # noqa: E731
    carry, ys = _trip_at(unit_step, carry, xs, ys, j, one)
  return carry, ys


def pipelined_host_scan(
  step: Step,
  carry: Any,
  units: Any,
  xs: Any,
  *,
  depth: int,
  shardings: tuple[jax.sharding.Sharding, ...],
  length: int,
  reverse: bool = False,
) -> tuple[Any, Any]:
  k = max(1, min(depth, length))
  if k == 1:

    def body1(c: Any, ix: tuple[Any, Any]) -> tuple[Any, Any]:
      i, x = ix
      return step(c, fetch(units, i, shardings), x)

    return lax.scan(body1, carry, (jnp.arange(length), xs), reverse=reverse)

  # Prologue: units 0 .. k-2 start moving before the loop. Every step then
  # computes the oldest carried unit while the move of unit i + k - 1 is issued.
  # All `length` steps run in the one loop (the last k-1 re-issue the final
  # unit's index rather than leaving the loop), so each layer's math is compiled
  # exactly as in the plain model's scan.
  # A reversed loop runs the same pipeline from the last unit down.
  order = range(length - 1, -1, -1) if reverse else range(length)
  window = tuple(fetch(units, j, shardings) for j in order[: k - 1])

  def ahead(i: Any) -> Any:
    return jnp.maximum(i - (k - 1), 0) if reverse else jnp.minimum(i + (k - 1), length - 1)

  def body(state: tuple[Any, tuple[Any, ...]], ix: tuple[Any, Any]) -> tuple[Any, Any]:
    c, buf = state
    i, x = ix
    incoming = fetch(units, ahead(i), shardings)
    c, y = step(c, buf[0], x)
    return (c, buf[1:] + (incoming,)), y

  (carry, _), ys = lax.scan(body, (carry, window), (jnp.arange(length), xs), reverse=reverse)
  return carry, ys
