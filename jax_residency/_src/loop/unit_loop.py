"""The one layer-loop primitive every policy runs through.

Model code runs its stacked layers with :func:`scan_units` (NNX) or the Linen
transform in :mod:`jax_residency._src.loop.linen` instead of ``nnx.scan`` /
``nn.scan``. Outside a placed model these are exactly the Flax transforms. While
a placed model traces its forward, a :class:`LoopContext` is active and the loop
takes the shape the policy asks for:

* ``FULLY_RESIDENT``: a plain ``lax.scan`` over the stacked unit parameters; or, where
  the placement gives each unit's arrays apart (`StackLoop.apart`: views of the stack's
  rows on a CPU backend, section 3.1), the layer applied to each unit's own arrays in
  turn, in the same program, with no copy of a unit out of the stack.
* ``LAYERWISE_HOST``: the stacked parameters are ``pinned_host`` arguments; the
  scan body moves unit *i* to ``device`` memory with ``jax.device_put``. With a
  prefetch depth ``k >= 2`` the loop carries ``k - 1`` units already moved and
  issues the move of unit ``i + k - 1`` while unit ``i`` computes (a software
  pipeline: ``k - 1`` moves before the loop, one per step, and ``k - 1`` steps
  after it that only compute).
* ``DENSE_DISK_STREAM``: the forward is traced to a jaxpr with abstract unit
  parameters; the loop appears as a ``scan`` over them, which the streaming
  engine runs step by step with units read from disk.

Under every policy a unit of a quantized store arrives in the step as its stored
parts (`quant.encoding.QuantizedTensor`), and the step decodes it before the
layer runs.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_residency._src.errors import PlacementError
from jax_residency._src.loop.loop_shapes import (
  Step,
  each_unit,
  fetch,
  leading_dim,
  one_trip,
  pipelined_host_scan,
  resident_then_moved,
)
from jax_residency._src.plan.split import Bound
from jax_residency._src.policy.types import ExecutionResidency
from jax_residency._src.quant.encoding import decode_tree, has_quantized
from jax_residency._src.quant.fused import fenced, kernels_for


@dataclasses.dataclass
class StackLoop:
  """One placed stack, as the layer loop sees it.

  Attributes:
    ref: what identifies the stack: the rebuilt NNX module, or for Linen the
      scope path of the stack (``split.Bound.units``).
    shardings: the ``device`` sharding each leaf of one unit is moved to, in
      the leaf order of the stack's pytree.
    depth: device window in units (the prefetch depth for ``LAYERWISE_HOST``).
    loops: how many loops over the stack ran while tracing.
    resident: for ``LAYERWISE_HOST`` with device-resident units, the stack's first
      units, already in device memory: one stacked array per leaf, in the leaf order
      of the stack's pytree. The units the loop is given are then the rest.
    one: with ``resident`` or ``apart``, the int32 1 as an argument of the program (not
      a constant), the trip count of a part of the loop one unit long.
    apart: each unit's leaves as arrays of their own (arguments of the program), in
      unit order and the leaf order of the stack's pytree. The loop then runs the layer
      on each unit's arrays in turn (`loop_shapes.each_unit`) and never indexes the stacked ones.
  """

  ref: Any
  shardings: tuple[jax.sharding.Sharding, ...]
  depth: int
  loops: int = 0
  resident: Sequence[Any] | None = None
  one: Any = None
  apart: Sequence[Sequence[Any]] | None = None


@dataclasses.dataclass
class LoopContext:
  """What a placed forward tells the layer loop while it traces.

  Attributes:
    kind: how units are resident.
    stacks: the placed stacks.
    path_of: the model path of a module a loop runs over (``split.Bound.path_of``).
    unplaced: model paths of the stacks the forward looped over that are not
      placed, in the order it ran them (every stack, while discovering).
    activations: how a quantized unit's one-row products use the native kernels on
      one CPU device (`quant.native.ACTIVATIONS`).
  """

  kind: ExecutionResidency
  stacks: tuple[StackLoop, ...] = ()
  path_of: Callable[[Any], tuple[str, ...] | None] = lambda _: None
  unplaced: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
  activations: str = "exact"
  _nesting: int = 0

  @property
  def loops_run(self) -> int:
    return sum(s.loops for s in self.stacks)

  def claim(self, units: Any) -> StackLoop | None:
    """The placed stack ``units`` (a module or a Linen scope path) is, if any.

    A top-level loop over a module that is no placed stack is noted in
    ``unplaced``; the caller runs it as the plain Flax loop.
    """
    for s in self.stacks:
      if (units == s.ref) if isinstance(units, tuple) else (units is s.ref):
        return s
    if self._nesting == 0:
      path = self.path_of(units)
      if path is not None and path not in self.unplaced:
        self.unplaced.append(path)
    return None

  @contextlib.contextmanager
  def plain(self) -> Iterator[None]:
    """Marks a plain Flax loop while it traces: loops inside it are not stacks."""
    self._nesting += 1
    try:
      yield
    finally:
      self._nesting -= 1

  def run(
    self,
    loop: StackLoop,
    step: Step,
    carry: Any,
    units: Any,
    xs: Any,
    *,
    reverse: bool = False,
  ) -> tuple[Any, Any]:
    """Runs ``step`` over the stacked ``units`` (and ``xs``) as the policy asks.

    With ``reverse``, from the last unit to the first (as ``lax.scan``'s
    ``reverse``: ``ys[i]`` is still unit ``i``'s output).
    """
    loop.loops += 1
    leading_dim(units)  # raises for a stack without parameters

    def decoded(c: Any, unit: Any, x: Any) -> tuple[Any, Any]:
      # A quantized unit's tensors arrive as their stored parts; the float values are
      # this step's temporaries, each decoded inside the matmul that uses it
      # (docs/design.md, section 2.4; quant/fused.py).
      if not has_quantized(unit):
        return step(c, unit, x)
      devices = set().union(*(s.device_set for s in loop.shardings))
      kernels = kernels_for(devices, self.activations)
      return fenced(lambda c, u, x: step(c, decode_tree(u), x), c, unit, x, kernels=kernels)

    if loop.apart is not None:
      return each_unit(decoded, carry, units, loop.apart, xs, reverse=reverse, one=loop.one)
    if self.kind is ExecutionResidency.LAYERWISE_HOST:

      def moved(c: Any, u: Any, x: Any) -> tuple[Any, Any]:
        n = leading_dim(u)
        if n == 1 and loop.one is not None:  # see loop_shapes.one_trip
          return one_trip(
            lambda c, ix: decoded(c, fetch(u, ix[0], loop.shardings), ix[1]),
            c,
            (jnp.arange(1), x),
            loop.one,
          )

        def pipelined(depth: int) -> Callable[[Any, Any, Any], tuple[Any, Any]]:
          return lambda c, u, x: pipelined_host_scan(
            decoded, c, u, x, depth=depth, shardings=loop.shardings, length=n, reverse=reverse
          )

        if loop.depth == 1:
          return pipelined(1)(c, u, x)
        # Lowered for CPU, where device memory is host memory, a window buys no overlap
        # and carrying it copies each unit once more per step (measured: a 30-layer
        # decode step 1.9x slower at depth 2 than at depth 1): the CPU program is the
        # depth-1 loop; other platforms pipeline.
        return lax.platform_dependent(c, u, x, cpu=pipelined(1), default=pipelined(loop.depth))

      if not loop.resident:
        return moved(carry, units, xs)
      kept = jax.tree.unflatten(jax.tree.structure(units), list(loop.resident))
      return resident_then_moved(
        decoded, moved, carry, kept, units, xs, reverse=reverse, one=loop.one
      )
    # FULLY_RESIDENT runs the plain scan; DENSE_DISK_STREAM traces it so the
    # streaming engine can find it in the jaxpr and run it unit by unit.
    return lax.scan(lambda c, ux: decoded(c, *ux), carry, (units, xs), reverse=reverse)


def not_looped_error(names: Sequence[str]) -> PlacementError:
  """The error for a model whose forward never ran a placed layer stack through the loop."""
  which = ", ".join(repr(n) for n in names) if names else "(none found)"
  return PlacementError(
    f"the model's forward ran none of its layer stacks {which} through "
    "jax_residency.scan_units (NNX) or jax_residency.linen.scan (Linen); replace "
    "its nnx.scan / nn.scan with that call so the policy can place the layers"
  )


_ACTIVE: contextvars.ContextVar[LoopContext | None] = contextvars.ContextVar(
  "jax_residency_loop", default=None
)


@contextlib.contextmanager
def active_loop(ctx: LoopContext) -> Iterator[LoopContext]:
  """Makes ``ctx`` the loop context while a placed forward traces."""
  token = _ACTIVE.set(ctx)
  try:
    yield ctx
  finally:
    _ACTIVE.reset(token)


def run_in_loop(
  bound: Bound,
  stacks: Sequence[StackLoop],
  *,
  kind: ExecutionResidency,
  names: Sequence[str],
  args: tuple[Any, ...],
  kwargs: dict[str, Any],
  activations: str = "exact",
) -> tuple[Any, LoopContext]:
  """Calls a rebuilt model with its stacks (``bound.units``, one `StackLoop`
  each) placed in a loop context, and checks that a placed stack ran through
  the loop. Returns the output and the context (loops run, stacks not placed).

  A call may run only some of the stacks (a decoder step of an
  encoder–decoder); it must run at least one.

  Raises:
    PlacementError: the model ran no placed stack through ``scan_units`` (the
      error says how to fix the model); an error raised before any loop ran
      gets a note saying so.
  """
  loop = LoopContext(
    kind=kind, stacks=tuple(stacks), path_of=bound.path_of, activations=activations
  )
  try:
    with active_loop(loop):
      out = bound.call(*args, **kwargs)
  except Exception as e:
    if loop.loops_run == 0:
      if "memory_space" in str(e) or "memory kind" in str(e):  # host layers used off-loop
        raise not_looped_error(names) from e
      e.add_note(f"jax_residency: the layer loop had not run yet. {not_looped_error(names)}")
    raise
  if loop.loops_run == 0:
    raise not_looped_error(names)
  return out, loop


def current_loop() -> LoopContext | None:
  """The loop context of the placed forward being traced, if any."""
  return _ACTIVE.get()


def scan_units(
  body: Callable[..., Any],
  carry: Any,
  units: nnx.Module,
  xs: Any = None,
  *,
  outputs: bool = False,
  reverse: bool = False,
) -> Any:
  """Runs ``body`` over the layers of a stacked NNX module.

  A drop-in for the usual ``nnx.scan`` over a layer stack built with
  ``nnx.vmap``: ``body(carry, layer)`` (or ``body(carry, layer, x)`` when ``xs``
  is given) sees one layer and returns the new carry, or ``(carry, y)`` when
  ``outputs=True``. Outside :func:`jax_residency.place` this is ``nnx.scan``;
  inside, the policy decides where each layer's weights come from.

  Args:
    body: the per-layer function.
    carry: the loop carry (e.g. the hidden state).
    units: the stacked layer module (leading axis = layer index).
    xs: optional per-layer inputs stacked on axis 0 (e.g. a KV cache).
    outputs: whether ``body`` returns ``(carry, y)``; then the per-layer ``y``
      are stacked and returned with the carry.
    reverse: run from the last layer to the first (``ys`` stay in layer order).

  Returns:
    The final carry, or ``(carry, ys)`` when ``outputs=True``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> @nnx.vmap
    ... def make(key):
    ...   return nnx.Linear(4, 4, rngs=nnx.Rngs(key))
    >>> layers = make(jax.random.split(jax.random.key(0), 3))
    >>> y = jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), jnp.ones((2, 4)), layers)
    >>> y.shape
    (2, 4)
  """

  def call(c: Any, layer: Any, x: Any) -> tuple[Any, Any]:
    out = body(c, layer) if xs is None else body(c, layer, x)
    return out if outputs else (out, None)

  ctx = current_loop()
  loop = None if ctx is None else ctx.claim(units)
  if loop is None:
    with contextlib.nullcontext() if ctx is None else ctx.plain():
      return _plain_scan(call, carry, units, xs, outputs=outputs, reverse=reverse)

  graphdef, state = nnx.split(units)

  def step(c: Any, unit_state: Any, x: Any) -> tuple[Any, Any]:
    return call(c, nnx.merge(graphdef, unit_state), x)

  assert ctx is not None
  c, ys = ctx.run(loop, step, carry, state, xs, reverse=reverse)
  return (c, ys) if outputs else c


def _plain_scan(
  call: Callable[[Any, Any, Any], tuple[Any, Any]],
  carry: Any,
  units: nnx.Module,
  xs: Any,
  *,
  outputs: bool,
  reverse: bool,
) -> Any:
  """``nnx.scan`` of ``call(carry, layer, x)`` over the layers (and ``xs``)."""
  if xs is None:
    c, ys = nnx.scan(
      lambda c, layer: call(c, layer, None),
      in_axes=(nnx.Carry, 0),
      out_axes=(nnx.Carry, 0),
      reverse=reverse,
    )(carry, units)
  else:
    c, ys = nnx.scan(call, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0), reverse=reverse)(
      carry, units, xs
    )
  return (c, ys) if outputs else c
