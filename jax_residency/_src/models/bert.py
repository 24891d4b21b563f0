"""A BERT encoder in NNX whose layers run through :func:`jax_residency.scan_units`.

The math is Hugging Face ``BertModel``'s (post-norm layers, exact ``erf`` GELU,
LayerNorm with two-pass variance and ``layer_norm_eps``, additive attention mask
of ``finfo.min``), so a converted checkpoint (:mod:`..convert`) gives the
original model's hidden states. Static parameters: word, position and
token-type embeddings and the embedding LayerNorm. Units: the encoder layers,
stacked on axis 0 with ``nnx.vmap``. There is no pooler; sentence-transformers
models pool with :func:`mean_pool` and :func:`l2_normalize`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from flax import nnx

from jax_residency._src.errors import ModelConfigError
from jax_residency._src.loop.unit_loop import scan_units


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig:
  """Sizes of a BERT encoder (defaults: all-MiniLM-L6-v2).

  Attributes:
    vocab_size: word-piece vocabulary size.
    hidden_size: hidden width.
    num_layers: encoder layers (units).
    num_heads: attention heads (must divide ``hidden_size``).
    intermediate_size: MLP width.
    max_position_embeddings: longest sequence the position table covers.
    type_vocab_size: token types (segments).
    layer_norm_eps: LayerNorm epsilon.
    dtype: parameter and compute dtype.
  """

  vocab_size: int = 30522
  hidden_size: int = 384
  num_layers: int = 6
  num_heads: int = 12
  intermediate_size: int = 1536
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  layer_norm_eps: float = 1e-12
  dtype: str = "float32"

  def __post_init__(self) -> None:
    if self.hidden_size % self.num_heads:
      raise ModelConfigError(
        f"hidden_size={self.hidden_size} is not a multiple of num_heads={self.num_heads}; "
        "pick a head count that divides the hidden width"
      )

  @classmethod
  def from_hf(cls, config: Mapping[str, Any], *, dtype: str = "float32") -> BertConfig:
    """Reads a Hugging Face ``config.json`` of a ``BertModel``.

    Raises:
      ModelConfigError: the config asks for something this encoder does not implement
        (another activation or position embedding type).
    """
    act = config.get("hidden_act", "gelu")
    positions = config.get("position_embedding_type", "absolute")
    if act != "gelu" or positions != "absolute":
      raise ModelConfigError(
        f"hidden_act={act!r}, position_embedding_type={positions!r}: BertEncoder implements "
        "BERT with exact GELU ('gelu') and absolute positions only"
      )
    return cls(
      vocab_size=int(config["vocab_size"]),
      hidden_size=int(config["hidden_size"]),
      num_layers=int(config["num_hidden_layers"]),
      num_heads=int(config["num_attention_heads"]),
      intermediate_size=int(config["intermediate_size"]),
      max_position_embeddings=int(config.get("max_position_embeddings", 512)),
      type_vocab_size=int(config.get("type_vocab_size", 2)),
      layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)),
      dtype=dtype,
    )


def _kernel_init(names: tuple[str | None, ...], sharded: bool) -> nnx.Initializer:
  init = nnx.initializers.normal(0.02)
  return nnx.with_partitioning(init, names) if sharded else init


def _layer_norm(cfg: BertConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  dt = jnp.dtype(cfg.dtype)
  # Two-pass variance, as torch's layer_norm computes it.
  return nnx.LayerNorm(
    cfg.hidden_size,
    epsilon=cfg.layer_norm_eps,
    use_fast_variance=False,
    param_dtype=dt,
    dtype=dt,
    rngs=rngs,
  )


class BertEmbeddings(nnx.Module):
  """Word + position + token-type embeddings, then LayerNorm (static parameters)."""

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs) -> None:
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.normal(0.02)
    d = cfg.hidden_size

    def embed(n: int) -> nnx.Embed:
      return nnx.Embed(n, d, embedding_init=init, param_dtype=dt, dtype=dt, rngs=rngs)

    self.word_embeddings = embed(cfg.vocab_size)
    self.position_embeddings = embed(cfg.max_position_embeddings)
    self.token_type_embeddings = embed(cfg.type_vocab_size)
    self.norm = _layer_norm(cfg, rngs)

  def __call__(self, input_ids: jax.Array, token_type_ids: jax.Array) -> jax.Array:
    positions = jnp.arange(input_ids.shape[1])[None, :]
    x = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
    return self.norm(x + self.position_embeddings(positions))


class BertLayer(nnx.Module):
  """One post-norm encoder layer: self-attention, then the GELU MLP.

  With ``sharded=True`` the attention projections and the MLP carry
  partitioning metadata over a ``model`` mesh axis (heads / MLP columns split
  across it; the output projections split on their input axis).
  """

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs, sharded: bool = False) -> None:
    d, f, dt = cfg.hidden_size, cfg.intermediate_size, jnp.dtype(cfg.dtype)
    self.num_heads = cfg.num_heads
    col = _kernel_init((None, "model"), sharded)
    row = _kernel_init(("model", None), sharded)

    def linear(n_in: int, n_out: int, init: nnx.Initializer) -> nnx.Linear:
      return nnx.Linear(n_in, n_out, kernel_init=init, param_dtype=dt, dtype=dt, rngs=rngs)

    self.query = linear(d, d, col)
    self.key = linear(d, d, col)
    self.value = linear(d, d, col)
    self.attention_output = linear(d, d, row)
    self.attention_norm = _layer_norm(cfg, rngs)
    self.intermediate = linear(d, f, col)
    self.output = linear(f, d, row)
    self.output_norm = _layer_norm(cfg, rngs)

  def __call__(self, x: jax.Array, mask_bias: jax.Array) -> jax.Array:
    """``x``: ``(batch, seq, hidden)``; ``mask_bias``: ``(batch, 1, 1, seq)``, added to scores."""
    b, t, d = x.shape
    h = self.num_heads
    q, k, v = (p(x).reshape(b, t, h, d // h) for p in (self.query, self.key, self.value))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(d // h)
    probs = jax.nn.softmax(scores + mask_bias, axis=-1)
    context = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    x = self.attention_norm(x + self.attention_output(context))
    y = self.output(jax.nn.gelu(self.intermediate(x), approximate=False))
    return self.output_norm(x + y)


class BertEncoder(nnx.Module):
  """Token ids ``(batch, seq)`` → last hidden states ``(batch, seq, hidden)``.

  ``embeddings`` is static; ``layers`` is the stacked unit module.

  Example:
    >>> cfg = BertConfig(vocab_size=50, hidden_size=16, num_layers=2, num_heads=2,
    ...                  intermediate_size=32, max_position_embeddings=8)
    >>> model = nnx.eval_shape(lambda: BertEncoder(cfg, rngs=nnx.Rngs(0)))  # shapes only
    >>> model.layers.query.kernel.shape  # (layer, in, out): one unit per layer
    (2, 16, 16)
    >>> hidden = nnx.eval_shape(lambda m, i, a: m(i, a), model, jnp.ones((1, 4), jnp.int32),
    ...                         jnp.array([[1, 1, 1, 0]]))
    >>> hidden.shape
    (1, 4, 16)
  """

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs, sharded: bool = False) -> None:
    self.config = cfg
    self.embeddings = BertEmbeddings(cfg, rngs=rngs)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(key: jax.Array) -> BertLayer:
      return BertLayer(cfg, rngs=nnx.Rngs(key), sharded=sharded)

    self.layers = make(jax.random.split(rngs.params(), cfg.num_layers))

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    token_type_ids: jax.Array | None = None,
  ) -> jax.Array:
    """Runs the encoder.

    Args:
      input_ids: ``(batch, seq)`` word-piece ids.
      attention_mask: ``(batch, seq)``, 1 for real tokens and 0 for padding
        (default: all ones). Padding keys get a score of ``finfo.min``.
      token_type_ids: ``(batch, seq)`` segment ids (default: zeros).

    Returns:
      The last layer's hidden states, ``(batch, seq, hidden)``.
    """
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    if token_type_ids is None:
      token_type_ids = jnp.zeros(input_ids.shape, jnp.int32)
    x = self.embeddings(input_ids, token_type_ids)
    dt = x.dtype
    mask_bias = (1.0 - attention_mask[:, None, None, :].astype(dt)) * jnp.finfo(dt).min
    return scan_units(lambda h, layer: layer(h, mask_bias), x, self.layers)


def mean_pool(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """Mean of the hidden states over real tokens (sentence-transformers' ``Pooling``)."""
  mask = attention_mask[..., None].astype(hidden.dtype)
  return (hidden * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1e-9)


def l2_normalize(x: jax.Array, eps: float = 1e-12) -> jax.Array:
  """``x / max(||x||, eps)`` along the last axis (sentence-transformers' ``Normalize``)."""
  return x / jnp.maximum(jnp.linalg.norm(x, axis=-1, keepdims=True), eps)


def sentence_embeddings(hidden: jax.Array, attention_mask: jax.Array) -> jax.Array:
  """Mean pooling over the attention mask, then L2 normalisation (all-MiniLM-L6-v2)."""
  return l2_normalize(mean_pool(hidden, attention_mask))
