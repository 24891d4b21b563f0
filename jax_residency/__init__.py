"""jax_residency: run Flax models whose weights do not fit in accelerator memory.

Pick where a model's layers live — on the device (`FullyResident`), in pinned
host memory streamed through a bounded device window (`LayerwiseHost`), or cold
on disk behind byte-bounded host and device caches (`DenseDiskStream`) — and
get the plain model's outputs with memory held to your budgets.

The public surface (``__all__``):

* placing: `place`, `PlacedModel` (``placed.arrays()``, ``placed.report()``,
  ``placed.metadata``), `scan_units`, `linen` (``jr.linen.scan``), `save`, and
  `picked_experts` (a mixture of experts marks the experts its router picks);
* choosing a placement: `measure` and the `Measurement` it returns (a store's read
  bandwidths, host-to-device bandwidth and a unit step's time on this backend), and
  `plan`, every placement a store's (or a config.json's) budgets admit as a
  `Candidate` with its predicted times for a `Workload`, fastest first; `Accelerator`,
  an accelerator's figures given as numbers, to plan for a machine this is not;
* policies and their options: `FullyResident`, `LayerwiseHost`,
  `DenseDiskStream` (with `ExpertResidency`, a mixture of experts' experts read only
  when picked), `LayerWeightResidency`, `OrdinaryWeightResidency`,
  `ExecutionResidency`, `LayerwiseLoadOptions`, `DenseDiskStreamLoadOptions`,
  `OffloadConfig`, `CacheEvictionPolicy`, `parse_bytes`, `format_bytes`;
* reading stores: `ReadOptions` (retries and time-outs, for remote stores);
* what you get back: `ModelMetadata` with its `MemoryItem` s and
  `StackMetadata` s, `StoreInfo` (from `save`) with its `StackInfo` s, and
  `Report` (``placed.report()``) with its `PassReport` s (each with a
  `StackPass` per layer stack), `Totals`, `TierMetrics`, `WorkerMetrics`,
  `ExpertMetrics`, `SpeculationTotals` and
  `TimelinePoint` s; every field is described in ``docs/reports.md``;
* errors: the module `errors` (``jr.errors``) holds every error type and
  documents the hierarchy. The top level lists only `ResidencyError` (the base
  of them all) and the ones a user catches most: `BudgetTooSmallError`,
  `DeviceBudgetTooSmallError`, `HostBudgetTooSmallError`, `PlacementError`,
  `StoreError` and `ClosedError`. The other error types stay importable from
  the top level (``jr.StoreLayoutError``) for code written against earlier
  versions, but are not in ``__all__``; new code should use ``jr.errors``;
* constants: ``DENSE_TRANSFER_WINDOW``, the device window of `DenseDiskStream`
  in units (2: the current unit and the next), and
  ``DEFAULT_MAX_CACHED_SHARDS``, the default ``max_cached_shards`` of the load
  options (open checkpoint shard handles kept).
"""

import importlib
from typing import TYPE_CHECKING, Any

