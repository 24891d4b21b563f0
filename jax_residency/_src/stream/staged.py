"""Running a traced forward whose layer loop is driven from the host.

A dense disk stream cannot run the model as one compiled program: unit weights
arrive from disk while the loop runs. Instead the forward is traced once per
input shape to a jaxpr, with the unit parameters as abstract inputs. The unit
loop shows up in it as a ``scan`` whose scanned operands are those inputs.
:func:`run_staged` evaluates the jaxpr: every other equation is bound as-is
(exactly what eager execution of the plain model does), and the unit loop runs
step by step, its body compiled once and fed each unit's parameters by a
``fetch(i)`` callback.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from jax_residency._src.errors import PlacementError
from jax_residency._src.jaxprs import Evaluation, last_uses
from jax_residency._src.plan.split import Stack
from jax_residency._src.quant.fused import kernels_for
from jax_residency._src.report.compile_time import temp_bytes
from jax_residency._src.stream.expert_steps import (
  ExpertHooks,
  ExpertStep,
  expert_step,
  marker_index,
)
from jax_residency._src.stream.static_decode import StaticDecodes, plan_static_decodes

#: ``fetch(u, upcoming) -> unit leaves`` in its stack's leaf order (device arrays, or on
#: one CPU device host arrays a step takes in place, `StreamedStack.to_device`). ``u`` is a
#: unit id (stacks number their units one after another, `split.Stack.units`);
#: ``upcoming`` the ids the forward runs after ``u``: the rest of this loop, then
#: the loops that follow it.
Fetch = Callable[[int, Sequence[int]], Sequence[Any]]
#: ``after_step(u, upcoming)``, called once step ``u`` has been dispatched and
#: the step before it has finished (to start moving the units that come next).
AfterStep = Callable[[int, Sequence[int]], None]


@dataclasses.dataclass
class StagedForward:
  """A forward traced for one input signature.

  Attributes:
    closed: the traced jaxpr: inputs are static leaves, unit leaves, then the
      flattened call arguments.
    n_static: number of static leaf inputs.
    n_units: number of unit leaf inputs.
    out_tree: the pytree structure of the outputs.
    in_loop: compile each step inside a run-time-bounded while loop, so its
      math is the plain model's scanned loop bit for bit (used on CPU).
    static_decodes: where its quantized static tensors are decoded (`static_decode`).
    bodies: compiled loop bodies, one per unit-loop equation.
    stacks: where each stack's units and leaves lie.
    loops: per unit-loop equation, in order: its index and the unit ids it
      runs, in its order.
    expert_steps: per unit-loop equation run with expert residency, its probe and
      body cut at the layer's `picked_experts` (None: the layer marks none).
  """

  closed: jcore.ClosedJaxpr
  n_static: int
  n_units: int
  out_tree: Any
  in_loop: bool = True
  static_decodes: StaticDecodes | None = None
  bodies: dict[int, CompiledStep] = dataclasses.field(default_factory=dict)
  stacks: tuple[Stack, ...] = ()
  loops: list[tuple[int, list[int]]] = dataclasses.field(default_factory=list)
  expert_steps: dict[int, ExpertStep | None] = dataclasses.field(default_factory=dict)

  def stack_of(self, operands: dict[int, int]) -> Stack:
    """The stack whose leaves a unit loop's operands are."""
    leaf = min(operands.values())
    for s in self.stacks:
      leaves = range(s.leaf_slice.start, s.leaf_slice.stop)
      if leaf in leaves:
        if not all(j in leaves for j in operands.values()):
          raise PlacementError("one unit loop runs over the leaves of two layer stacks")
        return s
    raise PlacementError(f"unit leaf {leaf} belongs to no stack")

  @property
  def step_temp_bytes(self) -> int | None:
    """The most temporary bytes any compiled step of this forward needs (None: unknown)."""
    known = [t for t in (b.temp_bytes for b in self.bodies.values()) if t is not None]
    return max(known) if known else None

  @property
  def unit_loop_count(self) -> int:
    return sum(1 for e in self.closed.jaxpr.eqns if self._unit_operands(e) is not None)

  def _unit_operands(self, eqn: jcore.JaxprEqn) -> dict[int, int] | None:
    """For a scan over unit inputs: scanned operand position → unit leaf index."""
    if eqn.primitive.name != "scan":
      return None
    unit_vars = self._unit_vars()
    first_x = eqn.params["num_consts"] + eqn.params["num_carry"]
    found = {
      pos: unit_vars[v]
      for pos, v in enumerate(eqn.invars)
      if pos >= first_x and not isinstance(v, jcore.Literal) and v in unit_vars
    }
    return found or None

  def _unit_vars(self) -> dict[jcore.Var, int]:
    invars = self.closed.jaxpr.invars
    return {v: j for j, v in enumerate(invars[self.n_static : self.n_static + self.n_units])}


