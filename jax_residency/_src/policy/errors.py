"""The error hierarchy of jax_residency.

Every error raised on purpose by the library derives from `ResidencyError` and
from the builtin that best describes it (`ValueError` for bad input,
`RuntimeError` for a failure while running), so callers can catch either.
Messages say what went wrong, where (a parameter path or a store path), the
offending value, and how to fix it. Where several leaves are wrong, one error
lists all of them, sorted.
"""

from __future__ import annotations

from collections.abc import Iterable


class ResidencyError(Exception):
  """Base class of every error jax_residency raises on purpose."""


# --- policy (SPEC §1) ------------------------------------------------------


class WeightResidencyPolicyError(ResidencyError, ValueError):
  """A weight-residency policy or one of its options is invalid."""


class ZeroHostLookaheadError(WeightResidencyPolicyError):
  """A dense stream with a host cache was given `host_lookahead=0`."""


class ZeroQueueCapacityError(WeightResidencyPolicyError):
  """A dense stream with a host cache was given `background_queue_capacity=0`."""


class HostDisabledControlsError(WeightResidencyPolicyError):
  """Host-cache controls were set although `host_budget_bytes=0` disables the host cache."""


class ZeroPrefetchDepthError(WeightResidencyPolicyError):
  """`prefetch_depth` was below 1."""


class InvalidBudgetError(WeightResidencyPolicyError):
  """A byte budget was negative, not an integer, or not a parseable size."""


class ZeroMaxCachedShardsError(WeightResidencyPolicyError):
  """`max_cached_shards` was below 1."""


class UnknownPolicyFieldError(WeightResidencyPolicyError):
  """A policy dictionary named a key or a kind the policy types do not have."""


class InvalidPolicyValueError(WeightResidencyPolicyError):
  """A policy field or argument has the wrong type (e.g. a str flag), or `of()` got a non-policy."""


# --- placement (SPEC §2) ---------------------------------------------------


class PlacementError(ResidencyError, ValueError):
  """A model could not be placed as asked (bad unit selection, bad mesh...)."""


class UnitSelectionError(PlacementError):
  """The stacked layer module could not be found or is not a layer stack."""


class BudgetTooSmallError(PlacementError):
  """Base of the load-time budget errors, raised before anything is placed.

  The arithmetic is in the message and, as ints, in attributes: ``required``
  and ``budget`` always; ``static``, ``window`` and ``depth`` (device) or
  ``window`` and ``staging`` (host) where they apply, else ``None``.
  """

  def __init__(
    self,
    message: str,
    *,
    required: int | None = None,
    budget: int | None = None,
    static: int | None = None,
    window: int | None = None,
    depth: int | None = None,
    staging: int | None = None,
  ) -> None:
    super().__init__(message)
    self.required = required
    self.budget = budget
    self.static = static
    self.window = window
    self.depth = depth
    self.staging = staging


class DeviceBudgetTooSmallError(BudgetTooSmallError):
  """Static bytes plus the largest device window exceed `device_budget_bytes`."""


class HostBudgetTooSmallError(BudgetTooSmallError):
  """The host window (or every unit, for `LayerwiseHost`) exceeds `host_budget_bytes`."""


# --- stores and loading ----------------------------------------------------


class StoreError(ResidencyError, ValueError):
  """A unit store is missing, unreadable, or not laid out as needed."""


class StoreNotFoundError(StoreError, FileNotFoundError):
  """No unit store exists at the given path."""


class StoreLayoutError(StoreError):
  """A store exists but cannot be streamed (e.g. one chunk holds many units)."""


class CheckpointMismatchError(StoreError):
  """Base of the errors that compare a stored tree with the model's tree."""


class MissingCheckpointParametersError(CheckpointMismatchError):
  """The model has parameters the store does not hold."""


class CheckpointShapeMismatchError(CheckpointMismatchError):
  """Stored tensors disagree with the model's shape or dtype."""


class UnexpectedCheckpointParametersError(CheckpointMismatchError):
  """With `strict_loading`, the store holds tensors the model does not claim."""


# --- running ---------------------------------------------------------------


class ResidencyRuntimeError(ResidencyError, RuntimeError):
  """A failure while running a placed model."""


class AdmissionError(ResidencyRuntimeError):
  """A cache reservation could not be satisfied; nothing was changed."""


class PrefetchError(ResidencyRuntimeError):
  """The background prefetch worker failed to read a unit."""


class ClosedError(ResidencyRuntimeError):
  """A placed model, cache or worker was used after `close()`."""


def format_paths(paths: Iterable[str], *, limit: int = 50) -> str:
  """Formats paths one per line, sorted, eliding past `limit`."""
  items = sorted(paths)
  shown = [f"  {p}" for p in items[:limit]]
  if len(items) > limit:
    shown.append(f"  ... and {len(items) - limit} more")
  return "\n".join(shown)
