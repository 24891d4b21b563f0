"""Speculative decoding for Llama-family decoders (docs/speculative.md).

A draft model with the target's vocabulary proposes tokens from its own cache; the
target checks all of them in **one** pass with its cache, and keeps the longest run it
agrees with plus one token of its own. A streamed target moves the same bytes for many
positions as for one, so every accepted proposal is a token that cost no pass.

Every round expands a token tree (`draft_tree.DraftTree`): a chain of ``k`` proposals
(``draft_tokens=k``) is the tree ``(1,) * k``; ``draft_tree=(b1, b2, ...)`` gives the
nodes of each depth ``b`` children. The draft makes one call a depth, the target one
pass over every node, each node attending to the committed cache and its own
ancestors; the kept path is chosen by `draft_tree.walk_greedy` or `walk_sampled`.

* Greedy (``temperature=0``): a node is kept where its token is the target's argmax at
  its parent, so the tokens are the target's own greedy tokens, whatever the draft
  proposes (up to the float rounding of a many-token pass against a one-token step: a
  near tie could part them, as it could part two backends).
* Sampling: speculative sampling (Leviathan et al., 2023; Chen et al., 2023), tried
  child by child on a tree: the tokens are distributed as the target's own samples.

Caches: both models keep the same slot layout. A round writes its nodes at slots
``index .. index + size - 1`` of each cache (the draft's deepest call only fills its
cache), then moves each row's kept path to the first of those slots and unmarks the
rest (``LlamaCache.mask``): an unmarked slot is never attended to and does not count
towards a row's positions, and the next round overwrites it. Rows of a batch that keep
different counts leave holes; the next round starts after the row that kept most, and
when a round would run past the cache, both caches are compacted (each row's marked
slots moved to the front, in order). A finished row (all its tokens, or a stop token)
keeps none of a round's slots.

``draft_tokens="auto"`` (`speculative_auto`) measures its first rounds, fits the target's
pass time to its tokens and the draft's call time to its nodes, counts how often the
target's token is among the draft's top choices, and then picks the shape with the
most predicted tokens per second (`draft_tree.choose`), or none where no speculation is
predicted faster than one token a pass. What it measured (`AutoTuning`) is kept for the
same target and draft, batch size and sampling settings, and pooled over later
generations in the process: a second prompt starts from the first one's estimates.
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
from jax_residency._src.models.draft_tree import (
  MAX_AUTO_BRANCHES,
  DraftTree,
  shapes,
  walk_greedy,
  walk_sampled,
)
from jax_residency._src.models.llama import LlamaCache
from jax_residency._src.models.logits import filter_logits
from jax_residency._src.models.speculative_auto import AutoTuning, next_shape
from jax_residency._src.report.speculation import SpeculationTotals

Forward = Callable[..., tuple[jax.Array, LlamaCache]]


@dataclasses.dataclass
class SpeculationReport:
  """What a speculative generation did.

  Attributes:
    rounds: draft-and-verify rounds.
    proposed: draft tokens proposed, over rows and rounds.
    accepted: proposals the target kept.
    target_passes: the target's passes: its prefill and one a round.
    draft_steps: the draft's calls (one a depth of the round's tree, the deepest
      included: ``k + 1`` for a chain of ``k``), prefill not counted.
    generated: tokens returned per row, summed over rows (``batch * max_new_tokens``
      unless every row stopped early).
    draft_s: seconds in the draft's prefill and steps.
    target_s: seconds in the target's prefill and passes.
    trees: the shape of each round's tree (``(1,) * k`` for a chain of ``k``).
  """

  rounds: int = 0
  proposed: int = 0
  accepted: int = 0
  target_passes: int = 0
  draft_steps: int = 0
  generated: int = 0
  draft_s: float = 0.0
  target_s: float = 0.0
  trees: list[tuple[int, ...]] = dataclasses.field(default_factory=list)

  @property
  def draft_tokens(self) -> list[int]:
    """The proposals of each round (a tree's nodes but its root)."""
    return [DraftTree(shape).proposals for shape in self.trees]

  @property
  def acceptance_rate(self) -> float:
    """The share of proposals kept (0 when none were made)."""
    return self.totals().acceptance_rate

  @property
  def tokens_per_pass(self) -> float:
    """Tokens returned per row and target pass (one without a draft)."""
    return self.totals().tokens_per_pass

  _batch: int = dataclasses.field(default=1, repr=False)

  def totals(self) -> SpeculationTotals:
    """This generation's counts as a placed target's report sums them."""
    return SpeculationTotals(
      generations=1,
      rounds=self.rounds,
      proposed=self.proposed,
      accepted=self.accepted,
      target_passes=self.target_passes,
      row_passes=self.target_passes * self._batch,
      draft_steps=self.draft_steps,
      generated=self.generated,
      draft_s=self.draft_s,
      target_s=self.target_s,
    )

  def summary(self) -> str:
    """One line: rounds, proposals, acceptance, tokens a pass, time in each model."""
    return self.totals().summary()


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


@functools.partial(jax.jit, static_argnames=("branches", "greedy", "top_k", "top_p"))
def _children(
  logits: jax.Array,
  key: jax.Array,
  branches: int,
  temperature: Any,
  greedy: bool,
  top_k: Any,
  top_p: Any,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """From the draft's logits at ``n`` nodes (``(batch, n, vocab)``): each node's
  ``branches`` children ``(batch, n, branches)`` (greedy: its top tokens, best first;
  sampling: independent draws from ``q``), ``q`` ``(batch, n, vocab)`` (greedy: unused
  zeros) and the draft's top `MAX_AUTO_BRANCHES` tokens ``(batch, n, MAX_AUTO_BRANCHES)``."""
  logits = logits.astype(jnp.float32)
  top = jax.lax.top_k(logits, min(MAX_AUTO_BRANCHES, logits.shape[-1]))[1].astype(jnp.int32)
  if greedy:
    kids = jax.lax.top_k(logits, branches)[1].astype(jnp.int32)
    return kids, jnp.zeros((*logits.shape[:2], 1), jnp.float32), top
  b, n, vocab = logits.shape
  scores = filter_logits(logits.reshape(b * n, vocab), temperature, top_k, top_p)
  draws = jax.random.categorical(key, scores, axis=-1, shape=(branches, b * n))
  kids = jnp.moveaxis(draws, 0, -1).reshape(b, n, branches).astype(jnp.int32)
  return kids, jax.nn.softmax(scores, axis=-1).reshape(b, n, vocab), top


@functools.partial(jax.jit, static_argnames=("top_k", "top_p"))
def _target_probs(logits: jax.Array, temperature: Any, top_k: Any, top_p: Any) -> jax.Array:
  """The target's filtered distribution at each node, ``(batch, size, vocab)``."""
  b, t, vocab = logits.shape
  scores = filter_logits(
    logits.astype(jnp.float32).reshape(b * t, vocab), temperature, top_k, top_p
  )
  return jax.nn.softmax(scores, axis=-1).reshape(b, t, vocab)


@functools.partial(jax.jit, static_argnames=("slots",))
def _visible(ancestors: jax.Array, index: jax.Array, slots: int) -> jax.Array:
  """``(1, n, slots)``: the committed slots (before ``index``) and, in the round's slots
  from ``index``, each node's ancestors (``ancestors`` ``(n, size)``)."""
  committed = jnp.arange(slots)[None, :] < index
  block = jnp.zeros((ancestors.shape[0], slots), bool)
  block = jax.lax.dynamic_update_slice(block, ancestors, (jnp.zeros_like(index), index))
  return (committed | block)[None]


@functools.partial(jax.jit, static_argnames=("size",))
def _keep_path(
  cache: LlamaCache, index: jax.Array, path: jax.Array, kept: jax.Array, size: int
) -> LlamaCache:
  """Moves each row's kept path (node numbers ``path`` ``(batch, size)``, the first
  ``kept`` of them) to the round's first slots, in order, and unmarks the round's
  other slots, so that the row's tokens stay contiguous."""
  zero = jnp.zeros_like(index)

  def gather(kv: jax.Array) -> jax.Array:
    region = jax.lax.dynamic_slice_in_dim(kv, index, size, axis=2)
    moved = jnp.take_along_axis(region, path[None, :, :, None, None], axis=2)
    return jax.lax.dynamic_update_slice_in_dim(kv, moved, index, axis=2)

  marks = (jnp.arange(size)[None, :] < kept[:, None]).astype(cache.mask.dtype)
  mask = jax.lax.dynamic_update_slice(cache.mask, marks, (zero, index))
  return LlamaCache(gather(cache.k), gather(cache.v), mask)


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


def _placed_as(new: LlamaCache, old: LlamaCache) -> LlamaCache:
  """``new`` with ``old``'s shardings: a model's program is compiled for the shardings
  of the cache it returns, and a helper's output sharding may be an equivalent one that
  is not equal (``P()`` for ``P(None, None)``), which would compile the program again."""
  return jax.tree.map(lambda n, o: jax.device_put(n, o.sharding), new, old)


class _Clock:
  """Seconds spent in a call, its outputs ready."""

  def __init__(self) -> None:
    self.seconds = 0.0
    self.last = 0.0

  def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    self.last = time.perf_counter() - start
    self.seconds += self.last
    return out


@dataclasses.dataclass
class _Sampling:
  """How tokens are picked: greedy, or sampled after temperature, top-k and top-p."""

  temperature: float
  top_k: int | None
  top_p: float | None
  seed: int

  @functools.cached_property
  def key(self) -> jax.Array:
    """The root of the draws made in JAX (the draft's children, the first token)."""
    return jax.random.key(self.seed)

  @property
  def greedy(self) -> bool:
    return self.temperature == 0

  def first(self, logits: jax.Array) -> jax.Array:
    """The target's token from its prefill's last logits."""
    kids, _, _ = self.children(logits[:, -1:], 1, jax.random.fold_in(self.key, 0))
    return kids[:, 0, 0]

  def children(self, logits: jax.Array, branches: int, key: jax.Array) -> Any:
    return _children(logits, key, branches, self.temperature, self.greedy, self.top_k, self.top_p)

  def probs(self, logits: jax.Array) -> jax.Array:
    return _target_probs(logits, self.temperature, self.top_k, self.top_p)

  def rng(self, r: int) -> np.random.Generator:
    """The host generator of round ``r``'s accept and resample draws."""
    return np.random.default_rng((self.seed, r))


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
    tuning: AutoTuning,
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
    first = self.sampling.first(logits)
    self.out = np.full((batch, max_new_tokens + widest + 1), pad, np.int32)
    self.out[:, 0] = np.asarray(first)
    self.count = np.ones(batch, np.int64)
    self.last, self.index = np.asarray(first), length
    self.stop_ids = np.asarray(tuple(stops), np.int32)
    #: pass and draft call times and the chances, pooled over this pair's generations
    self.tuning = tuning

  def rows_done(self) -> np.ndarray:
    """The rows with all their tokens, or a stop token among them."""
    done = self.count >= self.n
    if len(self.stop_ids):
      written = np.arange(self.n)[None, :] < self.count[:, None]
      done |= (np.isin(self.out[:, : self.n], self.stop_ids) & written).any(axis=1)
    return done

  def round(self, tree: DraftTree) -> None:
    """The draft expands ``tree`` from the last token, the target checks every node in
    one pass, each row keeps its accepted path and the target's next token."""
    r = self.report.rounds
    if self.index + tree.size > self.slots:
      self.t_cache = _placed_as(_compact(self.t_cache), self.t_cache)
      self.d_cache = _placed_as(_compact(self.d_cache), self.d_cache)
      self.index = int(jnp.max(jnp.sum(self.t_cache.mask, axis=1)))
      # an unfinished row holds under length + max_new_tokens marked slots
      assert self.index + tree.size <= self.slots, (self.index, tree.size, self.slots)
    # each row's positions so far, as a host array: the models' inputs are then alike
    # (uncommitted) in every round, and no program or eager op compiles again for them
    seen = np.asarray(jnp.sum(self.t_cache.mask, axis=1, keepdims=True))
    ancestors = jnp.asarray(tree.ancestors)
    key = jax.random.fold_in(self.sampling.key, r + 1)
    tokens, q, top = self._expand(tree, ancestors, seen, key)
    batch = tokens.shape[0]
    index = jnp.int32(self.index)
    visible = None if tree.is_chain else _visible(ancestors, index, self.slots)
    logits, self.t_cache = self.t_clock(
      self.target,
      jnp.asarray(tokens),
      jnp.ones((batch, tree.size), jnp.int32),
      self.t_cache,
      index,
      jnp.asarray(seen + tree.depth[None]),
      visible,
    )
    self.tuning.pass_times.add(tree.size, self.t_clock.last)
    paths, after = self._walk(tree, tokens, logits, q, top, r)
    # a finished row (all its tokens, or a stop token) keeps none of the round's slots,
    # so that its cache stops growing
    done = self.rows_done()
    kept = np.asarray([0 if d else len(p) for d, p in zip(done, paths, strict=True)], np.int32)
    table = np.zeros((batch, tree.size), np.int32)
    for row, p in enumerate(paths):
      table[row, : len(p)] = p
    args = (index, jnp.asarray(table), jnp.asarray(kept), tree.size)
    self.t_cache = _placed_as(_keep_path(self.t_cache, *args), self.t_cache)
    self.d_cache = _placed_as(_keep_path(self.d_cache, *args), self.d_cache)
    for live in np.flatnonzero(~done):
      c = int(self.count[live])
      new = [*tokens[live, paths[live][1:]].tolist(), after[live]][: self.out.shape[1] - c]
      self.out[live, c : c + len(new)] = new
      self.count[live] += len(paths[live])
    report = self.report
    report.rounds += 1
    report.proposed += int((~done).sum()) * tree.proposals
    report.accepted += sum(len(p) - 1 for d, p in zip(done, paths, strict=True) if not d)
    report.target_passes += 1
    report.draft_steps += len(tree.levels)
    report.trees.append(tree.branches)
    self.tuning.rounds += 1
    self.index += int(kept.max(initial=0))
    self.last = np.asarray(after, np.int32)

  def _expand(
    self, tree: DraftTree, ancestors: jax.Array, seen: np.ndarray, key: jax.Array
  ) -> tuple[np.ndarray, list[Any], np.ndarray]:
    """The draft's tree from the last token (``ancestors``: the tree's table on the device),
    one call a depth, each depth written at its own slots: the nodes' tokens ``(batch,
    size)``, the draft's ``q`` at each expanded depth (sampling) and its top tokens at
    each node ``(batch, size, MAX_AUTO_BRANCHES)``."""
    batch = self.last.shape[0]
    tokens = np.zeros((batch, tree.size), np.int32)
    tokens[:, 0] = self.last
    top = np.zeros((batch, tree.size, MAX_AUTO_BRANCHES), np.int32)
    qs: list[Any] = []
    for d, (start, n) in enumerate(zip(tree.starts, tree.levels, strict=True)):
      index = jnp.int32(self.index + start)
      visible = (
        None
        if tree.is_chain
        else _visible(ancestors[start : start + n], jnp.int32(self.index), self.slots)
      )
      logits, self.d_cache = self.d_clock(
        self.draft,
        jnp.asarray(tokens[:, start : start + n]),
        jnp.ones((batch, n), jnp.int32),
        self.d_cache,
        index,
        jnp.asarray(seen + d),
        visible,
      )
      self.tuning.draft_times.add(n, self.d_clock.last)
      if d == len(tree.branches):
        break  # the deepest call only fills the draft's cache
      b = tree.branches[d]
      kids, q, best = self.sampling.children(logits, b, jax.random.fold_in(key, d))
      nxt = tree.starts[d + 1]
      tokens[:, nxt : nxt + n * b] = np.asarray(kids).reshape(batch, n * b)
      top[:, start : start + n] = np.asarray(best)
      qs.append(q)
    return tokens, qs, top

  def _walk(
    self,
    tree: DraftTree,
    tokens: np.ndarray,
    logits: jax.Array,
    qs: list[Any],
    top: np.ndarray,
    r: int,
  ) -> tuple[list[list[int]], list[int]]:
    """Each row's kept path and the target's token after it; counts the chances."""
    paths, after = [], []
    if self.sampling.greedy:
      pred = np.asarray(jnp.argmax(logits, axis=-1))
      for row in range(tokens.shape[0]):
        path, token = walk_greedy(tree, tokens[row], pred[row])
        paths.append(path)
        after.append(token)
        for node in path:
          if tree.children(node):
            hits = np.flatnonzero(top[row, node] == pred[row, node])
            self.tuning.chances.add_rank(int(hits[0]) if hits.size else None)
      return paths, after
    p = np.asarray(self.sampling.probs(logits))
    q = [np.asarray(x) for x in qs]
    rng = self.sampling.rng(r)
    for row in range(tokens.shape[0]):

      def p_at(node: int, row: int = row) -> np.ndarray:
        return p[row, node]

      def q_at(node: int, row: int = row) -> np.ndarray:
        d = int(tree.depth[node])
        return q[d][row, node - tree.starts[d]]

      path, token, first = walk_sampled(tree, tokens[row], p_at, q_at, rng)
      paths.append(path)
      after.append(token)
      for ok in first:
        self.tuning.chances.add_first(ok)
    return paths, after

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
  draft_tree: DraftTree | None,
  temperature: float,
  top_k: int | None,
  top_p: float | None,
  seed: int,
  stops: Sequence[int],
  pad: int,
  tuning: AutoTuning | None = None,
) -> tuple[jax.Array, SpeculationReport]:
  """The tokens after ``ids`` (``(batch, max_new_tokens)``) by speculative decoding, and
  what it did. ``target`` and ``draft`` are forwards ``(ids, mask, cache, index,
  positions, visible) -> (logits, cache)`` of models with configs ``target_cfg`` and
  ``draft_cfg``; a round expands ``draft_tree``, else a chain of ``draft_tokens``, else
  (``"auto"``) the shape `_auto` picks from ``tuning`` (default: a fresh one). Arguments
  are checked by the caller (`generate_llm`)."""
  batch, length = ids.shape
  if draft_tree is not None:
    fixed: DraftTree | None = draft_tree
  elif draft_tokens == "auto":
    fixed = None
  else:
    fixed = DraftTree((1,) * int(draft_tokens))
  widest = fixed.size if fixed is not None else max(DraftTree(s).size for s in shapes())
  slots = length + max_new_tokens + 2 * widest
  caches = (
    LlamaCache.zeros(target_cfg, batch, slots),
    LlamaCache.zeros(draft_cfg, batch, slots),
  )
  sampling = _Sampling(temperature, top_k, top_p, seed)
  tuning = AutoTuning() if tuning is None else tuning
  run = _Generation(
    target, draft, caches, ids, mask, max_new_tokens, widest, sampling, stops, pad, tuning
  )
  while not run.rows_done().all():
    run.round(fixed if fixed is not None else next_shape(run.tuning, run.sampling.greedy))
  return run.tokens(pad), run.report