def trace(
  forward: Callable[..., Any],
  static_leaves: Sequence[Any],
  unit_specs: Sequence[jax.ShapeDtypeStruct],
  args: Sequence[Any],
  stacks: Sequence[Stack],
  activations: str = "exact",
) -> StagedForward:
  """Traces ``forward(static_leaves, unit_leaves, *args)`` with abstract units
  (``unit_specs``: every stack's leaves, stack by stack, as ``stacks`` lays out).
  ``activations``: how a quantized static tensor's one-row products use the native
  kernels (`quant.native.ACTIVATIONS`)."""
  flat_args, args_tree = jax.tree.flatten(tuple(args))

  def flat_forward(*flat: Any) -> Any:
    s = list(flat[: len(static_leaves)])
    u = list(flat[len(static_leaves) : len(static_leaves) + len(unit_specs)])
    a = jax.tree.unflatten(args_tree, list(flat[len(static_leaves) + len(unit_specs) :]))
    return forward(s, u, *a)

  closed, out_shape = jax.make_jaxpr(flat_forward, return_shape=True)(
    *static_leaves, *unit_specs, *flat_args
  )
  staged = StagedForward(
    closed=closed,
    n_static=len(static_leaves),
    n_units=len(unit_specs),
    out_tree=jax.tree.structure(out_shape),
    stacks=tuple(stacks),
  )
  _check_units_only_in_loops(staged)
  staged.static_decodes = plan_static_decodes(
    closed.jaxpr,
    closed.jaxpr.invars[: staged.n_static],
    lambda eqn: staged._unit_operands(eqn) is not None,
    # The static tensors' devices: the native one-row kernels serve one CPU device.
    kernels=lambda: kernels_for(
      {d for x in static_leaves for d in x.sharding.device_set}, activations
    ),
  )
  for k, eqn in enumerate(closed.jaxpr.eqns):
    operands = staged._unit_operands(eqn)
    if operands is not None:
      span = staged.stack_of(operands)
      steps = range(span.count - 1, -1, -1) if eqn.params["reverse"] else range(span.count)
      staged.loops.append((k, [span.offset + i for i in steps]))
  return staged


def _check_units_only_in_loops(staged: StagedForward) -> None:
  unit_vars = staged._unit_vars()
  for eqn in staged.closed.jaxpr.eqns:
    operands = staged._unit_operands(eqn)
    allowed = set(operands) if operands else set()
    for pos, v in enumerate(eqn.invars):
      if not isinstance(v, jcore.Literal) and v in unit_vars and pos not in allowed:
        raise PlacementError(
          f"the model uses its stacked layer parameters outside the unit loop (in a "
          f"{eqn.primitive.name!r} operation); a dense disk stream can only feed them to "
          "jax_residency.scan_units at the top level of the forward (not inside a jit or "
          "another transform of the model's own)"
        )
  for out in staged.closed.jaxpr.outvars:
    if not isinstance(out, jcore.Literal) and out in unit_vars:
      raise PlacementError("the model returns its stacked layer parameters; it cannot be streamed")


def run_staged(
  staged: StagedForward,
  static_leaves: Sequence[Any],
  args: Sequence[Any],
  *,
  fetch: Fetch,
  after_step: AfterStep,
  experts: ExpertHooks | None = None,
) -> Any:
  """Evaluates a staged forward; unit loops pull units through ``fetch``, and with
  ``experts``, a loop whose layer marks its expert ids runs its router first and
  takes only the experts it picks from those hooks (`expert_steps`)."""
  jaxpr = staged.closed.jaxpr
  values = Evaluation()
  read = values.read
  values.write(jaxpr.constvars, staged.closed.consts)
  ins = jaxpr.invars
  values.write(ins[: staged.n_static], static_leaves)
  values.write(ins[staged.n_static + staged.n_units :], jax.tree.leaves(tuple(args)))

  last_use = last_uses(jaxpr)
  static = set(ins[: staged.n_static])
  decodes = staged.static_decodes or StaticDecodes(frozenset(), {})
  for k, eqn in enumerate(jaxpr.eqns):
    if k in decodes.deferred:  # computed inside the regions that use it
      continue
    operands = staged._unit_operands(eqn)
    region = decodes.regions.get(k)
    if operands is not None:
      values.write(
        eqn.outvars, _run_unit_loop(staged, k, eqn, operands, read, fetch, after_step, experts)
      )
    elif region is not None:
      values.write(eqn.outvars, region([read(v) for v in region.inputs]))
    else:
      values.bind(eqn)
    for v in eqn.invars:  # free intermediates as soon as nothing needs them
      if not isinstance(v, jcore.Literal) and last_use.get(v) == k and v not in static:
        values.env.pop(v, None)
  return jax.tree.unflatten(staged.out_tree, [read(v) for v in jaxpr.outvars])


