"""`ExpertResidency`: where a mixture of experts' experts live under a dense stream
(docs/design.md, 4.9).

A dense stream moves a layer's ordinary weights (attention, norms, router, a shared
expert) as its unit. With ``DenseDiskStream(experts=ExpertResidency(...))`` the
experts stay apart: each step runs its layer's router first, then reads and moves
only the experts the router picked, through a byte-bounded device expert cache and,
behind it, a host expert cache. Pure Python, like the other options.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jax_residency._src.errors import InvalidPolicyValueError
from jax_residency._src.policy.checks import (
  CacheEvictionPolicy,
  Options,
  check_bool,
  check_budget,
  check_member,
)
from jax_residency._src.policy.sizes import GiB

DEFAULT_EXPERT_DEVICE_BUDGET_BYTES = 1 * GiB
"""Default `ExpertResidency.device_budget_bytes` (the device expert cache); 1 GiB."""


@dataclasses.dataclass(frozen=True, kw_only=True, repr=False)
class ExpertResidency(Options):
  """Experts read only when the router picks them, through caches of their own.

  Attributes:
    device_budget_bytes: bytes of the device expert cache: experts a step used stay
      there for later steps (a pick found there is a hit). ``None``: unbounded, so
      every expert stays on the device once read (resident). It must hold the
      experts one token picks in a layer (``top_k`` of them); a step that picks
      more (a prefill) moves the ones that do not fit through without caching them.
      Out of the policy's ``device_budget_bytes``, beside the static weights and
      the unit window.
    host_budget_bytes: bytes of the host expert cache behind it (0: none; ``None``:
      unbounded); an expert evicted from the device stays here, and the device
      takes it from here before the store.
    eviction_policy: which cached expert each cache evicts first.
    speculative_prefetch: while a layer runs, apply the next layer's router (the
      part of the layer up to it) to this layer's input and start reading the experts
      it predicts; the reports count how many of them the next layer picked. Off by
      default: on `benchmarks/moe_decode.py` it read more than it saved.

  Example:
    >>> e = ExpertResidency(device_budget_bytes="512MiB", host_budget_bytes="4GiB")
    >>> e.device_budget_bytes, e.to_dict()["host_budget_bytes"]
    (536870912, 4294967296)
    >>> ExpertResidency.from_dict(e.to_dict()) == e
    True
  """

  device_budget_bytes: int | None = DEFAULT_EXPERT_DEVICE_BUDGET_BYTES
  host_budget_bytes: int | None = 0
  eviction_policy: CacheEvictionPolicy = CacheEvictionPolicy.LEAST_RECENTLY_USED
  speculative_prefetch: bool = False

  def __post_init__(self) -> None:
    owner = self._check_budgets()
    check_member(owner, "eviction_policy", self.eviction_policy, CacheEvictionPolicy)
    check_bool(owner, "speculative_prefetch", self.speculative_prefetch)
    if self.device_budget_bytes == 0:
      raise InvalidPolicyValueError(
        f"{owner}: device_budget_bytes=0 leaves no room for the experts a step runs; give "
        "the device expert cache room for at least the experts one token picks in a layer "
        "(e.g. device_budget_bytes='1GiB'), or None to keep every expert once read."
      )

  def validate(self) -> None:
    """Checks every field again (the policy's ``validate`` calls it)."""
    owner = type(self).__name__
    check_budget(owner, "device_budget_bytes", self.device_budget_bytes)
    check_budget(owner, "host_budget_bytes", self.host_budget_bytes)
    check_member(owner, "eviction_policy", self.eviction_policy, CacheEvictionPolicy)
    check_bool(owner, "speculative_prefetch", self.speculative_prefetch)


def check_experts(owner: str, value: Any) -> ExpertResidency | None:
  """``experts=`` of `DenseDiskStream`: an `ExpertResidency`, its dict, or None."""
  if value is None or isinstance(value, ExpertResidency):
    return value
  if isinstance(value, dict):
    return ExpertResidency.from_dict(value)
  raise InvalidPolicyValueError(
    f"{owner}: experts={value!r} has type {type(value).__name__}; pass an "
    "ExpertResidency, e.g. experts=jax_residency.ExpertResidency(device_budget_bytes='2GiB'), "
    "or None (experts move with their layer's unit)."
  )
