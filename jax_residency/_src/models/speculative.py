"""Speculative decoding for Llama-family decoders (docs/speculative.md).

A draft model with the target's vocabulary proposes ``k`` tokens, one step each from
its own cache; the target checks all of them in **one** pass over ``k + 1`` positions
(the last token and the ``k`` proposals) with its cache, and keeps the longest prefix
it agrees with plus one token of its own. A streamed target moves the same bytes for
``k + 1`` positions as for one, so every accepted proposal is a token that cost no pass.

* Greedy (``temperature=0``): a proposal is kept where it is the target's argmax, so
  the tokens are the target's own greedy tokens, whatever the draft proposes (up to
  the float rounding of a ``k + 1``-token pass against a one-token step: a near tie
  could part them, as it could part two backends).
* Sampling: speculative sampling (Leviathan et al., 2023; Chen et al., 2023): proposal
  ``d`` drawn from the draft's filtered distribution ``q`` is kept with probability
  ``min(1, p(d) / q(d))`` under the target's ``p``; at the first rejection the token is
  drawn from ``max(0, p - q)`` normalized; after ``k`` kept ones, from the next ``p``.
  The tokens are then distributed as the target's own samples.

Caches: both models keep the same slot layout. A round writes the last token and the
``k`` proposals at slots ``index .. index + k`` of each cache (the draft runs ``k + 1``
one-token steps: the last of them only fills its cache with the ``k``-th proposal),
then unmarks the slots past each row's kept tokens (``LlamaCache.mask``): an unmarked
slot is never attended to and does not count towards a row's positions, and the next
round overwrites it. Rows of a batch that keep different counts leave holes; the next
round starts after the row that kept most, and when a round would run past the cache,
both caches are compacted (each row's marked slots moved to the front, in order). A
finished row (all its tokens, or a stop token) keeps none of a round's slots.

``draft_tokens="auto"`` fits each pass's time to the tokens it takes from the first two
rounds (``k`` = 1, then 4), and then picks the ``k`` that maximizes the predicted
tokens per second from the running acceptance rate, or none where no ``k`` is
predicted faster than one token a pass (`choose_k`).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import SpeculationError
from jax_residency._src.models.llama import LlamaCache
from jax_residency._src.models.logits import filter_logits

#: The largest ``k`` that ``"auto"`` considers.
MAX_AUTO_TOKENS = 8
#: ``"auto"``'s first two rounds: the ``k`` s whose pass times it fits.
AUTO_PROBES = (1, 4)

Forward = Callable[..., tuple[jax.Array, LlamaCache]]


@dataclasses.dataclass
class SpeculationReport:
  """What a speculative generation did.

  Attributes:
    rounds: draft-and-verify rounds.
    proposed: draft tokens proposed, over rows and rounds.
    accepted: proposals the target kept.
    target_passes: the target's passes: its prefill and one a round.
    draft_steps: the draft's one-token steps (``k + 1`` a round), prefill not counted.
    generated: tokens returned per row, summed over rows (``batch * max_new_tokens``
      unless every row stopped early).
    draft_s: seconds in the draft's prefill and steps.
    target_s: seconds in the target's prefill and passes.
    draft_tokens: the ``k`` of each round.
  """

  rounds: int = 0
  proposed: int = 0
  accepted: int = 0
  target_passes: int = 0
  draft_steps: int = 0
  generated: int = 0
  draft_s: float = 0.0
  target_s: float = 0.0
  draft_tokens: list[int] = dataclasses.field(default_factory=list)

  @property
  def acceptance_rate(self) -> float:
    """The share of proposals kept (0 when none were made)."""
    return self.accepted / self.proposed if self.proposed else 0.0

  @property
  def tokens_per_pass(self) -> float:
    """Tokens returned per row and target pass (one without a draft)."""
    rows = max(self.generated, 1) / max(self.target_passes, 1)
    return rows / max(self._batch, 1)

  _batch: int = dataclasses.field(default=1, repr=False)

  def summary(self) -> str:
    """One line: rounds, proposals, acceptance, tokens a pass, time in each model."""
    return (
      f"speculation: {self.rounds} rounds, {self.accepted} of {self.proposed} proposals "
      f"accepted ({self.acceptance_rate:.0%}), {self.tokens_per_pass:.2f} tokens per target "
      f"pass; draft {self.draft_s:.2f} s, target {self.target_s:.2f} s"
    )


def check_draft_tokens(value: Any) -> int | str:
  """``draft_tokens``: a positive int, or ``"auto"``.

  Raises:
    SpeculationError: anything else, naming the value.
  """
  if value == "auto" and isinstance(value, str):
    return value
  if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 1:
    raise SpeculationError(
      f"draft_tokens={value!r}: pass a positive int (the draft's proposals a round, e.g. 4) "
      "or 'auto' (chosen from measured pass times and the acceptance rate)"
    )
  return int(value)


def check_vocabularies(target_cfg: Any, draft_cfg: Any) -> None:
  """Raises `SpeculationError` unless the draft's vocabulary and special tokens (begin,
  end, padding) are the target's: a draft must share the target's tokenizer."""
  fix = (
    "a draft must share the target's tokenizer (for example a quantized copy of the "
    "target, or a smaller model of the same family)"
  )
  if target_cfg.vocab_size != draft_cfg.vocab_size:
    raise SpeculationError(
      f"the draft's vocabulary has {draft_cfg.vocab_size} tokens and the target's "
      f"{target_cfg.vocab_size}: {fix}"
    )
  special = (
    ("bos_token_id", draft_cfg.bos_token_id, target_cfg.bos_token_id),
    ("eos_token_ids", draft_cfg.eos_token_ids, target_cfg.eos_token_ids),
    ("pad_token_id", draft_cfg.pad_token_id, target_cfg.pad_token_id),
  )
  for name, theirs, ours in special:
    if theirs != ours:
      raise SpeculationError(f"the draft's {name} is {theirs!r} and the target's {ours!r}: {fix}")


def choose_k(alpha: float, draft_step_s: float, pass_s: Callable[[int], float]) -> int:
  """The ``k`` in ``0 .. MAX_AUTO_TOKENS`` with the most predicted tokens per second.

  A round of ``k`` proposals takes ``(k + 1) * draft_step_s + pass_s(k + 1)`` and yields
  ``(1 - alpha**(k + 1)) / (1 - alpha)`` tokens on average, where ``alpha`` is the
  chance that a proposal is kept (each independently); ``k = 0`` is one target pass
  a token, no draft.

  Example:
    >>> choose_k(0.8, 0.001, lambda t: 0.5)  # a streamed pass: speculate deeply
    8
    >>> choose_k(0.8, 0.01, lambda t: 0.002 * t)  # passes that cost per token: none
    0
  """
  alpha = min(max(alpha, 0.0), 0.999)
  best, best_rate = 0, 1.0 / max(pass_s(1), 1e-12)
  for k in range(1, MAX_AUTO_TOKENS + 1):
    tokens = (1 - alpha ** (k + 1)) / (1 - alpha)
    rate = tokens / max((k + 1) * draft_step_s + pass_s(k + 1), 1e-12)
    if rate > best_rate:
      best, best_rate = k, rate
  return best


@functools.partial(jax.jit, static_argnames=("greedy", "top_k", "top_p"))
def _propose(
  logits: jax.Array, key: jax.Array, temperature: Any, greedy: bool, top_k: Any, top_p: Any
) -> tuple[jax.Array, jax.Array]:
  """The draft's proposal from a step's last logits, and its distribution ``q``
  (greedy: the argmax and a one-hot)."""
  last = logits[:, -1].astype(jnp.float32)
  if greedy:
    token = jnp.argmax(last, axis=-1).astype(jnp.int32)
    return token, jax.nn.one_hot(token, last.shape[-1], dtype=jnp.float32)
  scores = filter_logits(last, temperature, top_k, top_p)
  token = jax.random.categorical(key, scores, axis=-1).astype(jnp.int32)
  return token, jax.nn.softmax(scores, axis=-1)


@functools.partial(jax.jit, static_argnames=("greedy", "top_k", "top_p"))
def _verify(
  logits: jax.Array,
  proposals: jax.Array,
  q: jax.Array,
  key: jax.Array,
  temperature: Any,
  greedy: bool,
  top_k: Any,
  top_p: Any,
) -> tuple[jax.Array, jax.Array]:
  """``(kept, token)`` of each row: how many leading proposals the target keeps, and its
  own token after them. ``logits`` ``(batch, k + 1, vocab)``: the target's after the last
  token and after each proposal; ``proposals`` ``(batch, k)``; ``q`` ``(batch, k, vocab)``."""
  b, t, vocab = logits.shape
  k = t - 1
  if greedy:
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    keep = pred[:, :k] == proposals
    kept = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
    return kept, jnp.take_along_axis(pred, kept[:, None], axis=1)[:, 0]
  scores = filter_logits(logits.reshape(b * t, vocab), temperature, top_k, top_p)
  p = jax.nn.softmax(scores, axis=-1).reshape(b, t, vocab)
  k_accept, k_residual = jax.random.split(key)
  p_d = jnp.take_along_axis(p[:, :k], proposals[..., None], axis=-1)[..., 0]
  q_d = jnp.take_along_axis(q, proposals[..., None], axis=-1)[..., 0]
  u = jax.random.uniform(k_accept, (b, k))
  keep = u * q_d < p_d
  kept = jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=1), axis=1)
  # after `kept` proposals: from max(0, p - q) where one was rejected, else from p
  p_at = jnp.take_along_axis(p, kept[:, None, None], axis=1)[:, 0]
  q_full = jnp.concatenate([q, jnp.zeros((b, 1, vocab), q.dtype)], axis=1)
  q_at = jnp.take_along_axis(q_full, kept[:, None, None], axis=1)[:, 0]
  residual = jnp.maximum(p_at - q_at, 0.0)
  residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, p_at)
  token = jax.random.categorical(k_residual, jnp.log(residual), axis=-1).astype(jnp.int32)
  return kept, token


@jax.jit
def _roll_back(cache: LlamaCache, index: jax.Array, kept: jax.Array, k: jax.Array) -> LlamaCache:
  """Unmarks each row's slots after its kept tokens: ``index + kept + 1 .. index + k``."""
  slot = jnp.arange(cache.mask.shape[1])[None, :]
  drop = (slot >= index + kept[:, None] + 1) & (slot <= index + k)
  return cache._replace(mask=jnp.where(drop, 0, cache.mask))


