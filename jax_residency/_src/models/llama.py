"""A Llama-family decoder in NNX (Llama, Mistral, Qwen2; Mixtral and Qwen2-MoE, whose MLP
is a mixture of experts): one layer stack and a KV cache.

The math is Hugging Face's eager float32 forward of ``LlamaForCausalLM``
(``MistralForCausalLM``, ``Qwen2ForCausalLM``): token embedding; per layer an
RMSNorm (in float32), grouped-query attention with rotary embeddings (the
``rotate_half`` convention, so Hugging Face weights need no permutation;
scores scaled by ``head_dim**-0.5``, softmax in float32), a residual add, an
RMSNorm and a SwiGLU MLP (``down(silu(gate(x)) * up(x))``); a final RMSNorm
and an LM head that is its own matrix or the embedding's transpose.

Static parameters: ``embed_tokens``, ``norm`` and (untied) ``lm_head``.
Units: ``layers``, built with ``nnx.vmap`` and run through
:func:`jax_residency.scan_units`. Every parameter is a Hugging Face tensor,
transposed (Linear weights) or not, so a checkpoint converts one tensor at a
time (``llama_load.hf_tensor_map``).

The cache (:class:`LlamaCache`) holds every layer's keys and values for a
fixed number of slots, and which slots hold real tokens (padding does not).
Keys and values go through the layer loop as per-layer inputs (``xs``) and
come back as per-layer outputs. Rotary positions count real tokens only, as
``generate`` in transformers derives them from the attention mask, so a
left-padded prompt decodes as the unpadded one.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jax_residency._src.loop.picked import picked_experts
from jax_residency._src.loop.unit_loop import scan_units
from jax_residency._src.models.llama_config import LlamaConfig


def rope_frequencies(cfg: LlamaConfig) -> np.ndarray:
  """The rotary inverse frequencies ``(head_dim // 2,)``, computed as transformers does.

  In float32, like ``_compute_default_rope_parameters`` and (``rope_type``
  ``"llama3"``) ``_compute_llama3_parameters``: low frequencies divided by
  ``rope_factor``, high ones kept, the band between interpolated smoothly.

  Example:
    >>> cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=4)
    >>> rope_frequencies(cfg)[:2].tolist()
    [1.0, 0.3162277638912201]
  """
  dim = cfg.head_width
  f32 = np.float32
  exponent = np.arange(0, dim, 2, dtype=np.int64).astype(f32) / f32(dim)
  # torch's float32 pow rounds the exact power (NumPy's float32 pow can be 1 ulp off).
  power = np.power(np.float64(cfg.rope_theta), exponent.astype(np.float64)).astype(f32)
  inv_freq = (f32(1.0) / power).astype(f32)
  if cfg.rope_type != "llama3":
    return inv_freq
  # torch divides a Python number by a tensor as ``tensor.reciprocal() * number``.
  factor = f32(cfg.rope_factor)
  low, high = f32(cfg.low_freq_factor), f32(cfg.high_freq_factor)
  old = f32(cfg.original_max_position_embeddings)
  low_wavelen, high_wavelen = old / low, old / high
  wavelen = (f32(1) / inv_freq * f32(2 * math.pi)).astype(f32)
  scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq).astype(f32)
  smooth = ((f32(1) / wavelen * old - low) / (high - low)).astype(f32)
  smoothed = ((f32(1) - smooth) * scaled / factor + smooth * scaled).astype(f32)
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return np.where(medium, smoothed, scaled).astype(f32)


def rotary(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
  """``(cos, sin)`` of ``positions`` ``(batch, t)``: ``(batch, t, 1, head_dim)`` float32 each."""
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
  emb = jnp.concatenate([freqs, freqs], axis=-1)[:, :, None, :]
  return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """``x * cos + rotate_half(x) * sin`` (``x``: ``(batch, t, heads, head_dim)``)."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return (x * cos + rotated * sin).astype(x.dtype)


