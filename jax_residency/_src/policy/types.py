"""Weight-residency policies: where a model's layer weights live (docs/design.md, section 1).

Pure Python, no JAX: policies can be built, validated, compared, hashed (so used
as static `jax.jit` arguments) and serialized without a backend. Their load
options, and the field checks, are in `options.py`; the keyword fields of the
constructors are in `fields.py`.

* `FullyResident()` keeps every unit on the execution device(s).
* `LayerwiseHost(prefetch_depth=2, ...)` keeps units in host memory and moves a
  window of `prefetch_depth` units to the device.
* `DenseDiskStream(host_budget_bytes="8GiB", ...)` leaves units on disk and
  streams them through a byte-bounded host cache into a device window of
  `DENSE_TRANSFER_WINDOW` units.

Policies take their fields as keywords (the fields of `OffloadConfig`,
`LayerwiseLoadOptions` or `DenseDiskStreamLoadOptions` that apply). The nested
form, `LayerwiseHost(LayerwiseLoadOptions(...))` or
`DenseDiskStream(DenseDiskStreamLoadOptions(...))`, remains valid and builds an
equal policy; giving an options object and keyword fields together raises
`InvalidPolicyValueError`, an unknown keyword `UnknownPolicyFieldError`.

Default budgets follow one rule (see `options.py`): a budget that only checks
what a policy places is unbounded unless given (`FullyResident`,
`LayerwiseHost`); the budgets of the caches `DenseDiskStream` fills on its own
default to 4 GiB (device) and 16 GiB (host).

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
from typing import Any, ClassVar, Self, Unpack, cast

from jax_residency._src.errors import InvalidPolicyValueError, UnknownPolicyFieldError
from jax_residency._src.policy.fields import (
  DENSE_FIELDS,
  LAYERWISE_FIELDS,
  RESIDENT_FIELDS,
  UNSET,
  DenseFields,
  LayerwiseFields,
  ResidentFields,
  check_fields,
  layerwise_options,
  options_of,
)
from jax_residency._src.policy.options import (
  DEFAULT_MAX_CACHED_SHARDS,
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
  check_budget,
  check_int,
  check_keys,
  format_budget,
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

  One of `FullyResident(...)`, `LayerwiseHost(...)` or `DenseDiskStream(...)`,
  each built from keyword fields (or, equally, from its options object). Match
  on the variants, with a wildcard arm: more variants may be added.

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
    >>> describe(DenseDiskStream(host_budget_bytes="2GiB"))
    'disk, host cache 2.0 GiB'
    >>> describe(LayerWeightResidency.of(LayerwiseLoadOptions()))
    'host, window 1'
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

    `FullyResident` has no options; a device budget set on it is a top-level
    `"device_budget_bytes"` key. Missing options take their defaults. Raises
    `UnknownPolicyFieldError` for an unknown key or kind.
    """
    owner = cls.__name__
    data = check_keys(
      owner, data, dict.fromkeys(k for v in _VARIANTS.values() for k in v._dict_keys)
    )
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
    policy: object = variant._from_data(data)
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


# --- variants ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True, init=False, repr=False)
class FullyResident(OrdinaryWeightResidency):
  """Every unit is built once and kept on the execution device(s).

  The one `OffloadConfig` field that applies is `device_budget_bytes`: bytes the
  device may hold for the whole model, checked when it is placed; `None` (the
  default) means unbounded. Size strings such as `"8GiB"` are accepted.

  Example:
    >>> p = FullyResident()
    >>> p.device_depth(32), p.max_cached_shards, p.dense, p.offload() == OffloadConfig()
    (32, 4, None, True)
    >>> FullyResident(device_budget_bytes="8GiB")
    FullyResident(device_budget_bytes=8.0 GiB)
    >>> FullyResident(device_budget_bytes="8GiB").offload().device_budget_bytes
    8589934592
  """

  device_budget_bytes: int | None = None
  __match_args__: ClassVar[tuple[str, ...]] = ()
  name: ClassVar[str] = "fully_resident"
  _dict_keys: ClassVar[tuple[str, ...]] = ("kind", *RESIDENT_FIELDS)

  def __init__(self, **fields: Unpack[ResidentFields]) -> None:
    owner = type(self).__name__
    check_fields(
      owner,
      fields,
      RESIDENT_FIELDS,
      " (every unit stays on the device, so only the device budget applies)",
    )
    budget = fields.get("device_budget_bytes")
    object.__setattr__(
      self, "device_budget_bytes", check_budget(owner, "device_budget_bytes", budget)
    )

  @classmethod
  def _from_data(cls, data: Mapping[str, Any]) -> Self:
    return cls(**{k: v for k, v in data.items() if k != "kind"})

  def to_dict(self) -> dict[str, Any]:
    """Returns `{"kind": "fully_resident"}`, plus `"device_budget_bytes"` where one is set."""
    out: dict[str, Any] = {"kind": self.name}
    if self.device_budget_bytes is not None:
      out["device_budget_bytes"] = self.device_budget_bytes
    return out

  def __repr__(self) -> str:
    if self.device_budget_bytes is None:
      return f"{type(self).__name__}()"
    return f"{type(self).__name__}(device_budget_bytes={format_budget(self.device_budget_bytes)})"

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
    return OffloadConfig(device_budget_bytes=self.device_budget_bytes)


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


