"""``place``: put a Flax model's weights where a policy says, and run it.

``place(model, policy)`` splits the model into static parameters and a unit
stack (:mod:`.split`), checks the budgets before anything moves (:mod:`.budget`),
places the leaves (:mod:`.shardings`) and returns a :class:`PlacedModel` that is
called like the original. Fully-resident and layerwise-host forwards are one
jitted program each (compiled once per input shape); a dense disk stream runs
through :mod:`jax_residency._src.stream.engine`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jax_residency._src.compile_cache import enable_default_cache
from jax_residency._src.placement import shardings as pl
from jax_residency._src.placement.budget import ModelMetadata, check_budgets
from jax_residency._src.placement.split import SplitModel, path_str, split_model
from jax_residency._src.placement.unit_loop import LoopContext, not_looped_error
from jax_residency._src.policy.errors import ClosedError, PlacementError
from jax_residency._src.policy.types import (
  DenseDiskStream,
  ExecutionResidency,
  FullyResident,
  LayerWeightResidency,
  LayerwiseHost,
)
from jax_residency._src.report.compile_time import temp_bytes
from jax_residency._src.report.telemetry import PassCounters, Report, Telemetry


class PlacedModel:
  """A model whose unit weights live where its policy says.

  Call it like the original model. Use it as a context manager, or call
  :meth:`close`, to release what it holds (device and host copies, open stores,
  background threads).

  Attributes:
    metadata: sizes and placement decided at load time (:class:`ModelMetadata`).
    policy: the weight-residency policy.
    mesh: the mesh parameters are placed on.
  """

  def __init__(
    self,
    split: SplitModel,
    policy: LayerWeightResidency,
    mesh: Mesh,
    metadata: ModelMetadata,
    runner: Callable[..., Any],
    closers: list[Callable[[], None]],
    lowerer: Callable[..., Any] | None = None,
    *,
    telemetry: Telemetry,
    clear_caches: Callable[[], None] | None = None,
    arrays: Callable[[], dict[str, jax.Array]] | None = None,
  ) -> None:
    self._split = split
    self.policy = policy
    self.mesh = mesh
    self.metadata = metadata
    self._runner = runner
    self._closers = closers
    self._lowerer = lowerer
    self._telemetry = telemetry
    self._clear_caches = clear_caches
    self._arrays = arrays
    self._closed = False
    self._lock = threading.Lock()
    telemetry.start()  # background samplers (sample_process_memory) run until close()

  @property
  def unit_count(self) -> int:
    return self.metadata.layer_count

  @property
  def unit_prefix(self) -> tuple[str, ...]:
    """Path of the stacked layer module inside the model."""
    return self._split.unit_prefix

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if self._closed:
      raise ClosedError("this placed model was closed; place the model again to run it")
    return self._runner(*args, **kwargs)

  def arrays(self) -> dict[str, jax.Array]:
    """The arrays this placement holds, by parameter path (``"layers.attn.kernel"``).

    Static parameters, and for ``FullyResident`` / ``LayerwiseHost`` the stacked
    units (a dense stream holds no units between passes). Their ``sharding``
    shows the memory kind each lives in.
    """
    if self._closed:
      raise ClosedError("this placed model was closed; it holds no arrays")
    return {} if self._arrays is None else self._arrays()

  def report(self) -> Report:
    """What the passes so far moved and cost (an immutable :class:`Report`)."""
    return self._telemetry.report()

  def clear_caches(self) -> None:
    """Drops cached unit copies (a dense stream's host and device tiers).

    The next pass reads every unit from the store again. A no-op for policies
    that keep every unit placed.
    """
    if self._clear_caches is not None:
      self._clear_caches()

  def lower(self, *args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    """Lowers the jitted forward (``FullyResident``/``LayerwiseHost``) for inspection.

    ``platforms=("cuda",)`` or ``("tpu",)`` lowers for an accelerator even on a
    CPU-only machine, which shows where parameters live and where they move.
    """
    if self._closed:
      raise ClosedError("this placed model was closed; place the model again to lower it")
    if self._lowerer is None:
      raise PlacementError(
        f"{self.policy.name} does not run as one jitted program; there is nothing to lower"
      )
    return self._lowerer(*args, platforms=platforms, **kwargs)

  def close(self) -> None:
    """Releases every buffer, store handle and thread this placement holds."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
      closers, self._closers = self._closers, []
    try:
      for close in reversed(closers):
        close()
    finally:
      self._telemetry.close()

  def __enter__(self) -> PlacedModel:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __repr__(self) -> str:
    state = "closed" if self._closed else "open"
    return (
      f"PlacedModel({self.policy!r}, layers={self.metadata.layer_count}, "
      f"units={'.'.join(self.unit_prefix)!r}, {state})"
    )


def place(
  model: Any,
  policy: Any = None,
  *,
  params: Any = None,
  mesh: Mesh | None = None,
  units: str | tuple[str, ...] | None = None,
  rules: pl.Rules | None = None,
  store: str | None = None,
  sequence_axis: int = 1,
) -> PlacedModel:
  """Places a Flax model's weights as ``policy`` says.

  Args:
    model: an ``nnx.Module``, or a Linen module (then pass ``params``). Its layers
      must run through :func:`jax_residency.scan_units` (NNX) or
      :func:`jax_residency.linen.scan` (Linen).
    policy: a :class:`LayerWeightResidency` or options convertible by
      ``LayerWeightResidency.of``; default :class:`FullyResident`.
    params: a Linen model's variables (``model.init(...)``).
    mesh: the mesh to place on. Default: the mesh set with ``jax.set_mesh``,
      else the mesh (or the one device) the model's arrays are already on, else
      the default device alone, as the plain model runs.
    units: path of the stacked layer module (``"layers"``); default: the first
      of the common names that is a layer stack, else the only candidate.
    rules: logical-to-mesh axis rules for models with logical partitioning.
    store: a unit store written by :func:`jax_residency.save` (a directory or
      TensorStore kvstore URL). Required for ``DenseDiskStream``, which streams
      from it; the other policies read every weight from it once, so ``model``
      may be abstract (``nnx.eval_shape``) under every policy.
    sequence_axis: the axis of the first array argument that counts tokens; a
      pass with more than one token along it is reported as prefill, else decode.

  Returns:
    A :class:`PlacedModel`, called like ``model``.

  Raises:
    UnitSelectionError: the layer stack cannot be found.
    DeviceBudgetTooSmallError, HostBudgetTooSmallError: the budgets cannot
      hold the model's windows (raised before anything is placed).

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(
    ...         jax.random.split(rngs.params(), 4))
    ...   def __call__(self, x):
    ...     return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)
    >>> net = Net(nnx.Rngs(0))
    >>> x = jnp.ones((2, 8))
    >>> with jr.place(net, jr.LayerwiseHost(jr.LayerwiseLoadOptions())) as placed:
    ...   bool((placed(x) == net(x)).all())
    True
  """
  policy = LayerWeightResidency.default() if policy is None else LayerWeightResidency.of(policy)
  if isinstance(sequence_axis, bool) or not isinstance(sequence_axis, int):
    raise PlacementError(f"sequence_axis={sequence_axis!r}: pass an int axis (default 1)")
  enable_default_cache()  # JAX's persistent compilation cache; JAX_RESIDENCY_COMPILATION_CACHE=0
  split = split_model(model, params=params, units=units)
  mesh = pl.default_mesh(split.values) if mesh is None else mesh
  match policy:
    case DenseDiskStream():
      from jax_residency._src.stream.engine import place_dense  # noqa: PLC0415 - only dense placements need stores

      if store is None:
        raise PlacementError(
          "DenseDiskStream streams units from a store: pass store=<path> written by "
          "jax_residency.save(model, path)"
        )
      return place_dense(
        split, policy, mesh=mesh, rules=rules, store=store, sequence_axis=sequence_axis
      )
    case FullyResident() | LayerwiseHost():
      return _place_jitted(
        split, policy, mesh=mesh, rules=rules, sequence_axis=sequence_axis, store=store
      )
  raise PlacementError(f"unsupported policy {policy!r}")


def _place_jitted(
  split: SplitModel,
  policy: LayerWeightResidency,
  *,
  mesh: Mesh,
  rules: pl.Rules | None,
  sequence_axis: int = 1,
  store: str | None = None,
) -> PlacedModel:
  layerwise = policy.execution_residency is ExecutionResidency.LAYERWISE_HOST
  unit_kind = pl.PINNED_HOST if layerwise else pl.DEVICE
  if layerwise:
    pl.require_memory_kind(mesh, pl.PINNED_HOST)
  placed_at = pl.layout(split, mesh, rules, unit_kind=unit_kind)
  metadata = metadata_for(split, policy, placed_at.static, placed_at.unit_slices)
  values = _weights(split, policy, store)
  split.values = []  # the placement holds its own copies, not the caller's arrays
  static = pl.put([values[i] for i in split.static_index], placed_at.static)
  unit_values = pl.put([values[i] for i in split.unit_index], placed_at.units)
  del values
  depth = policy.device_depth(split.unit_count)

  def forward(static_leaves: list[Any], unit_leaves: list[Any], *args: Any, **kwargs: Any) -> Any:
    loop = LoopContext(
      kind=policy.execution_residency, depth=depth, unit_shardings=tuple(placed_at.unit_slices)
    )
    try:
      out = split.forward(split.join(static_leaves, unit_leaves), loop, *args, **kwargs)
    except Exception as e:
      if loop.loops_run == 0:
        if "memory_space" in str(e) or "memory kind" in str(e):  # host layers used off-loop
          raise not_looped_error(split.unit_prefix) from e
        e.add_note(
          f"jax_residency: the layer loop had not run yet. {not_looped_error(split.unit_prefix)}"
        )
      raise
    if loop.loops_run == 0:
      raise not_looped_error(split.unit_prefix)
    return out

  jitted = jax.jit(forward)
  held: dict[str, list[Any]] = {"static": static, "units": unit_values}
  telemetry = Telemetry.for_policy(policy=policy, metadata=metadata, sequence_axis=sequence_axis)
  moved = metadata.total_unit_bytes if layerwise else 0
  # One program per input signature, compiled ahead of its first call so each
  # pass can report the temporaries XLA gives it (memory_analysis).
  compiled: dict[Any, tuple[Any, int]] = {}

  def program(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, int]:
    key = signature(args, kwargs)
    found = compiled.get(key)
    if found is None:
      exe = jitted.trace(held["static"], held["units"], *args, **kwargs).lower().compile()
      found = compiled[key] = (exe, temp_bytes(exe) or 0)
    return found

  def run(*args: Any, **kwargs: Any) -> Any:
    start = time.perf_counter()
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
      # Under a transformation (grad, make_jaxpr, an outer jit) the forward is traced.
      exe, temp = jitted, 0
    else:
      exe, temp = program(args, kwargs)
    out = jax.block_until_ready(exe(held["static"], held["units"], *args, **kwargs))
    telemetry.commit_pass(
      args=args,
      seconds=time.perf_counter() - start,
      counters=PassCounters(host_to_device_bytes=moved, step_temp_bytes=temp),
      peak_device_units=metadata.device_window_units,
      peak_device_bytes=metadata.device_window_bytes,
      peak_host_units=metadata.layer_count if layerwise else 0,
      peak_host_bytes=metadata.largest_host_unit_bytes * metadata.layer_count if layerwise else 0,
    )
    return out

  def lowerer(*args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    traced = jitted.trace(held["static"], held["units"], *args, **kwargs)
    return traced.lower(lowering_platforms=platforms) if platforms else traced.lower()

  def arrays() -> dict[str, jax.Array]:
    leaves = split.join(held["static"], held["units"])
    return {path_str(leaf.path): a for leaf, a in zip(split.leaves, leaves, strict=True)}

  def release() -> None:
    # Dropping the references frees the copies; deleting them outright could free
    # buffers shared with the caller's model (device_put to an equal sharding aliases).
    held["static"], held["units"] = [], []

  return PlacedModel(
    split, policy, mesh, metadata, run, [release], lowerer, telemetry=telemetry, arrays=arrays
  )


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """What a compiled program is specialised to: the call's pytree structure and, per
  leaf, its shape, dtype, weak type and (for arrays) sharding."""
  leaves, tree = jax.tree.flatten((args, kwargs))

  def aval(x: Any) -> Any:
    weak = bool(getattr(x, "weak_type", isinstance(x, bool | int | float | complex)))
    return (np.shape(x), jax.dtypes.result_type(x), weak, getattr(x, "sharding", None))

  return tree, tuple(aval(x) for x in leaves)


def _weights(split: SplitModel, policy: LayerWeightResidency, store: str | None) -> list[Any]:
  """The model's own weights, or (with ``store``) the weights read from the store."""
  if store is not None:
    from jax_residency._src.store.loading import open_for, read_all  # noqa: PLC0415 - stores only when asked

    with open_for(
      split, store, strict=policy.strict_loading, max_cached_shards=policy.max_cached_shards
    ) as opened:
      return read_all(split, opened)
  abstract = [
    path_str(leaf.path)
    for leaf, v in zip(split.leaves, split.values, strict=True)
    if isinstance(v, jax.ShapeDtypeStruct)
  ]
  if abstract:
    raise PlacementError(
      f"the model is abstract ({len(abstract)} parameters have no values, e.g. "
      f"{abstract[0]!r}); pass store=<path> written by jax_residency.save to read its weights"
    )
  return split.values


def metadata_for(
  split: SplitModel,
  policy: LayerWeightResidency,
  static_shardings: Sequence[jax.sharding.Sharding],
  slice_shardings: Sequence[jax.sharding.Sharding],
) -> ModelMetadata:
  static_bytes = sum(
    pl.per_device_bytes(leaf.shape, leaf.dtype, s)
    for leaf, s in zip(split.static_leaves(), static_shardings, strict=True)
  )
  unit_leaves = split.unit_leaves()
  one_unit = [(leaf.shape[1:], leaf.dtype) for leaf in unit_leaves]
  unit_total = sum(leaf.nbytes for leaf in unit_leaves) // max(split.unit_count, 1)
  device_unit = sum(
    pl.per_device_bytes(shape, dtype, s)
    for (shape, dtype), s in zip(one_unit, slice_shardings, strict=True)
  )
  if policy.execution_residency is ExecutionResidency.LAYERWISE_HOST:
    host_unit = sum(
      pl.per_process_bytes(shape, dtype, s)
      for (shape, dtype), s in zip(one_unit, slice_shardings, strict=True)
    )
  elif policy.execution_residency is ExecutionResidency.DENSE_DISK_STREAM:
    host_unit = unit_total
  else:
    host_unit = 0
  n = split.unit_count
  devices: set[Any] = {d for s in (*static_shardings, *slice_shardings) for d in s.device_set}
  return check_budgets(
    policy,
    static_device_bytes=static_bytes,
    unit_bytes=[unit_total] * n,
    device_unit_bytes=[device_unit] * n,
    host_unit_bytes=[host_unit] * n,
    device_is_host=all(d.platform == "cpu" for d in devices),
  )
