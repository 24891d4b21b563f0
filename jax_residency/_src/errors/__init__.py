"""Every error jax_residency raises on purpose, by what went wrong.

The bottom layer of the package: it imports nothing else of jax_residency.
Every error derives from `ResidencyError` (`base`) and from the builtin that best
describes it (`ValueError` for bad input, `RuntimeError` for a failure while
running). Messages say what went wrong, where (a parameter path or a store path),
the offending value, and how to fix it; where several leaves are wrong, one error
lists all of them, sorted. The public face is `jax_residency.errors`.
"""

from jax_residency._src.errors.base import ResidencyError as ResidencyError
from jax_residency._src.errors.base import format_paths as format_paths
from jax_residency._src.errors.placement import BudgetTooSmallError as BudgetTooSmallError
from jax_residency._src.errors.placement import (
  DeviceBudgetTooSmallError as DeviceBudgetTooSmallError,
)
from jax_residency._src.errors.placement import HostBudgetTooSmallError as HostBudgetTooSmallError
from jax_residency._src.errors.placement import InvalidPromptsError as InvalidPromptsError
from jax_residency._src.errors.placement import (
  MeasurementMismatchError as MeasurementMismatchError,
)
from jax_residency._src.errors.placement import ModelConfigError as ModelConfigError
from jax_residency._src.errors.placement import PlacementError as PlacementError
from jax_residency._src.errors.placement import QuantizationError as QuantizationError
from jax_residency._src.errors.placement import SpeculationError as SpeculationError
from jax_residency._src.errors.placement import UnitSelectionError as UnitSelectionError
from jax_residency._src.errors.policy import HostDisabledControlsError as HostDisabledControlsError
from jax_residency._src.errors.policy import InvalidBudgetError as InvalidBudgetError
from jax_residency._src.errors.policy import InvalidPolicyValueError as InvalidPolicyValueError
from jax_residency._src.errors.policy import UnknownPolicyFieldError as UnknownPolicyFieldError
from jax_residency._src.errors.policy import (
  WeightResidencyPolicyError as WeightResidencyPolicyError,
)
from jax_residency._src.errors.policy import ZeroHostLookaheadError as ZeroHostLookaheadError
from jax_residency._src.errors.policy import ZeroMaxCachedShardsError as ZeroMaxCachedShardsError
from jax_residency._src.errors.policy import ZeroPrefetchDepthError as ZeroPrefetchDepthError
from jax_residency._src.errors.policy import ZeroQueueCapacityError as ZeroQueueCapacityError
from jax_residency._src.errors.runtime import AdmissionError as AdmissionError
from jax_residency._src.errors.runtime import ClosedError as ClosedError
from jax_residency._src.errors.runtime import PrefetchError as PrefetchError
from jax_residency._src.errors.runtime import ResidencyRuntimeError as ResidencyRuntimeError
from jax_residency._src.errors.store import CheckpointMismatchError as CheckpointMismatchError
from jax_residency._src.errors.store import (
  CheckpointShapeMismatchError as CheckpointShapeMismatchError,
)
from jax_residency._src.errors.store import (
  MissingCheckpointParametersError as MissingCheckpointParametersError,
)
from jax_residency._src.errors.store import StoreCorruptionError as StoreCorruptionError
from jax_residency._src.errors.store import StoreError as StoreError
from jax_residency._src.errors.store import StoreLayoutError as StoreLayoutError
from jax_residency._src.errors.store import StoreNotFoundError as StoreNotFoundError
from jax_residency._src.errors.store import StoreReplacedError as StoreReplacedError
from jax_residency._src.errors.store import StoreTimeoutError as StoreTimeoutError
from jax_residency._src.errors.store import StoreUnavailableError as StoreUnavailableError
from jax_residency._src.errors.store import (
  UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError,
)
