"""Expert residency (docs/design.md, 4.9): a mixture of experts' experts read only when
the router picks them.

``tests/test_llama.py`` runs it for the Mixtral and Qwen2-MoE fixtures on one and eight
devices (the tokens transformers generates, the prefill bit for bit the eager model's,
and the bytes read accounted for). Here, on the Mixtral fixture (4 experts, top 2, 3
layers): a one-row decode step reads its unit without the experts and only the experts
its router picked; a cache that holds every expert turns every later pick into a hit;
the host expert cache serves what the device cache evicted; the speculative prefetch's
counts add up; the marker is the identity under every transform; and bad input is
refused with the arithmetic, leaving a placed model that runs its next pass.
"""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models import llama

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT = jnp.asarray([[1, 5, 9, 3, 7, 2, 11, 4]], jnp.int32)
NEW = 4


@pytest.fixture(scope="module")
def mixtral() -> models.Llama:
  return models.load_llama(FIXTURES / "mixtral_tiny")


@pytest.fixture(scope="module")
def store(mixtral, saved_store) -> jr.StoreInfo:
  return saved_store(("experts", "mixtral"), mixtral)


@pytest.fixture(scope="module")
def plain_tokens(mixtral) -> np.ndarray:
  return np.asarray(models.generate_llm(mixtral, PROMPT, NEW))


def sizes(model: models.Llama, store: jr.StoreInfo) -> tuple[int, int, int]:
  """(bytes of one expert, of a unit without its experts, top-k) of the model."""
  cfg = model.config
  expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
  return expert, store.stacks[0].unit_nbytes - cfg.num_experts * expert, cfg.num_experts_per_tok


def experts_policy(
  device: int | str | None, *, host: int | str | None = 0, **kw
) -> jr.DenseDiskStream:
  cache = jr.ExpertResidency(device_budget_bytes=device, host_budget_bytes=host, **kw)
  return jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=None, experts=cache)


def generate(placed: jr.PlacedModel, model: models.Llama) -> np.ndarray:
  return np.asarray(models.generate_llm(placed, PROMPT, NEW, config=model.config))


def test_a_decode_step_reads_its_units_without_experts_and_only_the_picked_ones(
  mixtral, store, plain_tokens
):
  expert, ordinary, k = sizes(mixtral, store)
  layers = 3
  policy = experts_policy(k * expert, speculative_prefetch=False)
  with jr.place(mixtral, policy, store=store.path) as placed:
    np.testing.assert_array_equal(generate(placed, mixtral), plain_tokens)
    decode = [p for p in placed.report().passes if p.phase == "decode"]
  assert len(decode) == NEW - 1
  for p in decode:
    e = p.experts
    assert e.selected == layers * k  # one token picks k distinct experts in each layer
    assert e.selected == e.hits + e.misses and e.predicted == e.read_ahead == 0
    assert e.bytes_read == (e.misses - e.host_hits) * expert
    units = p.bytes_read - e.bytes_read  # what the units' reads took: no expert among it
    assert units % ordinary == 0 and units <= layers * ordinary
    # Fewer bytes than a dense stream of the same units, which reads every expert.
    assert p.bytes_read <= layers * (ordinary + k * expert) < layers * store.stacks[0].unit_nbytes
    assert e.device.peak_bytes <= k * expert


def test_a_cache_that_holds_every_expert_makes_every_later_pick_a_hit(mixtral, store):
  expert, _, _ = sizes(mixtral, store)
  with jr.place(mixtral, experts_policy(None), store=store.path) as placed:
    generate(placed, mixtral)
    generate(placed, mixtral)  # the same picks again
    passes = placed.report().passes
  first, second = passes[:NEW], passes[NEW:]
  read = sum(p.experts.bytes_read for p in first)
  assert (
    read
    == sum(p.experts.misses - p.experts.host_hits + p.experts.read_ahead for p in first) * expert
  )
  assert all(p.experts.misses == 0 and p.experts.bytes_read == 0 for p in second)
  assert sum(p.experts.hits for p in second) == sum(p.experts.selected for p in second) > 0


