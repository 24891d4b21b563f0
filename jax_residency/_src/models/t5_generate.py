"""Greedy decoding with a T5: encode once, then decode one token at a time over the cache.

The prefill encodes the source (the only encoder run), stores each decoder
layer's cross-attention keys and values in the cache and decodes the start
token; every later step decodes one token over the cache, running the decoder
stack only. Shapes are fixed (the cache holds ``max_new_tokens`` positions), so
the prefill compiles once and every step shares one program.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jax_residency._src.models.decoding import check_max_new_tokens, decode, plain_or_placed, prompt
from jax_residency._src.models.t5 import T5, T5Cache
from jax_residency._src.models.t5_config import T5Config

_UNSET: Any = object()


def generate_t5(
  model: Any,
  input_ids: Any,
  max_new_tokens: int,
  attention_mask: Any = None,
  *,
  config: T5Config | None = None,
  eos_token_id: int | None = _UNSET,
) -> jax.Array:
  """Greedy decoding, as Hugging Face ``generate(do_sample=False, num_beams=1)`` does.

  Runs the encoder once (in the prefill) and then ``max_new_tokens - 1``
  one-token decode steps over the cache. A sequence that emits ``eos_token_id``
  is finished: its later tokens are ``pad_token_id`` (and are fed back as
  such); decoding stops early once every sequence has finished.

  Args:
    model: a :class:`T5` (run jitted), or a :class:`jax_residency.PlacedModel`
      of one whose placed stack is ``decoder_layers`` (then pass ``config``):
      the prefill and every step run under its policy, and its report counts
      one prefill pass and one decode pass per further token.
    input_ids: ``(batch, source)`` or ``(source,)`` token ids.
    max_new_tokens: tokens to generate (>= 1); the cache holds this many positions.
    attention_mask: ``(batch, source)``, 1 for real source tokens (default all ones).
    config: the model's :class:`T5Config`; taken from ``model`` when it is a :class:`T5`.
    eos_token_id: overrides ``config.eos_token_id`` (``None``: never stop).

  Returns:
    The generated tokens, ``(batch, max_new_tokens)`` (the start token not included).

  Raises:
    ValueError: ``max_new_tokens < 1``, or no ``config`` for a placed model.
    PlacementError: the placement places only ``encoder_layers``: a decode step
      runs only the decoder stack, and every call must run a placed stack.

  Example:
    >>> from jax_residency.models import T5Config, init_t5
    >>> cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
    ...                num_decoder_layers=2, num_heads=2, relative_attention_num_buckets=8)
    >>> generate_t5(init_t5(cfg), [[5, 6, 7, 1]], max_new_tokens=3).shape
    (1, 3)
  """
  check_max_new_tokens(max_new_tokens)
  cfg, forward = plain_or_placed(model, T5, config, "T5Config")
  eos = cfg.eos_token_id if eos_token_id is _UNSET else eos_token_id
  ids, mask = prompt(input_ids, attention_mask)
  batch, source = ids.shape
  cache = T5Cache.zeros(cfg, batch, source, max_len=max_new_tokens)
  start = jnp.full((batch, 1), cfg.decoder_start_token_id, jnp.int32)
  logits, cache = forward(ids, start, mask, cache, 0)

  def step(token: jax.Array, i: int, cache: T5Cache) -> tuple[jax.Array, T5Cache]:
    # The last token, at position i; the decoder stack only.
    return forward(None, token[:, None], None, cache, jnp.asarray(i, jnp.int32))

  def pick(logits: jax.Array, i: int) -> jax.Array:
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)

  stops = () if eos is None else (eos,)
  return decode(logits, cache, step, pick, max_new_tokens, stops=stops, pad=cfg.pad_token_id)