from . import errors as errors
from .errors import AdmissionError as AdmissionError
from .errors import BudgetTooSmallError as BudgetTooSmallError
from .errors import CheckpointMismatchError as CheckpointMismatchError
from .errors import CheckpointShapeMismatchError as CheckpointShapeMismatchError
from .errors import ClosedError as ClosedError
from .errors import DeviceBudgetTooSmallError as DeviceBudgetTooSmallError
from .errors import HostBudgetTooSmallError as HostBudgetTooSmallError
from .errors import HostDisabledControlsError as HostDisabledControlsError
from .errors import InvalidBudgetError as InvalidBudgetError
from .errors import InvalidPolicyValueError as InvalidPolicyValueError
from .errors import InvalidPromptsError as InvalidPromptsError
from .errors import MeasurementMismatchError as MeasurementMismatchError
from .errors import MissingCheckpointParametersError as MissingCheckpointParametersError
from .errors import ModelConfigError as ModelConfigError
from .errors import PlacementError as PlacementError
from .errors import PrefetchError as PrefetchError
from .errors import QuantizationError as QuantizationError
from .errors import ResidencyError as ResidencyError
from .errors import ResidencyRuntimeError as ResidencyRuntimeError
from .errors import SpeculationError as SpeculationError
from .errors import StoreCorruptionError as StoreCorruptionError
from .errors import StoreError as StoreError
from .errors import StoreLayoutError as StoreLayoutError
from .errors import StoreNotFoundError as StoreNotFoundError
from .errors import StoreReplacedError as StoreReplacedError
from .errors import StoreTimeoutError as StoreTimeoutError
from .errors import StoreUnavailableError as StoreUnavailableError
from .errors import (
  UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError,
)
from .errors import UnitSelectionError as UnitSelectionError
from .errors import UnknownPolicyFieldError as UnknownPolicyFieldError
from .errors import WeightResidencyPolicyError as WeightResidencyPolicyError
from .errors import ZeroHostLookaheadError as ZeroHostLookaheadError
from .errors import ZeroMaxCachedShardsError as ZeroMaxCachedShardsError
from .errors import ZeroPrefetchDepthError as ZeroPrefetchDepthError
from .errors import ZeroQueueCapacityError as ZeroQueueCapacityError

if TYPE_CHECKING:  # what the names below are, for type checkers (loaded lazily at run time)
  from . import linen as linen
  from ._src.loop.picked import picked_experts as picked_experts
  from ._src.loop.unit_loop import scan_units as scan_units
  from ._src.plan.budget import ModelMetadata as ModelMetadata
  from ._src.plan.budget import StackMetadata as StackMetadata
  from ._src.plan.memory import MemoryItem as MemoryItem
  from ._src.policy.experts import ExpertResidency as ExpertResidency
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
  from ._src.report.metrics import StackPass as StackPass
  from ._src.report.records import PassReport as PassReport
  from ._src.report.records import Report as Report
  from ._src.report.records import TimelinePoint as TimelinePoint
  from ._src.report.records import Totals as Totals
  from ._src.report.speculation import SpeculationTotals as SpeculationTotals
  from ._src.report.stream_metrics import ExpertMetrics as ExpertMetrics
  from ._src.report.stream_metrics import TierMetrics as TierMetrics
  from ._src.report.stream_metrics import WorkerMetrics as WorkerMetrics
  from ._src.run.accelerator import Accelerator as Accelerator
  from ._src.run.measure import Measurement as Measurement
  from ._src.run.measure import measure as measure
  from ._src.run.place import PlacedModel as PlacedModel
  from ._src.run.place import place as place
  from ._src.run.planner import Candidate as Candidate
  from ._src.run.planner import Workload as Workload
  from ._src.run.planner import plan as plan
  from ._src.store.info import StackInfo as StackInfo
  from ._src.store.info import StoreInfo as StoreInfo
  from ._src.store.read_options import ReadOptions as ReadOptions
  from ._src.store.save import save as save
  from ._src.version import __version__ as __version__

