"""The error hierarchy of jax_residency.

Every error raised on purpose by the library derives from `ResidencyError` and
from the builtin that best describes it (`ValueError` for bad input,
`RuntimeError` for a failure while running), so callers can catch either.
Messages say what went wrong, where (a parameter path or a store path), the
offending value, and how to fix it. Where several leaves are wrong, one error
lists all of them, sorted.

The root, `ResidencyError`, is in `error_base.py` and the store errors in
`store_errors.py`; this module re-exports both, so it names every error type.
"""

from __future__ import annotations

from jax_residency._src.policy.error_base import ResidencyError as ResidencyError
from jax_residency._src.policy.error_base import format_paths as format_paths
from jax_residency._src.policy.store_errors import (
  CheckpointMismatchError as CheckpointMismatchError,
)
from jax_residency._src.policy.store_errors import (
  CheckpointShapeMismatchError as CheckpointShapeMismatchError,
)
from jax_residency._src.policy.store_errors import (
  MissingCheckpointParametersError as MissingCheckpointParametersError,
)
from jax_residency._src.policy.store_errors import StoreCorruptionError as StoreCorruptionError
from jax_residency._src.policy.store_errors import StoreError as StoreError
from jax_residency._src.policy.store_errors import StoreLayoutError as StoreLayoutError
from jax_residency._src.policy.store_errors import StoreNotFoundError as StoreNotFoundError
from jax_residency._src.policy.store_errors import StoreReplacedError as StoreReplacedError
from jax_residency._src.policy.store_errors import StoreTimeoutError as StoreTimeoutError
from jax_residency._src.policy.store_errors import (
  StoreUnavailableError as StoreUnavailableError,
)
from jax_residency._src.policy.store_errors import (
  UnexpectedCheckpointParametersError as UnexpectedCheckpointParametersError,
)

# --- policy (SPEC §1) ------------------------------------------------------


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


# --- placement (SPEC §2) ---------------------------------------------------


class PlacementError(ResidencyError, ValueError):
  """A model could not be placed as asked (bad unit selection, bad mesh...).

  Raised by `place` (e.g. `DenseDiskStream` without ``store=``) and by a placed
  model given what it cannot run (a dense stream under ``jax.jit``).

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> placed = jr.place(nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    >>> try:  # one Linear layer: its forward loops over no stack of layers
    ...   placed(jnp.ones((1, 2)))
    ... except jr.PlacementError as e:
    ...   print(type(e).__name__, isinstance(e, ValueError))
    PlacementError True
  """


class UnitSelectionError(PlacementError):
  """The stacked layer module could not be found or is not a layer stack.

  Raised by `place` and `save` when ``units=`` names no parameters, or not a
  stack (leaves sharing a leading layer axis), and by `save` when nothing says
  which modules the stacks are.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(blocks=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> try:
    ...   jr.place(net, units="layers")
    ... except jr.errors.UnitSelectionError as e:
    ...   print(type(e).__name__, "units='layers' names no parameters" in str(e))
    UnitSelectionError True
  """


class BudgetTooSmallError(PlacementError):
  """Base of the load-time budget errors, raised before anything is placed.

  `place` raises a subclass when the budgets cannot hold the model's windows.
  The arithmetic is in the message and, as ints, in attributes:
  ``required`` and ``budget`` always; ``static``, ``window`` and ``depth``
  (device) or ``window`` and ``staging`` (host) where they apply, else ``None``.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))  # 2 x 64 B
    >>> try:
    ...   jr.place(net, jr.LayerwiseHost(host_budget_bytes=100), units="layers")
    ... except jr.BudgetTooSmallError as e:
    ...   print(type(e).__name__, e.required, e.budget)
    HostBudgetTooSmallError 128 100
  """

  def __init__(
    self,
    message: str,
    *,
    required: int | None = None,
    budget: int | None = None,
    static: int | None = None,
    window: int | None = None,
    depth: int | None = None,
    staging: int | None = None,
  ) -> None:
    super().__init__(message)
    self.required = required
    self.budget = budget
    self.static = static
    self.window = window
    self.depth = depth
    self.staging = staging