@jax.jit
def _compact(cache: LlamaCache) -> LlamaCache:
  """Each row's marked slots moved to the front, in order (unmarked ones after)."""
  order = jnp.argsort(1 - cache.mask, axis=1, stable=True)
  kv = order[None, :, :, None, None]
  return LlamaCache(
    jnp.take_along_axis(cache.k, kv, axis=2),
    jnp.take_along_axis(cache.v, kv, axis=2),
    jnp.take_along_axis(cache.mask, order, axis=1),
  )


class _Clock:
  """Seconds spent in a call, its outputs ready."""

  def __init__(self) -> None:
    self.seconds = 0.0

  def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    self.seconds += time.perf_counter() - start
    return out


@dataclasses.dataclass
class _Sampling:
  """How tokens are picked: greedy, or sampled after temperature, top-k and top-p."""

  temperature: float
  top_k: int | None
  top_p: float | None
  key: jax.Array

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def propose(self, logits: jax.Array, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _propose(logits, key, self.temperature, self.greedy, self.top_k, self.top_p)

  def verify(self, logits: Any, proposals: Any, q: Any, key: Any) -> tuple[jax.Array, jax.Array]:
    return _verify(logits, proposals, q, key, self.temperature, self.greedy, self.top_k, self.top_p)


class _Generation:
  """A speculative generation between rounds: both caches, the next slot (``index``),
  each row's tokens so far (``out``, ``count``) and what it did (``report``)."""

  def __init__(
    self,
    target: Forward,
    draft: Forward,
    caches: tuple[LlamaCache, LlamaCache],
    ids: jax.Array,
    mask: jax.Array,
    max_new_tokens: int,
    widest: int,
    sampling: _Sampling,
    stops: Sequence[int],
    pad: int,
  ) -> None:
    batch, length = ids.shape
    self.target, self.draft, self.sampling = target, draft, sampling
    self.n, self.slots = max_new_tokens, caches[0].max_len
    self.report = SpeculationReport(_batch=batch)
    self.t_clock, self.d_clock = _Clock(), _Clock()
    logits, self.t_cache = self.t_clock(target, ids, mask, caches[0], 0)
    _, self.d_cache = self.d_clock(draft, ids, mask, caches[1], 0)
    self.report.target_passes = 1
    # the first token is the target's own, from its prefill
    first, _ = sampling.propose(logits, jax.random.fold_in(sampling.key, 0))
    self.out = np.full((batch, max_new_tokens + widest + 1), pad, np.int32)
    self.out[:, 0] = np.asarray(first)
    self.count = np.ones(batch, np.int64)
    self.last, self.index = first, length
    self.ones = jnp.ones((batch, 1), jnp.int32)
    self.stop_ids = np.asarray(tuple(stops), np.int32)
    self.pass_times: dict[int, list[float]] = {}
    self.draft_step_times: list[float] = []

  def rows_done(self) -> np.ndarray:
    """The rows with all their tokens, or a stop token among them."""
    done = self.count >= self.n
    if len(self.stop_ids):
      written = np.arange(self.n)[None, :] < self.count[:, None]
      done |= (np.isin(self.out[:, : self.n], self.stop_ids) & written).any(axis=1)
    return done

  def round(self, k: int) -> None:
    """The draft proposes ``k`` tokens, the target checks them in one pass, each row
    keeps its agreed prefix and the target's next token."""
    r = self.report.rounds
    if self.index + k + 1 > self.slots:
      self.t_cache, self.d_cache = _compact(self.t_cache), _compact(self.d_cache)
      self.index = int(jnp.max(jnp.sum(self.t_cache.mask, axis=1)))
      # an unfinished row holds under length + max_new_tokens marked slots
      assert self.index + k + 1 <= self.slots, (self.index, k, self.slots)
    proposals, q = self._propose(k, jax.random.fold_in(self.sampling.key, 2 * r + 1))
    verify = jnp.concatenate([self.last[:, None], proposals], axis=1)
    before = self.t_clock.seconds
    logits, self.t_cache = self.t_clock(
      self.target, verify, jnp.ones_like(verify), self.t_cache, jnp.int32(self.index)
    )
    self.pass_times.setdefault(k + 1, []).append(self.t_clock.seconds - before)
    kept, token = self.sampling.verify(
      logits, proposals, q, jax.random.fold_in(self.sampling.key, 2 * r + 2)
    )
    # a finished row (all its tokens, or a stop token) keeps none of the round's slots,
    # so that its cache stops growing
    kept = jnp.where(jnp.asarray(self.rows_done()), -1, kept)
    index, width = jnp.int32(self.index), jnp.int32(k)
    self.t_cache = _roll_back(self.t_cache, index, kept, width)
    self.d_cache = _roll_back(self.d_cache, index, kept, width)
    self._keep(np.asarray(kept), np.asarray(token), np.asarray(proposals), k)
    self.last = token

  def _propose(self, k: int, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``k`` proposals ``(batch, k)`` and their distributions ``(batch, k, vocab)``; the
    draft's (k + 1)-th step writes the k-th proposal's slot."""
    token, proposals, qs = self.last, [], []
    before = self.d_clock.seconds
    for j in range(k + 1):
      index = jnp.int32(self.index + j)
      logits, self.d_cache = self.d_clock(
        self.draft, token[:, None], self.ones, self.d_cache, index
      )
      if j < k:
        token, q = self.sampling.propose(logits, jax.random.fold_in(key, j))
        proposals.append(token)
        qs.append(q)
    self.draft_step_times.append((self.d_clock.seconds - before) / (k + 1))
    if k:
      return jnp.stack(proposals, axis=1), jnp.stack(qs, axis=1)
    batch, vocab = logits.shape[0], logits.shape[-1]
    return jnp.zeros((batch, 0), jnp.int32), jnp.zeros((batch, 0, vocab), jnp.float32)

  def _keep(self, kept: np.ndarray, token: np.ndarray, proposals: np.ndarray, k: int) -> None:
    """Appends each active row's kept proposals and the target's token; counts."""
    active = kept >= 0
    for row in np.flatnonzero(active):
      n, c = int(kept[row]), int(self.count[row])
      new = [*proposals[row, :n].tolist(), int(token[row])][: self.out.shape[1] - c]
      self.out[row, c : c + len(new)] = new
      self.count[row] += n + 1
    report = self.report
    report.rounds += 1
    report.proposed += int(active.sum()) * k
    report.accepted += int(kept[active].sum())
    report.target_passes += 1
    report.draft_steps += k + 1
    report.draft_tokens.append(k)
    self.index += int(kept.max()) + 1

  def tokens(self, pad: int) -> jax.Array:
    """``(batch, max_new_tokens)``: each row's tokens, padding after its first stop."""
    tokens = self.out[:, : self.n]
    if len(self.stop_ids):
      hit = np.isin(tokens, self.stop_ids)
      tokens = np.where(np.cumsum(hit, axis=1) - hit > 0, pad, tokens)
    self.report.generated = int(np.minimum(self.count, self.n).sum())
    self.report.draft_s, self.report.target_s = self.d_clock.seconds, self.t_clock.seconds
    return jnp.asarray(tokens)


def speculative_decode(
  target: Forward,
  draft: Forward,
  target_cfg: Any,
  draft_cfg: Any,
  ids: jax.Array,
  mask: jax.Array,
  max_new_tokens: int,
  *,
  draft_tokens: int | str,
  temperature: float,
  top_k: int | None,
  top_p: float | None,
  seed: int,
  stops: Sequence[int],
  pad: int,
) -> tuple[jax.Array, SpeculationReport]:
  """The tokens after ``ids`` (``(batch, max_new_tokens)``) by speculative decoding, and
  what it did. ``target`` and ``draft`` are forwards ``(ids, mask, cache, index) ->
  (logits, cache)`` of models with configs ``target_cfg`` and ``draft_cfg``; arguments
  are checked by the caller (`generate_llm`)."""
  batch, length = ids.shape
  fixed = None if draft_tokens == "auto" else int(draft_tokens)
  widest = MAX_AUTO_TOKENS if fixed is None else fixed
  slots = length + max_new_tokens + 2 * (widest + 1)
  caches = (
    LlamaCache.zeros(target_cfg, batch, slots),
    LlamaCache.zeros(draft_cfg, batch, slots),
  )
  sampling = _Sampling(temperature, top_k, top_p, jax.random.key(seed))
  run = _Generation(target, draft, caches, ids, mask, max_new_tokens, widest, sampling, stops, pad)
  while not run.rows_done().all():
    r = run.report.rounds
    k = fixed if fixed is not None else _auto_k(r, run.report, run.pass_times, run.draft_step_times)
    run.round(k)
  return run.tokens(pad), run.report


def _auto_k(
  r: int, report: SpeculationReport, pass_times: dict[int, list[float]], draft: list[float]
) -> int:
  """``"auto"``'s ``k`` for round ``r``: the probes first, then `choose_k` on a line
  fitted to the pass times by tokens (the fastest of each count: compiles are slow)."""
  if r < len(AUTO_PROBES):
    return AUTO_PROBES[r]
  counts = sorted(pass_times)
  best = [min(pass_times[t]) for t in counts]
  if len(counts) > 1:
    slope, intercept = np.polyfit(counts, best, 1)
  else:
    slope, intercept = 0.0, best[0]
  slope = max(float(slope), 0.0)
  alpha = report.acceptance_rate
  return choose_k(alpha, float(np.median(draft[1:] or draft)), lambda t: intercept + slope * t)
