"""A T5 encoder–decoder in NNX: two stacked layer modules, a decoder KV cache, greedy decoding.

The math is Hugging Face ``T5ForConditionalGeneration``'s in eager mode:
RMS LayerNorm without bias (``layer_norm_epsilon``), unscaled dot-product
attention with a learned relative position bias (bucketed distances, one table
per stack, kept by layer 0 in the checkpoint), pre-norm residual blocks, a ReLU
(T5 v1.0) or gated tanh-GELU (v1.1) feed-forward, and an LM head that is the
shared embedding (its input scaled by ``d_model**-0.5``) or a separate matrix.

Static parameters: ``shared`` (token embedding), the two relative-bias tables
``encoder_relative_bias`` / ``decoder_relative_bias``, the final norms
``encoder_norm`` / ``decoder_norm``, and ``lm_head`` when untied. Units: the
stacked layers ``encoder_layers`` and ``decoder_layers``, each run through
:func:`jax_residency.scan_units`. The position bias (and the attention masks)
is computed once per forward from the static tables and closed over by the
loop body, so no layer reads the tables.

The decoder cache (:class:`T5Cache`) holds every decoder layer's self-attention
keys and values for a fixed number of positions, and its cross-attention keys
and values. These are computed from the encoder output once, by the prefill,
and read by every later step, so a one-token step costs no projection of the
encoder output. Both go through the layer loop as per-layer inputs (``xs``);
a step returns only the self-attention keys and values as per-layer outputs.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_residency._src.loop.unit_loop import scan_units
from jax_residency._src.models.t5_config import T5Config


def relative_position_bucket(
  relative_position: np.ndarray, *, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
  """T5's bucket of each ``key position - query position`` (Hugging Face's float32 math).

  Half the buckets (per direction when ``bidirectional``) count distances one
  by one; the rest grow logarithmically up to ``max_distance``, past which all
  distances share the last bucket. Causal (decoder) attention puts every key at
  or after the query in bucket 0. Computed with NumPy: positions are static.

  Example:
    >>> relative_position_bucket(np.arange(-3, 4), bidirectional=True, num_buckets=8,
    ...                          max_distance=16).tolist()
    [2, 2, 1, 0, 5, 6, 6]
  """
  rel = np.asarray(relative_position, np.int64)
  buckets = np.zeros_like(rel)
  if bidirectional:
    num_buckets //= 2
    buckets += (rel > 0).astype(np.int64) * num_buckets
    rel = np.abs(rel)
  else:
    rel = -np.minimum(rel, 0)
  exact = num_buckets // 2
  # Distances below `exact` are their own bucket (log(0) is never taken: max(rel, 1)).
  log_ratio = np.log(np.maximum(rel, 1).astype(np.float32) / np.float32(exact))
  scaled = log_ratio / np.float32(math.log(max_distance / exact)) * np.float32(num_buckets - exact)
  large = np.minimum(exact + scaled.astype(np.int64), num_buckets - 1)
  return buckets + np.where(rel < exact, rel, large)


class T5Cache(NamedTuple):
  """The decoder's cache for greedy decoding.

  ``self_k``/``self_v``: ``(decoder layers, batch, max_len, heads, d_kv)``, the
  self-attention keys and values of positions ``0 .. max_len-1``;
  ``cross_k``/``cross_v``: ``(decoder layers, batch, source length, heads,
  d_kv)``, the cross-attention keys and values of the encoder output (written
  by the prefill); ``encoder_mask``: ``(batch, source length)``, 1 for real
  source tokens. Inside a layer the leading layer axis is gone.
  """

  self_k: jax.Array
  self_v: jax.Array
  cross_k: jax.Array
  cross_v: jax.Array
  encoder_mask: jax.Array

  @classmethod
  def zeros(cls, cfg: T5Config, batch: int, source_len: int, max_len: int) -> T5Cache:
    """An empty cache for ``max_len`` decoder positions over a ``source_len``-token source."""
    dt = jnp.dtype(cfg.dtype)
    heads = (cfg.num_heads, cfg.d_kv)
    own = jnp.zeros((cfg.num_decoder_layers, batch, max_len, *heads), dt)
    cross = jnp.zeros((cfg.num_decoder_layers, batch, source_len, *heads), dt)
    return cls(own, own, cross, cross, jnp.ones((batch, source_len), jnp.int32))

  @property
  def max_len(self) -> int:
    return int(self.self_k.shape[-3])


class T5LayerNorm(nnx.Module):
  """RMS LayerNorm: ``scale * (x * rsqrt(mean(x**2) + eps))``, no mean and no bias."""

  def __init__(self, cfg: T5Config) -> None:
    self.epsilon = cfg.layer_norm_epsilon
    self.scale = nnx.Param(jnp.ones((cfg.d_model,), jnp.dtype(cfg.dtype)))

  def __call__(self, x: jax.Array) -> jax.Array:
    variance = jnp.mean(jnp.square(x.astype(jnp.float32)), axis=-1, keepdims=True)
    return self.scale[...] * (x * lax.rsqrt(variance + self.epsilon)).astype(x.dtype)


def _linear(cfg: T5Config, n_in: int, n_out: int, rngs: nnx.Rngs) -> nnx.Linear:
  dt = jnp.dtype(cfg.dtype)
  return nnx.Linear(n_in, n_out, use_bias=False, param_dtype=dt, dtype=dt, rngs=rngs)


class T5Attention(nnx.Module):
  """Multi-head attention without score scaling; the caller adds bias and mask to the scores."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs) -> None:
    inner = cfg.num_heads * cfg.d_kv
    self.num_heads, self.d_kv = cfg.num_heads, cfg.d_kv
    self.q = _linear(cfg, cfg.d_model, inner, rngs)
    self.k = _linear(cfg, cfg.d_model, inner, rngs)
    self.v = _linear(cfg, cfg.d_model, inner, rngs)
    self.o = _linear(cfg, inner, cfg.d_model, rngs)

  def _heads(self, proj: nnx.Linear, x: jax.Array) -> jax.Array:
    return proj(x).reshape(*x.shape[:2], self.num_heads, self.d_kv)

  def key_values(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Keys and values of ``x``: ``(batch, t, heads, d_kv)`` each."""
    return self._heads(self.k, x), self._heads(self.v, x)

  def __call__(
    self, x: jax.Array, keys: jax.Array, values: jax.Array, bias: jax.Array
  ) -> jax.Array:
    """Queries from ``x`` attend to ``keys``/``values``; ``bias`` (``(., heads|1, t, keys)``)
    is added to the scores (position bias, and ``finfo.min`` where masked)."""
    q = self._heads(self.q, x)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, keys) + bias
    wide = jnp.promote_types(scores.dtype, jnp.float32)  # half precision: softmax in float32
    probs = jax.nn.softmax(scores.astype(wide), axis=-1).astype(q.dtype)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, values)
    return self.o(out.reshape(*x.shape[:2], -1))


class T5FeedForward(nnx.Module):
  """``wo(relu(wi(x)))``, or gated: ``wo(gelu_tanh(wi_0(x)) * wi_1(x))``."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs) -> None:
    self.gated = cfg.gated
    if self.gated:
      self.wi_0 = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
      self.wi_1 = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    else:
      self.wi = _linear(cfg, cfg.d_model, cfg.d_ff, rngs)
    self.wo = _linear(cfg, cfg.d_ff, cfg.d_model, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    if self.gated:
      return self.wo(jax.nn.gelu(self.wi_0(x), approximate=True) * self.wi_1(x))
    return self.wo(jax.nn.relu(self.wi(x)))


class T5EncoderLayer(nnx.Module):
  """Pre-norm self-attention, then the feed-forward, each added to the residual."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs) -> None:
    self.attention_norm = T5LayerNorm(cfg)
    self.attention = T5Attention(cfg, rngs=rngs)
    self.mlp_norm = T5LayerNorm(cfg)
    self.mlp = T5FeedForward(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, bias: jax.Array) -> jax.Array:
    """``x``: ``(batch, seq, d_model)``; ``bias``: position bias plus padding mask."""
    h = self.attention_norm(x)
    x = x + self.attention(h, *self.attention.key_values(h), bias)
    return x + self.mlp(self.mlp_norm(x))


KV = tuple[jax.Array, jax.Array]


class T5DecoderLayer(nnx.Module):
  """Pre-norm causal self-attention over the cache, cross-attention, then the feed-forward."""

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs) -> None:
    self.self_attention_norm = T5LayerNorm(cfg)
    self.self_attention = T5Attention(cfg, rngs=rngs)
    self.cross_attention_norm = T5LayerNorm(cfg)
    self.cross_attention = T5Attention(cfg, rngs=rngs)
    self.mlp_norm = T5LayerNorm(cfg)
    self.mlp = T5FeedForward(cfg, rngs=rngs)

  def __call__(
    self,
    x: jax.Array,
    cache: KV,
    pos: jax.Array,
    biases: KV,
    cross: jax.Array | KV,
  ) -> tuple[jax.Array, KV, KV]:
    """Runs ``x`` (``(batch, t, d_model)``) at positions ``pos .. pos+t-1``.

    Args:
      x: the decoder hidden states.
      cache: this layer's self-attention keys and values (``max_len`` positions).
      pos: position of ``x[:, 0]``.
      biases: (self-attention bias with the causal mask, cross-attention mask bias).
      cross: the encoder output (a prefill: its keys and values are computed
        here), or this layer's cached cross-attention keys and values.

    Returns:
      ``(x, (keys, values), (cross keys, cross values))`` with this step's keys
      and values written into the cache.
    """
    h = self.self_attention_norm(x)
    k, v = self.self_attention.key_values(h)
    zero = jnp.zeros_like(pos)
    start = (zero, pos, zero, zero)
    keys = lax.dynamic_update_slice(cache[0], k.astype(cache[0].dtype), start)
    values = lax.dynamic_update_slice(cache[1], v.astype(cache[1].dtype), start)
    x = x + self.self_attention(h, keys, values, biases[0])
    kv = self.cross_attention.key_values(cross) if isinstance(cross, jax.Array) else cross
    x = x + self.cross_attention(self.cross_attention_norm(x), *kv, biases[1])
    return x + self.mlp(self.mlp_norm(x)), (keys, values), kv


def _mask_bias(mask: jax.Array, dtype: Any) -> jax.Array:
  """``(batch, 1, 1, keys)``: 0 for real keys, ``finfo.min`` for padding."""
  return jnp.where(mask[:, None, None, :] > 0, 0.0, jnp.finfo(dtype).min).astype(dtype)


def _stack(make: Any, cfg: T5Config, n: int, rngs: nnx.Rngs) -> Any:
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def build(key: jax.Array) -> Any:
    return make(cfg, rngs=nnx.Rngs(key))

  return build(jax.random.split(rngs.params(), n))


class T5(nnx.Module):
  """Source ids ``(batch, source)`` and decoder ids ``(batch, target)`` → logits.

  Three ways to call it (a :class:`jax_residency.PlacedModel` of it takes the same):

  * ``model(input_ids, decoder_input_ids, attention_mask)``: teacher-forced
    logits ``(batch, target, vocab)``;
  * ``model(input_ids, decoder_input_ids, attention_mask, cache, 0)``: the
    prefill: encodes the source, fills the cache's cross-attention keys and
    values, runs the decoder from position 0; returns ``(logits, cache)``;
  * ``model(None, decoder_input_ids, None, cache, pos)``: a decode step at
    ``pos`` over the cache (the decoder stack only); returns ``(logits, cache)``.

  ``attention_mask`` (``(batch, source)``, 1 for real tokens) defaults to all ones.

  Example:
    >>> cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
    ...                num_decoder_layers=3, num_heads=2, relative_attention_num_buckets=8)
    >>> model = nnx.eval_shape(lambda: T5(cfg, rngs=nnx.Rngs(0)))  # shapes only
    >>> model.encoder_layers.attention.q.kernel.shape  # (layer, in, heads * d_kv)
    (2, 16, 8)
    >>> src, tgt = jnp.ones((1, 5), jnp.int32), jnp.zeros((1, 3), jnp.int32)
    >>> nnx.eval_shape(lambda m: m(src, tgt), model).shape
    (1, 3, 32)
    >>> cache = T5Cache.zeros(cfg, batch=1, source_len=5, max_len=4)
    >>> prefill = lambda m, c: m(src, tgt[:, :1], None, c, 0)  # encodes, fills the cache
    >>> logits, cache = nnx.eval_shape(prefill, model, cache)
    >>> step = lambda m, c: m(None, tgt[:, :1], None, c, 1)  # the decoder stack only
    >>> logits, cache = nnx.eval_shape(step, model, cache)
    >>> logits.shape, cache.self_k.shape  # cache: (layer, batch, max_len, heads, d_kv)
    ((1, 1, 32), (3, 1, 4, 2, 4))
  """

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("encoder_layers", "decoder_layers")

  def __init__(self, cfg: T5Config, *, rngs: nnx.Rngs) -> None:
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg

    def embed(n: int, width: int) -> nnx.Embed:
      return nnx.Embed(n, width, param_dtype=dt, dtype=dt, rngs=rngs)

    buckets = cfg.relative_attention_num_buckets
    self.shared = embed(cfg.vocab_size, cfg.d_model)
    self.encoder_relative_bias = embed(buckets, cfg.num_heads)
    self.encoder_layers = _stack(T5EncoderLayer, cfg, cfg.num_layers, rngs)
    self.encoder_norm = T5LayerNorm(cfg)
    self.decoder_relative_bias = embed(buckets, cfg.num_heads)
    self.decoder_layers = _stack(T5DecoderLayer, cfg, cfg.num_decoder_layers, rngs)
    self.decoder_norm = T5LayerNorm(cfg)
    if not cfg.tie_word_embeddings:
      self.lm_head = _linear(cfg, cfg.d_model, cfg.vocab_size, rngs)

  def _bucket_bias(self, table: nnx.Embed, buckets: jax.Array) -> jax.Array:
    """Bias of each (query, key) bucket: ``(1, heads, queries, keys)``."""
    return jnp.transpose(table.embedding[...][buckets], (2, 0, 1))[None]

  def encode(self, input_ids: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
    """The encoder output ``(batch, source, d_model)`` (after the final norm)."""
    if attention_mask is None:
      attention_mask = jnp.ones(input_ids.shape, jnp.int32)
    cfg = self.config
    x = self.shared(input_ids)
    n = input_ids.shape[1]
    buckets = relative_position_bucket(
      np.arange(n)[None, :] - np.arange(n)[:, None],
      bidirectional=True,
      num_buckets=cfg.relative_attention_num_buckets,
      max_distance=cfg.relative_attention_max_distance,
    )
    bias = self._bucket_bias(self.encoder_relative_bias, jnp.asarray(buckets))
    bias = bias + _mask_bias(attention_mask, x.dtype)
    x = scan_units(lambda h, layer: layer(h, bias), x, self.encoder_layers)
    return self.encoder_norm(x)

  def decode(
    self,
    decoder_input_ids: jax.Array,
    cache: T5Cache,
    pos: Any = 0,
    encoder_output: jax.Array | None = None,
    attention_mask: jax.Array | None = None,
  ) -> tuple[jax.Array, T5Cache]:
    """Runs the decoder over ``decoder_input_ids`` at positions ``pos .. pos+t-1``.

    Args:
      decoder_input_ids: ``(batch, t)`` token ids.
      cache: the cache of the previous call, or :meth:`T5Cache.zeros` for a prefill.
      pos: position of ``decoder_input_ids[:, 0]`` (keep it an int32 array
        across steps so they share one compiled program).
      encoder_output: given, this is the prefill: each layer's cross-attention
        keys and values are computed from it and stored in the cache, with
        ``attention_mask``. Else the cache's are used.
      attention_mask: with ``encoder_output``, the source mask (default all ones).

    Returns:
      ``(logits, cache)``: logits ``(batch, t, vocab)``, the cache updated.
    """
    cfg = self.config
    pos = jnp.asarray(pos, jnp.int32)
    x = self.shared(decoder_input_ids)
    if encoder_output is not None:
      if attention_mask is None:
        attention_mask = jnp.ones(encoder_output.shape[:2], jnp.int32)
      cache = cache._replace(encoder_mask=jnp.asarray(attention_mask, jnp.int32))
    # Causal bias: the bucket of each distance q - k >= 0; keys after the query are masked.
    n = cache.max_len
    table = relative_position_bucket(
      -np.arange(n),
      bidirectional=False,
      num_buckets=cfg.relative_attention_num_buckets,
      max_distance=cfg.relative_attention_max_distance,
    )
    queries = pos + jnp.arange(decoder_input_ids.shape[1])
    distance = queries[:, None] - jnp.arange(n)[None, :]
    bias = self._bucket_bias(self.decoder_relative_bias, jnp.asarray(table)[jnp.clip(distance, 0)])
    causal = jnp.where(distance >= 0, 0.0, jnp.finfo(x.dtype).min).astype(x.dtype)
    biases = (bias + causal[None, None], _mask_bias(cache.encoder_mask, x.dtype))

    if encoder_output is not None:

      def prefill(h: jax.Array, layer: T5DecoderLayer, kv: KV) -> tuple[jax.Array, Any]:
        h, own, cross = layer(h, kv, pos, biases, encoder_output)
        return h, (*own, *cross)

      xs: Any = (cache.self_k, cache.self_v)
      x, ys = scan_units(prefill, x, self.decoder_layers, xs=xs, outputs=True)
      cache = cache._replace(self_k=ys[0], self_v=ys[1], cross_k=ys[2], cross_v=ys[3])
    else:

      def step(h: jax.Array, layer: T5DecoderLayer, kv: Any) -> tuple[jax.Array, KV]:
        h, own, _ = layer(h, (kv[0], kv[1]), pos, biases, (kv[2], kv[3]))
        return h, own

      xs = (cache.self_k, cache.self_v, cache.cross_k, cache.cross_v)
      x, (keys, values) = scan_units(step, x, self.decoder_layers, xs=xs, outputs=True)
      cache = cache._replace(self_k=keys, self_v=values)
    x = self.decoder_norm(x)
    if cfg.scales_output:
      x = x * cfg.d_model**-0.5
    logits = self.shared.attend(x) if cfg.tie_word_embeddings else self.lm_head(x)
    return logits, cache

  def __call__(
    self,
    input_ids: jax.Array | None,
    decoder_input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    cache: T5Cache | None = None,
    pos: Any = 0,
  ) -> Any:
    """Teacher-forced logits (no ``cache``), or a prefill / decode step with it (see the class)."""
    if cache is None:
      if input_ids is None:
        raise ValueError("input_ids is None without a cache: pass the source ids to encode")
      encoded = self.encode(input_ids, attention_mask)
      b, t = decoder_input_ids.shape
      fresh = T5Cache.zeros(self.config, b, input_ids.shape[1], max_len=t)
      return self.decode(decoder_input_ids, fresh, 0, encoded, attention_mask)[0]
    if input_ids is None:
      return self.decode(decoder_input_ids, cache, pos)
    encoded = self.encode(input_ids, attention_mask)
    return self.decode(decoder_input_ids, cache, pos, encoded, attention_mask)
