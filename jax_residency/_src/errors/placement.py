"""Errors in placing a model: units that cannot be placed, budgets too small, a
model config the model does not implement."""

from __future__ import annotations

from jax_residency._src.errors.base import ResidencyError


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


class QuantizationError(PlacementError):
  """A model's tensors cannot be quantized as asked, or a quantized store does not fit
  the model.

  Raised by `save` and `place` with ``quantize=``, the converters, and `place` from a
  quantized store: a model with no floating matrices to quantize, a group size that
  does not divide a tensor's input dimension. The message names the tensor and the fix.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 96, 64)))))
    >>> try:
    ...   jr.place(net, units="layers", quantize="int4")
    ... except jr.errors.QuantizationError as e:
    ...   print("layers.w" in str(e), "group_size=64" in str(e))
    True True
  """


class BudgetTooSmallError(PlacementError):
  """Base of the load-time budget errors, raised before anything is placed.

  `place` raises a subclass when the budgets cannot hold the model's windows.
  The arithmetic is in the message and, as ints, in attributes:
  ``required`` and ``budget`` always; ``static``, ``window``, ``depth`` and
  ``decoded`` (device: a quantized unit's float tensors while its step runs) or
  ``window`` and ``staging`` (host) where they apply, and ``resident`` (the bytes
  of the units a dense stream keeps resident in that tier), else ``None``.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))  # 2 x 64 B
    >>> tight = (jr.LayerwiseHost(host_budget_bytes=100), jr.FullyResident(device_budget_bytes=100))
    >>> for policy in tight:
    ...   try:
    ...     jr.place(net, policy, units="layers")
    ...   except jr.BudgetTooSmallError as e:  # either tier's
    ...     print(type(e).__name__, e.required, e.budget)
    HostBudgetTooSmallError 128 100
    DeviceBudgetTooSmallError 128 100
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
    decoded: int | None = None,
    resident: int | None = None,
  ) -> None:
    super().__init__(message)
    self.resident = resident
    self.required = required
    self.budget = budget
    self.static = static
    self.window = window
    self.depth = depth
    self.staging = staging
    self.decoded = decoded


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


class SpeculationError(ResidencyError, ValueError):
  """Speculative decoding asked for with a draft or settings it cannot use.

  Raised by `jax_residency.models.generate_llm` with ``draft=`` before any pass runs
  (both models stay usable): a draft whose vocabulary differs from the target's, a
  ``draft_tokens`` that is not a positive int or ``"auto"``. The message names the
  value and the fix.

  Example:
    >>> import jax_residency as jr
    >>> from jax_residency import models
    >>> cfg = models.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                          num_hidden_layers=1, num_attention_heads=2,
    ...                          num_key_value_heads=1)
    >>> target = models.init_llama(cfg)
    >>> try:
    ...   models.generate_llm(target, [1, 2], 4, draft=target, draft_tokens=0)
    ... except jr.errors.SpeculationError as e:
    ...   print("draft_tokens=0" in str(e))
    True
  """


class InvalidPromptsError(ResidencyError, ValueError):
  """Prompts a batched generation cannot run.

  Raised by `jax_residency.models.generate_batch` before any pass runs: no prompts, an
  empty prompt, a ``batch_size`` under 1, or a prompt longer than the model's context
  (``max_position_embeddings``). The message names the prompt's index, the value and
  the fix.

  Example:
    >>> import jax_residency as jr
    >>> from jax_residency import models
    >>> cfg = models.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                          num_hidden_layers=1, num_attention_heads=2,
    ...                          num_key_value_heads=1)
    >>> try:
    ...   models.generate_batch(models.init_llama(cfg), [[1, 2], []], 4)
    ... except jr.errors.InvalidPromptsError as e:
    ...   print("prompts[1]" in str(e))
    True
  """


class MeasurementMismatchError(PlacementError):
  """A measurement given for another store or another backend than the one at hand.

  Raised by `jax_residency.plan` and ``Measurement.check``: a measurement's figures hold
  for the store (as it was when measured) and the backend it was taken on. The message
  shows both keys; measure again with ``jr.measure``.

  Example:
    >>> import jax_residency as jr
    >>> issubclass(jr.errors.MeasurementMismatchError, jr.PlacementError)
    True
  """
