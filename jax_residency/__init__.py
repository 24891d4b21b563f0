"""jax_residency: run Flax models whose weights do not fit in accelerator memory.

Pick where a model's layers live — on the device (`FullyResident`), in pinned
host memory streamed through a bounded device window (`LayerwiseHost`), or cold
on disk behind byte-bounded host and device caches (`DenseDiskStream`) — and
get the plain model's outputs with memory held to your budgets.
"""

from . import linen as linen
from ._src.placement.budget import ModelMetadata as ModelMetadata
from ._src.placement.place import PlacedModel as PlacedModel
from ._src.placement.place import place as place
from ._src.placement.unit_loop import scan_units as scan_units
from ._src.policy.errors import AdmissionError as AdmissionError
from ._src.policy.errors import BudgetTooSmallError as BudgetTooSmallError
from ._src.policy.errors import CheckpointMismatchError as CheckpointMismatchError
from ._src.policy.errors import CheckpointShapeMismatchError as CheckpointShapeMismatchError
from ._src.policy.errors import ClosedError as ClosedError
from ._src.policy.errors import DeviceBudgetTooSmallError as DeviceBudgetTooSmallError
from ._src.policy.errors import HostBudgetTooSmallError as HostBudgetTooSmallError
from ._src.policy.errors import HostDisabledControlsError as HostDisabledControlsError
from ._src.policy.errors import InvalidBudgetError as InvalidBudgetError
from ._src.policy.errors import InvalidPolicyValueError as InvalidPolicyValueError
from ._src.policy.errors import MissingCheckpointParametersError as MissingCheckpointParametersError
from ._src.policy.errors import PlacementError as PlacementError
from ._src.policy.errors import PrefetchError as PrefetchError
from ._src.policy.errors import ResidencyError as ResidencyError
from ._src.policy.errors import ResidencyRuntimeError as ResidencyRuntimeError
from ._src.policy.errors import StoreError as StoreError
from ._src.policy.errors import StoreLayoutError as StoreLayoutError
from ._src.policy.errors import StoreNotFoundError as StoreNotFoundError
from ._src.policy.errors import (
  UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError,
)
from ._src.policy.errors import UnitSelectionError as UnitSelectionError
from ._src.policy.errors import UnknownPolicyFieldError as UnknownPolicyFieldError
from ._src.policy.errors import WeightResidencyPolicyError as WeightResidencyPolicyError
from ._src.policy.errors import ZeroHostLookaheadError as ZeroHostLookaheadError
from ._src.policy.errors import ZeroMaxCachedShardsError as ZeroMaxCachedShardsError
from ._src.policy.errors import ZeroPrefetchDepthError as ZeroPrefetchDepthError
from ._src.policy.errors import ZeroQueueCapacityError as ZeroQueueCapacityError
from ._src.policy.options import DEFAULT_MAX_CACHED_SHARDS as DEFAULT_MAX_CACHED_SHARDS
from ._src.policy.options import CacheEvictionPolicy as CacheEvictionPolicy
from ._src.policy.options import DenseDiskStreamLoadOptions as DenseDiskStreamLoadOptions
from ._src.policy.options import LayerwiseLoadOptions as LayerwiseLoadOptions
from ._src.policy.options import OffloadConfig as OffloadConfig
from ._src.policy.sizes import format_bytes as format_bytes
from ._src.policy.sizes import parse_bytes as parse_bytes
from ._src.policy.types import DENSE_TRANSFER_WINDOW as DENSE_TRANSFER_WINDOW
from ._src.policy.types import DenseDiskStream as DenseDiskStream
from ._src.policy.types import ExecutionResidency as ExecutionResidency
from ._src.policy.types import FullyResident as FullyResident
from ._src.policy.types import LayerWeightResidency as LayerWeightResidency
from ._src.policy.types import LayerwiseHost as LayerwiseHost
from ._src.policy.types import OrdinaryWeightResidency as OrdinaryWeightResidency
from ._src.store.save import save as save

__version__ = "0.1.0"

__all__ = [
  "DEFAULT_MAX_CACHED_SHARDS",
  "DENSE_TRANSFER_WINDOW",
  "AdmissionError",
  "BudgetTooSmallError",
  "CacheEvictionPolicy",
  "CheckpointMismatchError",
  "CheckpointShapeMismatchError",
  "ClosedError",
  "DenseDiskStream",
  "DenseDiskStreamLoadOptions",
  "DeviceBudgetTooSmallError",
  "ExecutionResidency",
  "FullyResident",
  "HostBudgetTooSmallError",
  "HostDisabledControlsError",
  "InvalidBudgetError",
  "InvalidPolicyValueError",
  "LayerWeightResidency",
  "LayerwiseHost",
  "LayerwiseLoadOptions",
  "MissingCheckpointParametersError",
  "ModelMetadata",
  "OffloadConfig",
  "OrdinaryWeightResidency",
  "PlacedModel",
  "PlacementError",
  "PrefetchError",
  "ResidencyError",
  "ResidencyRuntimeError",
  "StoreError",
  "StoreLayoutError",
  "StoreNotFoundError",
  "UnexpectedCheckpointParametersError",
  "UnitSelectionError",
  "UnknownPolicyFieldError",
  "WeightResidencyPolicyError",
  "ZeroHostLookaheadError",
  "ZeroMaxCachedShardsError",
  "ZeroPrefetchDepthError",
  "ZeroQueueCapacityError",
  "format_bytes",
  "linen",
  "parse_bytes",
  "place",
  "save",
  "scan_units",
]
