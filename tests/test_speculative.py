"""Speculative decoding (models/speculative.py, docs/speculative.md): greedy tokens are
the target's own whatever the draft proposes, sampled tokens are distributed as the
target's, caches roll back (rows of a batch keeping different counts, compaction), a
placed streamed target works with a resident draft, and bad drafts or settings are
refused before any pass."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from scipy import stats

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.models.draft_tree import DraftTree, choose, shapes

CFG = models.LlamaConfig(
  vocab_size=48,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=2,
  num_attention_heads=4,
  num_key_value_heads=2,
)
PROMPTS = jnp.asarray([[0, 0, 5, 6, 7], [9, 3, 4, 1, 2]], jnp.int32)  # row 0 left-padded
MASK = jnp.asarray([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], jnp.int32)
N = 12


@pytest.fixture(scope="module")
def target() -> models.Llama:
  return models.init_llama(CFG, seed=0)


@pytest.fixture(scope="module")
def want(target) -> jax.Array:
  """The target's own greedy tokens, no draft."""
  return models.generate_llm(target, PROMPTS, N, attention_mask=MASK, stop_tokens=())


def _reversed(model: models.Llama, rows=(0, 1)):
  """A draft that is always wrong on ``rows``: the target with its logits negated there,
  so that its top choices are the target's last ones (never its argmax, for any branches
  under the vocabulary's size); right on the other rows."""

  def forward(ids, mask, cache, index, *tree):
    logits, cache = jitted_plain(model, ids, mask, cache, index, *tree)
    wrong = jnp.zeros((logits.shape[0], 1, 1), bool).at[jnp.asarray(rows)].set(True)
    return jnp.where(wrong, -logits, logits), cache

  return forward


def _noisy(scale: float) -> models.Llama:
  """The target (seed 0) plus ``scale`` times another model's weights (seed 1): a draft
  that agrees often, not always."""
  noisy, other = models.init_llama(CFG, seed=0), models.init_llama(CFG, seed=1)
  nnx.update(noisy, jax.tree.map(lambda a, b: a + scale * b, nnx.state(noisy), nnx.state(other)))
  return noisy


SHAPES = [
  {"draft_tokens": 1},
  {"draft_tokens": 3},
  {"draft_tokens": "auto"},
  {"draft_tree": (2, 2, 1)},
  {"draft_tree": (3,)},
]


def _full_paths(report) -> bool:
  """Every round kept a whole path, root to leaf, on both rows."""
  return report.accepted == 2 * sum(len(t) for t in report.trees) > 0


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: str(next(iter(s.values()))))
def test_greedy_tokens_are_the_targets_for_any_draft(target, want, spec):
  """An always-wrong draft (0% kept), the target itself (every path whole) and a noisy
  copy (some): the tokens are the target's greedy tokens, rows of a batch (one
  left-padded) keeping different counts; chains, token trees and ``"auto"``."""
  noisy = _noisy(0.3)
  cases = [
    ("wrong", _reversed(target), CFG, lambda r: r.accepted == 0),
    ("right", target, None, _full_paths),
    ("noisy", noisy, None, lambda r: 0 < r.accepted < r.proposed),
  ]
  for name, draft, draft_cfg, kept in cases:
    got, report = models.speculate(
      target,
      PROMPTS,
      N,
      draft=draft,
      draft_config=draft_cfg,
      attention_mask=MASK,
      stop_tokens=(),
      **spec,
    )
    np.testing.assert_array_equal(got, want, err_msg=name)
    assert kept(report), (name, report)
    assert report.target_passes == report.rounds + 1
    assert report.generated == N * 2