class LlamaCache(NamedTuple):
  """The decoder's cache: keys, values and which slots hold real tokens.

  ``k``/``v``: ``(layers, batch, max_len, kv heads, head_dim)``; ``mask``:
  ``(batch, max_len)`` int32, 1 for a slot written with a real token (0 for
  padding and for slots not yet written). Inside a layer the layer axis is gone.

  Example:
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> cache = LlamaCache.zeros(cfg, batch=1, max_len=8)
    >>> cache.k.shape, cache.max_len
    ((2, 1, 8, 2, 4), 8)
  """

  k: jax.Array
  v: jax.Array
  mask: jax.Array

  @classmethod
  def zeros(cls, cfg: LlamaConfig, batch: int, max_len: int) -> LlamaCache:
    """An empty cache of ``max_len`` slots."""
    shape = (cfg.num_hidden_layers, batch, max_len, cfg.num_key_value_heads, cfg.head_width)
    kv = jnp.zeros(shape, jnp.dtype(cfg.dtype))
    return cls(kv, kv, jnp.zeros((batch, max_len), jnp.int32))

  @property
  def max_len(self) -> int:
    return int(self.k.shape[-3])


class RMSNorm(nnx.Module):
  """``scale * (x * rsqrt(mean(x**2) + eps))``, the statistics in float32."""

  def __init__(self, width: int, eps: float, dtype: Any) -> None:
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((width,), dtype))

  def __call__(self, x: jax.Array) -> jax.Array:
    wide = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(wide), axis=-1, keepdims=True)
    return self.scale[...] * (wide * lax.rsqrt(variance + self.eps)).astype(x.dtype)


def _linear(cfg: LlamaConfig, n_in: int, n_out: int, bias: bool, rngs: nnx.Rngs) -> nnx.Linear:
  dt = jnp.dtype(cfg.dtype)
  return nnx.Linear(n_in, n_out, use_bias=bias, param_dtype=dt, dtype=dt, rngs=rngs)


