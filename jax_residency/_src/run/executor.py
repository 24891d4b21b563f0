"""What runs a placed model: the `Executor` protocol.

`place` builds one executor per placement and `PlacedModel` wraps it. Two
implement it: `JittedExecutor` (``run/jitted.py``: ``FullyResident`` and
``LayerwiseHost``, one jitted program per input signature) and
`DenseExecutor` (``run/dense.py``: ``DenseDiskStream``, a staged forward
whose unit loop the host drives from a store).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Protocol

import jax

from jax_residency._src.loop.unit_loop import LoopContext
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.report.telemetry import Telemetry
from jax_residency._src.typing import path_str


class Executor(Protocol):
  """Runs a placed model's passes and owns what the placement holds.

  Attributes:
    metadata: sizes and placement decided at load time.
    telemetry: the pass reports of this placement.
  """

  metadata: ModelMetadata
  telemetry: Telemetry

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    """One forward pass, called like the model."""
    ...

  def close(self) -> None:
    """Releases every buffer, store handle and thread (idempotent)."""
    ...

  def clear_caches(self) -> None:
    """Drops cached unit copies; a no-op where every unit stays placed."""
    ...

  def lower(self, *args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    """The lowered jitted forward; `PlacementError` where there is none."""
    ...

  def arrays(self) -> dict[str, jax.Array]:
    """The arrays the placement holds, by parameter path."""
    ...


def note_unplaced(executor: Executor, ctx: LoopContext) -> None:
  """Records, with a warning, the stacks a traced call looped over that are not placed.

  Their weights are static parameters on the device; ``metadata.unplaced_stacks``
  lists them.
  """
  known = executor.metadata.unplaced_stacks
  new = [path_str(p) for p in ctx.unplaced if path_str(p) not in known]
  if not new:
    return
  executor.metadata = dataclasses.replace(executor.metadata, unplaced_stacks=(*known, *new))
  executor.telemetry.note_metadata(executor.metadata)
  placed = ", ".join(repr(s.path) for s in executor.metadata.stacks) or "the chosen stacks"
  warnings.warn(
    f"the forward loops over layer stack(s) {', '.join(map(repr, new))} that this placement "
    f"does not place (it places {placed}): their weights stay on the device as static "
    "parameters. Pass units=(...) naming every stack to place them too, or leave units= "
    "out to place every stack the forward loops over.",
    UserWarning,
    stacklevel=4,
  )
