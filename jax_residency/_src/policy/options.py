"""Load options of the weight-residency policies and their field checks (docs/design.md, section 1).

Pure Python, no JAX: options can be built, validated, compared, hashed (so used
as static `jax.jit` arguments) and serialized without a backend.

* `OffloadConfig`: budgets, device window and eviction policy; every policy
  resolves to one (see `LayerWeightResidency.offload()`).
* `LayerwiseLoadOptions`: the controls of `LayerwiseHost`.
* `DenseDiskStreamLoadOptions`: the controls of `DenseDiskStream`.

Validation happens in `__post_init__`, so `dataclasses.replace` revalidates.
Per object, fields are checked in declaration order (types, then ranges), then
the cross-field rules. For `DenseDiskStreamLoadOptions` those rules apply in
this order: `host_budget_bytes == 0` with a host control set to a non-zero
value raises `HostDisabledControlsError`; otherwise `host_lookahead < 1` raises
`ZeroHostLookaheadError`, then `background_queue_capacity < 1` raises
`ZeroQueueCapacityError`. `host_lookahead` and `background_queue_capacity` left
unset follow the host budget: 2 with a host cache, 0 with `host_budget_bytes=0`.
Budgets may be given as size strings (`"512MiB"`) and are stored as ints.

Default budgets, one rule for every policy: a budget that only checks what the
policy places (the device budget of `FullyResident` and `LayerwiseHost`, the
host budget of `LayerwiseHost`) is unbounded unless given; a budget that sizes a
cache the policy fills on its own (the host unit cache and the device tier of
`DenseDiskStream`) has a finite default, `DEFAULT_DENSE_HOST_BUDGET_BYTES` and
`DEFAULT_DENSE_DEVICE_BUDGET_BYTES`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from jax_residency._src.errors import (
  HostDisabledControlsError,
  InvalidPolicyValueError,
  ZeroHostLookaheadError,
  ZeroMaxCachedShardsError,
  ZeroPrefetchDepthError,
  ZeroQueueCapacityError,
)
from jax_residency._src.policy.checks import CacheEvictionPolicy as CacheEvictionPolicy
from jax_residency._src.policy.checks import Options, check_bool, check_member
from jax_residency._src.policy.checks import check_budget as check_budget
from jax_residency._src.policy.checks import check_int as check_int
from jax_residency._src.policy.checks import check_keys as check_keys
from jax_residency._src.policy.checks import check_units as check_units
from jax_residency._src.policy.checks import format_budget as format_budget
from jax_residency._src.policy.experts import ExpertResidency, check_experts
from jax_residency._src.policy.sizes import GiB, format_bytes

DEFAULT_MAX_CACHED_SHARDS = 4
"""Default bound on open checkpoint shard handles/readers."""

DEFAULT_DENSE_DEVICE_BUDGET_BYTES = 4 * GiB
"""Default `device_budget_bytes` of `DenseDiskStream` (its device tier); 4 GiB."""

DEFAULT_DENSE_HOST_BUDGET_BYTES = 16 * GiB
"""Default `host_budget_bytes` of `DenseDiskStream` (its host unit cache); 16 GiB."""

DEFAULT_HOST_LOOKAHEAD = 2
"""Default `host_lookahead` of `DenseDiskStream` with a host cache (0 without one)."""

DEFAULT_BACKGROUND_QUEUE_CAPACITY = 2
"""Default `background_queue_capacity` of `DenseDiskStream` with a host cache (0 without one)."""


class _FollowsHostBudget:
  """Default of the dense host controls, resolved in `__post_init__` from `host_budget_bytes`."""

  def __repr__(self) -> str:
    return "<2, or 0 when host_budget_bytes=0>"


FOLLOWS_HOST_BUDGET: Any = _FollowsHostBudget()
"""Default of `host_lookahead` / `background_queue_capacity`: 2 with a host cache, 0 without."""

# --- options ---------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class OffloadConfig(Options):
  """The shared offload configuration every policy resolves to (see `offload()`).

  Attributes:
    device_budget_bytes: bytes the execution device may hold for the model
      (static parameters plus the unit window); `None` means unbounded, `0`
      means nothing fits. Size strings such as `"4GiB"` are accepted.
    host_budget_bytes: bytes the host cache may hold; `None` means unbounded.
    prefetch_depth: units on device at once (the window); at least 1.
    eviction_policy: which cached unit to evict first.

  Example:
    >>> cfg = OffloadConfig(device_budget_bytes="4GiB", prefetch_depth=2)
    >>> cfg.device_budget_bytes
    4294967296
    >>> cfg  # doctest: +NORMALIZE_WHITESPACE
    OffloadConfig(device_budget_bytes=4.0 GiB, host_budget_bytes=unbounded,
      prefetch_depth=2, eviction_policy=CacheEvictionPolicy.LEAST_RECENTLY_USED)
    >>> cfg.with_eviction_policy(CacheEvictionPolicy.LEAST_FREQUENTLY_USED).prefetch_depth
    2
  """

  device_budget_bytes: int | None = None
  host_budget_bytes: int | None = None
  prefetch_depth: int = 1
  eviction_policy: CacheEvictionPolicy = CacheEvictionPolicy.LEAST_RECENTLY_USED

  def __post_init__(self) -> None:
    owner = self._check_budgets()
    set_ = object.__setattr__
    depth = check_int(owner, "prefetch_depth", self.prefetch_depth, 1)
    if depth < 1:
      raise ZeroPrefetchDepthError(
        f"{owner}: prefetch_depth={depth!r} must be >= 1; set prefetch_depth=1 for one unit "
        "on device at a time, or more to overlap transfers with compute."
      )
    set_(self, "prefetch_depth", depth)
    check_member(owner, "eviction_policy", self.eviction_policy, CacheEvictionPolicy)

  def with_eviction_policy(self, policy: CacheEvictionPolicy) -> OffloadConfig:
    """Returns a copy with `eviction_policy` replaced."""
    return dataclasses.replace(self, eviction_policy=policy)


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class LayerwiseLoadOptions(Options):
  """Controls of `LayerwiseHost`: units in host memory, a device window of them.

  Attributes:
    offload: budgets, window (`prefetch_depth`) and eviction policy.
    device_resident_units: the first this many units of each stack stay in
      device memory for the placement's life and never move; the program moves
      only the rest from ``pinned_host`` memory through the window (docs/design.md,
      4.6). The device budget pays for them beside the window.
    max_cached_shards: open checkpoint shard handles/readers kept; at least 1.
    strict_loading: reject stored tensors the model does not claim.
    sample_backend_memory: record the backend's memory statistics per pass.
    sample_process_memory: record process RSS and page faults per pass.

  Example:
    >>> from jax_residency._src.policy.types import LayerwiseHost
    >>> opts = LayerwiseLoadOptions(offload=OffloadConfig(prefetch_depth=2))
    >>> LayerwiseHost(opts).device_depth(32)
    2
  """

  offload: OffloadConfig = OffloadConfig()
  _nested: ClassVar[dict[str, type[Options]]] = {"offload": OffloadConfig}
  device_resident_units: int = 0
  max_cached_shards: int = DEFAULT_MAX_CACHED_SHARDS
  strict_loading: bool = True
  sample_backend_memory: bool = False
  sample_process_memory: bool = False

  def __post_init__(self) -> None:
    owner = type(self).__name__
    if not isinstance(self.offload, OffloadConfig):
      raise InvalidPolicyValueError(
        f"{owner}: offload={self.offload!r} has type {type(self.offload).__name__}; "
        "pass an OffloadConfig, e.g. offload=OffloadConfig(prefetch_depth=2)."
      )
    units = check_units(owner, "device_resident_units", self.device_resident_units)
    object.__setattr__(self, "device_resident_units", units)
    object.__setattr__(self, "max_cached_shards", _max_cached_shards(owner, self.max_cached_shards))
    for name in ("strict_loading", "sample_backend_memory", "sample_process_memory"):
      check_bool(owner, name, getattr(self, name))


def _max_cached_shards(owner: str, value: object) -> int:
  shards = check_int(owner, "max_cached_shards", value, DEFAULT_MAX_CACHED_SHARDS)
  if shards < 1:
    raise ZeroMaxCachedShardsError(
      f"{owner}: max_cached_shards={shards!r} must be >= 1; set max_cached_shards="
      f"{DEFAULT_MAX_CACHED_SHARDS} (the default) or another positive bound."
    )
  return shards


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class DenseDiskStreamLoadOptions(Options):
  """Controls of `DenseDiskStream`: units on disk, a host cache, a device window.

  Defaults: `device_budget_bytes` 4 GiB, `host_budget_bytes` 16 GiB (budgets
  of caches the stream fills on its own, so bounded by default), lookahead 2,
  queue 2. `host_budget_bytes=0` selects direct disk-to-device loading (no host
  cache, no background thread): `host_lookahead` and
  `background_queue_capacity` then follow to 0 when left unset, and an explicit
  non-zero value for either raises `HostDisabledControlsError`.

  Attributes:
    device_budget_bytes: bytes the device may hold (static parameters plus a
      window of `DENSE_TRANSFER_WINDOW` units); `None` means unbounded.
    host_budget_bytes: bytes of the host unit cache; `None` means unbounded,
      `0` disables the cache.
    host_lookahead: units read ahead into (and protected in) the host cache;
      unset, 2 with a host cache and 0 with `host_budget_bytes=0`.
    background_queue_capacity: pending reads the prefetch worker's FIFO holds;
      a full queue blocks the submitter. Unset, it follows the host budget
      like `host_lookahead`.
    device_resident_units: the first this many units of each stack are read
      once, at placement, and stay on the device: they never move again, and the
      device budget pays for them beside the window (docs/design.md, 4.6).
    host_resident_units: the next this many units of each stack stay in host
      memory from placement on (out of the host budget, beside the cache): a
      pass moves them to the device but never reads them from the store.
      Needs a host budget; with ``host_budget_bytes=0`` a value other than 0
      raises `HostDisabledControlsError`.
    eviction_policy: which cached unit to evict first.
    max_cached_shards: open TensorStore handles/readers kept; at least 1.
    strict_loading: reject stored tensors the model does not claim.
    sample_backend_memory: record the backend's memory statistics per pass.
    sample_process_memory: record process RSS and page faults per pass.
    experts: where a mixture of experts' experts live (`ExpertResidency`): read only
      when the router picks them, through expert caches of their own. ``None``
      (the default): each layer's experts move with its unit.

  Example:
    >>> from jax_residency._src.policy.types import DenseDiskStream
    >>> opts = DenseDiskStreamLoadOptions(host_budget_bytes="512MiB", host_lookahead=3)
    >>> opts.host_budget_bytes
    536870912
    >>> opts  # doctest: +NORMALIZE_WHITESPACE
    DenseDiskStreamLoadOptions(device_budget_bytes=4.0 GiB, host_budget_bytes=512.0 MiB,
      host_lookahead=3, background_queue_capacity=2, device_resident_units=0,
      host_resident_units=0, eviction_policy=CacheEvictionPolicy.LEAST_RECENTLY_USED,
      max_cached_shards=4,
      strict_loading=True, sample_backend_memory=False, sample_process_memory=False,
      experts=None)
    >>> direct = DenseDiskStreamLoadOptions(host_budget_bytes=0)
    >>> direct.host_lookahead, direct.background_queue_capacity
    (0, 0)
    >>> DenseDiskStream(direct).offload().prefetch_depth
    2
  """

  device_budget_bytes: int | None = DEFAULT_DENSE_DEVICE_BUDGET_BYTES
  host_budget_bytes: int | None = DEFAULT_DENSE_HOST_BUDGET_BYTES
  host_lookahead: int = FOLLOWS_HOST_BUDGET
  background_queue_capacity: int = FOLLOWS_HOST_BUDGET
  device_resident_units: int = 0
  host_resident_units: int = 0
  eviction_policy: CacheEvictionPolicy = CacheEvictionPolicy.LEAST_RECENTLY_USED
  max_cached_shards: int = DEFAULT_MAX_CACHED_SHARDS
  strict_loading: bool = True
  sample_backend_memory: bool = False
  sample_process_memory: bool = False
  experts: ExpertResidency | None = None
  _nested: ClassVar[dict[str, type[Options]]] = {"experts": ExpertResidency}

  def __post_init__(self) -> None:
    owner = self._check_budgets()
    set_ = object.__setattr__
    set_(self, "experts", check_experts(owner, self.experts))
    direct = self.host_budget_bytes == 0
    for name, default in (
      ("host_lookahead", DEFAULT_HOST_LOOKAHEAD),
      ("background_queue_capacity", DEFAULT_BACKGROUND_QUEUE_CAPACITY),
    ):
      if getattr(self, name) is FOLLOWS_HOST_BUDGET:
        set_(self, name, 0 if direct else default)
    set_(self, "host_lookahead", check_int(owner, "host_lookahead", self.host_lookahead, 2))
    set_(
      self,
      "background_queue_capacity",
      check_int(owner, "background_queue_capacity", self.background_queue_capacity, 2),
    )
    for name in ("device_resident_units", "host_resident_units"):
      set_(self, name, check_units(owner, name, getattr(self, name)))
    self.validate()

  def validate(self) -> None:
    """Checks every field and the host-cache rules; raises on the first violation.

    Raises:
      HostDisabledControlsError: `host_budget_bytes == 0` and `host_lookahead`,
        `background_queue_capacity` or `host_resident_units` was set to a value
        other than 0.
      ZeroHostLookaheadError: a host cache (budget > 0 or `None`) with
        `host_lookahead < 1`.
      ZeroQueueCapacityError: a host cache with `background_queue_capacity < 1`.
      InvalidBudgetError, InvalidPolicyValueError, ZeroMaxCachedShardsError:
        a field has a bad type or value.
    """
    owner = type(self).__name__
    check_budget(owner, "device_budget_bytes", self.device_budget_bytes)
    host = check_budget(owner, "host_budget_bytes", self.host_budget_bytes)
    lookahead = check_int(owner, "host_lookahead", self.host_lookahead, 2)
    queue = check_int(owner, "background_queue_capacity", self.background_queue_capacity, 2)
    check_units(owner, "device_resident_units", self.device_resident_units)
    pinned = check_units(owner, "host_resident_units", self.host_resident_units)
    check_member(owner, "eviction_policy", self.eviction_policy, CacheEvictionPolicy)
    _max_cached_shards(owner, self.max_cached_shards)
    for name in ("strict_loading", "sample_backend_memory", "sample_process_memory"):
      check_bool(owner, name, getattr(self, name))
    if check_experts(owner, self.experts) is not None:
      self.experts.validate()  # type: ignore[union-attr]
    if host == 0:
      if pinned:
        raise HostDisabledControlsError(
          f"{owner}: host_budget_bytes=0 disables host memory for units, but "
          f"host_resident_units={pinned!r} asks to keep {pinned} units of each stack there; "
          "give a host budget that holds them (plus the cache), or set host_resident_units=0 "
          "(device_resident_units keeps units on the device instead)."
        )
      if lookahead != 0 or queue != 0:
        raise HostDisabledControlsError(
          f"{owner}: host_budget_bytes=0 disables the host cache, but host_lookahead="
          f"{lookahead!r} and background_queue_capacity={queue!r}; set both to 0 (or leave "
          "them unset) for direct disk-to-device loading, or give host_budget_bytes > 0 to "
          "use a host cache."
        )
      return
    if lookahead < 1:
      raise ZeroHostLookaheadError(
        f"{owner}: host_lookahead={lookahead!r} with host_budget_bytes={host!r} "
        f"({format_bytes(host)}); set host_lookahead >= 1, or host_budget_bytes=0 "
        "(with background_queue_capacity=0) for direct disk-to-device loading."
      )
    if queue < 1:
      raise ZeroQueueCapacityError(
        f"{owner}: background_queue_capacity={queue!r} with host_budget_bytes={host!r} "
        f"({format_bytes(host)}); set background_queue_capacity >= 1, or host_budget_bytes=0 "
        "(with host_lookahead=0) for direct disk-to-device loading."
      )