def _slicer(unit_xs: frozenset[int]) -> Callable[[list[Any], list[Any], Any], list[Any]]:
  """``(units, others, i) -> xs``: a step's scanned inputs, its unit leaves (at
  ``unit_xs``) and the other stacked inputs sliced at ``i``."""

  def xs(units: list[Any], others: list[Any], i: Any) -> list[Any]:
    unit_iter, other_iter = iter(units), iter(others)
    return [
      next(unit_iter)
      if j in unit_xs
      else jax.lax.dynamic_index_in_dim(next(other_iter), i, keepdims=False)
      for j in range(len(units) + len(others))
    ]

  return xs


def _compile_step(
  closed: jcore.ClosedJaxpr, num_carry: int, unit_xs: frozenset[int], *, in_loop: bool
) -> CompiledStep:
  """Compiles step ``i`` of a unit loop: ``(consts, carry, units, others, ys, i, extra)
  -> (carry, ys)``.

  The loop's scanned inputs are this step's unit leaves (``unit_xs``: their
  positions among the scanned inputs) and the other stacked inputs
  (``others``, e.g. a per-layer KV cache), which the step slices at ``i``. Its
  per-step outputs are written in place (donated) into the stacked ``ys``
  buffers at ``i``, as ``lax.scan`` does, so no step costs a host-side slice
  or the loop a final stack. ``extra`` inputs follow the scanned ones (an
  expert step's ids, `expert_steps`).

  With ``in_loop``, the step runs inside a ``while_loop`` whose trip count (1)
  is only known at run time. XLA then compiles the body exactly as it does in
  the plain model's scanned loop (a trip count known to be 1 would be inlined
  and compiled differently), so results are bit-identical to the plain model.
  """
  fun = jcore.jaxpr_as_fun(closed)
  slice_xs = _slicer(unit_xs)

  def step(
    consts: list[Any],
    carry: list[Any],
    units: list[Any],
    others: list[Any],
    ys: list[Any],
    i: Any,
    extra: list[Any],
  ) -> tuple[list[Any], list[Any]]:
    outs = fun(*consts, *carry, *slice_xs(units, others, i), *extra)
    ys = [
      jax.lax.dynamic_update_index_in_dim(b, y, i, 0)
      for b, y in zip(ys, outs[num_carry:], strict=True)
    ]
    return list(outs[:num_carry]), ys

  if not in_loop:
    return CompiledStep(jax.jit(step, donate_argnums=4))

  def looped(
    consts: list[Any],
    carry: list[Any],
    units: list[Any],
    others: list[Any],
    ys: list[Any],
    i: Any,
    extra: list[Any],
    trips: Any,
  ) -> tuple[list[Any], list[Any]]:
    def body(state: tuple[Any, list[Any], list[Any]]) -> tuple[Any, list[Any], list[Any]]:
      t, c, b = state
      return t + 1, *step(consts, c, units, others, b, i, extra)

    _, c, b = jax.lax.while_loop(lambda s: s[0] < trips, body, (jnp.int32(0), carry, ys))
    return c, b

  return CompiledStep(jax.jit(looped, donate_argnums=4), np.int32(1))


class CompiledStep:
  """A unit-loop step, compiled ahead of its first call so its memory is known.

  Attributes:
    temp_bytes: bytes of temporaries XLA allocates while the step runs (its
      ``memory_analysis``), or ``None`` before the first call or where the
      backend does not say.
  """

  def __init__(self, jitted: Any, *extra: Any) -> None:
    self._jitted = jitted
    self._extra = extra
    self._compiled: Any = None
    self.temp_bytes: int | None = None

  def __call__(self, *args: Any) -> Any:
    if self._compiled is None:
      self._compiled = self._jitted.lower(*args, *self._extra).compile()
      self.temp_bytes = temp_bytes(self._compiled)
    return self._compiled(*args, *self._extra)


