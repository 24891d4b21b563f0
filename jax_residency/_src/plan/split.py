"""A Flax model seen as static parameters, layer stacks and a pure forward.

NNX and Linen models are both reduced to a :class:`SplitModel`: a flat list of
parameter leaves with normalised paths, the leaves of each stacked layer module
(a :class:`Stack`; its *units* are its layers, leading axis = layer index),
their partitioning metadata, and a ``bind(leaves)`` that rebuilds the model
from leaves. Which modules are stacks is the user's choice (``units=``), the
store's record, or what the forward loops over (``loop/stacks.py``).
Placement never mutates the user's model.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec

from jax_residency._src.errors import PlacementError, UnitSelectionError, format_paths
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes


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
class Stack:
  """One stacked layer module of a split model.

  Attributes:
    prefix: its path in the model (for Linen, without the ``params`` collection).
    path_prefix: the prefix as it appears in leaf paths.
    index: positions in ``SplitModel.leaves`` of its leaves, in order.
    count: its number of units (layers).
    offset: the id of its first unit: units are numbered stack by stack.
    first: position of its first leaf among all unit leaves.
  """

  prefix: ParamPath
  path_prefix: ParamPath
  index: tuple[int, ...]
  count: int
  offset: int
  first: int

  @property
  def name(self) -> str:
    """The stack's path as a dotted string (``"encoder.layers"``)."""
    return path_str(self.prefix)

  @property
  def units(self) -> range:
    """The ids of its units."""
    return range(self.offset, self.offset + self.count)

  @property
  def leaf_slice(self) -> slice:
    """Its leaves' positions among all unit leaves (``SplitModel.unit_index`` order)."""
    return slice(self.first, self.first + len(self.index))


@dataclasses.dataclass(frozen=True)
class Bound:
  """A model rebuilt from leaf values.

  Attributes:
    call: calls the rebuilt model (``call(*args, **kwargs)``).
    units: what identifies each placed stack to the layer loop, in stack
      order: the rebuilt NNX module, or for Linen the stack's scope path.
    path_of: the model path of a module the forward loops over (an NNX
      module, or a Linen scope path); ``None`` if it is not one of the
      model's own modules.
  """

  call: Callable[..., Any]
  units: tuple[Any, ...]
  path_of: Callable[[Any], ParamPath | None]


@dataclasses.dataclass
class SplitModel:
  """A model reduced to leaves, its layer stacks and a pure forward.

  Attributes:
    kind: ``"nnx"`` or ``"linen"``.
    leaves: every parameter leaf, in the model's pytree order.
    values: the leaf arrays, same order.
    stacks: the placed layer stacks, in the order the forward runs them
      (empty until they are chosen or found, see `with_stacks`).
    bind: ``bind(leaves)`` rebuilds the model from leaf values (a
      :class:`Bound`: its call and its stacks). The unit loop
      (``unit_loop.run_in_loop``) runs it; this module knows nothing of loops.
    root: the leaf-path prefix of parameters (``("params",)`` for Linen).
    quantization: for a split whose leaves are quantized tensors' stored parts, the
      plan of those tensors (``plan.quantized.QuantPlan``); else None.
    activations: how the one-row products of quantized tensors take their row on one
      CPU device (`place`'s ``activations``: ``"exact"`` or ``"int8"``).
  """

  kind: str
  leaves: list[Leaf]
  values: list[Any]
  stacks: tuple[Stack, ...]
  bind_stacks: Callable[[Sequence[Any], Sequence[Stack]], Bound]
  root: ParamPath
  quantization: Any = None
  activations: str = "exact"

  def bind(self, leaf_values: Sequence[Any]) -> Bound:
    return self.bind_stacks(leaf_values, self.stacks)

  @property
  def unit_index(self) -> list[int]:
    """Positions in ``leaves`` of every unit leaf, stack by stack."""
    return [i for s in self.stacks for i in s.index]

  @property
  def static_index(self) -> list[int]:
    """Positions of the static leaves, in order."""
    units = set(self.unit_index)
    return [i for i in range(len(self.leaves)) if i not in units]

  @property
  def unit_prefix(self) -> ParamPath:
    """The first stack's path (the only one for single-stack models)."""
    return self.stacks[0].prefix if self.stacks else ()

  @property
  def unit_path_prefix(self) -> ParamPath:
    return self.stacks[0].path_prefix if self.stacks else ()

  @property
  def unit_count(self) -> int:
    """Units over all stacks."""
    return sum(s.count for s in self.stacks)

  def unit_leaves(self) -> list[Leaf]:
    return [self.leaves[i] for i in self.unit_index]

  def stack_leaves(self, stack: Stack) -> list[Leaf]:
    return [self.leaves[i] for i in stack.index]

  def static_leaves(self) -> list[Leaf]:
    return [self.leaves[i] for i in self.static_index]

  def stack_of(self, leaf: Leaf) -> Stack:
    for s in self.stacks:
      if leaf.path[: len(s.path_prefix)] == s.path_prefix:
        return s
    raise KeyError(leaf.path)

  def unit_rel_path(self, leaf: Leaf) -> ParamPath:
    """A unit leaf's path inside its stack."""
    return leaf.path[len(self.stack_of(leaf).path_prefix) :]

  def join(self, static: Sequence[Any], units: Sequence[Any]) -> list[Any]:
    """Interleaves static and unit leaves back into pytree order."""
    out: list[Any] = [None] * len(self.leaves)
    for i, v in zip(self.static_index, static, strict=True):
      out[i] = v
    for i, v in zip(self.unit_index, units, strict=True):
      out[i] = v
    return out

  def with_stacks(self, prefixes: Sequence[ParamPath]) -> SplitModel:
    """The same model with ``prefixes`` (model paths, in forward order) as its stacks.

    Raises:
      UnitSelectionError: a prefix names no parameters or is not a layer stack.
    """
    paths = [leaf.path for leaf in self.leaves]
    shapes = [leaf.shape for leaf in self.leaves]
    for p in prefixes:
      check_stack(paths, shapes, p, self.root, given=path_str(p))
    stacks: list[Stack] = []
    offset = first = 0
    taken: set[int] = set()
    for prefix in prefixes:
      full = (*self.root, *prefix)
      index = tuple(
        i for i, leaf in enumerate(self.leaves) if leaf.path[: len(full)] == full and i not in taken
      )
      taken.update(index)
      count = self.leaves[index[0]].shape[0]
      stacks.append(Stack(tuple(prefix), full, index, count, offset, first))
      offset += count
      first += len(index)
    return dataclasses.replace(self, stacks=tuple(stacks))


