"""The GPT decoder: KV cache through the unit loop, greedy generation under every policy."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models.decoding import jitted_plain

CFG = models.GPTConfig(vocab_size=128, d_model=32, n_heads=4, d_ff=64, n_layers=4, max_len=24)
STEPS = 8
PROMPT_LEN = 6


class CountingGPT(models.GPT):
  """Counts traces of the forward (one per compiled input signature)."""

  calls = 0

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    type(self).calls += 1
    return super().__call__(*args, **kwargs)


@pytest.fixture(scope="module")
def model() -> CountingGPT:
  abstract = nnx.eval_shape(lambda: CountingGPT(CFG, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(models.init_gpt(CFG, seed=0)))


@pytest.fixture(scope="module")
def unit_bytes(model: CountingGPT) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(nnx.state(model.layers))) // CFG.n_layers


@pytest.fixture(scope="module")
def prompt() -> jax.Array:
  return jax.random.randint(jax.random.key(1), (2, PROMPT_LEN), 0, CFG.vocab_size)


@pytest.fixture(scope="module")
def expected(model: CountingGPT, prompt: jax.Array) -> jax.Array:
  return models.generate(model, prompt, STEPS)


@pytest.fixture(scope="module")
def store(model: CountingGPT, saved_store) -> str:
  return saved_store(("gpt", CFG, 0), model).path


def policy(name: str, unit: int) -> jr.LayerWeightResidency:
  match name:
    case "fully-resident":
      return jr.FullyResident()
    case "layerwise-host-1" | "layerwise-host-2":
      depth = int(name[-1])
      return jr.LayerwiseHost(
        jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=depth))
      )
    case "dense-small-host":  # 2 of 4 units fit the host cache: every pass reads from disk
      return jr.DenseDiskStream(
        jr.DenseDiskStreamLoadOptions(
          host_budget_bytes=2 * unit, host_lookahead=1, background_queue_capacity=1
        )
      )
    case "dense-direct":
      return jr.DenseDiskStream(
        jr.DenseDiskStreamLoadOptions(
          host_budget_bytes=0, host_lookahead=0, background_queue_capacity=0
        )
      )
  raise AssertionError(name)


POLICIES = [
  "fully-resident",
  "layerwise-host-1",
  "layerwise-host-2",
  "dense-small-host",
  "dense-direct",
]


@pytest.fixture(scope="module")
def plain_prefill(model: CountingGPT, prompt: jax.Array) -> Any:
  """``{dense: the plain model's prefill (logits, cache)}``: eager for a dense stream's
  per-layer steps, under ``jax.jit`` for the one program of the other policies, what each
  gives on CPU (docs/parity.md)."""
  return {True: model(prompt), False: jitted_plain(model, prompt, None, 0)}


@pytest.mark.parametrize("name", POLICIES)
def test_generation_is_identical_under_every_policy(
  name, model, unit_bytes, prompt, expected, plain_prefill, store
):
  CountingGPT.calls = 0
  dense = name.startswith("dense")
  with jr.place(model, policy(name, unit_bytes), store=store if dense else None) as placed:
    tokens = models.generate(placed, prompt, STEPS)
    report = placed.report()
    logits, cache = placed(prompt, None, 0)  # one more prefill, as generate ran it
  np.testing.assert_array_equal(tokens, expected)
  assert report.prefill.passes == 1 and report.decode.passes == STEPS - 1
  assert report.total.passes == STEPS
  # Fixed-size caches: one trace for the prefill, one shared by every decode step.
  assert CountingGPT.calls == 2
  if dense:  # a 2-unit host cache (or none) cannot keep 4 units: each pass reads them all
    assert report.total.bytes_read == STEPS * CFG.n_layers * unit_bytes
  want_logits, want_cache = plain_prefill[dense]
  np.testing.assert_array_equal(logits, want_logits)
  np.testing.assert_array_equal(cache.k, want_cache.k)
  np.testing.assert_array_equal(cache.v, want_cache.v)
  assert cache.k.shape == (CFG.n_layers, 2, CFG.max_len, CFG.n_heads, CFG.head_dim)


@pytest.mark.parametrize("name", ["fully-resident", "layerwise-host-2", "dense-small-host"])
def test_generation_on_eight_devices(name, model, unit_bytes, prompt, expected, store):
  """Replicated over a (data=2, model=4) mesh: the KV cache and tokens stay the same."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  dense = name.startswith("dense")
  with jr.place(model, policy(name, unit_bytes), mesh=mesh, store=store if dense else None) as p:
    np.testing.assert_array_equal(models.generate(p, prompt, STEPS), expected)
    assert p.mesh.devices.size == 8


def test_generation_on_the_accelerator_step_path(
  model, unit_bytes, prompt, expected, store, monkeypatch
):
  """Off CPU a dense stream compiles each unit step as its own program; tokens stay the same."""
  from jax_residency._src.stream import engine as stream

  monkeypatch.setattr(stream, "STEP_IN_LOOP_PLATFORMS", frozenset())
  with jr.place(model, policy("dense-small-host", unit_bytes), store=store) as placed:
    np.testing.assert_array_equal(models.generate(placed, prompt, STEPS), expected)


def test_decoding_with_the_cache_equals_a_full_forward(model, prompt, expected):
  """Logits of one-token steps over the cache = logits of the whole sequence at once."""
  step = nnx.jit(lambda m, t, c, p: m(t, c, p))
  sequence = jnp.concatenate([prompt, expected], axis=1)
  full, _ = nnx.jit(lambda m, t: m(t))(model, sequence)
  logits, cache = step(model, prompt, None, 0)
  np.testing.assert_allclose(logits, full[:, :PROMPT_LEN], atol=1e-5)
  for i in range(STEPS):
    pos = PROMPT_LEN + i
    logits, cache = step(model, sequence[:, pos : pos + 1], cache, jnp.int32(pos))
    np.testing.assert_allclose(logits[:, 0], full[:, pos], atol=1e-5)
  # Greedy: each generated token is the argmax at the position before it.
  np.testing.assert_array_equal(
    jnp.argmax(full[:, PROMPT_LEN - 1 : -1], axis=-1), expected, err_msg="greedy"
  )


def test_generate_checks_lengths(model, prompt):
  with pytest.raises(ValueError, match="max_len=24"):
    models.generate(model, prompt, CFG.max_len)
  with pytest.raises(ValueError, match="steps=0"):
    models.generate(model, prompt, 0)
  assert models.generate(model, prompt[0], 1).shape == (1, 1)  # a 1-D prompt is one sequence


TIED = dataclasses.replace(CFG, tie_head=True)


@pytest.fixture(scope="module")
def tied() -> models.GPT:
  return models.init_gpt(TIED, seed=0)


@pytest.fixture(scope="module")
def tied_store(tied: models.GPT, saved_store) -> str:
  return saved_store(("gpt", TIED, 0), tied).path


def test_a_tied_head_is_the_embedding_transposed(tied, model, prompt):
  """No head parameter; the logits equal an untied model's whose head is ``embedding.T``."""
  params = nnx.to_pure_dict(nnx.state(tied, nnx.Param))
  assert "head" not in params and set(params) == {"embed", "pos_embed", "layers", "norm"}
  head = CFG.d_model * CFG.vocab_size + CFG.vocab_size  # the untied head's kernel + bias

  def static(m: models.GPT) -> int:
    params = nnx.to_pure_dict(nnx.state(m, nnx.Param))
    return sum(x.nbytes for k, v in params.items() if k != "layers" for x in jax.tree.leaves(v))

  assert static(model) - static(tied) == head * np.dtype(CFG.dtype).itemsize
  untied = models.init_gpt(CFG, seed=0)
  nnx.update(untied, nnx.state(tied, nnx.Param))  # every parameter but the head
  untied.head.kernel[...] = tied.embed.embedding[...].T
  want, _ = untied(prompt)
  got, _ = tied(prompt)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tied_expected(tied: models.GPT, prompt: jax.Array) -> jax.Array:
  return models.generate(tied, prompt, STEPS)


@pytest.mark.parametrize("name", POLICIES)
def test_a_tied_model_generates_the_same_tokens_under_every_policy(
  name, tied, prompt, tied_expected, tied_store
):
  unit = sum(x.nbytes for x in jax.tree.leaves(nnx.state(tied.layers))) // TIED.n_layers
  dense = name.startswith("dense")
  with jr.place(tied, policy(name, unit), store=tied_store if dense else None) as placed:
    np.testing.assert_array_equal(models.generate(placed, prompt, STEPS), tied_expected)
    assert "embed.embedding" in placed.arrays()
    assert not any(k.startswith("head") for k in placed.arrays())
