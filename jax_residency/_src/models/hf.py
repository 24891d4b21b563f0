"""Reading a Hugging Face checkpoint's safetensors tensors whole, for the model loaders
(:mod:`~jax_residency._src.models.hf_loader`); ``safetensors_files`` reads them one at a time.

``safetensors`` is an optional dependency (``pip install 'jax-residency[models]'``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


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
