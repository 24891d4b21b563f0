"""Where a :class:`~jax_residency._src.models.t5.T5`'s weights come from: a Hugging Face
``T5ForConditionalGeneration`` safetensors checkpoint, or seeded random draws.

Hugging Face names layer ``N``'s tensors ``encoder.block.<N>.layer.<i>.<name>``
(``decoder.block...``); the model here keeps each stack in one module, so layer
``N``'s tensor becomes row ``N`` of the stacked parameter. ``torch.nn.Linear``
stores ``weight`` as ``(out, in)`` and ``nnx.Linear``'s ``kernel`` is
``(in, out)``, so Linear weights are transposed. The relative-position tables,
held by layer 0 of each stack, are static parameters of the model. Copies of
``shared.weight`` (``encoder.embed_tokens``, ``decoder.embed_tokens``, a tied
``lm_head``) are not read. Nor is a bias table of the decoder's first
cross-attention, which some checkpoints hold: strict loading rejects it as unused.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jax_residency._src.models import hf_loader
from jax_residency._src.models.hf_config import read_config
from jax_residency._src.models.hf_loader import HFTensor
from jax_residency._src.models.init import seeded_weights
from jax_residency._src.models.t5 import T5
from jax_residency._src.models.t5_config import T5Config
from jax_residency._src.typing import ParamPath


def _bias_table(stack: str) -> str:
  return f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"


#: Static parameter path → its tensor (``lm_head`` is read only when untied).
STATIC_TENSORS: dict[ParamPath, HFTensor] = {
  ("shared", "embedding"): HFTensor("shared.weight", False),
  ("encoder_relative_bias", "embedding"): HFTensor(_bias_table("encoder"), False),
  ("encoder_norm", "scale"): HFTensor("encoder.final_layer_norm.weight", False),
  ("decoder_relative_bias", "embedding"): HFTensor(_bias_table("decoder"), False),
  ("decoder_norm", "scale"): HFTensor("decoder.final_layer_norm.weight", False),
  ("lm_head", "kernel"): HFTensor("lm_head.weight", True),
}

_ATTENTION = ("q", "k", "v", "o")
_MLP = ("wi", "wi_0", "wi_1", "wo")


def _layer_tensors(stack: str, parts: Mapping[str, str], mlp: str) -> dict[ParamPath, HFTensor]:
  block = f"{stack}.block.{{i}}"
  names: dict[ParamPath, HFTensor] = {}
  for ours, hf in parts.items():
    if ours.endswith("attention"):
      for p in _ATTENTION:
        names[(ours, p, "kernel")] = HFTensor(f"{block}.{hf}.{p}.weight", True)
  for p in _MLP:
    names[("mlp", p, "kernel")] = HFTensor(f"{block}.{mlp}.DenseReluDense.{p}.weight", True)
  for ours, hf in parts.items():
    norm = f"{block}.{hf.rsplit('.', 1)[0]}.layer_norm.weight"
    names[(f"{ours}_norm", "scale")] = HFTensor(norm, False)
  names[("mlp_norm", "scale")] = HFTensor(f"{block}.{mlp}.layer_norm.weight", False)
  return names


#: Path inside one layer → its tensor (``{i}``: the layer). Feed-forward tensors of
#: both variants are listed; the config picks which the model has.
ENCODER_LAYER_TENSORS = _layer_tensors("encoder", {"attention": "layer.0.SelfAttention"}, "layer.1")
DECODER_LAYER_TENSORS = _layer_tensors(
  "decoder",
  {"self_attention": "layer.0.SelfAttention", "cross_attention": "layer.1.EncDecAttention"},
  "layer.2",
)

#: Tensors of a checkpoint the model does not read and strict loading tolerates: the
#: stacks' copies of ``shared.weight`` (a tied ``lm_head`` is tolerated too).
IGNORED = re.compile(r"^(encoder|decoder)\.embed_tokens\.weight$")


def read_t5_config(path: str | Path, *, dtype: str = "float32") -> T5Config:
  """The :class:`T5Config` of the ``config.json`` in (or beside) ``path``."""
  return T5Config.from_hf(read_config(path, "T5Config"), dtype=dtype)


def _abstract(cfg: T5Config) -> T5:
  return hf_loader.abstract_of(T5, cfg)


def _checkpoint_map(cfg: T5Config) -> hf_loader.CheckpointMap:
  def ignored(name: str) -> bool:
    return bool(IGNORED.match(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")

  return hf_loader.CheckpointMap(
    static=STATIC_TENSORS,
    stacks={
      "encoder_layers": (cfg.num_layers, ENCODER_LAYER_TENSORS),
      "decoder_layers": (cfg.num_decoder_layers, DECODER_LAYER_TENSORS),
    },
    ignored=ignored,
    unused_note=(
      f"a T5 of this config does not use ({cfg.num_layers} encoder / "
      f"{cfg.num_decoder_layers} decoder layers, feed_forward_proj={cfg.feed_forward_proj!r})"
    ),
    missing_note=(
      "a T5 of this config needs; is it a T5ForConditionalGeneration checkpoint of this config?"
    ),
  )


def _has_own_head(tensors: Mapping[str, np.ndarray]) -> bool:
  head, shared = tensors.get("lm_head.weight"), tensors.get("shared.weight")
  return head is not None and (
    shared is None or head.shape != shared.shape or not np.array_equal(head, shared)
  )


def _fit(cfg: T5Config, tensors: Mapping[str, np.ndarray]) -> T5Config:
  """``cfg``, untied if it ties the head while the checkpoint holds its own."""
  if cfg.tie_word_embeddings and _has_own_head(tensors):
    return dataclasses.replace(
      cfg, tie_word_embeddings=False, scale_decoder_outputs=cfg.scales_output
    )
  return cfg


#: How the loader reads a ``T5ForConditionalGeneration`` checkpoint.
LOADER = hf_loader.Loader(abstract=_abstract, checkpoint_map=_checkpoint_map, fit=_fit)


def t5_params_from_hf(
  tensors: Mapping[str, np.ndarray], cfg: T5Config, *, strict: bool = True
) -> dict[ParamPath, np.ndarray]:
  """Maps ``T5ForConditionalGeneration`` tensors to the model's parameter paths.

  Layer tensors are stacked on axis 0 (``encoder_layers.<path>`` holds every
  encoder layer's copy); Linear weights are transposed to ``(in, out)``.

  Args:
    tensors: ``T5ForConditionalGeneration`` tensors by name.
    cfg: the model's sizes; every tensor's shape is checked against them, and
      its ``feed_forward_proj`` says which feed-forward tensors are read.
    strict: reject tensors that map to nothing (other than the copies of
      ``shared.weight`` listed in the module docstring).

  Returns:
    Static and stacked parameters by path, in ``cfg.dtype``.

  Raises:
    MissingCheckpointParametersError: a layer's tensor, or a static one, is absent.
    UnexpectedCheckpointParametersError: with ``strict``, tensors of more layers,
      of the other feed-forward variant, or of nothing here.
    CheckpointShapeMismatchError: a tensor's shape (transposed, for a Linear
      weight) is not its parameter's.
  """
  return hf_loader.params_from_hf(tensors, cfg, LOADER, strict=strict)


def load_t5(
  path: str | Path,
  *,
  config: T5Config | None = None,
  strict: bool = True,
  dtype: str = "float32",
) -> T5:
  """Builds a :class:`T5` holding a Hugging Face ``T5ForConditionalGeneration`` checkpoint.

  A config that ties the head while the checkpoint holds an ``lm_head.weight``
  with other values than ``shared.weight`` gets an untied head, as transformers
  does (transformers 5 writes ``tie_word_embeddings: true`` for every T5, and
  ``scale_decoder_outputs`` says whether to scale).

  Args:
    path: a ``.safetensors`` file, or a checkpoint directory (one file or sharded).
    config: the encoder–decoder's sizes; default: :func:`read_t5_config` of ``path``.
    strict: reject tensors that map to nothing (see :func:`t5_params_from_hf`).
    dtype: parameter, compute and cache dtype, with the default config.

  Returns:
    The model; nothing is compiled to build it.

  Example:
    >>> from jax_residency.models import load_t5
    >>> model = load_t5("tests/fixtures/t5_tiny_gated")  # doctest: +SKIP
  """
  cfg = read_t5_config(path, dtype=dtype) if config is None else config
  return hf_loader.load_checkpoint(path, cfg, LOADER, strict=strict)


def init_t5(cfg: T5Config, seed: int = 0) -> T5:
  """A :class:`T5` with seeded random weights, drawn host-side so nothing compiles.

  Linear kernels ``normal(0, 1/sqrt(fan_in))``, embeddings and bias tables
  ``normal(0, 1)``, unit norm scales.

  Example:
    >>> cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
    ...                num_decoder_layers=3, num_heads=2, relative_attention_num_buckets=8)
    >>> init_t5(cfg).decoder_layers.mlp.wo.kernel.shape
    (3, 32, 16)
  """
  return seeded_weights(_abstract(cfg), seed)
