"""``place``: put a Flax model's weights where a policy says, and run it.

``place(model, policy)`` splits the model into static parameters and a unit
stack (:mod:`.split`), checks the budgets before anything moves (:mod:`.budget`),
places the leaves (:mod:`.shardings`) and returns a :class:`PlacedModel` that is
called like the original. Fully-resident and layerwise-host forwards are one
jitted program each (compiled once per input shape); a dense disk stream runs
through :mod:`jax_residency._src.stream.engine`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.sharding import Mesh

from jax_residency._src.errors import ClosedError, PlacementError, QuantizationError
from jax_residency._src.loop.stacks import find_stacks
from jax_residency._src.plan import shardings as pl
from jax_residency._src.plan.arguments import check_place_arguments
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.plan.memory import MemoryItem
from jax_residency._src.plan.quantized import check_wanted, for_placement
from jax_residency._src.plan.split import SplitModel, split_model
from jax_residency._src.policy.types import (
  DenseDiskStream,
  FullyResident,
  LayerWeightResidency,
  LayerwiseHost,
)
from jax_residency._src.quant import native
from jax_residency._src.quant.schemes import Quantization
from jax_residency._src.report.records import Report
from jax_residency._src.report.speculation import SpeculationTotals
from jax_residency._src.run.compile_cache import enable_default_cache
from jax_residency._src.run.dense import DenseExecutor
from jax_residency._src.run.executor import Executor
from jax_residency._src.run.jitted import JittedExecutor
from jax_residency._src.store.loading import StoreSource, recorded_in
from jax_residency._src.store.read_options import ReadOptions
from jax_residency._src.typing import path_str


class PlacedModel:
  """A model whose unit weights live where its policy says.

  Call it like the original model. Use it as a context manager, or call
  :meth:`close`, to release what it holds (device and host copies, open stores,
  background threads).

  Attributes:
    policy: the weight-residency policy.
    mesh: the mesh parameters are placed on.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> tokens = jnp.zeros((1, 4), jnp.int32)
    >>> with jr.place(model, jr.LayerwiseHost(prefetch_depth=1)) as placed:
    ...   same = bool((placed(tokens) == model(tokens)).all())
    ...   kind = placed.arrays()["layers.qkv.kernel"].sharding.memory_kind
    >>> same, kind, placed.unit_count, placed.unit_prefix
    (True, 'pinned_host', 2, ('layers',))
    >>> placed.metadata.device_window_units, placed.report().last.phase
    (1, 'prefill')
    >>> repr(placed).endswith("closed)")  # leaving the block released what it held
    True
  """

  def __init__(
    self,
    split: SplitModel,
    policy: LayerWeightResidency,
    mesh: Mesh,
    build: Callable[[SplitModel], Executor],
  ) -> None:
    self._split = split
    self.policy = policy
    self.mesh = mesh
    self._build = build
    self._executor: Executor | None = None
    self._closed = False
    self._lock = threading.Lock()
    if split.stacks:
      self._start(split)

  def _start(self, split: SplitModel) -> Executor:
    executor = self._build(split)
    self._split, self._executor = split, executor
    executor.telemetry.start()  # background samplers (sample_process_memory) run until close()
    return executor

  def _ready(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Executor:
    """The executor; on the first call of a placement whose stacks are not known yet,
    finds them by tracing the forward with these arguments, then places the model."""
    if self._closed:
      raise ClosedError("this placed model was closed; place the model again to run it")
    if self._executor is None:
      with self._lock:
        if self._executor is None:
          return self._start(find_stacks(self._split, args, kwargs))
    assert self._executor is not None
    return self._executor

  def _placed(self) -> Executor:
    if self._executor is None:
      raise PlacementError(
        "this placement finds the model's layer stacks on its first call (the modules the "
        "forward runs through scan_units / linen.scan), and places the model then; call it "
        "once, or pass units=<path or tuple of paths> to place(), to have it placed now"
      )
    return self._executor

  @property
  def metadata(self) -> ModelMetadata:
    """Sizes and placement decided at load time (:class:`ModelMetadata`)."""
    return self._placed().metadata

  @property
  def unit_count(self) -> int:
    return self.metadata.layer_count

  @property
  def unit_prefix(self) -> tuple[str, ...]:
    """Path of the (first) stacked layer module inside the model."""
    return self._split.unit_prefix

  @property
  def stacks(self) -> tuple[str, ...]:
    """Paths of the placed layer stacks, in the order the forward runs them
    (empty until the first call finds them, when ``units=`` was not given)."""
    return tuple(s.name for s in self._split.stacks)

  @property
  def stack_array_prefixes(self) -> tuple[str, ...]:
    """The placed stacks' paths as :meth:`arrays` keys their leaves (a Linen model's
    start with its variables' collection, ``params.``); empty until found."""
    return tuple(path_str(s.path_prefix) for s in self._split.stacks)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self._ready(args, kwargs)(*args, **kwargs)

  def arrays(self) -> dict[str, jax.Array]:
    """The arrays this placement holds, by parameter path (``"layers.attn.kernel"``).

    Static parameters, and for ``FullyResident`` / ``LayerwiseHost`` the stacked
    units (a dense stream holds no units between passes). Their ``sharding``
    shows the memory kind each lives in.
    """
    if self._closed:
      raise ClosedError("this placed model was closed; it holds no arrays")
    return self._placed().arrays()

  def report(self) -> Report:
    """What the passes so far moved and cost (an immutable :class:`Report`)."""
    return self._placed().telemetry.report()

  def note_speculation(self, totals: SpeculationTotals) -> None:
    """Adds a speculative generation's totals to this placement's report (called by
    ``models.speculate`` when this placement is its target; `Report.speculation`)."""
    self._placed().telemetry.note_speculation(totals)

  def clear_caches(self) -> None:
    """Drops cached unit copies (a dense stream's host and device tiers).

    The next pass reads every unit from the store again. A no-op for policies
    that keep every unit placed.
    """
    if self._executor is not None:
      self._executor.clear_caches()

  def lower(self, *args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    """Lowers the jitted forward (``FullyResident``/``LayerwiseHost``) for inspection.

    ``platforms=("cuda",)`` or ``("tpu",)`` lowers for an accelerator even on a
    CPU-only machine, which shows where parameters live and where they move.
    """
    if self._closed:
      raise ClosedError("this placed model was closed; place the model again to lower it")
    return self._ready(args, kwargs).lower(*args, platforms=platforms, **kwargs)

  def close(self) -> None:
    """Releases every buffer, store handle and thread this placement holds."""
    with self._lock:
      if self._closed:
        return
      self._closed = True
    executor = self._executor
    if executor is None:
      return
    try:
      executor.close()
    finally:
      executor.telemetry.close()

  def __enter__(self) -> PlacedModel:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __repr__(self) -> str:
    state = "closed" if self._closed else "open"
    if self._executor is None:
      return f"PlacedModel({self.policy!r}, stacks found on the first call, {state})"
    return f"PlacedModel({self.policy!r}, layers={self.unit_count}, stacks={self.stacks}, {state})"


def plan_beside(placed: PlacedModel, item: MemoryItem) -> None:
  """Adds ``item`` to ``placed.metadata.memory``: memory its user holds for it beside the
  placement's own (a draft's KV cache, `run.draft`)."""
  executor = placed._placed()
  executor.metadata = dataclasses.replace(
    executor.metadata, memory=(*executor.metadata.memory, item)
  )


def check_activations(activations: object, mesh: Mesh) -> None:
  """`place`'s ``activations``: one of `native.ACTIVATIONS`; ``"int8"`` only where the
  native integer kernels run (one CPU device).

  Raises:
    PlacementError: another value, or ``"int8"`` for another backend or several devices.
  """
  if activations not in native.ACTIVATIONS:
    raise PlacementError(
      f"activations={activations!r}: pass one of {', '.join(map(repr, native.ACTIVATIONS))}"
    )
  devices = list(mesh.devices.flat)
  if activations != "exact" and (len(devices) != 1 or devices[0].platform != "cpu"):
    platforms = sorted({d.platform for d in devices})
    raise PlacementError(
      f"activations={activations!r}: integer products are native CPU kernels, for one CPU "
      f"device; this mesh has {len(devices)} device(s) on backend {'/'.join(platforms)!r}, "
      "which has none. Leave activations='exact' there (XLA's products of the decoded "
      "weights)."
    )


def place(
  model: Any,
  policy: Any = None,
  *,
  params: Any = None,
  mesh: Mesh | None = None,
  units: str | tuple[str, ...] | None = None,
  rules: pl.Rules | None = None,
  store: str | os.PathLike[str] | None = None,
  sequence_axis: int = 1,
  read_options: ReadOptions | None = None,
  quantize: str | Mapping[str, Any] | Quantization | None = None,
  activations: str = "exact",
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
    units: the layer stacks to place: a path (``"layers"``,
      ``"decoder.layers"``) or a tuple or list of paths
      (``("encoder_layers", "decoder_layers")``). Default: the stacks ``store``
      records, else those the model's class declares (``residency_stacks``),
      else the modules the forward runs through ``scan_units`` /
      ``linen.scan``, found by tracing it on the first call (the model is
      placed then, and ``metadata`` is known from then on). A stack the forward
      loops over but ``units`` leaves out stays on the device as static
      parameters; ``metadata.unplaced_stacks`` lists it, with a warning.
    rules: logical-to-mesh axis rules for models with logical partitioning.
    store: a unit store written by :func:`jax_residency.save` (a directory or
      TensorStore kvstore URL). Required for ``DenseDiskStream``, which streams
      from it; the other policies read every weight from it once, so ``model``
      may be abstract (``nnx.eval_shape``) under every policy.
    sequence_axis: the axis of the first array argument that counts tokens; a
      pass with more than one token along it is reported as prefill, else decode.
    read_options: how reads from ``store`` retry and time out
      (:class:`ReadOptions`; default ``ReadOptions()``); they matter for remote
      stores (``http(s)://``, ``gs://``, ``s3://``).
    quantize: hold the model's floating matrices quantized (``"int8"``,
      ``"int4"``, ``{"scheme": "int4", "group_size": 128}``; see
      ``docs/quantization.md``), encoded from the model's weights on the host
      and decoded in the step that uses them. A store written with
      ``save(..., quantize=...)`` is placed quantized without it.
    activations: how a one-token product with a quantized matrix takes its activation
      row on one CPU device. ``"exact"`` (default): in float32, equal to the product of
      the decoded matrix to float rounding. ``"int8"``: rounded to 8-bit blocks of 32
      values (a scale each) and multiplied as integers, as llama.cpp does on CPU:
      faster, with logits within about 1e-2 of the exact ones (``docs/quantization.md``,
      "Integer products"). Needs quantized weights and one CPU device.

  Returns:
    A :class:`PlacedModel`, called like ``model``.

  Raises:
    UnitSelectionError: the layer stack cannot be found, or ``units`` or
      ``params`` has the wrong type.
    QuantizationError: ``quantize`` finds nothing to quantize, or a group size
      that does not divide a tensor's input dimension, or disagrees with the store;
      or ``activations="int8"`` for float weights.
    CheckpointShapeMismatchError: a quantized store records tensors the model
      does not have, or has with other shapes.
    PlacementError: ``mesh``, ``rules`` or ``sequence_axis`` has the wrong type, or
      ``activations`` is not ``"exact"`` or ``"int8"``, or is ``"int8"`` on a mesh that
      is not one CPU device (the error names the backend).
    StoreError: ``store`` is not a path, or not a readable store.
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
  check_place_arguments(
    params=params, mesh=mesh, units=units, rules=rules, store=store, sequence_axis=sequence_axis
  )
  enable_default_cache()  # JAX's persistent compilation cache; JAX_RESIDENCY_COMPILATION_CACHE=0
  split = split_model(model, params=params, units=units)
  source = None if store is None else StoreSource.of(store, read_options)
  wanted = None if quantize is None else Quantization.of(quantize)
  recorded, plan = ([], None) if source is None else recorded_in(source.path, source.reads)
  check_wanted(plan, wanted, store=None if source is None else source.path)
  if recorded and units is None:  # the store's stacks, as model paths
    split = split.with_stacks([p[len(split.root) :] for p in recorded])
  mesh = pl.default_mesh(split.values) if mesh is None else mesh
  check_activations(activations, mesh)
  if isinstance(policy, DenseDiskStream) and store is None:
    raise PlacementError(
      "DenseDiskStream streams units from a store: pass store=<path> written by "
      "jax_residency.save(model, path)"
    )
  if not isinstance(policy, DenseDiskStream | FullyResident | LayerwiseHost):
    raise PlacementError(f"unsupported policy {policy!r}")

  def build(split: SplitModel) -> Executor:
    split = for_placement(split, plan, wanted, store=None if source is None else source.path)
    if activations != "exact" and split.quantization is None:
      raise QuantizationError(
        f"activations={activations!r} rounds the activations of products with quantized "
        "weights, and this placement holds float weights: pass quantize='int8' (or "
        "'int4'), or a store written quantized, or leave activations='exact'"
      )
    split.activations = activations
    if isinstance(policy, DenseDiskStream):
      assert source is not None
      return DenseExecutor(
        split, policy, mesh=mesh, rules=rules, store=source, sequence_axis=sequence_axis
      )
    return JittedExecutor(
      split, policy, mesh=mesh, rules=rules, sequence_axis=sequence_axis, store=source
    )

  return PlacedModel(split, policy, mesh, build)
