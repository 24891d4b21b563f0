"""A split model whose floating matrices are quantized: the plan a store records, and the
split placement runs from (docs/design.md, section 2.4).

`plan_quantization` picks the tensors a scheme quantizes (`encoding.quantized_axis`)
and checks the scheme can encode each. `quantized_split` turns a `SplitModel` into
one whose leaves are the stored parts (``<path>.codes``, ``<path>.scale``,
``<path>.offset``) in place of each quantized tensor, so every part of placement that
counts, lays out, stores or streams leaves counts quantized bytes. Its ``bind``
regroups the parts: a static tensor's decode is traced where the forward begins, a
unit's tensor reaches the layer loop as a `QuantizedTensor` whose decode is traced at
the top of the step that runs the unit; `quant.fused` computes each decode inside the
operation that uses it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec

from jax_residency._src.errors import (
  CheckpointShapeMismatchError,
  InvalidPolicyValueError,
  QuantizationError,
  format_paths,
)
from jax_residency._src.plan.shardings import per_device_bytes
from jax_residency._src.plan.split import Bound, Leaf, SplitModel, Stack
from jax_residency._src.quant.encoding import (
  MIN_QUANTIZED_DIM,
  Encoding,
  QuantizedTensor,
  encoded_nbytes,
  quantized_axis,
)
from jax_residency._src.quant.schemes import GGUF_SCHEME, Quantization
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes


@dataclasses.dataclass(frozen=True)
class QuantizedLeaf:
  """One tensor held quantized: its path, its float shape (units stacked) and encoding."""

  path: ParamPath
  shape: tuple[int, ...]
  encoding: Encoding

  @property
  def float_nbytes(self) -> int:
    return tensor_nbytes(self.shape, self.encoding.dtype)

  @property
  def stored_nbytes(self) -> int:
    return encoded_nbytes(self.encoding, self.shape)


@dataclasses.dataclass(frozen=True)
class QuantPlan:
  """Which tensors a store holds quantized, and how (the sidecar's ``quantization``).

  Attributes:
    quantization: the scheme the store was written with.
    tensors: each quantized tensor, in the model's leaf order.
  """

  quantization: Quantization
  tensors: tuple[QuantizedLeaf, ...]

  def by_path(self) -> dict[ParamPath, QuantizedLeaf]:
    return {t.path: t for t in self.tensors}

  @property
  def float_nbytes(self) -> int:
    """Bytes the quantized tensors take as floats."""
    return sum(t.float_nbytes for t in self.tensors)

  @property
  def stored_nbytes(self) -> int:
    """Bytes they take at rest (codes, scales, offsets)."""
    return sum(t.stored_nbytes for t in self.tensors)

  def to_dict(self) -> dict[str, Any]:
    return {
      **self.quantization.to_dict(),
      "min_dim": MIN_QUANTIZED_DIM,
      "tensors": [
        {"path": list(t.path), "shape": list(t.shape), **t.encoding.to_dict()} for t in self.tensors
      ],
    }

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> QuantPlan:
    tensors = tuple(
      QuantizedLeaf(
        tuple(str(p) for p in t["path"]), tuple(int(n) for n in t["shape"]), Encoding.from_dict(t)
      )
      for t in d["tensors"]
    )
    return cls(Quantization.of({k: d[k] for k in ("scheme", "group_size") if k in d}), tensors)


def _unit_shape(split: SplitModel, i: int) -> tuple[int, ...]:
  units = set(split.unit_index)
  return split.leaves[i].shape[1:] if i in units else split.leaves[i].shape


def plan_quantization(
  split: SplitModel, quantization: Quantization | str | Mapping[str, Any]
) -> QuantPlan:
  """The tensors of ``split`` (its stacks chosen) that ``quantization`` quantizes.

  Raises:
    QuantizationError: the model has no floating matrix to quantize, or the scheme's
      groups do not divide some tensors' input dimension (one error lists them all).
  """
  units = set(split.unit_index)
  return plan_tensors(
    [(leaf.path, leaf.shape, i in units, leaf.dtype) for i, leaf in enumerate(split.leaves)],
    quantization,
  )


def plan_tensors(
  tensors: Sequence[tuple[ParamPath, tuple[int, ...], bool, Any]],
  quantization: Quantization | str | Mapping[str, Any],
) -> QuantPlan:
  """`plan_quantization` of tensors given as ``(path, shape, stacked, dtype)`` (stacked:
  a layer stack's tensor, units on axis 0), in order."""
  q = Quantization.of(quantization)
  if q.scheme == GGUF_SCHEME:
    raise InvalidPolicyValueError(
      f"quantize={q.scheme!r} is the scheme of stores converted from GGUF files "
      "(models.convert_gguf), which keep each tensor's GGML type; ask for 'int8' or 'int4'."
    )
  chosen, bad = [], []
  for path, shape, stacked, dtype in tensors:
    axis = quantized_axis(path, shape[1:] if stacked else shape, dtype)
    if axis is None:
      continue
    try:
      q.check(shape, axis, path_str(path))
    except QuantizationError as e:
      bad.append(str(e))
      continue
    chosen.append(QuantizedLeaf(path, tuple(shape), Encoding(q, axis, np.dtype(dtype).name)))
  if bad:
    raise QuantizationError(
      f"quantize={q.to_dict()}: {len(bad)} tensors cannot be encoded:\n" + format_paths(bad)
    )
  if not chosen:
    raise QuantizationError(
      f"quantize={q.to_dict()}: the model has no floating matrix to quantize (only 2-D "
      f"floating tensors, per layer, with both dimensions >= {MIN_QUANTIZED_DIM} are); "
      f"its {len(tensors)} parameters stay as they are. Leave quantize= out."
    )
  return QuantPlan(q, tuple(chosen))


def quantize_arrays(
  static: Mapping[ParamPath, Any],
  stacks: Mapping[ParamPath, Mapping[ParamPath, Any]],
  quantization: Quantization | str | Mapping[str, Any],
) -> tuple[QuantPlan, dict[ParamPath, Any], dict[ParamPath, dict[ParamPath, Any]]]:
  """A writer's arrays (``save_store``'s ``static`` and ``stacks``, possibly lazy) with
  each tensor ``quantization`` quantizes replaced by its parts, encoded as they are
  read (a unit at a time): the plan, and the new ``static`` and ``stacks``."""
  listed = [(p, tuple(a.shape), False, a.dtype) for p, a in static.items()]
  for prefix, arrays in stacks.items():
    listed += [(prefix + p, tuple(a.shape), True, a.dtype) for p, a in arrays.items()]
  plan = plan_tensors(listed, quantization)
  tensors = plan.by_path()

  def expand(arrays: Mapping[ParamPath, Any], prefix: ParamPath) -> dict[ParamPath, Any]:
    out: dict[ParamPath, Any] = {}
    for p, a in arrays.items():
      t = tensors.get(prefix + p)
      if t is None:
        out[p] = a
        continue
      encoder = _Encoder(a, t)
      for j, (name, (shape, dtype)) in enumerate(
        zip(t.encoding.part_names, t.encoding.part_shapes(t.shape), strict=True)
      ):
        out[(*p, name)] = LazyPart(encoder, j, shape, dtype)
    return out

  return plan, expand(static, ()), {k: expand(v, k) for k, v in stacks.items()}


def check_plan(split: SplitModel, plan: QuantPlan, *, where: str) -> None:
  """Checks a store's plan (read from ``where``) fits ``split``: each tensor it holds
  quantized is a parameter of the model with the recorded shape and dtype.

  Raises:
    CheckpointShapeMismatchError: one error listing every tensor that differs or is
      missing from the model.
  """
  leaves = {leaf.path: leaf for leaf in split.leaves}
  bad = []
  for t in plan.tensors:
    leaf = leaves.get(t.path)
    if leaf is None:
      bad.append(f"{path_str(t.path)}: stored quantized, but the model has no such parameter")
    elif leaf.shape != t.shape or leaf.dtype.name != t.encoding.dtype:
      bad.append(
        f"{path_str(t.path)}: the model has {leaf.shape} {leaf.dtype.name}, the store "
        f"holds {t.shape} {t.encoding.dtype} quantized as {t.encoding.quantization.scheme}"
      )
  if bad:
    raise CheckpointShapeMismatchError(
      f"the quantized store at {where!r} was written for another model: {len(bad)} "
      "tensors differ. Place the model the store was saved from, or save this one:\n"
      + format_paths(bad)
    )


def _part_spec(spec: PartitionSpec, ndim: int, encoding: Encoding, first: bool) -> PartitionSpec:
  """A part's spec: the tensor's, laid out as rows along the input axis (a kernel's
  last two entries swapped); a scale's or offset's not split along the input axis."""
  entries = list(spec) + [None] * (ndim - len(spec))
  if encoding.kernel:  # stored transposed
    entries[-2], entries[-1] = entries[-1], entries[-2]
  if not first:
    entries[-1] = None
  return PartitionSpec(*entries)


class _Encoder:
  """Encodes one tensor on demand, a unit or the whole of it at a time, keeping the last
  result: its parts are written one after another, so each unit is encoded once."""

  def __init__(self, source: Any, t: QuantizedLeaf) -> None:
    self.source, self.t = source, t
    self._key: Any = object()
    self._parts: tuple[np.ndarray, ...] = ()

  def parts(self, unit: int | None) -> tuple[np.ndarray, ...]:
    if unit != self._key:
      self._parts = ()  # drop the last encoding before making the next
      value = np.asarray(self.source if unit is None else self.source[unit])
      self._parts = self.t.encoding.encode(value, path_str(self.t.path))
      self._key = unit
    return self._parts


class LazyPart:
  """One part of a quantized tensor, encoded only when read: indexed by unit (``a[i]``)
  or read whole (``np.asarray(a)``), as `store.writer.save_store` reads lazy arrays."""

  def __init__(self, encoder: _Encoder, index: int, shape: tuple[int, ...], dtype: np.dtype):
    self._encoder, self._index = encoder, index
    self.shape, self.dtype = shape, dtype

  def __getitem__(self, key: Any) -> np.ndarray:
    if isinstance(key, int | np.integer):
      return self._encoder.parts(int(key))[self._index]
    return np.asarray(self)[key]

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    out = self._encoder.parts(None)[self._index]
    return out if dtype is None else out.astype(dtype)


def _encode(value: Any, leaf: Leaf, t: QuantizedLeaf, values_from: str) -> tuple[Any, ...]:
  shapes = t.encoding.part_shapes(t.shape)
  if values_from == "none" or value is None or isinstance(value, jax.ShapeDtypeStruct):
    return tuple(jax.ShapeDtypeStruct(s, d) for s, d in shapes)
  if values_from == "lazy":
    encoder = _Encoder(value, t)
    return tuple(LazyPart(encoder, j, s, d) for j, (s, d) in enumerate(shapes))
  return t.encoding.encode(np.asarray(value), path_str(leaf.path))


def quantized_split(
  split: SplitModel, plan: QuantPlan, *, values_from: str = "encode"
) -> SplitModel:
  """``split`` with each tensor of ``plan`` replaced by its stored parts.

  ``values_from`` says what the parts' values are: ``"encode"``, encoded from the model's
  now (on the host, one tensor at a time); ``"lazy"``, `LazyPart` s encoded when a
  writer reads them, a unit at a time; ``"none"``, placeholders
  (``jax.ShapeDtypeStruct``) for weights read from a store.
  """
  by_path = plan.by_path()
  leaves: list[Leaf] = []
  values: list[Any] = []
  groups: list[tuple[int, QuantizedLeaf | None]] = []  # first new position, encoding
  for leaf, value in zip(split.leaves, split.values or [None] * len(split.leaves), strict=True):
    t = by_path.get(leaf.path)
    groups.append((len(leaves), t))
    if t is None:
      leaves.append(leaf)
      values.append(value)
      continue
    parts = _encode(value, leaf, t, values_from)
    for j, (name, (shape, dtype)) in enumerate(
      zip(t.encoding.part_names, t.encoding.part_shapes(t.shape), strict=True)
    ):
      spec = _part_spec(leaf.spec, len(shape), t.encoding, j == 0)
      leaves.append(Leaf((*leaf.path, name), shape, dtype, spec))
    values.extend(parts)
  unit_positions = set(split.unit_index)
  original = split

  def bind(leaf_values: Sequence[Any], stacks: Sequence[Stack]) -> Bound:
    regrouped = []
    for i, (start, t) in enumerate(groups):
      if t is None:
        regrouped.append(leaf_values[start])
        continue
      node = QuantizedTensor(
        tuple(leaf_values[start : start + len(t.encoding.part_names)]), t.encoding
      )
      regrouped.append(node if i in unit_positions else node.decode())
    return original.bind_stacks(regrouped, stacks)

  out = SplitModel(split.kind, leaves, values, (), bind, split.root, quantization=plan)
  return out.with_stacks([s.prefix for s in split.stacks])


def for_placement(
  split: SplitModel, plan: QuantPlan | None, wanted: Quantization | None, *, store: str | None
) -> SplitModel:
  """The split a placement runs: ``plan``'s parts, read from the store at ``store``; or
  the model's own weights encoded as ``wanted`` asks; or ``split`` itself."""
  if plan is not None:
    check_plan(split, plan, where=str(store))
    return quantized_split(split, plan, values_from="none")
  if wanted is not None:
    return quantized_split(split, plan_quantization(split, wanted), values_from="encode")
  return split


def check_wanted(plan: QuantPlan | None, wanted: Quantization | None, *, store: str | None) -> None:
  """Checks ``place(..., quantize=wanted)`` agrees with the store's ``plan``.

  Raises:
    QuantizationError: the store holds float weights, or another scheme.
  """
  if store is None or wanted is None or (plan is not None and plan.quantization == wanted):
    return
  held = "float weights" if plan is None else f"weights quantized as {plan.quantization.to_dict()}"
  raise QuantizationError(
    f"quantize={wanted.to_dict()}, but the store at {store!r} holds {held}. A placement "
    "from a store runs what the store holds: leave quantize= out, or write a store "
    f"with jax_residency.save(model, path, quantize={wanted.to_dict()!r})."
  )


def decoded_bytes(
  split: SplitModel,
  static_shardings: Sequence[jax.sharding.Sharding],
  slice_shardings: Sequence[jax.sharding.Sharding],
) -> tuple[int, int]:
  """Bytes one device holds of a quantized split's float tensors while they are used:
  the largest static tensor's, and the largest tensor's of a unit. Each is decoded
  inside the operation that uses it, one at a time (`quant.fused`: a one-token product
  decodes inside its loop, a several-row product one matrix, or a slice of it, at a
  time; a dense stream's static regions, `stream.static_decode`, one operation at a
  time), so the largest is what a step adds. ``(0, 0)`` for a float model."""
  if split.quantization is None:
    return 0, 0
  tensors = split.quantization.by_path()

  def floats(leaves: Sequence[Any], shardings: Sequence[jax.sharding.Sharding], unit: bool) -> int:
    largest = 0
    for leaf, s in zip(leaves, shardings, strict=True):
      t = tensors.get(leaf.path[:-1])
      if t is not None and leaf.path[-1] == t.encoding.part_names[0]:
        shape = t.shape[1:] if unit else t.shape
        largest = max(largest, per_device_bytes(shape, np.dtype(t.encoding.dtype), s))
    return largest

  units = [
    floats(split.stack_leaves(st), slice_shardings[st.leaf_slice], True) for st in split.stacks
  ]
  return floats(split.static_leaves(), static_shardings, False), max(units, default=0)


def plan_decoded_bytes(plan: QuantPlan, stacks: Sequence[ParamPath]) -> tuple[int, int]:
  """`decoded_bytes` on one device, from a store's plan and its stacks' path prefixes
  (leaf paths, e.g. ``("params", "layers")``): the largest static tensor's float bytes,
  and the largest of one unit's tensors."""
  static = 0
  per_stack = dict.fromkeys(stacks, 0)
  for t in plan.tensors:
    prefix = next((p for p in stacks if t.path[: len(p)] == p), None)
    if prefix is None:
      static = max(static, t.float_nbytes)
    else:
      per_stack[prefix] = max(per_stack[prefix], t.float_nbytes // t.shape[0])
  return static, max(per_stack.values(), default=0)
