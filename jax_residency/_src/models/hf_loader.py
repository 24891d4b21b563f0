"""The one loader of Hugging Face checkpoints: tensors to parameters, checked, to a model.

Every family (Llama, T5, BERT) loads the same way: its config (read from
``config.json``, or given) → an abstract model → the shapes it expects → the
checkpoint's tensors (:func:`~jax_residency._src.models.hf.read_safetensors`) →
each parameter from its tensor (transposed, reshaped, a layer stack's rows
stacked) → every problem found raised as one typed error → the model, filled.
A family supplies only a :class:`Loader`: its abstract model and its
:class:`CheckpointMap` (which tensor fills which parameter, for a config).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jax_residency._src.errors import (
  CheckpointShapeMismatchError,
  MissingCheckpointParametersError,
  UnexpectedCheckpointParametersError,
  format_paths,
)
from jax_residency._src.models.hf import read_safetensors
from jax_residency._src.plan.split import normalise_path
from jax_residency._src.typing import ParamPath, path_str

C = TypeVar("C")
M = TypeVar("M", bound=nnx.Module)


@dataclasses.dataclass(frozen=True)
class HFTensor:
  """One Hugging Face tensor: its name (``{i}`` for the layer index in a per-layer name),
  and whether it is transposed before it is reshaped (row-major) to the parameter's shape.
  With ``experts``, a per-layer parameter stacks that many tensors, expert ``j``'s named
  with ``{j}`` (a mixture of experts' stacked kernels).

  Example:
    >>> t = HFTensor("model.layers.{i}.mlp.up_proj.weight", transpose=True)
    >>> t.name.format(i=3)
    'model.layers.3.mlp.up_proj.weight'
    >>> HFTensor("model.layers.{i}.mlp.experts.{j}.up_proj.weight", True, experts=2).names(1)
    ['model.layers.1.mlp.experts.0.up_proj.weight', 'model.layers.1.mlp.experts.1.up_proj.weight']
  """

  name: str
  transpose: bool
  experts: int = 0

  def names(self, i: int) -> list[str]:
    """Layer ``i``'s tensor names: one, or one per expert."""
    if not self.experts:
      return [self.name.format(i=i)]
    return [self.name.format(i=i, j=j) for j in range(self.experts)]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CheckpointMap:
  """Which checkpoint tensor fills each parameter of a model of one config, and what the
  loader says when the checkpoint does not fit.

  Entries for parameters the model lacks (another variant's) are skipped, and
  their tensors count as unused.

  Attributes:
    static: static parameter path (as in ``nnx.state(model)``) → its tensor.
    stacks: stack name (the first key of its parameters' paths) → ``(layers,
      {path inside the stack: its tensor, named with {i}})``; layer ``i``'s
      tensor is row ``i`` of the stacked parameter.
    ignored: whether a tensor the model does not read is tolerated when strict.
    unused_note: who does not use the unused tensors (``"a T5 of this config
      does not use (...)"``), for the error.
    missing_note: who needs the missing tensors, and what to check.
    unused_fix: what else to do about unused tensors, after ``pass strict=False
      to ignore them``.
    reshape: a tensor of the parameter's size but another rank is reshaped
      (row-major) to it; otherwise a tensor must have the parameter's shape.
    mark_transposed: shape errors name a transposed tensor ``<name> (transposed)``.
  """

  static: Mapping[ParamPath, HFTensor]
  stacks: Mapping[str, tuple[int, Mapping[ParamPath, HFTensor]]]
  ignored: Callable[[str], bool]
  unused_note: str
  missing_note: str
  unused_fix: str = ""
  reshape: bool = False
  mark_transposed: bool = False

  def of(self, expected: Mapping[ParamPath, Any]) -> CheckpointMap:
    """This map without the entries of parameters that are not in ``expected``."""
    stacks = {
      stack: (count, {sub: t for sub, t in unit.items() if (stack, *sub) in expected})
      for stack, (count, unit) in self.stacks.items()
    }
    static = {path: t for path, t in self.static.items() if path in expected}
    return dataclasses.replace(self, static=static, stacks=stacks)

  def names(self) -> set[str]:
    """Every tensor name the map reads."""
    names = {t.name for t in self.static.values()}
    for count, unit in self.stacks.values():
      names |= {n for t in unit.values() for i in range(count) for n in t.names(i)}
    return names


def _as_asked(cfg: C, tensors: Mapping[str, np.ndarray]) -> C:
  return cfg


def _as_named(tensors: Mapping[str, np.ndarray]) -> Mapping[str, np.ndarray]:
  return tensors


def _on_default_device(value: np.ndarray, leaf: Any) -> jax.Array:
  return jnp.asarray(value)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Loader(Generic[C, M]):
  """What a model family gives the loader: its abstract model and its checkpoint map.

  Attributes:
    abstract: the model of a config, abstract (``nnx.eval_shape``; see :func:`abstract_of`).
    checkpoint_map: the :class:`CheckpointMap` of a config.
    rename: the checkpoint's tensors under the names the map uses (BERT drops
      a task-head checkpoint's ``bert.`` prefix); default: as they are.
    fit: the config to build, given the one asked for and the checkpoint's
      tensors (T5 unties a head the checkpoint holds); default: as asked.
    place: a parameter's array from its NumPy value and its abstract leaf
      (BERT places a sharded one on its mesh); default: ``jnp.asarray``.
  """

  abstract: Callable[[C], M]
  checkpoint_map: Callable[[C], CheckpointMap]
  rename: Callable[[Mapping[str, np.ndarray]], Mapping[str, np.ndarray]] = _as_named
  fit: Callable[[C, Mapping[str, np.ndarray]], C] = _as_asked
  place: Callable[[np.ndarray, Any], jax.Array] = _on_default_device


def abstract_of(model: Callable[..., M], cfg: Any, **kwargs: Any) -> M:
  """``model(cfg, rngs=nnx.Rngs(0), **kwargs)``, abstract: shapes and dtypes, no weights."""
  return nnx.eval_shape(lambda: model(cfg, rngs=nnx.Rngs(0), **kwargs))


def expected_shapes(abstract: nnx.Module) -> dict[ParamPath, tuple[int, ...]]:
  """Parameter path (as in ``nnx.state(model)``) → shape, of an abstract model."""
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(abstract))[0]
  return {normalise_path(p): tuple(v.shape) for p, v in flat}


