"""A conversation with a Llama-family decoder whose KV cache is kept from turn to turn.

Each turn's prompt is the whole conversation so far (rendered with a chat template and
tokenized). `Conversation.reply` keeps the cache slots of the longest prefix that prompt
shares with the tokens the cache already holds (the prompt and the fed-back reply of the
turns before), unmarks the slots after it, and runs the prefill only over the rest, at
the slot where the prefix ends; then it decodes as `generate_llm` does (`decoding.decode`:
the same picking, stop tokens and ``on_token``). A reply is what `generate_llm` gives for
the whole prompt: the rotary positions count the cache's marked slots, attention reads
only marked slots, and each kept slot holds what a prefill of the whole prompt writes
there (to float rounding: the kept keys and values were computed in other passes).

The cache grows by `GROWTH` slots at a time, so a turn compiles a decode step again only
when the cache grows, and a prefill for each new length of the new tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jax_residency._src.models.decoding import OnToken, decode
from jax_residency._src.models.llama import LlamaCache
from jax_residency._src.models.llama_config import LlamaConfig
from jax_residency._src.models.llama_generate import checked_target, picker

#: Slots the cache grows by (the room a turn needs, rounded up to a multiple of this).
GROWTH = 256


class Conversation:
  """Turns of one conversation with ``model``, its KV cache kept between them.

  Args:
    model: a :class:`Llama` (run jitted), or a placed one (then pass ``config``).
    config: the model's :class:`LlamaConfig`, for a placed model.

  Example:
    >>> from jax_residency.models import LlamaConfig, generate_llm, init_llama
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = init_llama(cfg)
    >>> chat = Conversation(model)
    >>> first = chat.reply([5, 6, 7], 4, stop_tokens=())
    >>> second = [5, 6, 7, *first[0].tolist(), 9, 10]  # the reply, then the next turn
    >>> again = chat.reply(second, 4, stop_tokens=())
    >>> chat.reused  # the prompt and the 3 reply tokens fed back; 2 new tokens prefilled
    6
    >>> bool((again == generate_llm(model, second, 4, stop_tokens=())).all())
    True
  """

  def __init__(self, model: Any, *, config: LlamaConfig | None = None) -> None:
    self._model, self._config = model, config
    self._cache: LlamaCache | None = None
    self._ids: list[int] = []  # the token written at each marked slot
    self.reused = 0  #: slots the last turn kept from the turns before

  @property
  def cached_tokens(self) -> int:
    """Tokens the cache holds (the last prompt and the reply tokens fed back)."""
    return len(self._ids)

  def reply(
    self,
    input_ids: Sequence[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
    on_token: OnToken | None = None,
  ) -> jax.Array:
    """`generate_llm` for one prompt row, ``input_ids`` (the whole conversation so far),
    reusing the cache of the prefix it shares with the turns before.

    Returns:
      The generated tokens, ``(1, max_new_tokens)`` int32, as `generate_llm` returns them.

    Raises:
      ValueError: as `generate_llm`, or an empty prompt.
    """
    cfg, forward, stops, pad = checked_target(
      self._model, self._config, max_new_tokens, temperature, stop_tokens
    )
    ids = [int(t) for t in input_ids]
    if not ids:
      raise ValueError("input_ids is empty: a reply needs at least one prompt token")
    keep = _shared(self._ids, ids[:-1])  # at least one token is prefilled: its logits
    cache = self._room(cfg, len(ids) + max_new_tokens - 1)
    cache = cache._replace(mask=cache.mask.at[:, keep:].set(0))
    new = jnp.asarray([ids[keep:]], jnp.int32)
    logits, cache = forward(new, jnp.ones_like(new), cache, jnp.asarray(keep, jnp.int32))
    written, last = list(ids), [cache]
    ones = jnp.ones((1, 1), jnp.int32)

    def step(token: jax.Array, i: int, cache: LlamaCache) -> tuple[jax.Array, LlamaCache]:
      written.append(int(token[0]))  # token i - 1, at slot len(ids) + i - 1
      out = forward(token[:, None], ones, cache, jnp.asarray(len(ids) + i - 1, jnp.int32))
      last[0] = out[1]
      return out

    pick = picker(temperature, top_k, top_p, seed)
    tokens = decode(
      logits, cache, step, pick, max_new_tokens, stops=stops, pad=pad, on_token=on_token
    )
    self._cache, self._ids, self.reused = last[0], written, keep
    return tokens

  def _room(self, cfg: LlamaConfig, need: int) -> LlamaCache:
    """The cache, grown to hold ``need`` slots (a multiple of `GROWTH`) where it is
    smaller; what it holds is kept."""
    have = self._cache
    if have is not None and have.max_len >= need:
      return have
    grown = LlamaCache.zeros(cfg, 1, -(-need // GROWTH) * GROWTH)
    if have is None:
      return grown
    return LlamaCache(
      lax.dynamic_update_slice(grown.k, have.k, (0, 0, 0, 0, 0)),
      lax.dynamic_update_slice(grown.v, have.v, (0, 0, 0, 0, 0)),
      lax.dynamic_update_slice(grown.mask, have.mask, (0, 0)),
    )


def _shared(cached: Sequence[int], ids: Sequence[int]) -> int:
  """The length of the longest common prefix of ``cached`` and ``ids``."""
  n = 0
  for a, b in zip(cached, ids, strict=False):
    if a != b:
      break
    n += 1
  return n
