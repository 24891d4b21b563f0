"""Errors in what the user asks for: a policy or one of its options is invalid."""

from __future__ import annotations

from jax_residency._src.errors.base import ResidencyError


class WeightResidencyPolicyError(ResidencyError, ValueError):
  """A weight-residency policy or one of its options is invalid.

  Raised when a policy or its options are built (constructors, ``from_dict``,
  ``of``), never later; the subclass names the rule that was broken.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.LayerWeightResidency.from_dict({"kind": "teleport"})
    ... except jr.errors.WeightResidencyPolicyError as e:
    ...   print(type(e).__name__, "'teleport'" in str(e))
    UnknownPolicyFieldError True
  """


class ZeroHostLookaheadError(WeightResidencyPolicyError):
  """A dense stream with a host cache was given `host_lookahead=0`.

  Raised by `DenseDiskStream` and its options when ``host_budget_bytes`` is not 0.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.DenseDiskStream(host_lookahead=0)
    ... except jr.errors.ZeroHostLookaheadError as e:
    ...   print(type(e).__name__, "set host_lookahead >= 1" in str(e))
    ZeroHostLookaheadError True
  """


class ZeroQueueCapacityError(WeightResidencyPolicyError):
  """A dense stream with a host cache was given `background_queue_capacity=0`.

  Raised by `DenseDiskStream` and its options when ``host_budget_bytes`` is not 0.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.DenseDiskStream(background_queue_capacity=0)
    ... except jr.errors.ZeroQueueCapacityError as e:
    ...   print(type(e).__name__, "background_queue_capacity >= 1" in str(e))
    ZeroQueueCapacityError True
  """


class HostDisabledControlsError(WeightResidencyPolicyError):
  """Host-cache controls were set although `host_budget_bytes=0` disables the host cache.

  Raised by `DenseDiskStream` and its options when ``host_lookahead`` or
  ``background_queue_capacity`` is not 0 with a zero host budget; unset, both are 0.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.DenseDiskStream(host_budget_bytes=0, host_lookahead=2)
    ... except jr.errors.HostDisabledControlsError as e:
    ...   print(type(e).__name__, "disables the host cache" in str(e))
    HostDisabledControlsError True
  """


class ZeroPrefetchDepthError(WeightResidencyPolicyError):
  """`prefetch_depth` was below 1.

  Raised by `OffloadConfig`, `LayerwiseHost` and `LayerwiseLoadOptions`.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.LayerwiseHost(prefetch_depth=0)
    ... except jr.errors.ZeroPrefetchDepthError as e:
    ...   print(type(e).__name__, "prefetch_depth=0 must be >= 1" in str(e))
    ZeroPrefetchDepthError True
  """


class InvalidBudgetError(WeightResidencyPolicyError):
  """A byte budget was negative, not an integer, or not a parseable size.

  Raised by `parse_bytes`, `format_bytes`, and every policy or option given one.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.FullyResident(device_budget_bytes=-1)
    ... except jr.errors.InvalidBudgetError as e:
    ...   print(type(e).__name__, "device_budget_bytes=-1 is negative" in str(e))
    InvalidBudgetError True
  """


class ZeroMaxCachedShardsError(WeightResidencyPolicyError):
  """`max_cached_shards` was below 1.

  Raised by `LayerwiseHost`, `DenseDiskStream` and their load options.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.LayerwiseHost(max_cached_shards=0)
    ... except jr.errors.ZeroMaxCachedShardsError as e:
    ...   print(type(e).__name__, "max_cached_shards=0 must be >= 1" in str(e))
    ZeroMaxCachedShardsError True
  """


class UnknownPolicyFieldError(WeightResidencyPolicyError):
  """A policy dictionary named a key or a kind the policy types do not have.

  Raised for an unknown policy keyword, ``from_dict`` key or ``kind``, or
  eviction-policy name; the message lists the valid ones.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.LayerwiseHost(prefetch_dept=2)
    ... except jr.errors.UnknownPolicyFieldError as e:
    ...   print(type(e).__name__, "unknown field 'prefetch_dept'" in str(e))
    UnknownPolicyFieldError True
  """


class InvalidPolicyValueError(WeightResidencyPolicyError):
  """A policy field or argument has the wrong type (e.g. a str flag), or `of()` got a non-policy.

  Raised by the policy and option constructors, ``from_dict`` and ``of``.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.LayerwiseHost(strict_loading="yes")
    ... except jr.errors.InvalidPolicyValueError as e:
    ...   print(type(e).__name__, "pass True or False" in str(e))
    InvalidPolicyValueError True
  """
