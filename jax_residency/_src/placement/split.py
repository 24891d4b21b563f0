"""A Flax model seen as static parameters, a unit stack and a pure forward.

NNX and Linen models are both reduced to a :class:`SplitModel`: a flat list of
parameter leaves with normalised paths, the set of leaves that form the stacked
layer module (the *units*, leading axis = layer index), their partitioning
metadata, and a ``forward(leaves, *args)`` that rebuilds the model from leaves
and calls it. Placement never mutates the user's model.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec

from jax_residency._src.policy.errors import UnitSelectionError, format_paths
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes

#: Attribute names tried, in order, when ``units`` is not given.
DEFAULT_UNIT_NAMES: tuple[str, ...] = ("layers", "blocks", "h", "layer", "units", "decoder_layers")


def normalise_path(key_path: Sequence[Any]) -> ParamPath:
  """Turns a JAX key path into a tuple of strings, dropping NNX's ``.value``."""
  parts: list[str] = []
  for k in key_path:
    if isinstance(k, jax.tree_util.DictKey):
      parts.append(str(k.key))
    elif isinstance(k, jax.tree_util.SequenceKey):
      parts.append(str(k.idx))
    elif isinstance(k, jax.tree_util.GetAttrKey):
      parts.append(k.name)
    else:
      parts.append(str(k))
  if parts and parts[-1] == "value":
    parts.pop()
  return tuple(parts)


@dataclasses.dataclass(frozen=True)
class Leaf:
  """One parameter leaf of a split model."""

  path: ParamPath
  shape: tuple[int, ...]
  dtype: np.dtype
  spec: PartitionSpec

  @property
  def nbytes(self) -> int:
    return tensor_nbytes(self.shape, self.dtype)


@dataclasses.dataclass(frozen=True)
class Bound:
  """A model rebuilt from leaf values.

  Attributes:
    call: calls the rebuilt model (``call(*args, **kwargs)``).
    units: what identifies its unit stack to the layer loop: the rebuilt NNX
      module, or for Linen the stack's scope path.
  """

  call: Callable[..., Any]
  units: Any


@dataclasses.dataclass
class SplitModel:
  """A model reduced to leaves, a unit selection and a pure forward.

  Attributes:
    kind: ``"nnx"`` or ``"linen"``.
    leaves: every parameter leaf, in the model's pytree order.
    values: the leaf arrays, same order.
    unit_prefix: the path of the stacked layer module (for Linen, without
      the ``params`` collection name).
    unit_index: positions in ``leaves`` of the unit leaves, in order.
    static_index: positions of the static leaves, in order.
    bind: ``bind(leaves)`` rebuilds the model from leaf values (a
      :class:`Bound`: its call and its unit stack). The unit loop
      (``unit_loop.run_in_loop``) runs it; this module knows nothing of loops.
    unit_path_prefix: the unit prefix as it appears in leaf paths.
  """

  kind: str
  leaves: list[Leaf]
  values: list[Any]
  unit_prefix: ParamPath
  unit_index: list[int]
  static_index: list[int]
  bind: Callable[[Sequence[Any]], Bound]
  unit_path_prefix: ParamPath

  @property
  def unit_count(self) -> int:
    return self.leaves[self.unit_index[0]].shape[0]

  def unit_leaves(self) -> list[Leaf]:
    return [self.leaves[i] for i in self.unit_index]

  def static_leaves(self) -> list[Leaf]:
    return [self.leaves[i] for i in self.static_index]

  def unit_rel_path(self, leaf: Leaf) -> ParamPath:
    return leaf.path[len(self.unit_path_prefix) :]

  def join(self, static: Sequence[Any], units: Sequence[Any]) -> list[Any]:
    """Interleaves static and unit leaves back into pytree order."""
    out: list[Any] = [None] * len(self.leaves)
    for i, v in zip(self.static_index, static, strict=True):
      out[i] = v
    for i, v in zip(self.unit_index, units, strict=True):
      out[i] = v
    return out


