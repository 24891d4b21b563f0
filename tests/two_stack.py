"""Toy models with TWO layer stacks (docs/design.md, section 2.1), in NNX and in Linen.

An encoder–decoder-like shape: a token embedding, stack A ``towers`` (3 units of
Linear + LayerNorm + tanh, residual), a static LayerNorm ``mid_norm``, stack B
``mixer`` (2 units of a residual MLP d → 64 → d: a different unit structure and
size from A), and a head. Both stacks run through :func:`jax_residency.scan_units`
(NNX) or :func:`jax_residency.linen.scan` (Linen), towers first.

``mid_norm`` is there on purpose: its ``scale`` and ``bias`` share a leading axis
(of size ``D``), so a guess of the stacks from leaf shapes would wrongly take it
for one. The stack names are outside the common names (``layers``, ``blocks``,
``h``...), so only tracing the forward can find them.

``model(tokens)`` runs both stacks. ``model(tokens, encoded=e)`` takes the
towers' output ``e`` (``(batch, seq, D)`` floats) as given and runs only the
mixer stack: whether the towers run depends on the pytree structure of the call
(``None`` or an array), so the choice is static under ``jax.jit`` and inside a
placement, where a Python ``bool`` argument would be traced.

Imported by name (``conftest.py`` puts this directory on ``sys.path``)::

  from two_stack import TOKENS, make_linen, make_nnx
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx

import jax_residency as jr

VOCAB = 64
D = 32
TOWER_LAYERS = 3
MIXER_LAYERS = 2
MIXER_HIDDEN = 64
#: The stacks in forward order.
STACKS = ("towers", "mixer")

#: Bytes of one unit of each stack (float32): towers Linear d→d + LayerNorm(d);
#: mixer Linear d→64 + Linear 64→d.
TOWER_UNIT_BYTES = 4 * (D * D + D + 2 * D)
MIXER_UNIT_BYTES = 4 * (D * MIXER_HIDDEN + MIXER_HIDDEN + MIXER_HIDDEN * D + D)

#: An example input: token ids ``(2, 8)`` int32.
TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, VOCAB, (2, 8)), dtype=jnp.int32)
#: An example towers output for ``model(TOKENS, encoded=ENCODED)`` (runs only the mixer).
ENCODED = jnp.asarray(np.random.default_rng(2).standard_normal((2, 8, D)), dtype=jnp.float32)


# --- NNX ------------------------------------------------------------------------


class Tower(nnx.Module):
  """One unit of stack A: ``h + tanh(LayerNorm(Linear(h)))``."""

  def __init__(self, d: int, *, rngs: nnx.Rngs) -> None:
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.norm = nnx.LayerNorm(d, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return h + jnp.tanh(self.norm(self.proj(h)))


class MixerBlock(nnx.Module):
  """One unit of stack B: ``h + down(gelu(up(h)))``."""

  def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs) -> None:
    self.up = nnx.Linear(d, hidden, rngs=rngs)
    self.down = nnx.Linear(hidden, d, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return h + self.down(jax.nn.gelu(self.up(h)))


class TwoStackNNX(nnx.Module):
  """Token ids ``(batch, seq)`` → logits ``(batch, seq, VOCAB)``, through two stacks."""

  def __init__(self, *, rngs: nnx.Rngs) -> None:
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.towers = nnx.vmap(lambda k: Tower(D, rngs=nnx.Rngs(k)))(
      jax.random.split(rngs.params(), TOWER_LAYERS)
    )
    self.mid_norm = nnx.LayerNorm(D, rngs=rngs)
    self.mixer = nnx.vmap(lambda k: MixerBlock(D, MIXER_HIDDEN, rngs=nnx.Rngs(k)))(
      jax.random.split(rngs.params(), MIXER_LAYERS)
    )
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens: jax.Array, encoded: jax.Array | None = None) -> jax.Array:
    x = self.embed(tokens)
    if encoded is None:
      encoded = jr.scan_units(lambda h, tower: tower(h), x, self.towers)
    h = x + self.mid_norm(encoded)
    h = jr.scan_units(lambda h, block: block(h), h, self.mixer)
    return self.head(h)


# --- Linen ----------------------------------------------------------------------


class LinenTower(nn.Module):
  """The Linen twin of :class:`Tower` (``(carry, x) -> (carry, None)`` for ``scan``)."""

  d: int

  @nn.compact
  def __call__(self, h: jax.Array, _: None = None) -> tuple[jax.Array, None]:
    y = nn.LayerNorm(name="norm")(nn.Dense(self.d, name="proj")(h))
    return h + jnp.tanh(y), None


class LinenMixerBlock(nn.Module):
  """The Linen twin of :class:`MixerBlock`."""

  d: int
  hidden: int

  @nn.compact
  def __call__(self, h: jax.Array, _: None = None) -> tuple[jax.Array, None]:
    y = nn.Dense(self.hidden, name="up")(h)
    return h + nn.Dense(self.d, name="down")(jax.nn.gelu(y)), None


class TwoStackLinen(nn.Module):
  """The Linen twin of :class:`TwoStackNNX` (submodules ``towers`` and ``mixer``)."""

  @nn.compact
  def __call__(self, tokens: jax.Array, encoded: jax.Array | None = None) -> jax.Array:
    x = nn.Embed(VOCAB, D, name="embed")(tokens)
    towers = jr.linen.scan(
      LinenTower, variable_axes={"params": 0}, split_rngs={"params": True}, length=TOWER_LAYERS
    )(D, name="towers")
    mixer = jr.linen.scan(
      LinenMixerBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=MIXER_LAYERS,
    )(D, MIXER_HIDDEN, name="mixer")
    if encoded is None:
      encoded, _ = towers(x, None)
    h = x + nn.LayerNorm(name="mid_norm")(encoded)
    h, _ = mixer(h, None)
    return nn.Dense(VOCAB, name="head")(h)


# --- constructors: seeded weights, no initialiser compiled ------------------------


def _fill(tree: Any, seed: int) -> Any:
  """Every ``ShapeDtypeStruct`` leaf of ``tree`` → a seeded array of that shape and dtype."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(
    lambda s: jnp.asarray((0.2 * rng.standard_normal(s.shape)).astype(s.dtype)), tree
  )


def abstract_nnx() -> TwoStackNNX:
  """:class:`TwoStackNNX` with ``ShapeDtypeStruct`` leaves (``nnx.eval_shape``)."""
  return nnx.eval_shape(lambda: TwoStackNNX(rngs=nnx.Rngs(0)))


def make_nnx(seed: int = 0) -> TwoStackNNX:
  """:class:`TwoStackNNX` with seeded weights (the same values for the same ``seed``)."""
  graphdef, state = nnx.split(abstract_nnx())
  return nnx.merge(graphdef, _fill(state, seed))


def make_linen(seed: int = 0) -> tuple[TwoStackLinen, Any]:
  """``(module, variables)``: :class:`TwoStackLinen` and seeded ``{"params": ...}``."""
  module = TwoStackLinen()
  shapes = jax.eval_shape(module.init, jax.random.key(0), TOKENS)
  return module, _fill(shapes, seed)
