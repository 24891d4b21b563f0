"""A small GPT-style decoder in NNX with a per-layer KV cache, and greedy generation.

The layer stack runs through :func:`jax_residency.scan_units` with the KV cache
as the per-layer input ``xs`` (stacked on axis 0 like the layers) and the
updated cache returned as the per-layer output, so a placed model streams its
layers the same way in prefill and in decode. Caches have a fixed length
(``max_len``), so every decode step has the same shapes and compiles once.

Static parameters: token and learned position embeddings, final LayerNorm, the
output head (none with ``GPTConfig.tie_head``: the logits then use the token
embedding's transpose). Units: the pre-norm causal attention + GELU MLP blocks.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_residency._src.errors import ModelConfigError
from jax_residency._src.loop.unit_loop import scan_units
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.models.init import seeded_weights


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
  """Sizes of the decoder.

  Attributes:
    vocab_size: token vocabulary.
    d_model: hidden width.
    n_heads: attention heads (must divide ``d_model``).
    d_ff: MLP width.
    n_layers: stacked blocks (units).
    max_len: positions the model and its KV cache hold (prompt + generated).
    dtype: parameter, compute and cache dtype.
    tie_head: compute the logits with the token embedding's transpose
      (``x @ embed.embedding.T``, as GPT-2 does) instead of a separate
      ``head`` Linear; the static parameters shrink by ``vocab_size * d_model``.
  """

  vocab_size: int = 256
  d_model: int = 64
  n_heads: int = 4
  d_ff: int = 256
  n_layers: int = 4
  max_len: int = 64
  dtype: str = "float32"
  tie_head: bool = False

  def __post_init__(self) -> None:
    if self.d_model % self.n_heads:
      raise ModelConfigError(
        f"d_model={self.d_model} is not a multiple of n_heads={self.n_heads}; "
        "pick a head count that divides the hidden width"
      )

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads


class KVCache(NamedTuple):
  """Keys and values of every layer: ``(n_layers, batch, max_len, n_heads, head_dim)`` each.

  Inside a block (one layer) the leading layer axis is gone.
  """

  k: jax.Array
  v: jax.Array

  @classmethod
  def zeros(cls, cfg: GPTConfig, batch: int) -> KVCache:
    shape = (cfg.n_layers, batch, cfg.max_len, cfg.n_heads, cfg.head_dim)
    dt = jnp.dtype(cfg.dtype)
    return cls(jnp.zeros(shape, dt), jnp.zeros(shape, dt))

  @property
  def max_len(self) -> int:
    return int(self.k.shape[-3])


class GPTBlock(nnx.Module):
  """Pre-norm causal self-attention over a fixed-length KV cache, then a GELU MLP."""

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
    d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
    self.n_heads = cfg.n_heads

    def linear(n_in: int, n_out: int) -> nnx.Linear:
      return nnx.Linear(n_in, n_out, param_dtype=dt, dtype=dt, rngs=rngs)

    self.norm1 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
    self.qkv = linear(d, 3 * d)
    self.proj = linear(d, d)
    self.norm2 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
    self.up = linear(d, cfg.d_ff)
    self.down = linear(cfg.d_ff, d)

  def __call__(self, x: jax.Array, cache: KVCache, pos: jax.Array) -> tuple[jax.Array, KVCache]:
    """``x``: ``(batch, t, d)`` at positions ``pos .. pos+t-1``; ``cache``: this layer's."""
    b, t, d = x.shape
    h = self.n_heads
    q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(self.qkv(self.norm1(x)), 3, -1))
    start = (0, pos, 0, 0)
    keys = lax.dynamic_update_slice(cache.k, k.astype(cache.k.dtype), start)
    values = lax.dynamic_update_slice(cache.v, v.astype(cache.v.dtype), start)
    # Query at position p sees cached positions <= p; slots not yet written are > p.
    mask = jnp.arange(cache.max_len)[None, :] <= (pos + jnp.arange(t))[:, None]
    att = jax.nn.dot_product_attention(q, keys, values, mask=mask[None, None])
    x = x + self.proj(att.reshape(b, t, d))
    x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
    return x, KVCache(keys, values)