def _specs(tree: Any, get_spec: Callable[[Any], Any], n: int) -> list[PartitionSpec]:
  try:
    spec_tree = get_spec(tree)
    specs = jax.tree.leaves(spec_tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
    specs = [s if isinstance(s, PartitionSpec) else PartitionSpec() for s in specs]
    if len(specs) == n:
      return specs
  except Exception:  # noqa: BLE001 - models without metadata have no specs
    pass
  return [PartitionSpec()] * n


def _select_units(
  paths: list[ParamPath], shapes: list[tuple[int, ...]], units: Any, root: ParamPath
) -> ParamPath:
  """Resolves the unit prefix from a user choice or the defaults."""
  rel = [p[len(root) :] for p in paths]

  def leaves_under(prefix: ParamPath) -> list[int]:
    return [i for i, p in enumerate(rel) if p[: len(prefix)] == prefix]

  def is_stack(prefix: ParamPath) -> bool:
    idx = leaves_under(prefix)
    dims = {shapes[i][0] if shapes[i] else None for i in idx}
    return bool(idx) and len(dims) == 1 and None not in dims

  candidates = sorted({p[:k] for p in rel for k in range(1, len(p)) if is_stack(p[:k])})
  top_candidates = [
    c for c in candidates if not any(c[: len(o)] == o for o in candidates if o != c)
  ]

  if units is None:
    for name in DEFAULT_UNIT_NAMES:
      if is_stack((name,)):
        return (name,)
    if len(top_candidates) == 1:
      return top_candidates[0]
    raise UnitSelectionError(
      "could not tell which module is the stacked layer stack; pass units=<path>. "
      f"Tried the names {DEFAULT_UNIT_NAMES!r}. Candidate paths (all leaves share a leading "
      "axis):\n" + (format_paths(path_str(c) for c in top_candidates) or "  (none)")
    )
  prefix = tuple(units.split(".")) if isinstance(units, str) else tuple(str(u) for u in units)
  idx = leaves_under(prefix)
  if not idx:
    raise UnitSelectionError(
      f"units={units!r} names no parameters of the model. Candidate paths:\n"
      + (format_paths(path_str(c) for c in top_candidates) or "  (none)")
    )
  if not is_stack(prefix):
    bad = [f"{path_str(rel[i])}: shape {shapes[i]}" for i in idx]
    raise UnitSelectionError(
      f"units={units!r} is not a layer stack: its leaves do not share one leading axis. "
      "Build the layers with nnx.vmap / nn.scan so every parameter has the layer index "
      "on axis 0.\n" + format_paths(bad)
    )
  return prefix


def split_model(model: Any, *, params: Any = None, units: Any = None) -> SplitModel:
  """Splits an NNX module, or a Linen module with its ``params``, for placement."""
  if isinstance(model, nnx.Module):
    if params is not None:
      raise UnitSelectionError("params= is for Linen models; an NNX module carries its own state")
    return _split_nnx(model, units)
  if isinstance(model, nn.Module):
    if params is None:
      raise UnitSelectionError(
        "a Linen model needs its variables: place(model, policy, params=model.init(...))"
      )
    return _split_linen(model, params, units)
  raise UnitSelectionError(
    f"cannot place an object of type {type(model).__name__}; pass an nnx.Module, "
    "or a linen Module with params="
  )


def _flatten(tree: Any) -> tuple[Any, list[ParamPath], list[Any], list[tuple[int, ...]]]:
  """Flattens a parameter tree: its treedef, leaf paths, values and shapes."""
  with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
  values = [v for _, v in with_path]
  paths = [normalise_path(p) for p, _ in with_path]
  return treedef, paths, values, [tuple(np.shape(v)) for v in values]


def _leaves(
  paths: list[ParamPath],
  shapes: list[tuple[int, ...]],
  values: list[Any],
  specs: list[PartitionSpec],
) -> list[Leaf]:
  return [
    Leaf(p, s, np.dtype(v.dtype), sp)
    for p, s, v, sp in zip(paths, shapes, values, specs, strict=True)
  ]


def _walk(module: Any, path: ParamPath) -> Any:
  for part in path:
    module = module[int(part)] if part.isdigit() else getattr(module, part)
  return module


def _split_nnx(model: nnx.Module, units: Any) -> SplitModel:
  graphdef, state = nnx.split(model)
  treedef, paths, values, shapes = _flatten(state)
  prefix = _select_units(paths, shapes, units, ())
  leaves = _leaves(paths, shapes, values, _specs(state, nnx.get_partition_spec, len(values)))

  def bind(leaf_values: Sequence[Any]) -> Bound:
    merged = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(leaf_values)))
    return Bound(call=merged, units=_walk(merged, prefix))

  return _finish("nnx", leaves, values, prefix, prefix, bind)


def _split_linen(model: nn.Module, variables: Any, units: Any) -> SplitModel:
  if "params" not in variables:
    raise UnitSelectionError("Linen variables have no 'params' collection; pass model.init(...)")
  specs_tree = nn.get_partition_spec(variables)
  variables = nn.meta.unbox(variables)
  treedef, paths, values, shapes = _flatten(variables)
  param_paths = [p for p in paths if p[0] == "params"]
  param_shapes = [s for p, s in zip(paths, shapes, strict=True) if p[0] == "params"]
  prefix = _select_units(param_paths, param_shapes, units, ("params",))
  leaves = _leaves(paths, shapes, values, _specs(specs_tree, lambda t: t, len(values)))

  def bind(leaf_values: Sequence[Any]) -> Bound:
    variables = jax.tree.unflatten(treedef, list(leaf_values))
    return Bound(call=functools.partial(model.apply, variables), units=prefix)

  return _finish("linen", leaves, values, prefix, ("params", *prefix), bind)


def _finish(
  kind: str,
  leaves: list[Leaf],
  values: list[Any],
  prefix: ParamPath,
  full_prefix: ParamPath,
  bind: Callable[[Sequence[Any]], Bound],
) -> SplitModel:
  n = len(full_prefix)
  unit_index = [i for i, leaf in enumerate(leaves) if leaf.path[:n] == full_prefix]
  static_index = [i for i, leaf in enumerate(leaves) if leaf.path[:n] != full_prefix]
  return SplitModel(
    kind=kind,
    leaves=leaves,
    values=values,
    unit_prefix=prefix,
    unit_index=unit_index,
    static_index=static_index,
    bind=bind,
    unit_path_prefix=full_prefix,
  )