def test_the_host_expert_cache_serves_what_the_device_cache_evicted(mixtral, store, plain_tokens):
  expert, _, k = sizes(mixtral, store)
  policy = experts_policy(k * expert, host="1MiB", speculative_prefetch=False)
  with jr.place(mixtral, policy, store=store.path) as placed:
    generate(placed, mixtral)
    np.testing.assert_array_equal(generate(placed, mixtral), plain_tokens)
    second = placed.report().passes[NEW:]
  # Every expert the first run read stayed in host memory: nothing comes from the store.
  assert all(p.experts.bytes_read == 0 for p in second)
  assert sum(p.experts.host_hits for p in second) == sum(p.experts.misses for p in second) > 0
  assert all(p.experts.host is not None and p.experts.host.peak_bytes <= 2**20 for p in second)


def test_the_speculative_prefetch_counts_its_predictions(mixtral, store, plain_tokens):
  expert, _, k = sizes(mixtral, store)
  policy = experts_policy(4 * expert, speculative_prefetch=True)
  with jr.place(mixtral, policy, store=store.path) as placed:
    np.testing.assert_array_equal(generate(placed, mixtral), plain_tokens)
    decode = [p.experts for p in placed.report().passes if p.phase == "decode"]
    total = placed.report().decode.experts
  for e in decode:
    assert e.predicted == 2 * k  # layers 1 and 2, predicted from layers 0 and 1
    assert 0 <= e.predicted_used <= e.predicted
    assert e.bytes_read == (e.misses - e.host_hits + e.read_ahead) * expert
  assert total.predicted == sum(e.predicted for e in decode)
  assert total.precision == total.predicted_used / total.predicted


def test_the_plan_holds_the_expert_caches_and_the_policy_round_trips(mixtral, store):
  policy = jr.DenseDiskStream(
    host_budget_bytes="1MiB",
    device_budget_bytes="64MiB",
    experts=jr.ExpertResidency(device_budget_bytes="1MiB", host_budget_bytes="2MiB"),
  )
  assert jr.LayerWeightResidency.from_dict(policy.to_dict()) == policy
  assert policy.to_dict()["options"]["experts"]["device_budget_bytes"] == 2**20
  with jr.place(mixtral, policy, store=store.path) as placed:
    items = {m.name: m for m in placed.metadata.memory}
  assert items["device expert cache"].nbytes == 2**20
  assert items["device expert cache"].counted_in == "device budget"
  assert items["host expert cache"].nbytes == 2 * 2**20


# --- the marker -------------------------------------------------------------------


def test_picked_experts_is_the_identity_under_every_transform():
  ids = jnp.asarray([[2, 0], [1, 3]], jnp.int32)
  np.testing.assert_array_equal(jr.picked_experts(ids), ids)
  np.testing.assert_array_equal(jax.jit(jr.picked_experts)(ids), ids)
  np.testing.assert_array_equal(jax.vmap(jr.picked_experts)(ids), ids)
  w = jnp.arange(4.0)
  grad = jax.grad(lambda w: jnp.sum(w[jr.picked_experts(ids)]))(w)
  np.testing.assert_array_equal(grad, jnp.asarray([1.0, 1.0, 1.0, 1.0]))
  for platform in ("cuda", "tpu"):  # it lowers to nothing on an accelerator
    text = jax.jit(jr.picked_experts).trace(ids).lower(lowering_platforms=(platform,)).as_text()
    assert "return %arg0 :" in text and "custom_call" not in text
  with pytest.raises(TypeError, match="integer expert ids"):
    jr.picked_experts(jnp.zeros(2))


# --- bad input ----------------------------------------------------------------------