_BAD_ANNOTATIONS = (
  "partitioning annotations that are not mesh axis names; give each parameter a tuple "
  "with one entry per axis (a mesh axis name, a tuple of names, or None):\n"
)


def _spec_problem(spec: Any) -> str | None:
  """Why ``spec`` cannot place a leaf, or None: a spec names mesh axes (str), or None."""
  if not isinstance(spec, PartitionSpec):
    return "not a PartitionSpec"
  for entry in spec:
    names = entry if isinstance(entry, tuple) else (entry,)
    if any(n is not None and not isinstance(n, str) for n in names):
      return f"axis {entry!r} is not a mesh axis name (a str, a tuple of str, or None)"
  return None


def _specs(
  tree: Any,
  get_spec: Callable[[Any], Any],
  paths: Sequence[ParamPath],
  *,
  is_box: Callable[[Any], bool],
  annotation: Callable[[Any], Any],
) -> list[PartitionSpec]:
  """Each leaf's `PartitionSpec` from the model's partitioning metadata (``P()`` where it
  has none), in the order of ``paths``.

  Args:
    tree: the model's state (NNX) or variables (Linen), with their metadata.
    get_spec: ``nnx.get_partition_spec`` or ``nn.get_partition_spec``.
    paths: the leaves' paths, in pytree order.
    is_box: whether a node of ``tree`` is one leaf with its metadata (an NNX
      variable, a Linen ``Partitioned`` box).
    annotation: the annotation a box holds, for error messages.

  Raises:
    PlacementError: an annotation is not a sequence of mesh axis names; the
      message names every such parameter and its annotation.
  """
  try:
    specs = jax.tree.leaves(get_spec(tree), is_leaf=lambda x: isinstance(x, PartitionSpec))
  except (TypeError, ValueError) as e:
    bad = []
    for path, box in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_box)[0]:
      try:
        get_spec(box)
      except (TypeError, ValueError) as leaf_error:
        bad.append(f"{path_str(normalise_path(path))}: {annotation(box)!r} ({leaf_error})")
    raise PlacementError(_BAD_ANNOTATIONS + (format_paths(bad) or f"  ({e})")) from e
  if len(specs) != len(paths):
    warnings.warn(
      f"the model's partitioning metadata has {len(specs)} specs for {len(paths)} parameters; "
      "placing every parameter replicated. Annotate every parameter, or none.",
      UserWarning,
      stacklevel=4,
    )
    return [PartitionSpec()] * len(paths)
  bad = [
    f"{path_str(p)}: {s!r} ({why})"
    for p, s in zip(paths, specs, strict=True)
    if (why := _spec_problem(s))
  ]
  if bad:
    raise PlacementError(_BAD_ANNOTATIONS + format_paths(bad))
  return specs


def parse_units(units: Any) -> list[ParamPath]:
  """The stack paths ``units`` names: a dotted str is one path; a tuple or list
  holds one path per stack, each a dotted str or a tuple of path components."""
  if isinstance(units, str):
    return [tuple(units.split("."))]
  return [tuple(u.split(".")) if isinstance(u, str) else tuple(str(x) for x in u) for u in units]


