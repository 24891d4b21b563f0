"""``save``: write a model's parameters as a streamable unit store."""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from typing import Any

from jax_residency._src.errors import StoreError, UnitSelectionError
from jax_residency._src.loop.stacks import find_stacks
from jax_residency._src.plan.arguments import check_store_path, check_units
from jax_residency._src.plan.quantized import plan_quantization, quantized_split
from jax_residency._src.plan.split import split_model
from jax_residency._src.quant.schemes import Quantization
from jax_residency._src.store.info import StoreInfo
from jax_residency._src.store.writer import save_store


def save(
  model: Any,
  path: str | os.PathLike[str],
  *,
  params: Any = None,
  units: str | tuple[str, ...] | list[str] | None = None,
  example: tuple[Any, ...] | None = None,
  progress: bool | None = None,
  overwrite: bool = False,
  quantize: str | Mapping[str, Any] | Quantization | None = None,
  experts: str | tuple[str, ...] | list[str] | None = None,
) -> StoreInfo:
  """Writes a model's parameters to ``path`` as an Orbax-compatible unit store.

  Each layer stack's parameters are written one chunk per unit, uncompressed,
  so :class:`DenseDiskStream` can read any unit at disk speed; static
  parameters are written whole, every chunk with a CRC-32C that reads check.
  The store is written to a temporary location and put in place only once
  complete; over an existing store (``overwrite=True``), the path holds the
  old store or the new one at every moment, even if the process is killed.

  Args:
    model: an ``nnx.Module``, or a Linen module with ``params``.
    path: a directory (a ``str`` or ``os.PathLike``), or a TensorStore kvstore
      URL (``memory://...``, ``gs://...``).
    params: a Linen model's variables.
    units: the layer stacks to write one unit per chunk: a path, or a tuple or
      list of paths (as for :func:`place`). Default: the stacks the model
      declares (``residency_stacks``), else those its forward loops over when
      called with ``example``.
    example: the model's call arguments, as a tuple (arrays or
      ``jax.ShapeDtypeStruct``: only traced, never run), to find its stacks.
    progress: show a progress bar: True, False, or None (the default: when
      stderr is a terminal).
    overwrite: replace an existing store at ``path`` (True or False).
    quantize: store the floating matrices quantized: ``"int8"`` (symmetric, a
      scale per output channel), ``"int4"`` (asymmetric, groups of 64 along the
      input dimension, two values a byte) or ``{"scheme": "int4", "group_size":
      32 | 64 | 128}``. Norms, biases and small tensors are stored as they are
      (``docs/quantization.md``). Each tensor is encoded as it is written, a unit
      at a time; every policy places the store and decodes in the step.
    experts: the modules, by path inside a unit (``"mlp.experts"``), whose
      parameters are stacked per expert (``(units, experts, ...)``): each expert of
      each unit is written as a chunk of its own, read alone when picked
      (``docs/design.md``, 5.6). Default: what the model declares
      (``residency_experts``), else none.

  Returns:
    A description of what was written.

  Raises:
    StoreError: ``path`` is not a path, ``progress`` or ``overwrite`` is not a
      bool (``overwrite="no"`` is refused, not taken as true), a store
      already exists at ``path`` and ``overwrite`` is False, a file lies where
      a directory of ``path`` should be, or the disk has (or runs out of) less
      space than the store needs; nothing is left written, and an old store at
      ``path`` is kept.
    UnitSelectionError: ``units`` is not a path, or names no layer stack; or
      neither ``units``, a declaration nor ``example`` says which the stacks are.
    InvalidPolicyValueError: ``quantize`` names no scheme or group size there is.
    QuantizationError: the model has no floating matrix to quantize, or the
      group size does not divide a tensor's input dimension (each one named).

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> path = tempfile.mkdtemp() + "/toy"
    >>> info = jr.save(model, path, progress=False)
    >>> options = jr.DenseDiskStreamLoadOptions(host_budget_bytes="1MiB")
    >>> with jr.place(model, jr.DenseDiskStream(options), store=path) as placed:
    ...   tokens = jnp.zeros((1, 4), jnp.int32)
    ...   bool((placed(tokens) == model(tokens)).all())
    True
  """
  check_store_path(path, name="path", where="save")
  check_units(units, where="save")
  for name, flag, accepted in (
    ("progress", progress, "True, False or None (the default: when stderr is a terminal)"),
    ("overwrite", overwrite, "True or False (the default)"),
  ):
    if not isinstance(flag, bool) and not (flag is None and name == "progress"):
      raise StoreError(
        f"save: {name}={reprlib.repr(flag)} ({type(flag).__name__}) is not a bool; "
        f"nothing was written. Pass {accepted}."
      )
  split = split_model(model, params=params, units=units)
  if not split.stacks:
    if example is None:
      raise UnitSelectionError(
        "save: which modules are the layer stacks? The stacks are the modules the forward "
        "runs through jax_residency.scan_units / jax_residency.linen.scan. Pass units=<path> "
        "(or a tuple of paths), or example=(inputs...) to find them by tracing the forward."
      )
    split = find_stacks(split, tuple(example), {})
  plan = None
  if quantize is not None:
    plan = plan_quantization(split, quantize)  # checked before anything is written
    split = quantized_split(split, plan, values_from="lazy")
  if experts is None:
    experts = tuple(getattr(model, "residency_experts", ()) or ())
  elif isinstance(experts, str):
    experts = (experts,)
  return save_store(
    os.fspath(path),
    experts=tuple(experts),
    static={split.leaves[i].path: split.values[i] for i in split.static_index},
    stacks={
      s.path_prefix: {
        split.unit_rel_path(leaf): split.values[i]
        for i, leaf in zip(s.index, split.stack_leaves(s), strict=True)
      }
      for s in split.stacks
    },
    progress=progress,
    overwrite=overwrite,
    quantization=plan,
  )