class LlamaAttention(nnx.Module):
  """Grouped-query attention with rotary embeddings, over the cache."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
    d, hd = cfg.hidden_size, cfg.head_width
    self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, hd
    self.q_proj = _linear(cfg, d, self.heads * hd, cfg.qkv_bias, rngs)
    self.k_proj = _linear(cfg, d, self.kv_heads * hd, cfg.qkv_bias, rngs)
    self.v_proj = _linear(cfg, d, self.kv_heads * hd, cfg.qkv_bias, rngs)
    self.o_proj = _linear(cfg, self.heads * hd, d, cfg.o_bias, rngs)

  def __call__(
    self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: KV, index: jax.Array, bias: Any
  ) -> tuple[jax.Array, KV]:
    """``x`` ``(batch, t, hidden)`` written at cache slots ``index .. index+t-1``; ``bias``
    ``(batch, 1, t, max_len)``: 0 where a query sees a key, ``finfo.min`` elsewhere."""
    b, t, _ = x.shape
    q = self.q_proj(x).reshape(b, t, self.heads, self.head_dim)
    k = self.k_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
    v = self.v_proj(x).reshape(b, t, self.kv_heads, self.head_dim)
    q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
    zero = jnp.zeros_like(index)
    start = (zero, index, zero, zero)
    keys = lax.dynamic_update_slice(kv[0], k.astype(kv[0].dtype), start)
    values = lax.dynamic_update_slice(kv[1], v.astype(kv[1].dtype), start)
    groups = q.reshape(b, t, self.kv_heads, self.heads // self.kv_heads, self.head_dim)
    scores = jnp.einsum("btgrd,bsgd->bgrts", groups, keys) * self.head_dim**-0.5
    scores = scores + bias[:, :, None]
    wide = jnp.promote_types(scores.dtype, jnp.float32)
    probs = jax.nn.softmax(scores.astype(wide), axis=-1).astype(q.dtype)
    out = jnp.einsum("bgrts,bsgd->btgrd", probs, values)
    return self.o_proj(out.reshape(b, t, self.heads * self.head_dim)), (keys, values)


class LlamaMLP(nnx.Module):
  """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, width: int | None = None) -> None:
    d, f = cfg.hidden_size, cfg.intermediate_size if width is None else width
    self.gate_proj = _linear(cfg, d, f, False, rngs)
    self.up_proj = _linear(cfg, d, f, False, rngs)
    self.down_proj = _linear(cfg, f, d, False, rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


#: Where a layer's experts are, inside it (what ``save`` writes one chunk per expert).
EXPERTS_PATH = "mlp.experts"


class Experts(nnx.Module):
  """``num_experts`` SwiGLU experts as stacked kernels: ``gate_proj`` and ``up_proj``
  ``(experts, hidden, width)``, ``down_proj`` ``(experts, width, hidden)``."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
    dt = jnp.dtype(cfg.dtype)
    init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
    self.gate_proj = nnx.Param(init(rngs.params(), (e, d, f), dt))
    self.up_proj = nnx.Param(init(rngs.params(), (e, d, f), dt))
    self.down_proj = nnx.Param(init(rngs.params(), (e, f, d), dt))

  def __call__(
    self, x: jax.Array, weights: jax.Array, picked: jax.Array, top: jax.Array
  ) -> jax.Array:
    """Each token's picked experts' outputs, weighted and summed: ``picked`` ``(batch, t,
    top_k)`` are the experts' ids, ``top`` their weights; ``weights`` ``(batch, t,
    experts)`` the same weights, 0 for the experts not picked.

    Few tokens (fewer expert picks in all than experts: a decode step) multiply by each
    pick's matrices, sliced by id, and read no other expert's; the picks' outputs are
    added in order. More run every expert on every token: adding the unpicked experts'
    exact zeros leaves each sum as the picked ones' alone, and one product per expert
    beats one per pick."""
    if picked.size < self.gate_proj.shape[0]:
      return self._picked_only(x, picked, top)
    gate = jnp.einsum("btd,edf->btef", x, self.gate_proj[...])
    up = jnp.einsum("btd,edf->btef", x, self.up_proj[...])
    out = jnp.einsum("btef,efd->bted", jax.nn.silu(gate) * up, self.down_proj[...])
    return jnp.sum(out * weights[..., None].astype(out.dtype), axis=2)

  def _picked_only(self, x: jax.Array, picked: jax.Array, top: jax.Array) -> jax.Array:
    """Each token's picks, one at a time: the expert's matrices sliced out by id (on CPU
    XLA reads them in place, where a gather would copy them first)."""
    b, t, d = x.shape
    rows, ids, weights = x.reshape(b * t, d), picked.reshape(b * t, -1), top.reshape(b * t, -1)
    out = []
    for n in range(b * t):
      acc = jnp.zeros((d,), x.dtype)
      for j in range(ids.shape[1]):
        e = ids[n, j]
        gate = rows[n] @ lax.dynamic_index_in_dim(self.gate_proj[...], e, keepdims=False)
        up = rows[n] @ lax.dynamic_index_in_dim(self.up_proj[...], e, keepdims=False)
        down = lax.dynamic_index_in_dim(self.down_proj[...], e, keepdims=False)
        acc = acc + (jax.nn.silu(gate) * up) @ down * weights[n, j].astype(x.dtype)
      out.append(acc)
    return jnp.stack(out).reshape(b, t, d)


class SparseMoE(nnx.Module):
  """A mixture of experts: a router (``gate``, no bias) scores the experts, softmax in
  float32; the top ``num_experts_per_tok`` run, weighted by their probabilities
  (renormalized to sum to 1 if ``norm_topk_prob``); a shared expert, if any, is added,
  scaled by ``sigmoid(shared_expert_gate(x))`` (Qwen2-MoE)."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
    self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
    self.gate = _linear(cfg, cfg.hidden_size, cfg.num_experts, False, rngs)
    self.experts = Experts(cfg, rngs=rngs)
    if cfg.shared_expert_intermediate_size:
      self.shared_expert = LlamaMLP(cfg, rngs=rngs, width=cfg.shared_expert_intermediate_size)
      self.shared_expert_gate = _linear(cfg, cfg.hidden_size, 1, False, rngs)

  def route(self, x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(weights (batch, t, experts), picked (batch, t, top_k), top (batch, t, top_k))``:
    the router's weight of each expert for each token, 0 for those not picked; the
    picked experts' ids (marked with `picked_experts`, so expert residency reads only
    those experts); and their weights."""
    probs = jax.nn.softmax(self.gate(x).astype(jnp.float32), axis=-1)
    top, picked = lax.top_k(probs, self.top_k)
    picked = picked_experts(picked)
    if self.normalize:
      top = top / jnp.sum(top, axis=-1, keepdims=True)
    experts = probs.shape[-1]
    weights = jnp.sum(jax.nn.one_hot(picked, experts, dtype=top.dtype) * top[..., None], axis=-2)
    return weights, picked, top

  def __call__(self, x: jax.Array) -> jax.Array:
    weights, picked, top = self.route(x)
    out = self.experts(x, weights.astype(x.dtype), picked, top.astype(x.dtype))
    if hasattr(self, "shared_expert"):
      out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out


KV = tuple[jax.Array, jax.Array]


class LlamaLayer(nnx.Module):
  """Pre-norm attention, then the pre-norm MLP, each added to the residual."""

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
    dt = jnp.dtype(cfg.dtype)
    self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
    self.self_attn = LlamaAttention(cfg, rngs=rngs)
    self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
    self.mlp = SparseMoE(cfg, rngs=rngs) if cfg.num_experts else LlamaMLP(cfg, rngs=rngs)

  def __call__(
    self, x: jax.Array, rope: tuple[jax.Array, jax.Array], kv: KV, index: jax.Array, bias: Any
  ) -> tuple[jax.Array, KV]:
    h, kv = self.self_attn(self.input_layernorm(x), rope, kv, index, bias)
    x = x + h
    return x + self.mlp(self.post_attention_layernorm(x)), kv


def _stack(cfg: LlamaConfig, rngs: nnx.Rngs) -> LlamaLayer:
  @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
  def build(key: jax.Array) -> LlamaLayer:
    return LlamaLayer(cfg, rngs=nnx.Rngs(key))

  return build(jax.random.split(rngs.params(), cfg.num_hidden_layers))


class Llama(nnx.Module):
  """Token ids ``(batch, t)`` → logits ``(batch, t, vocab)``; a Llama-family decoder.

  Two ways to call it (a :class:`jax_residency.PlacedModel` of it takes the same):

  * ``model(input_ids, attention_mask)``: logits of the whole sequence;
  * ``model(input_ids, attention_mask, cache, index)``: writes the tokens
    into cache slots ``index .. index+t-1`` and returns ``(logits, cache)``. A
    prefill passes a fresh :meth:`LlamaCache.zeros` and ``index`` 0; a decode
    step one token per row at the next slot.

  ``attention_mask`` (``(batch, t)``, 1 for real tokens; left padding) defaults
  to all ones. The rotary positions count each row's real tokens (those
  ``attention_mask`` marks, in this call and in the cache), as transformers'
  ``generate`` makes its ``position_ids``, so a left-padded row gives the
  logits it gives unpadded; ``positions`` (``(batch, t)``) overrides them.
  ``visible`` (``(batch, t, max_len)`` bool) names the cache slots each token may
  attend to in place of the causal rule (a slot must still be marked): a token tree
  (docs/speculative.md) passes each node's ancestors, written at slots of their own.

  Example:
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = nnx.eval_shape(lambda: Llama(cfg, rngs=nnx.Rngs(0)))  # shapes only
    >>> model.layers.self_attn.k_proj.kernel.shape  # (layer, in, kv heads * head_dim)
    (2, 16, 8)
    >>> ids = jnp.ones((1, 5), jnp.int32)
    >>> nnx.eval_shape(lambda m: m(ids), model).shape
    (1, 5, 32)
    >>> cache = LlamaCache.zeros(cfg, batch=1, max_len=8)
    >>> logits, cache = nnx.eval_shape(lambda m, c: m(ids, None, c, 0), model, cache)
    >>> step = lambda m, c: m(ids[:, :1], None, c, jnp.int32(5))  # one token at slot 5
    >>> nnx.eval_shape(step, model, cache)[0].shape
    (1, 1, 32)
  """

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs) -> None:
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg
    self.embed_tokens = nnx.Embed(
      cfg.vocab_size, cfg.hidden_size, param_dtype=dt, dtype=dt, rngs=rngs
    )
    self.layers = _stack(cfg, rngs)
    self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dt)
    if not cfg.tie_word_embeddings:
      self.lm_head = _linear(cfg, cfg.hidden_size, cfg.vocab_size, False, rngs)

  @property
  def residency_experts(self) -> tuple[str, ...]:
    """The modules of a layer stacked per expert (what ``save`` writes one chunk per
    expert): a mixture of experts' ``mlp.experts``; none for a dense model."""
    return (EXPERTS_PATH,) if self.config.num_experts else ()

  def __call__(
    self,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    cache: LlamaCache | None = None,
    index: Any = 0,
    positions: jax.Array | None = None,
    visible: jax.Array | None = None,
  ) -> Any:
    """Logits (no ``cache``), or ``(logits, cache)`` with the tokens written at ``index``."""
    cfg = self.config
    input_ids = jnp.asarray(input_ids, jnp.int32)
    b, t = input_ids.shape
    mask = jnp.ones((b, t), jnp.int32) if attention_mask is None else attention_mask
    mask = jnp.asarray(mask, jnp.int32)
    given = cache is not None
    if cache is None:
      cache = LlamaCache.zeros(cfg, b, t)
    index = jnp.asarray(index, jnp.int32)
    if positions is None:  # as transformers' generate: cumsum(mask) - 1 (padding: 0)
      seen = jnp.sum(cache.mask, axis=1, keepdims=True)
      positions = jnp.where(mask > 0, seen + jnp.cumsum(mask, axis=1) - 1, 0)
    slots = lax.dynamic_update_slice(cache.mask, mask, (jnp.zeros_like(index), index))
    x = self.embed_tokens(input_ids)
    rope = rotary(positions, rope_frequencies(cfg))
    biases = self._biases(slots, index, t, x.dtype, visible)
    sliding = np.asarray(cfg.layer_sliding)

    def body(h: jax.Array, layer: LlamaLayer, xs: Any) -> tuple[jax.Array, KV]:
      bias = biases[0] if len(biases) == 1 else jnp.where(xs[2], biases[1], biases[0])
      return layer(h, rope, (xs[0], xs[1]), index, bias)

    xs: Any = (cache.k, cache.v) if len(biases) == 1 else (cache.k, cache.v, jnp.asarray(sliding))
    x, (keys, values) = scan_units(body, x, self.layers, xs=xs, outputs=True)
    x = self.norm(x)
    logits = self.embed_tokens.attend(x) if cfg.tie_word_embeddings else self.lm_head(x)
    if not given:
      return logits
    return logits, LlamaCache(keys, values, slots)

  def _biases(
    self, slots: jax.Array, index: jax.Array, t: int, dtype: Any, visible: Any
  ) -> list[jax.Array]:
    """Attention biases ``(batch, 1, t, max_len)``: causal (or ``visible``) and padding
    (and, if some layer slides, the same within ``sliding_window``: slot ``s`` is seen
    from ``q`` if ``q - s < window``, as transformers' sliding mask compares cache
    positions)."""
    queries = index + jnp.arange(t)[:, None]
    distance = queries - jnp.arange(slots.shape[1])[None, :]
    causal = (distance >= 0)[None] if visible is None else jnp.asarray(visible, bool)
    seen = causal & (slots[:, None, :] > 0)
    low = jnp.finfo(dtype).min

    def bias(ok: jax.Array) -> jax.Array:
      return jnp.where(ok, 0.0, low).astype(dtype)[:, None]

    window, sliding = self.config.sliding_window, self.config.layer_sliding
    if window is None or not any(sliding):
      return [bias(seen)]
    windowed = bias(seen & (distance < window)[None])
    return [windowed] if all(sliding) else [bias(seen), windowed]