def test_a_tree_pass_gives_each_node_the_logits_of_its_own_path(target):
  """The target's one pass over a tree (written after a cached prompt) against the plain
  model over the prompt and each node's path: every node attends to its ancestors only,
  at its depth's rotary position, on both rows (one left-padded)."""
  tree = DraftTree((2, 2))
  nodes = jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (2, tree.size)))
  slots = PROMPTS.shape[1] + tree.size
  _, cache = jitted_plain(target, PROMPTS, MASK, models.LlamaCache.zeros(CFG, 2, slots), 0)
  seen = jnp.sum(cache.mask, axis=1, keepdims=True)
  visible = jnp.zeros((1, tree.size, slots), bool).at[0, :, : PROMPTS.shape[1]].set(True)
  visible = visible.at[0, :, PROMPTS.shape[1] :].set(jnp.asarray(tree.ancestors))
  logits, _ = jitted_plain(
    target, nodes, jnp.ones_like(nodes), cache, PROMPTS.shape[1], seen + tree.depth, visible
  )
  for node in range(tree.size):
    path = np.flatnonzero(tree.ancestors[node])
    ids = jnp.concatenate([PROMPTS, nodes[:, path]], axis=1)
    mask = jnp.concatenate([MASK, jnp.ones((2, len(path)), jnp.int32)], axis=1)
    want = jitted_plain(target, ids, mask)[:, -1]
    np.testing.assert_allclose(logits[:, node], want, atol=2e-5, rtol=1e-5)