def raise_checkpoint_problems(
  *,
  unexpected: list[str],
  missing: list[str],
  bad: list[str],
  unused_note: str,
  missing_note: str,
  config: Any,
  unused_fix: str = "",
) -> None:
  """Raises the typed error for what a loader found wrong with a checkpoint, if anything.

  In this order: tensors the model does not use (``unexpected``: pass ``[]``
  when not strict), tensors it needs and the checkpoint lacks (``missing``),
  and tensors that do not fit their parameter (``bad``). Each message lists
  every name; ``unused_note`` and ``missing_note`` say which model, and what to
  check; ``unused_fix`` follows the advice to pass ``strict=False``.

  Raises:
    UnexpectedCheckpointParametersError, MissingCheckpointParametersError,
    CheckpointShapeMismatchError.
  """
  if unexpected:
    raise UnexpectedCheckpointParametersError(
      f"the checkpoint has {len(unexpected)} tensors {unused_note}; pass strict=False to "
      f"ignore them{unused_fix}:\n" + format_paths(sorted(unexpected))
    )
  if missing:
    raise MissingCheckpointParametersError(
      f"the checkpoint lacks {len(missing)} tensors {missing_note}\n"
      + format_paths(sorted(missing))
    )
  if bad:
    raise CheckpointShapeMismatchError(
      f"checkpoint tensors do not fit {config}; check the config's sizes:\n" + format_paths(bad)
    )


class _Taker:
  """Takes tensors out of a checkpoint as parameters, noting the missing and misfit ones."""

  def __init__(
    self, tensors: Mapping[str, np.ndarray], cmap: CheckpointMap, dtype: Any, consume: bool
  ) -> None:
    self._get = tensors.pop if consume and isinstance(tensors, dict) else tensors.get
    self._map, self._dtype = cmap, np.dtype(dtype)
    self.missing: list[str] = []
    self.bad: list[str] = []

  def _fits(self, value: np.ndarray, want: tuple[int, ...]) -> bool:
    if self._map.reshape:
      return value.size == int(np.prod(want)) and (value.ndim != len(want) or value.shape == want)
    return value.shape == want

  def take(
    self, name: str, t: HFTensor, path: ParamPath, want: tuple[int, ...]
  ) -> np.ndarray | None:
    """Tensor ``name``, transposed if ``t`` says so, as parameter ``path`` of shape
    ``want`` in the model's dtype; ``None`` (and the problem noted) if missing or misfit."""
    value = self._get(name, None)
    if value is None:
      self.missing.append(name)
      return None
    value = value.T if t.transpose else value
    if not self._fits(value, want):
      label = f"{name} (transposed)" if t.transpose and self._map.mark_transposed else name
      self.bad.append(f"{label} {value.shape} → {path_str(path)}: expected {want}")
      return None
    return np.asarray(value, self._dtype).reshape(want)