def candidates(paths: Sequence[ParamPath], shapes: Sequence[tuple[int, ...]]) -> list[ParamPath]:
  """The outermost modules whose leaves share a leading axis (hints for errors only:
  a LayerNorm passes this test too; the stacks are what the forward loops over)."""

  def is_stack(prefix: ParamPath) -> bool:
    dims = {
      shapes[i][0] if shapes[i] else None for i, p in enumerate(paths) if p[: len(prefix)] == prefix
    }
    return bool(dims) and len(dims) == 1 and None not in dims

  found = sorted({p[:k] for p in paths for k in range(1, len(p)) if is_stack(p[:k])})
  return [c for c in found if not any(c[: len(o)] == o for o in found if o != c)]


def check_stack(
  paths: Sequence[ParamPath],
  shapes: Sequence[tuple[int, ...]],
  prefix: ParamPath,
  root: ParamPath,
  *,
  given: str,
) -> None:
  """Checks that model path ``prefix`` is a layer stack (its leaves share axis 0)."""
  full = (*root, *prefix)
  idx = [i for i, p in enumerate(paths) if p[: len(full)] == full]
  rel = [p[len(root) :] for p in paths if p[: len(root)] == root]
  rel_shapes = [s for p, s in zip(paths, shapes, strict=True) if p[: len(root)] == root]
  if not idx:
    raise UnitSelectionError(
      f"units={given!r} names no parameters of the model. Modules whose parameters share "
      "a leading axis (possible stacks):\n"
      + (format_paths(path_str(c) for c in candidates(rel, rel_shapes)) or "  (none)")
    )
  dims = {shapes[i][0] if shapes[i] else None for i in idx}
  if len(dims) != 1 or None in dims:
    bad = [f"{path_str(paths[i][len(root) :])}: shape {shapes[i]}" for i in idx]
    raise UnitSelectionError(
      f"units={given!r} is not a layer stack: its leaves do not share one leading axis. "
      "Build the layers with nnx.vmap / nn.scan so every parameter has the layer index "
      "on axis 0.\n" + format_paths(bad)
    )


def _chosen(split: SplitModel, units: Any) -> SplitModel:
  """``split`` with the stacks ``units`` names (none yet when ``units`` is None)."""
  if units is None:
    return split
  prefixes = parse_units(units)
  dup = sorted({path_str(p) for p in prefixes if prefixes.count(p) > 1})
  nested = [
    (path_str(a), path_str(b)) for a in prefixes for b in prefixes if a != b and b[: len(a)] == a
  ]
  if dup or nested:
    what = f"names {dup[0]!r} twice" if dup else f"names {nested[0][1]!r} inside {nested[0][0]!r}"
    raise UnitSelectionError(f"units={units!r} {what}; name each layer stack once")
  return split.with_stacks(prefixes)


def split_model(model: Any, *, params: Any = None, units: Any = None) -> SplitModel:
  """Splits an NNX module, or a Linen module with its ``params``, for placement.

  The stacks are ``units`` when given, else the ones the model's class
  declares in a ``residency_stacks`` class attribute (a tuple of paths), else
  none yet: `placement.stacks.find_stacks` finds them by tracing the forward.
  """
  if units is None:
    units = getattr(type(model), "residency_stacks", None)
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
  specs = _specs(
    state,
    nnx.get_partition_spec,
    paths,
    is_box=lambda x: isinstance(x, nnx.Variable),
    annotation=lambda v: v.get_metadata().get("out_sharding"),
  )
  leaves = _leaves(paths, shapes, values, specs)

  def bind(leaf_values: Sequence[Any], stacks: Sequence[Stack]) -> Bound:
    merged = nnx.merge(graphdef, jax.tree.unflatten(treedef, list(leaf_values)))
    found: dict[int, ParamPath] = {}

    def path_of(module: Any) -> ParamPath | None:
      if not found:
        for path, node in nnx.iter_graph(merged):
          if isinstance(node, nnx.Module):
            found.setdefault(id(node), tuple(str(k) for k in path))
      return found.get(id(module))

    return Bound(call=merged, units=tuple(_walk(merged, s.prefix) for s in stacks), path_of=path_of)

  split = SplitModel("nnx", leaves, values, (), bind, ())
  return _chosen(split, units)


def _split_linen(model: nn.Module, variables: Any, units: Any) -> SplitModel:
  if "params" not in variables:
    raise UnitSelectionError("Linen variables have no 'params' collection; pass model.init(...)")
  boxed = variables
  variables = nn.meta.unbox(variables)
  treedef, paths, values, shapes = _flatten(variables)
  specs = _specs(
    boxed,
    nn.get_partition_spec,
    paths,
    is_box=lambda x: isinstance(x, nn.meta.AxisMetadata),
    annotation=lambda box: getattr(box, "names", box),
  )
  leaves = _leaves(paths, shapes, values, specs)

  def bind(leaf_values: Sequence[Any], stacks: Sequence[Stack]) -> Bound:
    variables = jax.tree.unflatten(treedef, list(leaf_values))
    return Bound(
      call=functools.partial(model.apply, variables),
      units=tuple(s.prefix for s in stacks),
      path_of=lambda scope_path: tuple(scope_path),
    )

  split = SplitModel("linen", leaves, values, (), bind, ("params",))
  return _chosen(split, units)
