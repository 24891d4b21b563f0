"""`models.generate_batch`: many prompts a pass (docs/throughput.md).

Each prompt's greedy tokens in a batch are the tokens it gets alone, under the plain
model and under a streamed placement, whose report counts one pass per step for the
whole batch, reading the same bytes a pass whatever the batch (three layers: more than
the stream's device window of two units, so every pass reads units). The model is a tiny
random Llama whose greedy picks are far from ties (float rounding, which differs with
the batch's shapes, never flips one here).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jax_residency as jr
from jax_residency import models

CFG = models.LlamaConfig(
  vocab_size=256,
  hidden_size=64,
  intermediate_size=128,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  max_position_embeddings=32,
)
NEW = 6
#: The prompts the tests draw from: 12 prompts of lengths 1, 4 and 9 (ragged batches, and
#: few shapes to compile: each length and batch width compiles a prefill and a step).
PROMPTS = [
  np.random.default_rng(i).integers(3, CFG.vocab_size, (1, 4, 9)[i % 3]).tolist() for i in range(12)
]


@pytest.fixture(scope="module")
def model() -> models.Llama:
  return models.init_llama(CFG, seed=3)


_ALONE: dict[int, list[int]] = {}


def alone(model: models.Llama, i: int) -> list[int]:
  """Prompt ``i``'s greedy tokens, generated in a batch of one (no padding)."""
  if i not in _ALONE:
    _ALONE[i] = models.generate_llm(model, PROMPTS[i], NEW, stop_tokens=())[0].tolist()
  return _ALONE[i]


@settings(max_examples=6, deadline=None)
@given(
  picked=st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=5),
  batch_size=st.one_of(st.none(), st.integers(1, 4)),
)
def test_each_prompt_in_a_batch_gets_its_greedy_tokens_alone(model, picked, batch_size):
  prompts = [PROMPTS[i] for i in picked]
  out = models.generate_batch(model, prompts, NEW, batch_size=batch_size, stop_tokens=())
  assert out == [alone(model, i) for i in picked]


def test_left_padding_changes_the_logits_by_float_rounding_only(model):
  """Positions come from the mask: a row padded on the left gives its unpadded logits."""
  row = PROMPTS[4]
  ids = np.zeros((1, 9), np.int32)
  mask = np.zeros((1, 9), np.int32)
  ids[0, 9 - len(row) :], mask[0, 9 - len(row) :] = row, 1
  padded = np.asarray(model(jnp.asarray(ids), jnp.asarray(mask)))[0, 9 - len(row) :]
  unpadded = np.asarray(model(jnp.asarray([row])))[0]
  np.testing.assert_allclose(padded, unpadded, rtol=0, atol=1e-5)


def test_a_streamed_batch_is_one_pass_a_step_reading_what_one_sequence_reads(model, saved_store):
  store = saved_store(("llama_batch", CFG), model)
  picked = [0, 5, 8, 3]
  reads: dict[int, tuple[int, int, int]] = {}
  for prompts in ([PROMPTS[i] for i in picked], [PROMPTS[8]]):
    with jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=store.path) as p:
      out = models.generate_batch(p, prompts, NEW, config=CFG, stop_tokens=())
      report = p.report()
    assert report.prefill.passes == 1 and report.decode.passes == NEW - 1
    reads[len(prompts)] = (report.prefill.bytes_read, report.decode.bytes_read, report.total.passes)
    if len(prompts) > 1:
      assert out == [alone(model, i) for i in picked]
    else:
      assert out == [alone(model, 8)]
  assert reads[4] == reads[1]  # each unit read once a pass, whatever the batch
  per_pass, left = divmod(reads[1][1], NEW - 1)  # the window may keep a unit between passes
  assert left == 0 and per_pass >= store.unit_nbytes


def test_a_sequence_is_cut_after_its_stop_token(model):
  stop = alone(model, 1)[2]
  out = models.generate_batch(model, [PROMPTS[1], PROMPTS[2]], NEW, stop_tokens=(stop,))
  for tokens, want in zip(out, (alone(model, 1), alone(model, 2)), strict=True):
    assert tokens == (want[: want.index(stop) + 1] if stop in want else want)
  assert len(out[0]) <= 3 and out[0][-1] == stop


def test_one_batch_samples_as_generate_llm_does_and_batches_differ(model):
  prompts = [PROMPTS[6], PROMPTS[6]]
  kw = {"temperature": 0.9, "top_k": 40, "seed": 7, "stop_tokens": ()}
  one = models.generate_batch(model, prompts, NEW, **kw)
  assert one == models.generate_llm(model, [PROMPTS[6]] * 2, NEW, **kw).tolist()
  assert models.generate_batch(model, prompts, NEW, **kw) == one  # seeded
  split = models.generate_batch(model, prompts, NEW, batch_size=1, **kw)
  assert split[0] == one[0] and split[1] != split[0]  # batch 1 draws with its own seed


@pytest.mark.parametrize(
  ("prompts", "batch_size", "fragments"),
  [
    ([], None, ["prompts=[]", "at least one prompt"]),
    ([[1, 2], [], [3]], None, ["prompts[1] is empty", "give each prompt 1 to 32"]),
    ([[1]], 0, ["batch_size=0", "positive int"]),
    ([[1], [2] * 33], 2, ["prompts[1] has 33 tokens", "context of 32", "cut long ones"]),
  ],
)
def test_bad_prompts_raise_a_typed_error_with_the_value_and_the_fix(
  model, prompts, batch_size, fragments
):
  with pytest.raises(jr.errors.InvalidPromptsError) as e:
    models.generate_batch(model, prompts, NEW, batch_size=batch_size)
  assert isinstance(e.value, ValueError)
  for fragment in fragments:
    assert fragment in str(e.value)
