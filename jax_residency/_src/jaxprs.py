"""Evaluating a jaxpr equation by equation, as `jax.core.eval_jaxpr` does, with room to
do something else at chosen equations (docs/design.md, 2.4 and 4.1).

Two evaluators build on `Evaluation`: the dense stream's staged forward
(`stream/staged.py`, which runs each unit loop step by step and frees each value after
its last use) and the quantized products (`quant/fused.py`, which computes a decode
where a product reads it, inside the product's own program).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from jax.extend import core as jcore


class Evaluation:
  """The values of a jaxpr's variables while it is evaluated.

  Args:
    env: values already known, by variable.
  """

  def __init__(self, env: dict[Any, Any] | None = None) -> None:
    self.env: dict[Any, Any] = {} if env is None else env

  def read(self, v: Any) -> Any:
    """The value of ``v`` (a literal's own)."""
    return v.val if isinstance(v, jcore.Literal) else self.env[v]

  def write(self, variables: Iterable[Any], values: Iterable[Any]) -> None:
    """Sets each of ``variables`` to its value (nothing for a dropped one)."""
    for v, x in zip(variables, values, strict=True):
      if not isinstance(v, jcore.DropVar):
        self.env[v] = x

  def bind(self, eqn: Any) -> list[Any]:
    """Evaluates ``eqn`` on the values it reads, as eager JAX would; writes and returns
    its outputs."""
    with eqn.ctx.manager:
      outs = eqn.primitive.bind(
        *map(self.read, eqn.invars), **eqn.primitive.get_bind_params(eqn.params)
      )
    outs = list(outs) if eqn.primitive.multiple_results else [outs]
    self.write(eqn.outvars, outs)
    return outs


def last_uses(jaxpr: jcore.Jaxpr) -> dict[Any, int]:
  """For each variable, the index of the last equation that reads it; the jaxpr's
  outputs are left out (they are never freed)."""
  last: dict[Any, int] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jcore.Literal):
        last[v] = k
  for v in jaxpr.outvars:
    if not isinstance(v, jcore.Literal):
      last.pop(v, None)
  return last


def renamed(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
  """``jaxpr`` with variables of its own: a jitted function's jaxpr is one object for
  every call with the same shapes, and an evaluation that inlines it twice keys its
  values by variable."""
  new: dict[Any, Any] = {}

  def var(v: Any) -> Any:
    if isinstance(v, jcore.Literal):
      return v
    if v not in new:
      new[v] = jcore.Var(v.aval)
    return new[v]

  eqns = [
    e.replace(invars=[var(v) for v in e.invars], outvars=[var(v) for v in e.outvars])
    for e in jaxpr.eqns
  ]
  return jaxpr.replace(
    constvars=[var(v) for v in jaxpr.constvars],
    invars=[var(v) for v in jaxpr.invars],
    outvars=[var(v) for v in jaxpr.outvars],
    eqns=eqns,
  )
