"""Generation with a Llama-family decoder: one prefill, then one decode step per token.

The prefill writes the prompt into a cache of ``prompt + max_new_tokens - 1``
slots; every later step writes one token per row at the next slot and reads
the cache, with the same shapes, so a plain model compiles the prefill once and
every step shares one program (a placed model runs each as one pass of its
placement). The next token is the argmax (``temperature=0``) or a seeded
sample of the logits after temperature, top-k and top-p, in that order, as
transformers' ``generate(do_sample=True)`` filters them.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jax_residency._src.errors import SpeculationError
from jax_residency._src.models.decoding import (
  OnToken,
  Pick,
  Timer,
  check_max_new_tokens,
  decode,
  plain_or_placed,
  prompt,
)
from jax_residency._src.models.draft_tree import check_draft_tree
from jax_residency._src.models.llama import Llama, LlamaCache
from jax_residency._src.models.llama_config import LlamaConfig
from jax_residency._src.models.logits import filter_logits as filter_logits
from jax_residency._src.models.speculative import (
  SpeculationReport,
  check_draft_tokens,
  check_vocabularies,
  speculative_decode,
)
from jax_residency._src.models.speculative_auto import auto_tuning
from jax_residency._src.report.speculation import RecordsSpeculation


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def _sample(
  logits: jax.Array, key: jax.Array, temperature: Any, top_k: int | None, top_p: float | None
) -> jax.Array:
  scores = filter_logits(logits, temperature, top_k, top_p)
  return jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)


def _greedy(logits: jax.Array) -> jax.Array:
  return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def generate_llm(
  model: Any,
  input_ids: Any,
  max_new_tokens: int,
  *,
  config: LlamaConfig | None = None,
  attention_mask: Any = None,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  stop_tokens: Sequence[int] | None = None,
  progress: bool = False,
  draft: Any = None,
  draft_config: LlamaConfig | None = None,
  draft_tokens: int | str = 4,
  draft_tree: Sequence[int] | None = None,
  on_token: OnToken | None = None,
) -> jax.Array:
  """Generates ``max_new_tokens`` tokens after a prompt, as transformers' ``generate`` does.

  Greedy (``temperature=0``) or sampled: logits divided by ``temperature``,
  cut to ``top_k`` and ``top_p`` (:func:`filter_logits`), then a token drawn
  with a key derived from ``seed`` and the step, so a seed always gives the same
  tokens. A row that emits a stop token is finished: its later tokens are
  ``config.pad_token_id`` (else the first stop token), fed back as such;
  generation ends early once every row has finished.

  Args:
    model: a :class:`Llama` (run jitted), or a :class:`jax_residency.PlacedModel`
      of one (then pass ``config``): the prefill and every step run under its
      policy, and its report counts one prefill pass and one decode pass per
      further token.
    input_ids: ``(batch, t)`` or ``(t,)`` prompt ids, left-padded if ragged.
    max_new_tokens: tokens to generate (>= 1).
    config: the model's :class:`LlamaConfig`; taken from ``model`` when it is a :class:`Llama`.
    attention_mask: ``(batch, t)``, 1 for real prompt tokens (default all ones).
    temperature: 0 for greedy decoding, else the sampling temperature.
    top_k: keep the ``top_k`` largest logits (sampling only).
    top_p: keep the smallest set of tokens whose probability exceeds ``top_p``.
    seed: the sampling seed.
    stop_tokens: tokens that end a row; default ``config.eos_token_ids``; ``()``: none.
    progress: print the prefill time and the decode rate (tokens per second), and with a
      draft, what speculation did (`SpeculationReport.summary`).
    draft: a model with the target's vocabulary (a :class:`Llama`, or a placed one: then
      pass ``draft_config``) that proposes ``draft_tokens`` tokens a round for the
      target to check in one pass (speculative decoding, docs/speculative.md): greedy
      tokens are the target's own, sampled ones distributed as the target's. `speculate`
      also returns what it did.
    draft_config: the draft's :class:`LlamaConfig`, for a placed draft.
    draft_tokens: proposals a round (a positive int), or ``"auto"``: a chain or a tree
      chosen each round from measured pass and draft times and the draft's hit rates
      (pooled over the generations with the same target and draft, batch size and
      sampling settings in this process).
    draft_tree: branches per depth, ``(b1, b2, ...)``: each round the draft expands a
      token tree (``b1`` children of the last token, ``b2`` of each of those, ...) and
      the target checks every node in one pass (in place of ``draft_tokens``).
    on_token: called with each step's new tokens as they are produced, a NumPy
      ``(batch,)`` int32 array (a finished row's pad token), before the next step runs;
      not told the pad columns filled in once every row has finished. It changes no
      token: the output is the same with it or without it. Not with a ``draft``.

  Returns:
    The generated tokens, ``(batch, max_new_tokens)`` int32 (the prompt not included).

  Raises:
    ValueError: ``max_new_tokens < 1``, a negative ``temperature``, no ``config``
      for a placed model, or ``on_token`` with a ``draft``.
    SpeculationError: a draft with another vocabulary, ``draft_tokens`` neither a
      positive int nor ``"auto"``, or a ``draft_tree`` that is empty, has a depth of no
      branches or too many nodes (before any pass runs).

  Example:
    >>> from jax_residency.models import LlamaConfig, init_llama
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> model = init_llama(cfg)
    >>> generate_llm(model, [[5, 6, 7]], max_new_tokens=4, stop_tokens=()).shape
    (1, 4)
    >>> a = generate_llm(model, [5, 6, 7], 4, temperature=0.8, top_p=0.9, seed=1)
    >>> bool((a == generate_llm(model, [5, 6, 7], 4, temperature=0.8, top_p=0.9, seed=1)).all())
    True
  """
  if draft is not None:
    if on_token is not None:
      raise ValueError("on_token is not called with a draft: pass one or the other")
    tokens, report = speculate(
      model,
      input_ids,
      max_new_tokens,
      draft=draft,
      config=config,
      draft_config=draft_config,
      draft_tokens=draft_tokens,
      draft_tree=draft_tree,
      attention_mask=attention_mask,
      temperature=temperature,
      top_k=top_k,
      top_p=top_p,
      seed=seed,
      stop_tokens=stop_tokens,
    )
    if progress:
      print(report.summary())
    return tokens
  cfg, forward, stops, pad = checked_target(model, config, max_new_tokens, temperature, stop_tokens)
  ids, mask = prompt(input_ids, attention_mask)
  batch, length = ids.shape
  timer = Timer(batch, length) if progress else None
  cache = LlamaCache.zeros(cfg, batch, length + max_new_tokens - 1)
  logits, cache = forward(ids, mask, cache, 0)
  ones = jnp.ones((batch, 1), jnp.int32)

  def step(token: jax.Array, i: int, cache: LlamaCache) -> tuple[jax.Array, LlamaCache]:
    # The last token, at slot length + i - 1.
    return forward(token[:, None], ones, cache, jnp.asarray(length + i - 1, jnp.int32))

  pick = picker(temperature, top_k, top_p, seed)
  return decode(
    logits, cache, step, pick, max_new_tokens, stops=stops, pad=pad, timer=timer, on_token=on_token
  )


def speculate(
  model: Any,
  input_ids: Any,
  max_new_tokens: int,
  *,
  draft: Any,
  config: LlamaConfig | None = None,
  draft_config: LlamaConfig | None = None,
  draft_tokens: int | str = 4,
  draft_tree: Sequence[int] | None = None,
  attention_mask: Any = None,
  temperature: float = 0.0,
  top_k: int | None = None,
  top_p: float | None = None,
  seed: int = 0,
  stop_tokens: Sequence[int] | None = None,
) -> tuple[jax.Array, SpeculationReport]:
  """`generate_llm` with a ``draft``: the tokens and a :class:`SpeculationReport` (rounds,
  proposals, acceptance, tokens per target pass, time in each model).

  Raises:
    SpeculationError: ``draft_tokens`` neither a positive int nor ``"auto"``, a bad
      ``draft_tree``, or a draft whose vocabulary or special tokens are not the
      target's; raised before any pass runs.
    ValueError: as `generate_llm`.
  """
  k = check_draft_tokens(draft_tokens)
  tree = None if draft_tree is None else check_draft_tree(draft_tree)
  cfg, forward, stops, pad = checked_target(model, config, max_new_tokens, temperature, stop_tokens)
  draft_cfg, draft_forward = plain_or_placed(draft, Llama, draft_config, "LlamaConfig")
  check_vocabularies(cfg, draft_cfg)
  if tree is not None and max(tree.branches) > cfg.vocab_size:
    raise SpeculationError(
      f"draft_tree={tree.branches} asks for {max(tree.branches)} children of a node from a "
      f"vocabulary of {cfg.vocab_size} tokens: use at most {cfg.vocab_size} branches"
    )
  ids, mask = prompt(input_ids, attention_mask)
  # "auto" pools what it measures over this pair's generations at one batch and setting
  setting = (ids.shape[0], float(temperature), top_k, top_p)
  tuning = auto_tuning(model, draft, setting) if tree is None and k == "auto" else None
  tokens, report = speculative_decode(
    forward,
    draft_forward,
    cfg,
    draft_cfg,
    ids,
    mask,
    max_new_tokens,
    draft_tokens=k,
    draft_tree=tree,
    temperature=temperature,
    top_k=top_k,
    top_p=top_p,
    seed=seed,
    stops=stops,
    pad=pad,
    tuning=tuning,
  )
  if isinstance(model, RecordsSpeculation):  # a placed target: its report sums them
    model.note_speculation(report.totals())
  return tokens, report


def checked_target(
  model: Any,
  config: LlamaConfig | None,
  max_new_tokens: int,
  temperature: float,
  stop_tokens: Sequence[int] | None,
) -> tuple[LlamaConfig, Any, tuple[int, ...], int]:
  """The checked arguments of a generation: its config, forward, stop tokens and pad."""
  check_max_new_tokens(max_new_tokens)
  if temperature < 0:
    raise ValueError(f"temperature={temperature}: use 0 for greedy decoding or a positive value")
  cfg, forward = plain_or_placed(model, Llama, config, "LlamaConfig")
  stops = tuple(cfg.eos_token_ids if stop_tokens is None else stop_tokens)
  pad = cfg.pad_token_id if cfg.pad_token_id is not None else (stops[0] if stops else 0)
  return cfg, forward, stops, pad


def picker(temperature: float, top_k: int | None, top_p: float | None, seed: int) -> Pick:
  """The next token from a step's logits: the argmax, or a sample with a key of
  ``seed`` and the step."""
  key = jax.random.key(seed)

  def pick(logits: jax.Array, step: int) -> jax.Array:
    last = logits[:, -1]
    if temperature == 0:
      return _greedy(last)
    return _sample(last, jax.random.fold_in(key, step), temperature, top_k, top_p)

  return pick
