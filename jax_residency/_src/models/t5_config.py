"""The sizes and variant of a T5 encoder–decoder, and reading them from a Hugging Face config.

A field of a ``T5ForConditionalGeneration`` config that asks for math the model
does not implement raises an error naming the field and its value.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from jax_residency._src.models.hf_config import unsupported

#: ``feed_forward_proj`` values the model implements.
FEED_FORWARD_PROJ = ("relu", "gated-gelu")
#: Hugging Face ``model_type`` values with this math (mT5 is T5 v1.1's).
MODEL_TYPES = ("t5", "mt5")


#: The error for a field this model does not implement (``T5 config <field>=...``).
_unsupported = functools.partial(unsupported, "T5")


@dataclasses.dataclass(frozen=True, kw_only=True)
class T5Config:
  """Sizes and variant of a T5 encoder–decoder (the names of Hugging Face's ``T5Config``).

  Attributes:
    vocab_size: token vocabulary.
    d_model: hidden width.
    d_kv: width of one attention head (``num_heads * d_kv`` may differ from ``d_model``).
    d_ff: feed-forward width.
    num_layers: encoder layers (units of ``encoder_layers``).
    num_decoder_layers: decoder layers (units of ``decoder_layers``).
    num_heads: attention heads.
    relative_attention_num_buckets: relative-position buckets (at least 4).
    relative_attention_max_distance: distances from this on share the last bucket.
    layer_norm_epsilon: RMS LayerNorm epsilon.
    feed_forward_proj: ``"relu"`` (T5 v1.0) or ``"gated-gelu"`` (v1.1: tanh GELU gate).
    tie_word_embeddings: the LM head is the shared embedding (no ``lm_head``).
    scale_decoder_outputs: multiply the decoder output by ``d_model**-0.5``
      before the head; ``None`` follows ``tie_word_embeddings``, as Hugging Face does.
    decoder_start_token_id: the first decoder input of generation.
    pad_token_id: what :func:`generate` emits after a sequence ended.
    eos_token_id: ends a sequence in :func:`generate`; ``None``: never.
    dtype: parameter, compute and cache dtype.

  Raises:
    ModelConfigError: ``feed_forward_proj`` or
      ``relative_attention_num_buckets`` is not one this model implements.
  """

  vocab_size: int = 32128
  d_model: int = 512
  d_kv: int = 64
  d_ff: int = 2048
  num_layers: int = 6
  num_decoder_layers: int = 6
  num_heads: int = 8
  relative_attention_num_buckets: int = 32
  relative_attention_max_distance: int = 128
  layer_norm_epsilon: float = 1e-6
  feed_forward_proj: str = "relu"
  tie_word_embeddings: bool = True
  scale_decoder_outputs: bool | None = None
  decoder_start_token_id: int = 0
  pad_token_id: int = 0
  eos_token_id: int | None = 1
  dtype: str = "float32"

  def __post_init__(self) -> None:
    if self.feed_forward_proj not in FEED_FORWARD_PROJ:
      raise _unsupported(
        "feed_forward_proj",
        self.feed_forward_proj,
        f"this T5 implements {' and '.join(map(repr, FEED_FORWARD_PROJ))}",
      )
    if self.relative_attention_num_buckets < 4:
      raise _unsupported(
        "relative_attention_num_buckets",
        self.relative_attention_num_buckets,
        "T5's bucketing needs at least 4 buckets",
      )

  @property
  def gated(self) -> bool:
    """Whether the feed-forward is gated (``wi_0``, ``wi_1``) rather than one ``wi``."""
    return self.feed_forward_proj.startswith("gated-")

  @property
  def scales_output(self) -> bool:
    """Whether the decoder output is scaled by ``d_model**-0.5`` before the LM head."""
    if self.scale_decoder_outputs is None:
      return self.tie_word_embeddings
    return self.scale_decoder_outputs

  @classmethod
  def from_hf(cls, config: Mapping[str, Any], *, dtype: str = "float32") -> T5Config:
    """Reads a Hugging Face ``config.json`` of a ``T5ForConditionalGeneration``.

    Both forms of the head's fields are read: ``tie_word_embeddings`` alone (a
    tied head is scaled, an untied one is not), and transformers 5's
    ``tie_word_embeddings: true`` with ``scale_decoder_outputs``. A checkpoint
    that holds its own ``lm_head.weight`` under a tied config is untied by
    :func:`jax_residency.models.load_t5`, as transformers does.

    Raises:
      ModelConfigError: a field asks for math this model does not
        implement (``model_type``, ``is_encoder_decoder``, ``feed_forward_proj``,
        a list ``eos_token_id``); the message names the field and its value.

    Example:
      >>> cfg = T5Config.from_hf({"d_model": 32, "num_layers": 2, "feed_forward_proj": "gated-gelu",
      ...                         "tie_word_embeddings": False})
      >>> cfg.num_decoder_layers, cfg.gated, cfg.scales_output
      (2, True, False)
    """
    model_type = config.get("model_type", "t5")
    if model_type not in MODEL_TYPES:
      raise _unsupported("model_type", model_type, f"this T5 reads {' and '.join(MODEL_TYPES)}")
    if not config.get("is_encoder_decoder", True):
      raise _unsupported("is_encoder_decoder", False, "this T5 is an encoder–decoder")
    eos = config.get("eos_token_id", 1)
    if isinstance(eos, list):
      if len(eos) != 1:
        raise _unsupported("eos_token_id", eos, "generate stops at one EOS token id")
      eos = eos[0]
    pad = int(config.get("pad_token_id", 0) or 0)
    start = config.get("decoder_start_token_id")
    scale = config.get("scale_decoder_outputs")
    num_layers = int(config.get("num_layers", 6))
    decoder_layers = config.get("num_decoder_layers")
    return cls(
      vocab_size=int(config.get("vocab_size", 32128)),
      d_model=int(config.get("d_model", 512)),
      d_kv=int(config.get("d_kv", 64)),
      d_ff=int(config.get("d_ff", 2048)),
      num_layers=num_layers,
      num_decoder_layers=num_layers if decoder_layers is None else int(decoder_layers),
      num_heads=int(config.get("num_heads", 8)),
      relative_attention_num_buckets=int(config.get("relative_attention_num_buckets", 32)),
      relative_attention_max_distance=int(config.get("relative_attention_max_distance", 128)),
      layer_norm_epsilon=float(config.get("layer_norm_epsilon", 1e-6)),
      feed_forward_proj=str(config.get("feed_forward_proj", "relu")),
      tie_word_embeddings=bool(config.get("tie_word_embeddings", True)),
      scale_decoder_outputs=None if scale is None else bool(scale),
      decoder_start_token_id=pad if start is None else int(start),
      pad_token_id=pad,
      eos_token_id=None if eos is None else int(eos),
      dtype=dtype,
    )