def test_a_device_expert_cache_smaller_than_one_tokens_picks_is_refused(mixtral, store):
  expert, _, k = sizes(mixtral, store)
  with jr.place(mixtral, experts_policy(k * expert - 1), store=store.path) as placed:
    with pytest.raises(jr.PlacementError) as e:
      placed(PROMPT)
    assert f"top_k {k} x {expert} B an expert = {k * expert} B" in str(e.value)
    assert placed.report().total.passes == 0  # the failed pass left nothing counted


def test_a_store_without_expert_chunks_points_to_rechunk(mixtral, saved_store):
  whole = saved_store(("experts", "whole"), mixtral, experts=())
  assert whole.stacks[0].experts == 0
  with pytest.raises(jr.errors.StoreLayoutError, match="rechunk STORE NEW --experts"):
    jr.place(mixtral, experts_policy("1MiB"), store=whole.path)


def test_a_layer_that_marks_no_experts_is_refused(mixtral, store, monkeypatch):
  monkeypatch.setattr(llama, "picked_experts", lambda ids: ids)
  with jr.place(mixtral, experts_policy("1MiB"), store=store.path) as placed:
    with pytest.raises(jr.PlacementError, match="does not mark which experts"):
      placed(PROMPT)


def test_the_device_budget_must_hold_the_expert_cache_beside_the_window(mixtral, store):
  tight = jr.DenseDiskStream(
    host_budget_bytes=0,
    device_budget_bytes="2MiB",
    experts=jr.ExpertResidency(device_budget_bytes="2MiB"),
  )
  with pytest.raises(jr.DeviceBudgetTooSmallError) as e:
    jr.place(mixtral, tight, store=store.path)
  assert e.value.budget == 2 * 2**20 and e.value.required > e.value.budget
  assert f"= {e.value.required} B" in str(e.value)
  unbounded = jr.DenseDiskStream(
    host_budget_bytes=0, experts=jr.ExpertResidency(device_budget_bytes=None)
  )
  with pytest.raises(jr.DeviceBudgetTooSmallError, match="without bound"):
    jr.place(mixtral, unbounded, store=store.path)


@pytest.mark.parametrize(
  ("fields", "match"),
  [
    ({"device_budget_bytes": 0}, "leaves no room"),
    ({"device_budget_bytes": "lots"}, "lots"),
    ({"speculative_prefetch": "yes"}, "speculative_prefetch='yes'"),
  ],
)
def test_bad_expert_residency_fields_are_refused(fields, match):
  with pytest.raises(jr.errors.WeightResidencyPolicyError, match=match):
    jr.ExpertResidency(**fields)


def test_experts_takes_an_expert_residency_or_its_dict():
  with pytest.raises(jr.errors.InvalidPolicyValueError, match="experts=3"):
    jr.DenseDiskStream(experts=3)
  from_dict = jr.DenseDiskStream(experts={"device_budget_bytes": "1MiB"})
  assert from_dict.options.experts == jr.ExpertResidency(device_budget_bytes=2**20)
  with pytest.raises(jr.errors.UnknownPolicyFieldError, match="'budget'"):
    jr.ExpertResidency.from_dict({"budget": 1})


def test_a_failed_expert_read_leaves_the_placement_running(mixtral, store, plain_tokens):
  policy = experts_policy("1MiB", speculative_prefetch=False)
  with jr.place(mixtral, policy, store=store.path) as placed:
    source = placed._placed()._store  # noqa: SLF001 - the store the stream reads
    real = source.read_experts_async

    def failing(*args, **kwargs):
      raise jr.StoreError("the disk went away")

    source.read_experts_async = failing
    with pytest.raises(jr.StoreError, match="went away"):
      placed(PROMPT)
    source.read_experts_async = real
    assert placed.report().total.passes == 0
    np.testing.assert_array_equal(generate(placed, mixtral), plain_tokens)
    assert placed.report().total.passes == NEW


