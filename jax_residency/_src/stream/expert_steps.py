"""A unit step that runs its router first (docs/design.md, 4.9).

With expert residency, a unit loop whose body marks its experts' ids with
`picked_experts` is run in two programs per step, both cut from the body's jaxpr:

* the **probe**: the body cut down to the marked ids (attention, norms, router), which
  must not read an expert's weights; it runs on the step's ordinary tensors;
* the **step**: the body with the marked ids as an input instead, fed the probe's ids,
  so the experts it uses are exactly those the host read for it.

`ExpertHooks` is what the loop asks of the engine in between.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import jax
from jax.extend import core as jcore
from jax.interpreters import partial_eval as pe

from jax_residency._src.errors import PlacementError
from jax_residency._src.loop.picked import picked_experts_p


class ExpertHooks(Protocol):
  """The engine's side of a step with expert residency."""

  def expert_leaves(self, unit: int) -> frozenset[int]:
    """Positions, among its stack's leaves, of unit ``unit``'s expert tensors."""
    ...

  def experts(self, unit: int, ids: jax.Array) -> Mapping[int, jax.Array]:
    """The expert tensors of ``unit`` (by leaf position) holding the experts ``ids``
    names (the others' rows zero), read and moved as needed."""
    ...

  def ordinary(self, unit: int) -> Sequence[jax.Array | None] | None:
    """Unit ``unit``'s ordinary tensors if they are on the device now (else None);
    counts no use."""
    ...

  def predict(self, unit: int, ids: jax.Array) -> None:
    """Starts reading the experts ``ids`` predicts unit ``unit`` will pick."""
    ...

  def check_top_k(self, unit: int, top_k: int) -> None:
    """Raises if the expert caches cannot run a layer whose tokens pick ``top_k``."""
    ...


@dataclasses.dataclass
class ExpertStep:
  """The two programs of an expert-resident step (see the module doc).

  Attributes:
    probe: ``(consts, carry, units, others, i) -> ids``; ``units`` may hold None
      where the expert tensors go.
    body: the body jaxpr, taking the ids as its last input.
    top_k: the ids' last axis (the experts each token picks).
  """

  probe: Callable[..., jax.Array]
  body: jcore.ClosedJaxpr
  top_k: int


def marker_index(body: jcore.Jaxpr) -> int | None:
  """The index of the body's one `picked_experts` equation, or None without one."""
  found = [k for k, e in enumerate(body.eqns) if e.primitive is picked_experts_p]
  if len(found) > 1:
    raise PlacementError(
      f"a layer marks {len(found)} sets of expert ids with picked_experts; expert residency "
      "runs one mixture of experts per layer. Place the model without experts= "
      "(its experts then move with their layer)."
    )
  if not found and _nested_marker(body):
    raise PlacementError(
      "the layer marks its expert ids with picked_experts inside a transform of its own "
      "(a jit, remat, scan or cond inside the layer); expert residency needs the mark at "
      "the layer's top level: call the router outside that transform."
    )
  return found[0] if found else None


def _nested_marker(jaxpr: jcore.Jaxpr) -> bool:
  for eqn in jaxpr.eqns:
    for sub in jcore.jaxprs_in_params(eqn.params):
      if any(e.primitive is picked_experts_p for e in sub.eqns) or _nested_marker(sub):
        return True
  return False


def expert_step(
  closed: jcore.ClosedJaxpr,
  num_consts: int,
  num_carry: int,
  unit_xs: frozenset[int],
  expert_xs: frozenset[int],
  index: int,
  slice_xs: Callable[[list[Any], list[Any], Any], list[Any]],
) -> ExpertStep:
  """Cuts a unit loop's body at its marker (equation ``index``).

  ``expert_xs`` are the scanned inputs that are expert tensors; ``slice_xs(units,
  others, i)`` builds the body's scanned inputs as the step does.
  """
  jaxpr = closed.jaxpr
  marker = jaxpr.eqns[index]
  ids_in, ids_out = marker.invars[0], marker.outvars[0]
  cut, used = pe.dce_jaxpr(jaxpr.replace(outvars=[ids_in]), [True])
  first_x = num_consts + num_carry
  if any(used[first_x + j] for j in expert_xs):
    raise PlacementError(
      "the ids the layer marks with picked_experts depend on its experts' weights; "
      "expert residency reads only the experts the router picks, so the router must "
      "not read any expert's weights. Mark the router's top-k ids."
    )
  probe_fun = jcore.jaxpr_as_fun(jcore.ClosedJaxpr(cut, closed.consts))

  def probe(consts: list[Any], carry: list[Any], units: list[Any], others: list[Any], i: Any):
    ins = [*consts, *carry, *slice_xs(units, others, i)]
    return probe_fun(*[x for x, u in zip(ins, used, strict=True) if u])[0]

  body = jaxpr.replace(
    invars=[*jaxpr.invars, ids_out], eqns=[e for e in jaxpr.eqns if e is not marker]
  )
  shape = ids_out.aval.shape
  top_k = shape[-1] if shape else 1
  return ExpertStep(jax.jit(probe), jcore.ClosedJaxpr(body, closed.consts), top_k)
