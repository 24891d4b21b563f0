"""Weight-residency policies: where a model's layer weights live (SPEC §1).

Pure Python, no JAX: policies can be built, validated, compared, hashed (so used
as static `jax.jit` arguments) and serialized without a backend. Their load
options, and the field checks, are in `options.py`.

* `FullyResident()` keeps every unit on the execution device(s).
* `LayerwiseHost(LayerwiseLoadOptions(...))` keeps units in host memory and
  moves a window of `prefetch_depth` units to the device.
* `DenseDiskStream(DenseDiskStreamLoadOptions(...))` leaves units on disk and
  streams them through a byte-bounded host cache into a device window of
  `DENSE_TRANSFER_WINDOW` units.

`OrdinaryWeightResidency` is the same three-way choice, used inside composite
placements. It is a distinct class between `LayerWeightResidency` and the three
variants: every variant is both, `OrdinaryWeightResidency.of()` converts like
`LayerWeightResidency.of()`, and `LayerWeightResidency.of()` accepts any
ordinary value unchanged. A future layer-only variant would subclass
`LayerWeightResidency` alone and be rejected by `OrdinaryWeightResidency.of()`.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
from collections.abc import Mapping
from typing import Any, ClassVar, Self, cast

from jax_residency._src.policy.errors import InvalidPolicyValueError, UnknownPolicyFieldError
from jax_residency._src.policy.options import (
  DEFAULT_MAX_CACHED_SHARDS,
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
  check_int,
  check_keys,
)

DENSE_TRANSFER_WINDOW = 2
"""Device window of `DenseDiskStream`, in units (the current one and the next)."""


class ExecutionResidency(enum.Enum):
  """The stable physical classification of a policy (see `execution_residency`).

  Example:
    >>> LayerWeightResidency.default().execution_residency
    ExecutionResidency.FULLY_RESIDENT
  """

  FULLY_RESIDENT = "fully_resident"
  LAYERWISE_HOST = "layerwise_host"
  DENSE_DISK_STREAM = "dense_disk_stream"

  def __repr__(self) -> str:
    return f"{type(self).__name__}.{self.name}"


# --- policies --------------------------------------------------------------


class LayerWeightResidency(abc.ABC):
  """Where a model's ordinary execution units (its layers) live.

  One of `FullyResident()`, `LayerwiseHost(options)` or
  `DenseDiskStream(options)`. Match on the variants, with a wildcard arm: more
  variants may be added.

  Example:
    >>> from jax_residency._src.policy.sizes import format_bytes
    >>> def describe(policy: LayerWeightResidency) -> str:
    ...   match policy:
    ...     case FullyResident():
    ...       return "all on device"
    ...     case LayerwiseHost(opts):
    ...       return f"host, window {opts.offload.prefetch_depth}"
    ...     case DenseDiskStream(opts):
    ...       return f"disk, host cache {format_bytes(opts.host_budget_bytes)}"
    ...     case _:
    ...       return "unknown"
    >>> describe(LayerWeightResidency.default())
    'all on device'
    >>> describe(LayerWeightResidency.of(DenseDiskStreamLoadOptions()))
    'disk, host cache 16.0 GiB'
  """

  name: ClassVar[str]
  """Short stable name, also the `"kind"` of `to_dict()`."""

  @classmethod
  def default(cls) -> Self:
    """Returns `FullyResident()` (for a variant class: that variant with default options)."""
    resident = FullyResident()
    return cast(Self, resident) if isinstance(resident, cls) else cast(Any, cls)()

  @classmethod
  def of(cls, value: object) -> Self:
    """Converts options or a policy into a policy of this class.

    Args:
      value: a `LayerwiseLoadOptions` (→ `LayerwiseHost`), a
        `DenseDiskStreamLoadOptions` (→ `DenseDiskStream`), or a policy of this
        class (returned unchanged; any `OrdinaryWeightResidency` is a
        `LayerWeightResidency`).

    Raises:
      InvalidPolicyValueError: `value` is anything else; the message names its type.
    """
    policy: object = value
    if isinstance(value, LayerwiseLoadOptions):
      policy = LayerwiseHost(value)
    elif isinstance(value, DenseDiskStreamLoadOptions):
      policy = DenseDiskStream(value)
    if isinstance(policy, cls):
      return policy
    raise InvalidPolicyValueError(
      f"{cls.__name__}.of() cannot convert value={value!r} of type {type(value).__name__}; "
      "pass a LayerwiseLoadOptions, a DenseDiskStreamLoadOptions, or a FullyResident(), "
      f"LayerwiseHost(...) or DenseDiskStream(...) that is a {cls.__name__}."
    )

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Self:
    """Builds a policy from `to_dict()` output, e.g. `{"kind": "layerwise_host", "options": {}}`.

    Missing options take their defaults. Raises `UnknownPolicyFieldError` for an
    unknown key or kind.
    """
    owner = cls.__name__
    data = check_keys(owner, data, ("kind", "options"))
    if "kind" not in data:
      raise InvalidPolicyValueError(
        f"{owner}.from_dict: missing key 'kind' in {dict(data)!r}; "
        f"add one of {', '.join(map(repr, _VARIANTS))}."
      )
    kind = data["kind"]
    variant = _VARIANTS.get(kind) if isinstance(kind, str) else None
    if variant is None:
      raise UnknownPolicyFieldError(
        f"{owner}: unknown kind={kind!r}; valid kinds are {', '.join(map(repr, _VARIANTS))}."
      )
    data = check_keys(f"{owner}(kind={kind!r})", data, variant._dict_keys)
    policy: object = variant._from_options(data.get("options"))
    if not isinstance(policy, cls):
      raise InvalidPolicyValueError(f"{owner}.from_dict: kind={kind!r} is not a {owner}.")
    return policy

  def to_dict(self) -> dict[str, Any]:
    """Returns `{"kind": name}`, plus `"options": options.to_dict()` where there are options."""
    return {"kind": self.name}

  @property
  @abc.abstractmethod
  def max_cached_shards(self) -> int:
    """Bound on open checkpoint shard handles/readers."""

  @property
  @abc.abstractmethod
  def strict_loading(self) -> bool:
    """Whether stored tensors the model does not claim are rejected."""

  @property
  @abc.abstractmethod
  def sample_backend_memory(self) -> bool:
    """Whether backend allocator memory is sampled."""

  @property
  @abc.abstractmethod
  def sample_process_memory(self) -> bool:
    """Whether process memory is sampled."""

  @property
  def dense(self) -> DenseDiskStreamLoadOptions | None:
    """The dense-stream options when this policy streams from disk, else `None`."""
    return None

  @property
  def is_fully_resident(self) -> bool:
    """Whether every ordinary unit stays on the device."""
    return self.execution_residency is ExecutionResidency.FULLY_RESIDENT

  @property
  @abc.abstractmethod
  def execution_residency(self) -> ExecutionResidency:
    """The stable physical execution classification."""

  @abc.abstractmethod
  def device_depth(self, unit_count: int) -> int:
    """The largest number of units on the device at once, for `unit_count` units."""

  @abc.abstractmethod
  def offload(self) -> OffloadConfig:
    """Resolves this policy into the shared offload configuration."""


class OrdinaryWeightResidency(LayerWeightResidency):
  """The same three-way choice, for the ordinary units of a composite placement.

  Every variant is an `OrdinaryWeightResidency`; `of()` and `default()` work as
  on `LayerWeightResidency`.

  Example:
    >>> policy = OrdinaryWeightResidency.of(LayerwiseLoadOptions())
    >>> policy.name, isinstance(policy, LayerWeightResidency)
    ('layerwise_host', True)
    >>> LayerWeightResidency.of(policy) is policy
    True
  """


def _unit_count(unit_count: object) -> int:
  count = check_int("device_depth", "unit_count", unit_count, 32)
  if count < 0:
    raise InvalidPolicyValueError(
      f"device_depth: unit_count={count!r} is negative; pass the number of units (>= 0)."
    )
  return count


@dataclasses.dataclass(frozen=True)
class FullyResident(OrdinaryWeightResidency):
  """Every unit is built once and kept on the execution device(s).

  Example:
    >>> p = FullyResident()
    >>> p.device_depth(32), p.max_cached_shards, p.dense, p.offload() == OffloadConfig()
    (32, 4, None, True)
  """

  name: ClassVar[str] = "fully_resident"

  _dict_keys: ClassVar[tuple[str, ...]] = ("kind",)

  @classmethod
  def _from_options(cls, options: object) -> Self:
    return cls()

  @property
  def max_cached_shards(self) -> int:
    return DEFAULT_MAX_CACHED_SHARDS

  @property
  def strict_loading(self) -> bool:
    return True

  @property
  def sample_backend_memory(self) -> bool:
    return False

  @property
  def sample_process_memory(self) -> bool:
    return False

  @property
  def execution_residency(self) -> ExecutionResidency:
    return ExecutionResidency.FULLY_RESIDENT

  def device_depth(self, unit_count: int) -> int:
    return _unit_count(unit_count)

  def offload(self) -> OffloadConfig:
    return OffloadConfig()


class _ForwardsControls:
  """The loading controls of a policy with options, read from those options."""

  name: ClassVar[str]
  options: LayerwiseLoadOptions | DenseDiskStreamLoadOptions

  @property
  def max_cached_shards(self) -> int:
    return self.options.max_cached_shards

  @property
  def strict_loading(self) -> bool:
    return self.options.strict_loading

  @property
  def sample_backend_memory(self) -> bool:
    return self.options.sample_backend_memory

  @property
  def sample_process_memory(self) -> bool:
    return self.options.sample_process_memory

  def to_dict(self) -> dict[str, Any]:
    return {"kind": self.name, "options": self.options.to_dict()}


@dataclasses.dataclass(frozen=True)
class LayerwiseHost(_ForwardsControls, OrdinaryWeightResidency):
  """Units are materialized in host memory; a window of `prefetch_depth` is on device.

  Example:
    >>> p = LayerwiseHost(LayerwiseLoadOptions(offload=OffloadConfig(prefetch_depth=3)))
    >>> p.device_depth(32), p.offload().prefetch_depth, p.name
    (3, 3, 'layerwise_host')
  """

  options: LayerwiseLoadOptions = LayerwiseLoadOptions()
  name: ClassVar[str] = "layerwise_host"
  _dict_keys: ClassVar[tuple[str, ...]] = ("kind", "options")

  def __post_init__(self) -> None:
    _check_options(self, LayerwiseLoadOptions)

  @classmethod
  def _from_options(cls, options: object) -> Self:
    return cls() if options is None else cls(LayerwiseLoadOptions.from_dict(cast(Any, options)))

  @property
  def execution_residency(self) -> ExecutionResidency:
    return ExecutionResidency.LAYERWISE_HOST

  def device_depth(self, unit_count: int) -> int:
    _unit_count(unit_count)
    return self.options.offload.prefetch_depth

  def offload(self) -> OffloadConfig:
    return self.options.offload


@dataclasses.dataclass(frozen=True)
class DenseDiskStream(_ForwardsControls, OrdinaryWeightResidency):
  """Units stay cold on disk and stream through a host cache into a 2-unit device window.

  Example:
    >>> p = DenseDiskStream(DenseDiskStreamLoadOptions(host_lookahead=4))
    >>> p.device_depth(32), p.device_depth(1), p.offload().prefetch_depth
    (2, 1, 4)
    >>> p.dense is p.options
    True
  """

  options: DenseDiskStreamLoadOptions = DenseDiskStreamLoadOptions()
  name: ClassVar[str] = "dense_disk_stream"
  _dict_keys: ClassVar[tuple[str, ...]] = ("kind", "options")

  def __post_init__(self) -> None:
    _check_options(self, DenseDiskStreamLoadOptions)

  @classmethod
  def _from_options(cls, options: object) -> Self:
    return (
      cls() if options is None else cls(DenseDiskStreamLoadOptions.from_dict(cast(Any, options)))
    )

  @property
  def dense(self) -> DenseDiskStreamLoadOptions | None:
    return self.options

  @property
  def execution_residency(self) -> ExecutionResidency:
    return ExecutionResidency.DENSE_DISK_STREAM

  def device_depth(self, unit_count: int) -> int:
    return min(_unit_count(unit_count), DENSE_TRANSFER_WINDOW)

  def offload(self) -> OffloadConfig:
    o = self.options
    o.validate()
    return OffloadConfig(
      device_budget_bytes=o.device_budget_bytes,
      host_budget_bytes=o.host_budget_bytes,
      prefetch_depth=max(o.host_lookahead, DENSE_TRANSFER_WINDOW),
      eviction_policy=o.eviction_policy,
    )


def _check_options(policy: LayerwiseHost | DenseDiskStream, expected: type) -> None:
  options = policy.options
  if not isinstance(options, expected):
    owner = type(policy).__name__
    raise InvalidPolicyValueError(
      f"{owner}: options={options!r} has type {type(options).__name__}; pass a "
      f"{expected.__name__}, or use LayerWeightResidency.of(options) to pick the variant."
    )


_VARIANTS: dict[str, type[FullyResident] | type[LayerwiseHost] | type[DenseDiskStream]] = {
  v.name: v for v in (FullyResident, LayerwiseHost, DenseDiskStream)
}