#: The public names defined in ``_src``, by the module that defines each: loaded when first
#: used (PEP 562), so that importing the package, or ``jax-residency --help``, does not
#: import JAX. ``""``: a submodule of the package.
_LAZY: dict[str, str] = {
  "picked_experts": "jax_residency._src.loop.picked",
  "scan_units": "jax_residency._src.loop.unit_loop",
  "ModelMetadata": "jax_residency._src.plan.budget",
  "StackMetadata": "jax_residency._src.plan.budget",
  "MemoryItem": "jax_residency._src.plan.memory",
  "ExpertResidency": "jax_residency._src.policy.experts",
  "DEFAULT_MAX_CACHED_SHARDS": "jax_residency._src.policy.options",
  "CacheEvictionPolicy": "jax_residency._src.policy.options",
  "DenseDiskStreamLoadOptions": "jax_residency._src.policy.options",
  "LayerwiseLoadOptions": "jax_residency._src.policy.options",
  "OffloadConfig": "jax_residency._src.policy.options",
  "format_bytes": "jax_residency._src.policy.sizes",
  "parse_bytes": "jax_residency._src.policy.sizes",
  "DENSE_TRANSFER_WINDOW": "jax_residency._src.policy.types",
  "DenseDiskStream": "jax_residency._src.policy.types",
  "ExecutionResidency": "jax_residency._src.policy.types",
  "FullyResident": "jax_residency._src.policy.types",
  "LayerWeightResidency": "jax_residency._src.policy.types",
  "LayerwiseHost": "jax_residency._src.policy.types",
  "OrdinaryWeightResidency": "jax_residency._src.policy.types",
  "StackPass": "jax_residency._src.report.metrics",
  "PassReport": "jax_residency._src.report.records",
  "Report": "jax_residency._src.report.records",
  "TimelinePoint": "jax_residency._src.report.records",
  "Totals": "jax_residency._src.report.records",
  "SpeculationTotals": "jax_residency._src.report.speculation",
  "ExpertMetrics": "jax_residency._src.report.stream_metrics",
  "TierMetrics": "jax_residency._src.report.stream_metrics",
  "WorkerMetrics": "jax_residency._src.report.stream_metrics",
  "Accelerator": "jax_residency._src.run.accelerator",
  "Measurement": "jax_residency._src.run.measure",
  "measure": "jax_residency._src.run.measure",
  "PlacedModel": "jax_residency._src.run.place",
  "place": "jax_residency._src.run.place",
  "Candidate": "jax_residency._src.run.planner",
  "Workload": "jax_residency._src.run.planner",
  "plan": "jax_residency._src.run.planner",
  "StackInfo": "jax_residency._src.store.info",
  "StoreInfo": "jax_residency._src.store.info",
  "ReadOptions": "jax_residency._src.store.read_options",
  "save": "jax_residency._src.store.save",
  "__version__": "jax_residency._src.version",
  "linen": "",
}


def __getattr__(name: str) -> Any:
  module = _LAZY.get(name)
  if module is None:
    raise AttributeError(f"module 'jax_residency' has no attribute {name!r}")
  value = importlib.import_module(f"jax_residency.{name}" if module == "" else module)
  if module != "":
    value = getattr(value, name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_LAZY})


__all__ = [
  # placing
  "PlacedModel",
  "linen",
  "picked_experts",
  "place",
  "save",
  "scan_units",
  # choosing a placement
  "Accelerator",
  "Candidate",
  "Measurement",
  "Workload",
  "measure",
  "plan",
  # policies and their options
  "CacheEvictionPolicy",
  "DenseDiskStream",
  "DenseDiskStreamLoadOptions",
  "ExecutionResidency",
  "ExpertResidency",
  "FullyResident",
  "LayerWeightResidency",
  "LayerwiseHost",
  "LayerwiseLoadOptions",
  "OffloadConfig",
  "OrdinaryWeightResidency",
  "format_bytes",
  "parse_bytes",
  # reading stores
  "ReadOptions",
  # what you get back
  "ExpertMetrics",
  "MemoryItem",
  "ModelMetadata",
  "PassReport",
  "Report",
  "StackInfo",
  "StackMetadata",
  "StackPass",
  "StoreInfo",
  "TierMetrics",
  "TimelinePoint",
  "Totals",
  "SpeculationTotals",
  "WorkerMetrics",
  # errors (every error type is in jr.errors)
  "BudgetTooSmallError",
  "ClosedError",
  "DeviceBudgetTooSmallError",
  "HostBudgetTooSmallError",
  "PlacementError",
  "ResidencyError",
  "StoreError",
  "errors",
  # constants
  "DEFAULT_MAX_CACHED_SHARDS",
  "DENSE_TRANSFER_WINDOW",
]
