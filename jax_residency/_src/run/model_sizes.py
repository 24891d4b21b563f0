"""A model's sizes as the planner prices them (docs/design.md, 4.8): from a store as it
is stored, or from a Hugging Face ``config.json`` as ``convert hf`` would store it
(abstractly: no weights are read or downloaded).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any

from jax_residency._src.errors import PlacementError
from jax_residency._src.plan.quantized import (
  QuantPlan,
  plan_decoded_bytes,
  plan_quantization,
  quantized_split,
)
from jax_residency._src.plan.split import split_model
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.typing import ParamPath, path_str


@dataclasses.dataclass(frozen=True)
class ModelSizes:
  """What the planner needs of a model.

  Attributes:
    static: bytes of the static (non-unit) tensors, as stored.
    stacks: ``(name, units, bytes per unit)`` of each stack, as stored; the name is
      the stack's path in the model (a Linen store's ``params`` collection dropped).
    decoded: a quantized store's float tensors while used (`plan_decoded_bytes`).
    unit_params: parameters of one unit of each stack, counted as floats (a quantized
      tensor by its float shape): a step multiplies by each once per token.
    quantization: the store's `QuantPlan` (None: floats).
  """

  static: int
  stacks: tuple[tuple[str, int, int], ...]
  decoded: tuple[int, int] = (0, 0)
  unit_params: tuple[int, ...] = ()
  quantization: QuantPlan | None = None

  def unit_bytes(self) -> list[int]:
    """Each unit's bytes, stack by stack."""
    return [b for _, n, b in self.stacks for _ in range(n)]


def config_path(path: str | os.PathLike[str]) -> str | None:
  """``path`` as a Hugging Face config.json to plan from (the file, or a directory with
  one and no store sidecar), else None."""
  path = os.fspath(path)
  if path.endswith(".json") and os.path.isfile(path):
    return path
  config = os.path.join(path, "config.json")
  if os.path.isfile(config) and not os.path.exists(os.path.join(path, "jax_residency.json")):
    return config
  return None


#: The sizes of the configs sized last, by file (its path and text) and options.
_CONFIG_SIZES: dict[tuple[Any, ...], ModelSizes] = {}


def sizes_of(
  path: str | os.PathLike[str], *, dtype: Any = None, quantize: Any = None
) -> ModelSizes:
  """The sizes of the store at ``path``, or of the model the config.json at ``path``
  describes, stored in ``dtype`` (default: its ``torch_dtype``) and quantized as
  ``quantize`` asks (as ``jr.save``'s ``quantize=``). ``dtype`` and ``quantize`` are
  for a config.json only: a store is planned as it is stored."""
  config = config_path(path)
  if config is not None:
    # Sizing a config builds its abstract model (about 1 s for an 8B one); a measurement
    # and a plan of the same config (`Accelerator.measurement`, then `jr.plan`) share it.
    with open(config, "rb") as f:  # a few KiB: its text is the key, not its time stamp
      key = (os.path.realpath(config), f.read(), repr(dtype), repr(quantize))
    if key not in _CONFIG_SIZES:
      if len(_CONFIG_SIZES) >= 8:
        _CONFIG_SIZES.pop(next(iter(_CONFIG_SIZES)))
      _CONFIG_SIZES[key] = _of_config(config, dtype, quantize)
    return _CONFIG_SIZES[key]
  if dtype is not None or quantize is not None:
    raise PlacementError(
      f"dtype={dtype!r}, quantize={quantize!r}: {os.fspath(path)} is a store, planned as it "
      "is stored; leave them out (or convert with them and plan the new store)"
    )
  return _of_store(os.fspath(path))


def _name(prefix: ParamPath) -> str:
  """A stored stack's name as a placement names it (and a measurement keys it): its
  path in the model, without the ``params`` collection a Linen model's store adds."""
  return path_str(prefix[1:] if prefix[:1] == ("params",) and len(prefix) > 1 else prefix)


def _of_config(path: str, dtype: Any, quantize: Any) -> ModelSizes:
  from jax_residency._src.models.hf_convert import abstract_model  # noqa: PLC0415 - heavy

  with open(path) as f:
    hf = json.load(f)
  model = abstract_model(hf, dtype=dtype or hf.get("torch_dtype") or None, where=path)
  split = split_model(model)
  params = tuple(
    sum(math.prod(leaf.shape) for leaf in split.stack_leaves(s)) // s.count for s in split.stacks
  )
  plan = None
  if quantize is not None:
    plan = plan_quantization(split, quantize)
    split = quantized_split(split, plan, values_from="none")
  stacks = tuple(
    (s.name, s.count, sum(leaf.nbytes for leaf in split.stack_leaves(s)) // s.count)
    for s in split.stacks
  )
  return ModelSizes(
    static=sum(leaf.nbytes for leaf in split.static_leaves()),
    stacks=stacks,
    decoded=(0, 0)
    if plan is None
    else plan_decoded_bytes(plan, [s.path_prefix for s in split.stacks]),
    unit_params=params,
    quantization=plan,
  )


def _of_store(path: str) -> ModelSizes:
  with UnitStore.open(path, require_unit_chunks=False) as opened:
    info = opened.info
    specs = [opened.stack_specs(k) for k in range(len(info.stacks))]
  quant = info.quantization
  params = []
  for stack, spec in zip(info.stacks, specs, strict=True):
    n, prefix = stack.count, stack.prefix
    held = {
      t.path[len(prefix) :]: math.prod(t.shape) // n
      for t in (quant.tensors if quant is not None else ())
      if t.path[: len(prefix)] == prefix
    }
    # A quantized tensor's stored leaves (codes, scales) count as its float shape, once.
    floats = sum(math.prod(shape) for rel, (shape, _) in spec.items() if rel[:-1] not in held)
    params.append(floats + sum(held.values()))
  return ModelSizes(
    static=info.static_nbytes,
    stacks=tuple((_name(s.prefix), s.count, s.unit_nbytes) for s in info.stacks),
    decoded=(0, 0) if quant is None else plan_decoded_bytes(quant, [s.prefix for s in info.stacks]),
    unit_params=tuple(params),
    quantization=quant,
  )