def params_from_hf(
  tensors: Mapping[str, np.ndarray],
  cfg: Any,
  loader: Loader[Any, Any],
  *,
  strict: bool = True,
  consume: bool = False,
  abstract: nnx.Module | None = None,
) -> dict[ParamPath, np.ndarray]:
  """Maps checkpoint tensors to the parameters of ``loader``'s model of ``cfg``.

  Args:
    tensors: name → array, as read from the checkpoint.
    cfg: the model's config; every tensor's shape is checked against it, and
      parameters are cast to its ``dtype``.
    loader: the family's :class:`Loader`.
    strict: reject tensors the map does not read and ``ignored`` does not tolerate.
    consume: take each tensor out of ``tensors`` (a dict the caller owns) as it
      is used, so the checkpoint is not held twice.
    abstract: the abstract model, if the caller has it; default: ``loader.abstract(cfg)``.

  Returns:
    Parameter path (as in ``nnx.state(model)``) → array in ``cfg.dtype``.

  Raises:
    UnexpectedCheckpointParametersError: with ``strict``, unknown tensors.
    MissingCheckpointParametersError: tensors the model needs are absent.
    CheckpointShapeMismatchError: a tensor does not fit its parameter.
  """
  tensors = loader.rename(tensors)
  expected = expected_shapes(loader.abstract(cfg) if abstract is None else abstract)
  cmap = loader.checkpoint_map(cfg).of(expected)
  known = cmap.names()
  unexpected = [n for n in tensors if n not in known and not cmap.ignored(n)] if strict else []
  taker = _Taker(tensors, cmap, cfg.dtype, consume)
  out: dict[ParamPath, np.ndarray] = {}
  for path, t in cmap.static.items():
    value = taker.take(t.name, t, path, expected[path])
    if value is not None:
      out[path] = value
  for stack, (count, unit) in cmap.stacks.items():
    for sub, t in unit.items():
      path = (stack, *sub)
      want = expected[path][2:] if t.experts else expected[path][1:]
      rows: list[Any] = [[taker.take(n, t, path, want) for n in t.names(i)] for i in range(count)]
      if all(r is not None for row in rows for r in row):
        out[path] = np.stack([np.stack(row) if t.experts else row[0] for row in rows])
      del rows
  raise_checkpoint_problems(
    unexpected=unexpected,
    missing=taker.missing,
    bad=taker.bad,
    unused_note=cmap.unused_note,
    unused_fix=cmap.unused_fix,
    missing_note=cmap.missing_note,
    config=cfg,
  )
  return out


def filled(abstract: M, params: dict[ParamPath, np.ndarray], loader: Loader[Any, M]) -> M:
  """``abstract`` with every parameter taken (popped) from ``params``, placed by ``loader``."""
  graphdef, state = nnx.split(abstract)
  leaves = jax.tree_util.tree_map_with_path(
    lambda p, leaf: loader.place(params.pop(normalise_path(p)), leaf), state
  )
  return nnx.merge(graphdef, leaves)


def load_checkpoint(path: str | Path, cfg: C, loader: Loader[C, M], *, strict: bool) -> M:
  """The model of ``cfg`` holding the checkpoint at ``path`` (see the module docstring).

  ``path`` is a ``.safetensors`` file, or a directory with ``model.safetensors``
  or a sharded ``model.safetensors.index.json``. The tensors are read into
  memory whole, each let go once its parameter holds it.

  Raises:
    FileNotFoundError: no checkpoint at ``path``.
    ModuleNotFoundError: ``safetensors`` is not installed (``pip install
      'jax-residency[models]'``).
    UnexpectedCheckpointParametersError, MissingCheckpointParametersError,
    CheckpointShapeMismatchError: as :func:`params_from_hf`.
  """
  tensors = read_safetensors(path)
  cfg = loader.fit(cfg, tensors)
  abstract = loader.abstract(cfg)
  params = params_from_hf(tensors, cfg, loader, strict=strict, consume=True, abstract=abstract)
  return filled(abstract, params, loader)
