"""Which modules are a model's layer stacks: the ones its forward loops over.

A stack is a module the forward passes to :func:`jax_residency.scan_units`
(NNX) or runs as a :func:`jax_residency.linen.scan` module (Linen), not a module
with a telling name or whose leaves happen to share a leading axis (a
LayerNorm's do). :func:`find_stacks` traces the forward with abstract weights
(no compute, no copies) under a loop context that claims no stack, so every
top-level loop is recorded with its model path, in the order the forward runs
them. A placement made without ``units=`` or a store that records its stacks
finds them this way on its first call; a placement with chosen stacks notes,
on every new input signature, loops over stacks it does not place
(``run/executor.py``, ``note_unplaced``).
"""

from __future__ import annotations

from typing import Any

import jax

from jax_residency._src.loop.unit_loop import LoopContext, active_loop, not_looped_error
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.types import ExecutionResidency
from jax_residency._src.typing import ParamPath


def find_stacks(split: SplitModel, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SplitModel:
  """``split`` with the stacks its forward loops over when called with ``args``.

  Raises:
    PlacementError: the forward runs no layer loop.
    UnitSelectionError: a module it loops over is not a layer stack.
  """
  abstract = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in split.leaves]
  found: list[ParamPath] = []

  def forward(values: list[Any], *args: Any, **kwargs: Any) -> Any:
    bound = split.bind_stacks(values, ())
    ctx = LoopContext(kind=ExecutionResidency.FULLY_RESIDENT, path_of=bound.path_of)
    with active_loop(ctx):
      out = bound.call(*args, **kwargs)
    found[:] = ctx.unplaced
    return out

  jax.jit(forward).trace(abstract, *args, **kwargs)
  if not found:
    raise not_looped_error(())
  return split.with_stacks(found)