@dataclasses.dataclass(frozen=True, init=False)
class LayerwiseHost(_ForwardsControls, OrdinaryWeightResidency):
  """Units are materialized in host memory; a window of `prefetch_depth` is on device.

  Keyword fields: those of `OffloadConfig` (`device_budget_bytes`,
  `host_budget_bytes`, `prefetch_depth`, `eviction_policy`) and of
  `LayerwiseLoadOptions` (`offload`, `max_cached_shards`, `strict_loading`,
  `sample_backend_memory`, `sample_process_memory`). `LayerwiseHost(options)`
  with a `LayerwiseLoadOptions` remains valid and equal.

  Defaults: both budgets unbounded (they only check what is placed: the device
  budget the static parameters plus the window, the host budget every unit),
  `prefetch_depth=1`, least-recently-used eviction, `max_cached_shards=4`.

  Example:
    >>> p = LayerwiseHost(prefetch_depth=3, device_budget_bytes="2GiB")
    >>> p.device_depth(32), p.offload().prefetch_depth, p.name
    (3, 3, 'layerwise_host')
    >>> cfg = OffloadConfig(prefetch_depth=3, device_budget_bytes="2GiB")
    >>> p == LayerwiseHost(LayerwiseLoadOptions(offload=cfg))
    True
    >>> LayerwiseHost.from_dict(p.to_dict()) == p
    True
  """

  options: LayerwiseLoadOptions = LayerwiseLoadOptions()
  name: ClassVar[str] = "layerwise_host"
  _dict_keys: ClassVar[tuple[str, ...]] = ("kind", "options")

  def __init__(
    self, options: LayerwiseLoadOptions = UNSET, **fields: Unpack[LayerwiseFields]
  ) -> None:
    opts = options_of(
      type(self).__name__,
      options,
      dict(fields),
      LayerwiseLoadOptions,
      LAYERWISE_FIELDS,
      layerwise_options,
    )
    object.__setattr__(self, "options", opts)

  @classmethod
  def _from_data(cls, data: Mapping[str, Any]) -> Self:
    options = data.get("options")
    return cls() if options is None else cls(LayerwiseLoadOptions.from_dict(options))

  @property
  def execution_residency(self) -> ExecutionResidency:
    return ExecutionResidency.LAYERWISE_HOST

  def device_depth(self, unit_count: int) -> int:
    _unit_count(unit_count)
    return self.options.offload.prefetch_depth

  def offload(self) -> OffloadConfig:
    return self.options.offload


@dataclasses.dataclass(frozen=True, init=False)
class DenseDiskStream(_ForwardsControls, OrdinaryWeightResidency):
  """Units stay cold on disk and stream through a host cache into a 2-unit device window.

  Keyword fields: those of `DenseDiskStreamLoadOptions` (`device_budget_bytes`,
  `host_budget_bytes`, `host_lookahead`, `background_queue_capacity`,
  `eviction_policy`, `max_cached_shards`, `strict_loading`,
  `sample_backend_memory`, `sample_process_memory`).
  `DenseDiskStream(options)` with a `DenseDiskStreamLoadOptions` remains valid
  and equal.

  Defaults: `device_budget_bytes` 4 GiB and `host_budget_bytes` 16 GiB (the
  stream fills these caches on its own, so they are bounded by default),
  `host_lookahead=2`, `background_queue_capacity=2`. `host_budget_bytes=0`
  alone selects direct disk-to-device loading: lookahead and queue then follow
  to 0; an explicit non-zero value for either raises `HostDisabledControlsError`.

  Example:
    >>> p = DenseDiskStream(host_lookahead=4)
    >>> p.device_depth(32), p.device_depth(1), p.offload().prefetch_depth
    (2, 1, 4)
    >>> p.dense is p.options
    True
    >>> direct = DenseDiskStream(host_budget_bytes=0)
    >>> direct.options.host_lookahead, direct.options.background_queue_capacity
    (0, 0)
    >>> direct == DenseDiskStream(DenseDiskStreamLoadOptions(host_budget_bytes=0))
    True
  """

  options: DenseDiskStreamLoadOptions = DenseDiskStreamLoadOptions()
  name: ClassVar[str] = "dense_disk_stream"
  _dict_keys: ClassVar[tuple[str, ...]] = ("kind", "options")

  def __init__(
    self, options: DenseDiskStreamLoadOptions = UNSET, **fields: Unpack[DenseFields]
  ) -> None:
    opts = options_of(
      type(self).__name__,
      options,
      dict(fields),
      DenseDiskStreamLoadOptions,
      DENSE_FIELDS,
      lambda kw: DenseDiskStreamLoadOptions(**kw),
    )
    object.__setattr__(self, "options", opts)

  @classmethod
  def _from_data(cls, data: Mapping[str, Any]) -> Self:
    options = data.get("options")
    return cls() if options is None else cls(DenseDiskStreamLoadOptions.from_dict(options))

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


_VARIANTS: dict[str, type[FullyResident] | type[LayerwiseHost] | type[DenseDiskStream]] = {
  v.name: v for v in (FullyResident, LayerwiseHost, DenseDiskStream)
}