class DeviceBudgetTooSmallError(BudgetTooSmallError):
  """Static bytes plus the largest device window exceed `device_budget_bytes`.

  Raised by `place`; the window is ``prefetch_depth`` units (`LayerwiseHost`),
  2 (`DenseDiskStream`) or all of them (`FullyResident`).

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> layers = nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4))))  # 2 units of 64 B
    >>> net = nnx.Dict(layers=layers, head=nnx.Param(jnp.zeros(4)))  # 16 B static
    >>> try:
    ...   jr.place(net, jr.LayerwiseHost(device_budget_bytes=64), units="layers")
    ... except jr.DeviceBudgetTooSmallError as e:
    ...   print(e.static, e.window, e.depth, e.required, e.budget)
    16 64 1 80 64
  """


class HostBudgetTooSmallError(BudgetTooSmallError):
  """The host window (or every unit, for `LayerwiseHost`) exceeds `host_budget_bytes`.

  Raised by `place` for `LayerwiseHost`, and for `DenseDiskStream` with a host
  cache (``host_lookahead`` units, plus a staging unit on an accelerator).

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))  # 2 x 64 B
    >>> try:
    ...   jr.place(net, jr.LayerwiseHost(host_budget_bytes=100), units="layers")
    ... except jr.HostBudgetTooSmallError as e:
    ...   print(e.window, e.staging, e.required, e.budget)
    128 0 128 100
  """


# --- models --------------------------------------------------------------


class ModelConfigError(ResidencyError, ValueError):
  """A model configuration asks for something the model does not implement.

  Raised by the configs of `jax_residency.models` (``BertConfig``, ``GPTConfig``,
  ``T5Config``) and their ``from_hf`` readers of a Hugging Face ``config.json``;
  the message names the field, its value and what is supported.

  Example:
    >>> import jax_residency as jr
    >>> from jax_residency import models
    >>> try:
    ...   models.T5Config.from_hf({"feed_forward_proj": "gated-silu"})
    ... except jr.errors.ModelConfigError as e:
    ...   print(type(e).__name__, "feed_forward_proj='gated-silu'" in str(e))
    ModelConfigError True
  """


# --- running ---------------------------------------------------------------


class ResidencyRuntimeError(ResidencyError, RuntimeError):
  """A failure while running a placed model.

  Raised by a placed model, or a dense stream's caches and worker, as it runs.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> placed = jr.place(net, units="layers")
    >>> placed.close()
    >>> try:
    ...   placed.arrays()
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, isinstance(e, RuntimeError))
    ClosedError True
  """


class AdmissionError(ResidencyRuntimeError):
  """A cache reservation could not be satisfied; nothing was changed.

  Raised by a dense stream's cache ledger when a unit does not fit a tier even
  after evicting every unprotected unit. The stream handles it (reading the unit
  uncached) and `place` checks the device window fits, so callers do not see it.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   raise jr.errors.AdmissionError("unit 3 does not fit the host tier")
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, isinstance(e, RuntimeError))
    AdmissionError True
  """


class PrefetchError(ResidencyRuntimeError):
  """The background prefetch worker failed to load a unit, not because of the store.

  Raised in a `DenseDiskStream` pass that waits for a unit its worker thread
  failed to load, with the worker's error as ``__cause__``. A store that cannot
  be read, or is corrupt, raises its `StoreError` instead, whichever thread read
  the unit, so ``except jr.StoreError`` catches every store failure. The
  example builds one as the worker does (a failing load is timing-dependent).

  Example:
    >>> import jax_residency as jr
    >>> failure = MemoryError("out of host memory")
    >>> try:
    ...   raise jr.errors.PrefetchError("prefetch of unit 1 failed") from failure
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, type(e.__cause__).__name__)
    PrefetchError MemoryError
  """


class ClosedError(ResidencyRuntimeError):
  """A placed model, cache or worker was used after `close()`.

  Raised by a `PlacedModel` called, lowered or asked for its arrays after
  ``close()`` (or its ``with`` block), and by a closed store, ledger or worker.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> with jr.place(net, units="layers") as placed:
    ...   pass
    >>> try:
    ...   placed(jnp.ones((1, 4)))
    ... except jr.ClosedError as e:
    ...   print(e)
    this placed model was closed; place the model again to run it
  """