def test_an_evicted_experts_row_reads_as_zero_and_gives_its_memory_back():
  """On CPU a unit's expert tensors are kept whole; the cache's experts are their rows."""
  from jax_residency._src.stream.expert_rows import ExpertRows

  def rss() -> int:
    with open("/proc/self/smaps_rollup") as f:
      return next(int(line.split()[1]) * 1024 for line in f if line.startswith("Rss:"))

  rows = ExpertRows(((4, 512, 2048),), (np.dtype(np.float32),))  # 4 MiB an expert
  before = rss()
  for e in range(4):
    rows.row(e)[0][...] = e + 1.0
  filled = rss()
  rows.clear(1)
  rows.clear(3)
  assert filled - before >= 15 * 2**20 and filled - rss() >= 7 * 2**20
  assert [float(rows.buffers[0][e].max()) for e in range(4)] == [1.0, 0.0, 3.0, 0.0]
  assert rows.buffers[0].ctypes.data % 4096 == 0  # page-aligned: a device array uses it as is


def test_an_accelerator_builds_the_expert_tensor_on_the_device():
  """The program that builds a step's expert tensor from cached parts on an accelerator:
  run here on CPU, and lowered for CUDA and TPU (not run on either)."""
  from jax_residency._src.stream.expert_rows import put_rows

  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  build = put_rows((4, 3, 2), np.dtype(np.float32), device)
  parts = [jnp.full((3, 2), 1.0), jnp.full((3, 2), 3.0)]
  ids = np.asarray([1, 3], np.int32)
  whole = np.asarray(build(ids, parts))
  np.testing.assert_array_equal(whole[[0, 2]], 0.0)
  np.testing.assert_array_equal(whole[1], 1.0)
  np.testing.assert_array_equal(whole[3], 3.0)
  for platform in ("cuda", "tpu"):
    text = build.trace(ids, parts).lower(lowering_platforms=(platform,)).as_text()
    assert "scatter" in text and "tensor<4x3x2xf32>" in text


# --- a model of one's own ----------------------------------------------------------------


class _Layer(nnx.Module):
  """A residual mixture of 4 experts (tanh MLPs) behind a top-1 router, as a user
  writes one: the ids marked with `jr.picked_experts`, the experts stacked."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.router = nnx.Linear(8, 4, use_bias=False, rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 8, 8)) * 0.5)

  def __call__(self, x: jax.Array) -> jax.Array:
    _, ids = jax.lax.top_k(self.router(x), 1)
    ids = jr.picked_experts(ids)  # (batch, tokens, 1): each token's pick, on the last axis
    picked = jnp.take(self.w[...], ids[..., 0], axis=0)  # (batch, tokens, 8, 8)
    return x + jnp.tanh(jnp.einsum("btd,btde->bte", x, picked))


class _Net(nnx.Module):
  residency_experts = ("w",)  # what jr.save writes a chunk per expert

  def __init__(self) -> None:
    @nnx.vmap(in_axes=0, out_axes=0)
    def build(key: jax.Array) -> _Layer:
      return _Layer(nnx.Rngs(key))

    self.layers = build(jax.random.split(jax.random.key(0), 3))

  def __call__(self, x: jax.Array) -> jax.Array:
    return jr.scan_units(lambda h, layer: layer(h), x, self.layers)


def test_a_mixture_of_experts_of_ones_own_reads_only_the_picked_experts(tmp_path):
  net = _Net()
  x = jax.random.normal(jax.random.key(1), (1, 1, 8))
  info = jr.save(net, str(tmp_path / "net"), units="layers", progress=False)
  assert info.stacks[0].experts == 4
  policy = experts_policy(4 * 8 * 8 * 4)  # room for every expert of one layer
  with jr.place(net, policy, store=info.path, units="layers") as placed:
    np.testing.assert_array_equal(placed(x), net(x))
    e = placed.report().last.experts
  assert e.selected == 3 and e.bytes_read == 3 * 8 * 8 * 4  # one expert a layer, one token
