"""A small transformer in NNX and in Linen, used by the demo, examples and tests.

Both have the layout the library expects: a static token embedding, a stack of
pre-norm attention + MLP blocks built with ``nnx.vmap`` / run through
:func:`jax_residency.scan_units` (Linen: :func:`jax_residency.linen.scan`),
and a static final norm and output head. With ``sharded=True`` the NNX model
carries partitioning metadata that shards attention and MLP weights over a
``model`` mesh axis.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

from jax_residency._src.loop import linen as jr_linen
from jax_residency._src.loop.unit_loop import scan_units


@dataclasses.dataclass(frozen=True)
class ToyConfig:
  """Sizes of the toy transformer.

  Attributes:
    vocab: vocabulary size.
    d_model: hidden width.
    n_heads: attention heads (must divide ``d_model``).
    d_ff: MLP width.
    n_layers: number of stacked blocks (units).
    dtype: parameter and compute dtype.
  """

  vocab: int = 256
  d_model: int = 64
  n_heads: int = 4
  d_ff: int = 128
  n_layers: int = 4
  dtype: str = "float32"

  def unit_bytes(self) -> int:
    """Bytes of one block's parameters."""
    d, f = self.d_model, self.d_ff
    n = 4 * d * d + 4 * d + 2 * d * f + f + d + 4 * d
    return n * jnp.dtype(self.dtype).itemsize


def _shard(init: nnx.Initializer, names: tuple[str | None, ...], sharded: bool) -> nnx.Initializer:
  return nnx.with_partitioning(init, names) if sharded else init


class Block(nnx.Module):
  """Pre-norm causal self-attention and MLP."""

  def __init__(self, cfg: ToyConfig, *, rngs: nnx.Rngs, sharded: bool = False) -> None:
    d, dt = cfg.d_model, jnp.dtype(cfg.dtype)
    w = nnx.initializers.lecun_normal()
    self.n_heads = cfg.n_heads
    self.norm1 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
    self.qkv = nnx.Linear(
      d, 3 * d, kernel_init=_shard(w, (None, "model"), sharded), param_dtype=dt, dtype=dt, rngs=rngs
    )
    self.out = nnx.Linear(
      d, d, kernel_init=_shard(w, ("model", None), sharded), param_dtype=dt, dtype=dt, rngs=rngs
    )
    self.norm2 = nnx.LayerNorm(d, param_dtype=dt, dtype=dt, rngs=rngs)
    self.up = nnx.Linear(
      d,
      cfg.d_ff,
      kernel_init=_shard(w, (None, "model"), sharded),
      param_dtype=dt,
      dtype=dt,
      rngs=rngs,
    )
    self.down = nnx.Linear(
      cfg.d_ff,
      d,
      kernel_init=_shard(w, ("model", None), sharded),
      param_dtype=dt,
      dtype=dt,
      rngs=rngs,
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    h = self.n_heads
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
    x = x + self.out(att.reshape(b, t, d))
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class ToyTransformer(nnx.Module):
  """Token ids ``(batch, seq)`` → logits ``(batch, seq, vocab)``.

  Example:
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> model(jnp.zeros((1, 5), jnp.int32)).shape
    (1, 5, 256)
  """

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, cfg: ToyConfig, *, rngs: nnx.Rngs, sharded: bool = False) -> None:
    dt = jnp.dtype(cfg.dtype)
    self.embed = nnx.Embed(cfg.vocab, cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
    def make(key: jax.Array) -> Block:
      return Block(cfg, rngs=nnx.Rngs(key), sharded=sharded)

    self.layers = make(jax.random.split(rngs.params(), cfg.n_layers))
    self.norm = nnx.LayerNorm(cfg.d_model, param_dtype=dt, dtype=dt, rngs=rngs)
    self.head = nnx.Linear(cfg.d_model, cfg.vocab, param_dtype=dt, dtype=dt, rngs=rngs)

  def __call__(self, tokens: jax.Array) -> jax.Array:
    x = self.embed(tokens)
    x = scan_units(lambda h, block: block(h), x, self.layers)
    return self.head(self.norm(x))


class LinenBlock(nn.Module):
  """The Linen twin of :class:`Block`."""

  cfg: ToyConfig

  @nn.compact
  def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
    cfg = self.cfg
    b, t, d = x.shape
    h = cfg.n_heads
    dt = jnp.dtype(cfg.dtype)
    q, k, v = jnp.split(
      nn.Dense(3 * d, dtype=dt, param_dtype=dt, name="qkv")(
        nn.LayerNorm(dtype=dt, name="norm1")(x)
      ),
      3,
      axis=-1,
    )
    q, k, v = (a.reshape(b, t, h, d // h) for a in (q, k, v))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
    x = x + nn.Dense(d, dtype=dt, param_dtype=dt, name="out")(att.reshape(b, t, d))
    y = nn.Dense(cfg.d_ff, dtype=dt, param_dtype=dt, name="up")(
      nn.LayerNorm(dtype=dt, name="norm2")(x)
    )
    return x + nn.Dense(d, dtype=dt, param_dtype=dt, name="down")(jax.nn.gelu(y)), None


class LinenToyTransformer(nn.Module):
  """The Linen twin of :class:`ToyTransformer`."""

  #: The layer stacks its forward loops over (what ``place`` and ``save`` stream).
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  cfg: ToyConfig

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    dt = jnp.dtype(cfg.dtype)
    x = nn.Embed(cfg.vocab, cfg.d_model, dtype=dt, param_dtype=dt, name="embed")(tokens)
    stack = jr_linen.scan(
      LinenBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=cfg.n_layers,
    )
    x, _ = stack(cfg, name="layers")(x, None)
    x = nn.LayerNorm(dtype=dt, name="norm")(x)
    return nn.Dense(cfg.vocab, dtype=dt, param_dtype=dt, name="head")(x)
