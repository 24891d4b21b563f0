"""Every error jax_residency raises on purpose: ``jr.errors``.

Each error derives from `ResidencyError` and from the builtin that best
describes it (`ValueError` for bad input, `RuntimeError` for a failure while
running), so callers can catch either. Messages say what went wrong, where (a
parameter path or a store path), the offending value, and how to fix it.

The hierarchy (a builtin in parentheses is a second base class)::

  ResidencyError
      WeightResidencyPolicyError (ValueError)
          ZeroHostLookaheadError
          ZeroQueueCapacityError
          HostDisabledControlsError
          ZeroPrefetchDepthError
          InvalidBudgetError
          ZeroMaxCachedShardsError
          UnknownPolicyFieldError
          InvalidPolicyValueError
      PlacementError (ValueError)
          UnitSelectionError
          QuantizationError
          BudgetTooSmallError
              DeviceBudgetTooSmallError
              HostBudgetTooSmallError
          MeasurementMismatchError
      StoreError (ValueError)
          StoreNotFoundError (FileNotFoundError)
          StoreLayoutError
          StoreCorruptionError
          StoreReplacedError
          StoreUnavailableError
              StoreTimeoutError
          CheckpointMismatchError
              MissingCheckpointParametersError
              CheckpointShapeMismatchError
              UnexpectedCheckpointParametersError
      ModelConfigError (ValueError)
      SpeculationError (ValueError)
      InvalidPromptsError (ValueError)
      ResidencyRuntimeError (RuntimeError)
          AdmissionError
          PrefetchError
          ClosedError

The budget errors (`BudgetTooSmallError` and its two subclasses) are raised by
``jr.place`` before anything is placed, and carry their arithmetic as ``int``
attributes: ``required`` and ``budget`` always; ``static``, ``window`` and
``depth`` for the device budget; ``window`` and ``staging`` for the host
budget; ``None`` where one does not apply.

The most caught of these are also at the top level (``jr.ResidencyError``,
``jr.BudgetTooSmallError``, ...); the rest are here. Each type's docstring says
when the library raises it, with a runnable example that raises and catches it.

Example:
  >>> import jax_residency as jr
  >>> issubclass(jr.errors.StoreLayoutError, jr.errors.StoreError)
  True
  >>> jr.errors.DeviceBudgetTooSmallError is jr.DeviceBudgetTooSmallError
  True
"""

from jax_residency._src.errors import AdmissionError as AdmissionError
from jax_residency._src.errors import BudgetTooSmallError as BudgetTooSmallError
from jax_residency._src.errors import CheckpointMismatchError as CheckpointMismatchError
from jax_residency._src.errors import (
  CheckpointShapeMismatchError as CheckpointShapeMismatchError,
)
from jax_residency._src.errors import ClosedError as ClosedError
from jax_residency._src.errors import DeviceBudgetTooSmallError as DeviceBudgetTooSmallError
from jax_residency._src.errors import HostBudgetTooSmallError as HostBudgetTooSmallError
from jax_residency._src.errors import HostDisabledControlsError as HostDisabledControlsError
from jax_residency._src.errors import InvalidBudgetError as InvalidBudgetError
from jax_residency._src.errors import InvalidPolicyValueError as InvalidPolicyValueError
from jax_residency._src.errors import InvalidPromptsError as InvalidPromptsError
from jax_residency._src.errors import MeasurementMismatchError as MeasurementMismatchError
from jax_residency._src.errors import (
  MissingCheckpointParametersError as MissingCheckpointParametersError,
)
from jax_residency._src.errors import ModelConfigError as ModelConfigError
from jax_residency._src.errors import PlacementError as PlacementError
from jax_residency._src.errors import PrefetchError as PrefetchError
from jax_residency._src.errors import QuantizationError as QuantizationError
from jax_residency._src.errors import ResidencyError as ResidencyError
from jax_residency._src.errors import ResidencyRuntimeError as ResidencyRuntimeError
from jax_residency._src.errors import SpeculationError as SpeculationError
from jax_residency._src.errors import StoreCorruptionError as StoreCorruptionError
from jax_residency._src.errors import StoreError as StoreError
from jax_residency._src.errors import StoreLayoutError as StoreLayoutError
from jax_residency._src.errors import StoreNotFoundError as StoreNotFoundError
from jax_residency._src.errors import StoreReplacedError as StoreReplacedError
from jax_residency._src.errors import StoreTimeoutError as StoreTimeoutError
from jax_residency._src.errors import StoreUnavailableError as StoreUnavailableError
from jax_residency._src.errors import (
  UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError,
)
from jax_residency._src.errors import UnitSelectionError as UnitSelectionError
from jax_residency._src.errors import UnknownPolicyFieldError as UnknownPolicyFieldError
from jax_residency._src.errors import (
  WeightResidencyPolicyError as WeightResidencyPolicyError,
)
from jax_residency._src.errors import ZeroHostLookaheadError as ZeroHostLookaheadError
from jax_residency._src.errors import ZeroMaxCachedShardsError as ZeroMaxCachedShardsError
from jax_residency._src.errors import ZeroPrefetchDepthError as ZeroPrefetchDepthError
from jax_residency._src.errors import ZeroQueueCapacityError as ZeroQueueCapacityError

__all__ = [
  "AdmissionError",
  "BudgetTooSmallError",
  "CheckpointMismatchError",
  "CheckpointShapeMismatchError",
  "ClosedError",
  "DeviceBudgetTooSmallError",
  "HostBudgetTooSmallError",
  "MeasurementMismatchError",
  "HostDisabledControlsError",
  "InvalidBudgetError",
  "InvalidPolicyValueError",
  "InvalidPromptsError",
  "MissingCheckpointParametersError",
  "ModelConfigError",
  "PlacementError",
  "QuantizationError",
  "PrefetchError",
  "ResidencyError",
  "ResidencyRuntimeError",
  "SpeculationError",
  "StoreError",
  "StoreLayoutError",
  "StoreCorruptionError",
  "StoreReplacedError",
  "StoreTimeoutError",
  "StoreUnavailableError",
  "StoreNotFoundError",
  "UnexpectedCheckpointParametersError",
  "UnitSelectionError",
  "UnknownPolicyFieldError",
  "WeightResidencyPolicyError",
  "ZeroHostLookaheadError",
  "ZeroMaxCachedShardsError",
  "ZeroPrefetchDepthError",
  "ZeroQueueCapacityError",
]
