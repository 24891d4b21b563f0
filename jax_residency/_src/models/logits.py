"""Filtering a decoder's logits before sampling: temperature, top-k and top-p, as
transformers' logits warpers do (shared by `generate_llm` and speculative decoding)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def filter_logits(
  logits: jax.Array, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> jax.Array:
  """``logits`` ``(batch, vocab)`` divided by ``temperature``, then those outside the top
  ``top_k`` and outside the top-``top_p`` probability mass set to ``-inf``, as
  transformers' ``TemperatureLogitsWarper``, ``TopKLogitsWarper`` and
  ``TopPLogitsWarper`` do (ties with the k-th largest kept; top-p keeps the
  smallest set of largest logits whose mass exceeds ``top_p``, at least one).

  Example:
    >>> logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
    >>> jnp.isfinite(filter_logits(logits, 1.0, top_k=3)).tolist()
    [[True, True, True, False]]
    >>> jnp.isfinite(filter_logits(logits, 1.0, top_p=0.7)).tolist()
    [[True, True, False, False]]
  """
  scores = logits.astype(jnp.float32) / temperature
  if top_k is not None:
    k = min(max(int(top_k), 1), scores.shape[-1])
    kth = lax_top_k(scores, k)
    scores = jnp.where(scores < kth, -jnp.inf, scores)
  if top_p is not None and top_p < 1.0:
    order = jnp.argsort(scores, axis=-1)  # ascending
    ascending = jnp.take_along_axis(scores, order, axis=-1)
    mass = jnp.cumsum(jax.nn.softmax(ascending, axis=-1), axis=-1)
    drop = (mass <= 1 - top_p).at[..., -1].set(False)
    drop = jnp.take_along_axis(drop, jnp.argsort(order, axis=-1), axis=-1)
    scores = jnp.where(drop, -jnp.inf, scores)
  return scores


def lax_top_k(scores: jax.Array, k: int) -> jax.Array:
  """The ``k``-th largest of each row, ``(batch, 1)``."""
  return jax.lax.top_k(scores, k)[0][..., -1:]
