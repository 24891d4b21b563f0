"""jax_residency: run Flax models whose weights do not fit in accelerator memory.

Pick where a model's layers live — on the device (`FullyResident`), in pinned
host memory streamed through a bounded device window (`LayerwiseHost`), or cold
on disk behind byte-bounded host and device caches (`DenseDiskStream`) — and
get the plain model's outputs with memory held to your budgets.
"""

from . import linen as linen
from ._src.errors import AdmissionError as AdmissionError
from ._src.errors import BudgetTooSmallError as BudgetTooSmallError
from ._src.errors import CheckpointMismatchError as CheckpointMismatchError
from ._src.errors import CheckpointShapeMismatchError as CheckpointShapeMismatchError
from ._src.errors import ClosedError as ClosedError
from ._src.errors import DeviceBudgetTooSmallError as DeviceBudgetTooSmallError
from ._src.errors import HostBudgetTooSmallError as HostBudgetTooSmallError
from ._src.errors import HostDisabledControlsError as HostDisabledControlsError
from ._src.errors import InvalidBudgetError as InvalidBudgetError
from ._src.errors import InvalidPolicyValueError as InvalidPolicyValueError
from ._src.errors import MissingCheckpointParametersError as MissingCheckpointParametersError
from ._src.errors import PlacementError as PlacementError
from ._src.errors import PrefetchError as PrefetchError
from ._src.errors import ResidencyError as ResidencyError
from ._src.errors import ResidencyRuntimeError as ResidencyRuntimeError
from ._src.errors import StoreError as StoreError
from ._src.errors import StoreLayoutError as StoreLayoutError
from ._src.errors import StoreNotFoundError as StoreNotFoundError
from ._src.errors import UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError
from ._src.errors import UnitSelectionError as UnitSelectionError
from ._src.errors import UnknownPolicyFieldError as UnknownPolicyFieldError
from ._src.errors import WeightResidencyPolicyError as WeightResidencyPolicyError
from ._src.errors import ZeroHostLookaheadError as ZeroHostLookaheadError
from ._src.errors import ZeroMaxCachedShardsError as ZeroMaxCachedShardsError
from ._src.errors import ZeroPrefetchDepthError as ZeroPrefetchDepthError
from ._src.errors import ZeroQueueCapacityError as ZeroQueueCapacityError
from ._src.options import DEFAULT_MAX_CACHED_SHARDS as DEFAULT_MAX_CACHED_SHARDS
from ._src.options import CacheEvictionPolicy as CacheEvictionPolicy
from ._src.options import DenseDiskStreamLoadOptions as DenseDiskStreamLoadOptions
from ._src.options import LayerwiseLoadOptions as LayerwiseLoadOptions
from ._src.options import OffloadConfig as OffloadConfig
from ._src.placed import PlacedModel as PlacedModel
from ._src.placed import place as place
from ._src.plan import ModelMetadata as ModelMetadata
from ._src.policy import DENSE_TRANSFER_WINDOW as DENSE_TRANSFER_WINDOW
from ._src.policy import DenseDiskStream as DenseDiskStream
from ._src.policy import ExecutionResidency as ExecutionResidency
from ._src.policy import FullyResident as FullyResident
from ._src.policy import LayerWeightResidency as LayerWeightResidency
from ._src.policy import LayerwiseHost as LayerwiseHost
from ._src.policy import OrdinaryWeightResidency as OrdinaryWeightResidency
from ._src.save import save as save
from ._src.sizes import format_bytes as format_bytes
from ._src.sizes import parse_bytes as parse_bytes
from ._src.unit_loop import scan_units as scan_units

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