def test_an_always_right_draft_takes_k_plus_one_tokens_a_pass(target, want):
  got, report = models.speculate(
    target, PROMPTS, N, draft=target, draft_tokens=3, attention_mask=MASK, stop_tokens=()
  )
  np.testing.assert_array_equal(got, want)
  assert report.rounds == -(-(N - 1) // 4)  # 11 tokens after the prefill's, 4 a round
  assert report.tokens_per_pass == pytest.approx(N / (report.rounds + 1))


def test_rows_that_keep_different_counts_compact_the_caches(target, want):
  """Right on row 0, wrong on row 1: the round's start runs ahead of row 1's tokens, so
  the caches fill with row 1's holes and are compacted; the tokens stay the target's."""
  got, report = models.speculate(
    target,
    PROMPTS,
    N,
    draft=_reversed(target, rows=(1,)),
    draft_config=CFG,
    draft_tokens=4,
    attention_mask=MASK,
    stop_tokens=(),
  )
  np.testing.assert_array_equal(got, want)
  # row 1 gains one token a round: 11 rounds of 5 slots, past the 5 + 12 + 10 slots
  assert report.rounds == N - 1 and 5 + report.rounds * 5 > 5 + N + 10


def test_stop_tokens_pad_a_row_as_without_a_draft(target, want):
  stop = int(want[0, 3])
  plain = models.generate_llm(target, PROMPTS, N, attention_mask=MASK, stop_tokens=(stop,))
  got = models.generate_llm(
    target,
    PROMPTS,
    N,
    attention_mask=MASK,
    stop_tokens=(stop,),
    draft=_noisy(0.3),
    draft_tokens=3,
  )
  np.testing.assert_array_equal(got, plain)


@pytest.mark.parametrize("spec", [{"draft_tokens": 3}, {"draft_tree": (2, 2)}], ids=str)
def test_a_streamed_target_with_a_resident_quantized_draft(target, want, tmp_path, spec):
  """The target placed DenseDiskStream at host budget 0 from its store, the draft its int4
  copy placed FullyResident: the target's greedy tokens, and the target's report counts
  one pass a round (a chain's k + 1 tokens, or a tree's nodes) and the prompt's, and
  carries the generation's `SpeculationTotals`."""
  path = str(tmp_path / "store")
  jr.save(target, path)
  draft_path = str(tmp_path / "draft")
  jr.save(target, draft_path, quantize={"scheme": "int4", "group_size": 32})
  with (
    jr.place(target, jr.DenseDiskStream(host_budget_bytes=0), store=path) as streamed,
    jr.place(target, jr.FullyResident(), store=draft_path) as draft,
  ):
    got, report = models.speculate(
      streamed,
      PROMPTS,
      N,
      config=CFG,
      draft=draft,
      draft_config=CFG,
      attention_mask=MASK,
      stop_tokens=(),
      **spec,
    )
    placed_report = streamed.report()
  np.testing.assert_array_equal(got, want)
  assert len(placed_report.passes) == report.target_passes and report.accepted > 0
  # the target's own report sums what speculation did with it
  assert placed_report.speculation == report.totals()
  assert placed_report.speculation.generations == 1
  assert report.summary() in str(placed_report)
  assert placed_report.to_dict()["speculation"]["accepted"] == report.accepted


@pytest.mark.parametrize("spec", [{"draft_tokens": 2}, {"draft_tree": (3, 1)}], ids=str)
def test_sampled_tokens_are_distributed_as_the_targets(spec):
  """A vocabulary of 4, 3 tokens after a 2-token prompt, 6000 rows: the speculative
  samples' joint distribution of the 3 tokens against the target's exact
  probabilities, chi-square, p > 1e-3 at a fixed seed; a draft with another
  distribution, so that acceptance, a later sibling's acceptance (a tree) and
  resampling all happen."""
  cfg = models.LlamaConfig(
    vocab_size=4,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
  )
  target, draft = models.init_llama(cfg, seed=3), models.init_llama(cfg, seed=4)
  rows, prompt = 6000, [1, 2]
  ids = jnp.asarray([prompt] * rows, jnp.int32)
  got, report = models.speculate(
    target, ids, 3, draft=draft, temperature=1.0, seed=7, stop_tokens=(), **spec
  )
  assert 0 < report.accepted < report.proposed
  got = np.asarray(got)

  # the exact joint of (t0, t1, t2) under the target, from one pass over the 16 paths
  # (a causal model: position i's logits see the path up to i): at[a, b, i] is the
  # distribution after the prompt (i = 1), after a (i = 2) and after a, b (i = 3)
  paths = jnp.asarray([[*prompt, a, b] for a in range(4) for b in range(4)], jnp.int32)
  at = np.asarray(jax.nn.softmax(jitted_plain(target, paths, jnp.ones_like(paths))), np.float64)
  at = at.reshape(4, 4, len(prompt) + 2, 4)
  joint = at[0, 0, 1][:, None, None] * at[:, 0, 2][:, :, None] * at[:, :, 3]
  observed = np.zeros((4, 4, 4))
  np.add.at(observed, (got[:, 0], got[:, 1], got[:, 2]), 1)
  expected = joint.reshape(-1) / joint.sum() * rows  # float32 softmaxes: sums of 1 - 5e-8
  keep = expected >= 5  # chi-square's rule of thumb; the rest pooled
  obs = np.append(observed.reshape(-1)[keep], observed.reshape(-1)[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  _, p = stats.chisquare(obs, exp)
  assert p > 1e-3, p


def test_bad_drafts_and_settings_are_refused_before_any_pass(target, want):
  other = models.init_llama(
    models.LlamaConfig(
      vocab_size=40,
      hidden_size=32,
      intermediate_size=64,
      num_hidden_layers=1,
      num_attention_heads=4,
      num_key_value_heads=2,
    )
  )
  with pytest.raises(
    jr.errors.SpeculationError, match="vocabulary has 40 tokens and the target's 48"
  ):
    models.generate_llm(target, PROMPTS, N, draft=other)
  eos = models.init_llama(dataclasses.replace(CFG, eos_token_ids=(7,)))
  with pytest.raises(jr.errors.SpeculationError, match=r"eos_token_ids is \(7,\) and .* \(2,\)"):
    models.generate_llm(target, PROMPTS, N, draft=eos)
  for bad in (0, -1, 2.5, True, "fast", None):
    with pytest.raises(jr.errors.SpeculationError, match=f"draft_tokens={bad!r}"):
      models.generate_llm(target, PROMPTS, N, draft=target, draft_tokens=bad)
  for tree, why in [
    ((), "draft_tree=()"),
    ("22", "draft_tree='22'"),
    ((2, 0), "at least 1 branch"),
    ((2, 1.5), "at least 1 branch"),
    ((4, 4, 4, 4), "341 nodes, over the 256"),
    ((49, 1), "49 children of a node from a vocabulary of 48"),
  ]:
    with pytest.raises(jr.errors.SpeculationError, match=re.escape(why)):
      models.generate_llm(target, PROMPTS, N, draft=target, draft_tree=tree)
  # both still usable
  got = models.generate_llm(target, PROMPTS, N, attention_mask=MASK, stop_tokens=())
  np.testing.assert_array_equal(got, want)


def test_auto_speculates_where_passes_cost_little_per_token():
  """`choose`'s model over chains: deep speculation for a streamed pass (flat in its
  tokens), none where a pass costs per token or the draft rarely agrees."""
  chains = [(1,) * k for k in range(1, 9)]
  flat = lambda t: 0.5  # noqa: E731
  assert choose(lambda b: 0.8, lambda n: 0.001, flat, chains) == (1,) * 8
  assert choose(lambda b: 0.0, lambda n: 0.001, flat, chains) == ()
  assert choose(lambda b: 0.8, lambda n: 0.01, lambda t: 0.002 * t, chains) == ()
  assert 1 <= len(choose(lambda b: 0.5, lambda n: 0.01, lambda t: 0.05 + 0.001 * t, chains)) < 8


def test_auto_pools_what_it_measured_over_a_pairs_generations(target, want, monkeypatch):
  """``"auto"`` probes once for a target and draft: a later generation with the same
  pair, batch and sampling goes on from the shape it chose (here it may never move:
  `AUTO_SWITCH_GAIN` infinite), a new pair probes again; the tokens stay the target's."""
  from jax_residency._src.models import speculative_auto as speculative

  monkeypatch.setattr(speculative, "AUTO_SWITCH_GAIN", float("inf"))
  draft = _noisy(0.3)
  probes = [p for p in speculative.AUTO_PROBES for _ in range(2)]

  def run(d):
    got, report = models.speculate(
      target, PROMPTS, N, draft=d, draft_tokens="auto", attention_mask=MASK, stop_tokens=()
    )
    np.testing.assert_array_equal(got, want)
    return report

  reports = [run(draft) for _ in range(3)]  # until the probes are done
  tuning = speculative.auto_tuning(target, draft, (2, 0.0, None, None))
  assert tuning.rounds == sum(r.rounds for r in reports) >= len(probes) + 1
  chosen = tuning.shape
  assert [t for r in reports for t in r.trees][len(probes) :][0] == chosen
  later = run(draft)
  assert later.trees == [chosen] * later.rounds
  assert tuning.rounds == sum(r.rounds for r in reports) + later.rounds
  fresh = run(_noisy(0.3))
  assert fresh.trees[: len(probes)] == probes[: len(fresh.trees)]


def test_a_sizes_first_time_is_set_apart_as_a_possible_compile():
  """`TimesBySize`: a size's first call (which may compile) does not count once the size
  has run again; ``"auto"``'s lines are fitted through the later ones."""
  from jax_residency._src.models.speculative_auto import TimesBySize, fit_line

  times = TimesBySize()
  times.add(2, 5.0)  # compiled
  assert times.typical() == {2: 5.0}
  times.add(2, 0.5)
  times.add(9, 7.0)  # compiled: not counted while 2 has later times
  assert times.typical() == {2: 0.5}
  times.add(9, 0.6)
  times.add(9, 0.8)
  assert times.typical() == {2: 0.5, 9: 0.7}
  line = fit_line(times)
  assert line(2) == pytest.approx(0.5) and line(9) == pytest.approx(0.7)


def test_auto_branches_where_second_choices_often_hit():
  """`draft_tree.choose`: where the target's token is often the draft's second or third
  choice, a streamed pass is worth a tree; where only first choices hit, a chain."""
  ranks = {1: 0.5, 2: 0.8, 3: 0.85, 4: 0.95}
  picked = choose(ranks.get, lambda n: 0.001, lambda t: 0.5, shapes())
  assert DraftTree(picked).size > len(picked) + 1 and not DraftTree(picked).is_chain
  firsts = {1: 0.8, 2: 0.8, 3: 0.8, 4: 0.8}
  assert DraftTree(choose(firsts.get, lambda n: 0.001, lambda t: 0.5, shapes())).is_chain
  assert choose(ranks.get, lambda n: 0.001, lambda t: 0.5 * t, shapes()) == ()