def _run_unit_loop(
  staged: StagedForward,
  k: int,
  eqn: jcore.JaxprEqn,
  operands: dict[int, int],
  read: Callable[[Any], Any],
  fetch: Fetch,
  after_step: AfterStep,
  hooks: ExpertHooks | None,
) -> list[Any]:
  p = eqn.params
  num_consts, num_carry, length = p["num_consts"], p["num_carry"], p["length"]
  span = staged.stack_of(operands)
  if length != span.count:
    raise PlacementError(f"the unit loop runs {length} steps but its stack has {span.count} units")
  first_x = num_consts + num_carry
  unit_xs = frozenset(pos - first_x for pos in operands)
  unit_leaves = [operands[first_x + j] - span.first for j in sorted(unit_xs)]
  experts = _expert_step(staged, k, p, span, unit_xs, unit_leaves, hooks)
  body = staged.bodies.get(k)
  if body is None:
    jaxpr = p["jaxpr"] if experts is None else experts.body
    body = _compile_step(jaxpr, num_carry, unit_xs, in_loop=staged.in_loop)
    staged.bodies[k] = body
  invals: list[Any] = [None if pos in operands else read(v) for pos, v in enumerate(eqn.invars)]
  consts = invals[:num_consts]
  carry = invals[num_consts:first_x]
  others = [x for j, x in enumerate(invals[first_x:]) if j not in unit_xs]
  # Each step writes its outputs into these stacked buffers at its index, as scan does.
  ys = [jnp.zeros((length, *a.shape), a.dtype) for a in p["jaxpr"].out_avals[num_carry:]]
  at = next(n for n, (eqn_k, _) in enumerate(staged.loops) if eqn_k == k)
  ids = staged.loops[at][1]
  later = [u for _, units in staged.loops[at + 1 :] for u in units]
  for s, u in enumerate(ids):
    upcoming = ids[s + 1 :] + later
    unit = fetch(u, upcoming)
    previous = carry
    i = np.int32(u - span.offset)
    leaves = [unit[j] for j in unit_leaves]
    extra: list[Any] = []
    if experts is not None:
      assert hooks is not None
      picked = experts.probe(consts, carry, leaves, others, i)
      moved = hooks.experts(u, picked)
      leaves = [moved.get(j, x) for j, x in zip(unit_leaves, leaves, strict=True)]
      extra = [picked]
    carry, ys = body(consts, carry, leaves, others, ys, i, extra)
    del unit, leaves
    # The step before this one is done before after_step moves the next unit in
    # and evicts the oldest: the evicted unit's memory is free when it is dropped
    # (this step keeps running meanwhile).
    jax.block_until_ready(previous)
    after_step(u, upcoming)
    if experts is not None and hooks is not None and s + 1 < len(ids):
      # The next unit's router on this unit's input, while this step runs.
      _predict(hooks, experts, ids[s + 1], span, unit_leaves, consts, previous, others)
  return list(carry) + list(ys)


def _expert_step(
  staged: StagedForward,
  k: int,
  p: Mapping[str, Any],
  span: Stack,
  unit_xs: frozenset[int],
  unit_leaves: list[int],
  hooks: ExpertHooks | None,
) -> ExpertStep | None:
  """The loop's expert step (cut once), or None where its experts move with its units."""
  if hooks is None:
    return None
  if k not in staged.expert_steps:
    closed: jcore.ClosedJaxpr = p["jaxpr"]
    index = marker_index(closed.jaxpr)
    step = None
    experts = hooks.expert_leaves(span.offset)
    if index is None and experts:
      raise PlacementError(
        "the layer does not mark which experts its router picks, so expert residency "
        "cannot tell which to read: apply jax_residency.picked_experts to the router's "
        "top-k expert ids in the layer (the Llama family's models do), or place the "
        "model without experts="
      )
    if index is not None:
      expert_xs = frozenset(
        j for j, leaf in zip(sorted(unit_xs), unit_leaves, strict=True) if leaf in experts
      )
      step = expert_step(
        closed, p["num_consts"], p["num_carry"], unit_xs, expert_xs, index, _slicer(unit_xs)
      )
      hooks.check_top_k(span.offset, step.top_k)
    staged.expert_steps[k] = step
  return staged.expert_steps[k]


def _predict(
  hooks: ExpertHooks,
  experts: ExpertStep,
  v: int,
  span: Stack,
  unit_leaves: list[int],
  consts: list[Any],
  carry: list[Any],
  others: list[Any],
) -> None:
  """Speculative prefetch: the next unit's probe (attention and router) on this unit's
  input, where the next unit's ordinary tensors are on the device already."""
  unit = hooks.ordinary(v)
  if unit is None:
    return
  leaves = [unit[j] for j in unit_leaves]
  hooks.predict(v, experts.probe(consts, carry, leaves, others, np.int32(v - span.offset)))
