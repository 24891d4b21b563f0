"""What runs a placed model: the `Executor` protocol.

`place` builds one executor per placement and `PlacedModel` wraps it. Two
implement it: `JittedExecutor` (``placement/jitted.py``: ``FullyResident`` and
``LayerwiseHost``, one jitted program per input signature) and
`DenseExecutor` (``stream/dense.py``: ``DenseDiskStream``, a staged forward
whose unit loop the host drives from a store).
"""

from __future__ import annotations

from typing import Any, Protocol

import jax

from jax_residency._src.placement.budget import ModelMetadata
from jax_residency._src.report.telemetry import Telemetry


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
