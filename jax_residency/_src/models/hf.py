"""Reading Hugging Face checkpoints: safetensors tensors, ``config.json``, and the shapes
a model expects, shared by the model loaders (BERT, T5).

``safetensors`` is an optional dependency (``pip install 'jax-residency[models]'``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jax_residency._src.errors import (
  CheckpointShapeMismatchError,
  MissingCheckpointParametersError,
  UnexpectedCheckpointParametersError,
  format_paths,
)
from jax_residency._src.plan.split import normalise_path
from jax_residency._src.typing import ParamPath


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
  """Every tensor of a checkpoint as NumPy arrays.

  ``path`` is a ``.safetensors`` file, or a directory with ``model.safetensors``
  or a sharded ``model.safetensors.index.json`` (every shard its
  ``weight_map`` names is read).

  Raises:
    FileNotFoundError: no checkpoint there.
    ModuleNotFoundError: ``safetensors`` is not installed.
  """
  try:
    from safetensors.numpy import load_file  # noqa: PLC0415 - an optional dependency
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
      "reading safetensors checkpoints needs the 'safetensors' package: "
      "pip install 'jax-residency[models]'"
    ) from e
  p = Path(path)
  if p.is_dir():
    index = p / "model.safetensors.index.json"
    if not (p / "model.safetensors").is_file() and index.is_file():
      shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
      tensors: dict[str, np.ndarray] = {}
      for shard in shards:
        tensors.update(load_file(str(p / shard)))
      return tensors
    p = p / "model.safetensors"
  if not p.is_file():
    raise FileNotFoundError(
      f"no safetensors checkpoint at {str(p)!r} (nor a model.safetensors.index.json beside it)"
    )
  return load_file(str(p))


def read_config(path: str | Path, config_type: str) -> dict[str, Any]:
  """The ``config.json`` in ``path`` (a directory) or beside it (a file).

  Raises:
    FileNotFoundError: there is none; the message says to pass ``config_type(...)``.
  """
  p = Path(path)
  config = (p if p.is_dir() else p.parent) / "config.json"
  if not config.is_file():
    raise FileNotFoundError(
      f"no config.json beside {str(path)!r}: pass config={config_type}(...) with the model's sizes"
    )
  return json.loads(config.read_text())


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
) -> None:
  """Raises the typed error for what a loader found wrong with a checkpoint, if anything.

  In this order: tensors the model does not use (``unexpected``: pass ``[]``
  when not strict), tensors it needs and the checkpoint lacks (``missing``),
  and tensors that do not fit their parameter (``bad``). Each message lists
  every name; ``unused_note`` and ``missing_note`` say which model, and what to
  check.

  Raises:
    UnexpectedCheckpointParametersError, MissingCheckpointParametersError,
    CheckpointShapeMismatchError.
  """
  if unexpected:
    raise UnexpectedCheckpointParametersError(
      f"the checkpoint has {len(unexpected)} tensors {unused_note}; pass strict=False to "
      "ignore them:\n" + format_paths(sorted(unexpected))
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
