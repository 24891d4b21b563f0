"""A dense stream's quantized static tensors, decoded inside the operation that uses them.

A staged forward (`staged`) binds the equations outside its unit loops one at a time.
A quantized static tensor (an embedding table, an output head) appears there as a
call of `quant.encoding`'s jitted decode on static leaves, and then as the input of
the operation that uses it: a lookup, a matmul, perhaps after a transpose. Bound one
by one, the decode writes the whole float tensor on every pass, and the matmul reads
it back: four times the bytes of an int8 head, and a float copy of each table.

Instead, each equation that uses a decoded static tensor runs as one small compiled
program with the decode (and the reshapes or transposes between them): a *region*.
Its matmuls are evaluated as `quant.fused` evaluates a unit's step, so a one-token
step reads the head's codes once, and XLA fuses a table's decode into the lookup,
which decodes only the rows it gathers. Nothing decoded outlives the region.

A decoded static tensor that something other than such an equation needs (a unit
loop that takes it as a constant, the forward's output) is decoded where the
forward computes it, on every pass, as a plain model would.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore

from jax_residency._src.quant.encoding import is_decode_call
from jax_residency._src.quant.fused import DECODE_PRIMITIVES, evaluate_eqns


@dataclasses.dataclass
class Region:
  """One equation that uses decoded static tensors, with the decodes it needs.

  Attributes:
    inputs: the variables it reads: static leaves and the equation's other inputs.
    eqns: the decodes and the equations between them and the user, then the user.
    run: the compiled region, built on its first call.
  """

  inputs: list[Any]
  eqns: list[Any]
  kernels: str | None = None
  run: Callable[..., Any] | None = None

  def __call__(self, values: Sequence[Any]) -> list[Any]:
    if self.run is None:
      inputs, eqns, outvars = self.inputs, self.eqns, self.eqns[-1].outvars
      kernels = self.kernels
      self.run = jax.jit(lambda *xs: evaluate_eqns(inputs, eqns, outvars, xs, kernels=kernels))
    return list(self.run(*values))


@dataclasses.dataclass(frozen=True)
class StaticDecodes:
  """Where a staged forward's quantized static tensors are decoded.

  Attributes:
    deferred: indices of equations that only feed regions (never bound on their own).
    regions: by the index of the equation that uses decoded static tensors.
  """

  deferred: frozenset[int]
  regions: dict[int, Region]


def plan_static_decodes(
  jaxpr: jcore.Jaxpr,
  static_vars: Sequence[Any],
  is_loop: Callable[[Any], bool],
  *,
  kernels: Callable[[], str | None] = lambda: None,
) -> StaticDecodes:
  """Finds the regions of ``jaxpr`` (``static_vars``: its static leaf inputs;
  ``is_loop(eqn)``: whether an equation is a unit loop, which runs no region;
  ``kernels()``: None, or how its regions use the native one-row kernels (`quant.fused`;
  asked only where there is a region))."""
  static = set(static_vars)
  made_by: dict[Any, int] = {}  # a decoded static variable -> the equation that makes it
  for k, eqn in enumerate(jaxpr.eqns):
    ins = [v for v in eqn.invars if not isinstance(v, jcore.Literal)]
    if not ins or not all(v in static or v in made_by for v in ins):
      continue
    follows = eqn.primitive.name in DECODE_PRIMITIVES and any(v in made_by for v in ins)
    if is_decode_call(eqn) or follows:
      made_by.update(dict.fromkeys(eqn.outvars, k))
  decodes = set(made_by.values())
  regions: dict[int, Region] = {}
  kept: set[int] = set()  # decodes something else needs: bound where they are
  for k, eqn in enumerate(jaxpr.eqns):
    uses = [v for v in eqn.invars if not isinstance(v, jcore.Literal) and v in made_by]
    if not uses or k in decodes:
      continue
    needed = _producers(jaxpr, uses, made_by)
    if is_loop(eqn):
      kept.update(needed)
      continue
    inputs = _inputs(jaxpr, [*needed, k])
    regions[k] = Region(inputs, [jaxpr.eqns[j] for j in (*sorted(needed), k)], kernels())
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal) and v in made_by:
      kept.update(_producers(jaxpr, [v], made_by))
  return StaticDecodes(frozenset(decodes - kept), regions)


def _producers(jaxpr: jcore.Jaxpr, vs: Sequence[Any], made_by: dict[Any, int]) -> set[int]:
  """The decode equations that ``vs`` are computed by, directly or through others."""
  found: set[int] = set()
  todo = [made_by[v] for v in vs]
  while todo:
    k = todo.pop()
    if k not in found:
      found.add(k)
      todo.extend(
        made_by[v]
        for v in jaxpr.eqns[k].invars
        if not isinstance(v, jcore.Literal) and v in made_by
      )
  return found


def _inputs(jaxpr: jcore.Jaxpr, ks: Sequence[int]) -> list[Any]:
  """What equations ``ks`` read that none of them computes, in first-read order."""
  inside = {v for k in ks for v in jaxpr.eqns[k].outvars}
  out: dict[Any, None] = {}
  for k in sorted(ks):
    for v in jaxpr.eqns[k].invars:
      if not isinstance(v, jcore.Literal) and v not in inside:
        out[v] = None
  return list(out)