class GPT(nnx.Module):
  """Tokens ``(batch, t)`` (+ cache, position) → logits ``(batch, t, vocab)`` and the cache.

  ``model(prompt)`` is a prefill from position 0 with a fresh cache;
  ``model(tokens, cache, pos)`` continues at position ``pos``.

  Example:
    >>> cfg = GPTConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=8)
    >>> model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))  # shapes only
    >>> step = lambda m, t, c, p: m(t, c, p)
    >>> logits, cache = nnx.eval_shape(step, model, jnp.ones((1, 3), jnp.int32), None, 0)
    >>> logits.shape, cache.k.shape  # cache: (layer, batch, max_len, heads, head_dim)
    ((1, 3, 32), (2, 1, 8, 2, 8))
    >>> logits, cache = nnx.eval_shape(step, model, jnp.ones((1, 1), jnp.int32), cache, 3)
  """

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs) -> None:
    dt = jnp.dtype(cfg.dtype)
    self.config = cfg
    self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
    self.pos_embed = nnx.Embed(cfg.max_len, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(key: jax.Array) -> GPTBlock:
      return GPTBlock(cfg, rngs=nnx.Rngs(key))

    self.layers = make(jax.random.split(rngs.params(), cfg.n_layers))
    self.norm = nnx.LayerNorm(cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
    if not cfg.tie_head:
      self.head = nnx.Linear(cfg.d_model, cfg.vocab_size, param_dtype=dt, dtype=dt, rngs=rngs)

  def __call__(
    self, tokens: jax.Array, cache: KVCache | None = None, pos: Any = 0
  ) -> tuple[jax.Array, KVCache]:
    """Runs ``tokens`` at positions ``pos .. pos+t-1``.

    Args:
      tokens: ``(batch, t)`` token ids.
      cache: the cache returned by the previous call; ``None`` starts a fresh one.
      pos: position of ``tokens[:, 0]`` (an int or a scalar int array; keep it an
        array across decode steps so they share one compiled program).

    Returns:
      ``(logits, cache)`` with the new tokens' keys and values written into the cache.
    """
    if cache is None:
      cache = KVCache.zeros(self.config, tokens.shape[0])
    pos = jnp.asarray(pos, jnp.int32)
    x = self.embed(tokens) + self.pos_embed(pos + jnp.arange(tokens.shape[1]))[None]

    def body(h: jax.Array, block: GPTBlock, layer_cache: KVCache) -> tuple[jax.Array, KVCache]:
      return block(h, layer_cache, pos)

    x, cache = scan_units(body, x, self.layers, xs=cache, outputs=True)
    x = self.norm(x)
    return (self.embed.attend(x) if self.config.tie_head else self.head(x)), cache


def init_gpt(cfg: GPTConfig, seed: int = 0) -> GPT:
  """A :class:`GPT` with seeded random weights, drawn host-side so nothing compiles.

  Weights at Flax's default scales, drawn with NumPy: Linear kernels
  ``normal(0, 1/sqrt(fan_in))``, embeddings ``normal(0, 1)``, zero biases, unit
  LayerNorm scales. (``GPT(cfg, rngs=nnx.Rngs(seed))`` also works; it draws
  through JAX's RNG and compiles every initialiser, seconds on a CPU.)
  """
  return seeded_weights(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(seed))), seed)


def generate(model: Any, prompt_tokens: Any, steps: int) -> jax.Array:
  """Greedy decoding: a prefill over the prompt, then ``steps - 1`` one-token decode steps.

  Args:
    model: a :class:`GPT` (run jitted), or a :class:`jax_residency.PlacedModel`
      of one — then the prefill and every decode step run under its policy, and
      its report counts one prefill pass and ``steps - 1`` decode passes (a
      one-token prompt's prefill counts as decode).
    prompt_tokens: ``(batch, t)`` or ``(t,)`` token ids.
    steps: tokens to generate (>= 1).

  Returns:
    The generated tokens, ``(batch, steps)``.

  Raises:
    ValueError: ``steps < 1``, or the prompt plus the generated tokens need more
      positions than the model's ``max_len``.

  Example:
    >>> cfg = GPTConfig(vocab_size=32, d_model=16, n_heads=2, d_ff=32, n_layers=2, max_len=8)
    >>> generate(init_gpt(cfg), [1, 2, 3], steps=4).shape
    (1, 4)
  """
  prompt = jnp.asarray(prompt_tokens, jnp.int32)
  if prompt.ndim == 1:
    prompt = prompt[None]
  if steps < 1:
    raise ValueError(f"steps={steps}: generate at least one token")
  if isinstance(model, GPT):
    _check_length(prompt.shape[1], steps, model.config.max_len)

    def forward(*args: Any) -> Any:
      return jitted_plain(model, *args)
  else:
    forward = model

  logits, cache = forward(prompt, None, 0)
  _check_length(prompt.shape[1], steps, cache.max_len)
  token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
  out = [token]
  for i in range(steps - 1):
    logits, cache = forward(token[:, None], cache, jnp.asarray(prompt.shape[1] + i, jnp.int32))
    token = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    out.append(token)
  return jnp.stack(out, axis=1)


def _check_length(prompt_len: int, steps: int, max_len: int) -> None:
  if prompt_len + steps - 1 > max_len:
    raise ValueError(
      f"a {prompt_len}-token prompt plus {steps} generated tokens needs "
      f"{prompt_len + steps - 1} positions but the model holds max_len={max_len}; "
      "generate fewer tokens or build the model with a larger GPTConfig.max_len"
    )
