"""The keyword fields of the policy constructors.

`LayerwiseHost(prefetch_depth=2)` and `DenseDiskStream(host_budget_bytes=0)`
take the fields of their load options as keywords. This module names those
fields (as `TypedDict` s, so type checkers see them), rejects unknown ones with a
close-match hint, and turns the keywords into the options object the policy
holds. See `types.py` for the policies themselves.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypedDict, TypeVar

from jax_residency._src.errors import InvalidPolicyValueError, UnknownPolicyFieldError
from jax_residency._src.policy.experts import ExpertResidency
from jax_residency._src.policy.options import (
  CacheEvictionPolicy,
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
)

_O = TypeVar("_O", LayerwiseLoadOptions, DenseDiskStreamLoadOptions)


class _Unset:
  def __repr__(self) -> str:
    return "<unset>"


UNSET: Any = _Unset()


class ResidentFields(TypedDict, total=False):
  """The keyword fields of `FullyResident`."""

  device_budget_bytes: int | str | None


class _LoadControls(TypedDict, total=False):
  max_cached_shards: int
  strict_loading: bool
  sample_backend_memory: bool
  sample_process_memory: bool


class LayerwiseFields(_LoadControls, total=False):
  """The keyword fields of `LayerwiseHost`: those of `OffloadConfig` and `LayerwiseLoadOptions`."""

  device_budget_bytes: int | str | None
  host_budget_bytes: int | str | None
  prefetch_depth: int
  eviction_policy: CacheEvictionPolicy
  offload: OffloadConfig
  device_resident_units: int


class DenseFields(_LoadControls, total=False):
  """The keyword fields of `DenseDiskStream`: those of `DenseDiskStreamLoadOptions`."""

  device_budget_bytes: int | str | None
  host_budget_bytes: int | str | None
  host_lookahead: int
  background_queue_capacity: int
  device_resident_units: int
  host_resident_units: int
  eviction_policy: CacheEvictionPolicy
  experts: ExpertResidency | None


def _field_names(cls: type) -> tuple[str, ...]:
  return tuple(f.name for f in dataclasses.fields(cls))


OFFLOAD_FIELDS = _field_names(OffloadConfig)
LAYERWISE_FIELDS = OFFLOAD_FIELDS + _field_names(LayerwiseLoadOptions)
DENSE_FIELDS = _field_names(DenseDiskStreamLoadOptions)
RESIDENT_FIELDS = ("device_budget_bytes",)


def check_fields(
  owner: str, fields: Mapping[str, object], valid: Iterable[str], note: str = ""
) -> None:
  """Raises `UnknownPolicyFieldError` for the first keyword not in `valid`."""
  valid = tuple(valid)
  for key in fields:
    if key not in valid:
      close = difflib.get_close_matches(key, valid, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      raise UnknownPolicyFieldError(
        f"{owner}: unknown field {key!r}{hint}{note}; valid fields are "
        f"{', '.join(map(repr, valid))}."
      )


def format_fields(fields: Mapping[str, object]) -> str:
  return ", ".join(f"{k}={v!r}" for k, v in fields.items())


def options_of(
  owner: str,
  options: object,
  fields: dict[str, Any],
  expected: type[_O],
  valid: tuple[str, ...],
  build: Callable[[dict[str, Any]], _O],
) -> _O:
  """The options of a policy given either an options object or keyword fields."""
  check_fields(owner, fields, valid)
  if options is UNSET:
    return build(fields)
  if fields:
    raise InvalidPolicyValueError(
      f"{owner}: got both options={options!r} and the keyword fields {format_fields(fields)}; "
      f"pass either a {expected.__name__} or keyword fields, not both, e.g. "
      f"{owner}({format_fields(fields)})."
    )
  if not isinstance(options, expected):
    raise InvalidPolicyValueError(
      f"{owner}: options={options!r} has type {type(options).__name__}; pass a "
      f"{expected.__name__} or keyword fields, or use LayerWeightResidency.of(options) to pick "
      "the variant."
    )
  return options


def layerwise_options(fields: dict[str, Any]) -> LayerwiseLoadOptions:
  offload = {k: fields.pop(k) for k in OFFLOAD_FIELDS if k in fields}
  if offload:
    if "offload" in fields:
      raise InvalidPolicyValueError(
        f"LayerwiseHost: got both offload={fields['offload']!r} and the keyword fields "
        f"{format_fields(offload)}; pass either an OffloadConfig or its fields, not both."
      )
    fields["offload"] = OffloadConfig(**offload)
  return LayerwiseLoadOptions(**fields)
