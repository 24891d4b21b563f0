"""The Llama-family decoder against Hugging Face transformers, and under every policy.

The references (``tests/fixtures/llama_tiny_tied``, ``llama_tiny_untied``,
``mistral_tiny``, ``qwen2_tiny``, ``mixtral_tiny``, ``qwen2_moe_tiny``: a tiny
random sharded checkpoint each, with ``reference.json``) were written by
``scripts/make_llama_reference.py`` with torch and transformers; these tests need
neither, only ``safetensors`` to read the checkpoints. They differ on purpose: a
tied head with the transformers 5 ``config.json`` form; Llama 3 rope scaling, an
own head and two EOS ids in the Hub's form; Mistral's head_dim (12) apart from
hidden/heads; Qwen2's q/k/v biases and its ignored sliding window; Mixtral's top-2
of 4 experts, renormalized; Qwen2-MoE's top-2 of 4 not renormalized, with a gated
shared expert (measured |logits - reference|, eager: 7.0e-6 and 1.8e-6; their
routers' 2nd and 3rd probabilities are at least 3.2e-4 apart on every token, so
float32 differences do not change a pick). All use grouped-query attention (4
query heads over 2 key/value heads) and left-padded prompts.

Placement: every policy on an 8-device mesh for every fixture, and on one
device for one fixture; FullyResident and LayerwiseHost
match the plain model run jitted bit for bit, DenseDiskStream the plain model
run eagerly (docs/parity.md).
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from user_env import run_script, user_env

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models.decoding import jitted_plain as _jitted_plain
from jax_residency._src.models.llama import rope_frequencies
from jax_residency._src.plan.split import normalise_path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
NAMES = (
  "llama_tiny_tied",
  "llama_tiny_untied",
  "mistral_tiny",
  "qwen2_tiny",
  "mixtral_tiny",
  "qwen2_moe_tiny",
)
#: Bound on |logits - reference| at real (unpadded) positions, for every fixture, jitted
#: and eager. The fixtures' final norm scales every logit by a power of two
#: (``logit_scale``, 0.5 or 0.25; max |logit| 1.4 to 2.0), so transformers' own float32
#: logits are 1.8e-6 to 2.4e-6 from its float64 ones (``float32_vs_float64_max_abs_diff``).
#: Measured |logits - reference| (jitted / eager): 2.3e-6 / 2.5e-6 tied, 1.9e-6 / 1.7e-6
#: untied, 2.6e-6 / 2.0e-6 mistral, 3.0e-6 / 2.8e-6 qwen2.
MAX_ABS_DIFF = 1e-5


#: Bound on the logits of each generation step (the reference records no float64
#: value for these): measured |logits - reference| up to 6.0e-6 (mistral_tiny);
#: 2.5e-6 tied, 3.6e-6 untied, 3.0e-6 qwen2.
STEP_MAX_ABS_DIFF = 1e-5


requires_safetensors = pytest.mark.skipif(
  importlib.util.find_spec("safetensors") is None,
  reason="the Llama checkpoints are safetensors files: pip install safetensors",
)


def reference(name: str) -> dict[str, Any]:
  return json.loads((FIXTURES / name / "reference.json").read_text())


def ids(ref: dict[str, Any], key: str) -> jax.Array:
  return jnp.asarray(ref[key], jnp.int32)


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, tuple[models.Llama, dict[str, Any]]]:
  if importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs safetensors")
  return {name: (models.load_llama(FIXTURES / name), reference(name)) for name in NAMES}


@pytest.fixture(params=NAMES)
def loaded(request: pytest.FixtureRequest, checkpoints) -> tuple[models.Llama, dict[str, Any]]:
  return checkpoints[request.param]


# --- config ---------------------------------------------------------------------


@requires_safetensors
def test_configs_of_the_fixtures():
  tied = models.read_llama_config(FIXTURES / "llama_tiny_tied")
  assert tied.tie_word_embeddings and tied.rope_type == "default" and tied.rope_theta == 1e4
  assert (tied.num_attention_heads, tied.num_key_value_heads, tied.head_width) == (4, 2, 8)
  assert (tied.bos_token_id, tied.pad_token_id, tied.eos_token_ids) == (1, 0, (2,))
  untied = models.read_llama_config(FIXTURES / "llama_tiny_untied")
  assert not untied.tie_word_embeddings and untied.eos_token_ids == (2, 3)
  assert (untied.rope_type, untied.rope_factor, untied.original_max_position_embeddings) == (
    "llama3",
    8.0,
    256,
  )
  assert untied.rope_theta == 5e5 and untied.rms_norm_eps == 1e-5
  mistral = models.read_llama_config(FIXTURES / "mistral_tiny")
  assert mistral.model_type == "mistral" and mistral.head_width == 12
  assert mistral.sliding_window is None and not (mistral.qkv_bias or mistral.o_bias)
  qwen = models.read_llama_config(FIXTURES / "qwen2_tiny")
  assert qwen.qkv_bias and not qwen.o_bias and qwen.tie_word_embeddings
  assert qwen.sliding_window is None  # use_sliding_window: false, so 32768 is ignored
  assert not any(qwen.layer_sliding)


@pytest.mark.parametrize("name", NAMES)
def test_rope_frequencies_match_transformers(name):
  cfg = models.read_llama_config(FIXTURES / name)
  ref = reference(name)
  np.testing.assert_array_equal(rope_frequencies(cfg), np.float32(ref["rope_inv_freq"]))


def test_config_reads_both_rope_forms_and_the_sliding_window():
  hub = {
    "architectures": ["LlamaForCausalLM"],
    "rope_theta": 5e5,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
  }  # fmt: skip
  v5 = {
    "architectures": ["LlamaForCausalLM"],
    "rope_parameters": {**hub["rope_scaling"], "rope_theta": 5e5},
  }
  assert models.LlamaConfig.from_hf(hub) == models.LlamaConfig.from_hf(v5)
  old = {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"type": "llama3", "factor": 8.0}}
  assert models.LlamaConfig.from_hf(old).rope_type == "llama3"
  assert models.LlamaConfig.from_hf({"model_type": "qwen2"}).architecture == "Qwen2ForCausalLM"
  mistral = models.LlamaConfig.from_hf(
    {"architectures": ["MistralForCausalLM"], "sliding_window": 8}
  )
  assert mistral.layer_sliding == (True,) * 32 and mistral.sliding_window == 8
  qwen = {
    "architectures": ["Qwen2ForCausalLM"],
    "num_hidden_layers": 4,
    "use_sliding_window": True,
    "sliding_window": 16,
    "max_window_layers": 2,
  }
  assert models.LlamaConfig.from_hf(qwen).layer_sliding == (False, False, True, True)
  types = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
  assert models.LlamaConfig.from_hf({**qwen, "layer_types": types}).layer_sliding == (
    True,
    False,
    True,
    False,
  )
  llama = models.LlamaConfig.from_hf({"attention_bias": True, "sliding_window": 4})
  assert llama.qkv_bias and llama.o_bias and llama.sliding_window is None


@pytest.mark.parametrize(
  ("field", "value"),
  [
    ("architectures", ["GPT2LMHeadModel"]),
    ("model_type", "gemma"),
    ("hidden_act", "gelu"),
    ("mlp_bias", True),
    ("rope_type", "yarn"),
    ("rope_type", "dynamic"),
    ("partial_rotary_factor", 0.5),
    ("layer_types", ["chunked_attention"] * 32),
    ("num_key_value_heads", 3),
  ],
)
def test_unsupported_config_fields_are_refused_by_name(field, value):
  config: dict[str, Any] = {field: value}
  if field == "rope_type":
    config = {"rope_scaling": {"rope_type": value, "factor": 2.0}}
  if field == "model_type":
    config = {"model_type": value}
  with pytest.raises(jr.errors.ModelConfigError, match=re.escape(f"{field}={value!r}")) as e:
    models.LlamaConfig.from_hf(config)
  assert isinstance(e.value, ValueError)
  if field == "rope_type":  # transformers 5's form too
    with pytest.raises(jr.errors.ModelConfigError, match=f"rope_type='{value}'"):
      models.LlamaConfig.from_hf({"rope_parameters": {"rope_type": value}})


@pytest.mark.parametrize(
  ("field", "value"),
  [("mlp_only_layers", [1]), ("decoder_sparse_step", 2), ("use_sliding_window", True)],
)
def test_unsupported_mixture_of_experts_fields_are_refused_by_name(field, value):
  """Qwen2-MoE layers that are dense, or that slide, are not implemented: named, refused."""
  config = {"architectures": ["Qwen2MoeForCausalLM"], field: value}
  with pytest.raises(jr.errors.ModelConfigError, match=re.escape(f"{field}={value!r}")):
    models.LlamaConfig.from_hf(config)
  with pytest.raises(jr.errors.ModelConfigError, match=r"num_experts_per_tok=5"):
    models.LlamaConfig.from_hf(
      {"architectures": ["MixtralForCausalLM"], "num_local_experts": 4, "num_experts_per_tok": 5}
    )


def test_configs_of_the_mixture_of_experts_fixtures():
  mixtral = models.read_llama_config(FIXTURES / "mixtral_tiny")
  assert (mixtral.model_type, mixtral.num_experts, mixtral.num_experts_per_tok) == ("mixtral", 4, 2)
  assert mixtral.norm_topk_prob and mixtral.moe_intermediate_size == 64
  assert not (mixtral.qkv_bias or mixtral.shared_expert_intermediate_size)
  qwen = models.read_llama_config(FIXTURES / "qwen2_moe_tiny")
  assert (qwen.model_type, qwen.num_experts, qwen.moe_intermediate_size) == ("qwen2_moe", 4, 48)
  assert not qwen.norm_topk_prob and qwen.shared_expert_intermediate_size == 64 and qwen.qkv_bias
  for name in ("mixtral_tiny", "qwen2_moe_tiny"):  # a router pick is no float32 coin toss
    ref = reference(name)
    assert ref["router_min_topk_gap"] > 1e-4 and 0 not in ref["router_picks_layer0"]


# --- the checkpoint -------------------------------------------------------------


@requires_safetensors
@pytest.mark.parametrize("name", NAMES)
def test_every_checkpoint_tensor_is_one_parameter(name):
  """``hf_tensor_map`` names each tensor of the checkpoint once; transposed and reshaped,
  it is the loaded parameter."""
  path = FIXTURES / name
  cfg = models.read_llama_config(path)
  tensors = models.read_safetensors(path)
  index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
  assert set(index) == set(tensors)
  static, unit = models.hf_tensor_map(cfg)
  named: dict[str, tuple[tuple[str, ...], models.HFTensor, tuple[int, ...]]] = {
    t.name: (p, t, ()) for p, t in static.items()
  }
  for sub, t in unit.items():
    for i in range(cfg.num_hidden_layers):  # a mixture's experts: one tensor each, {j}
      at = [(i, j) for j in range(t.experts)] if t.experts else [(i,)]
      named |= {name: (("layers", *sub), t, k) for name, k in zip(t.names(i), at, strict=True)}
  assert set(named) == set(tensors)
  flat = jax.tree_util.tree_flatten_with_path(nnx.state(models.load_llama(path)))[0]
  state = {normalise_path(p): np.asarray(v) for p, v in flat}
  assert {p for p, _, _ in named.values()} == set(state)
  for tensor, (param_path, t, at) in named.items():
    param = state[param_path][at]
    value = tensors[tensor].T if t.transpose else tensors[tensor]
    np.testing.assert_array_equal(value.reshape(param.shape), param)


@requires_safetensors
def test_loader_names_missing_unexpected_and_misshapen_tensors():
  path = FIXTURES / "qwen2_tiny"
  cfg, tensors = models.read_llama_config(path), models.read_safetensors(path)
  cut = {k: v for k, v in tensors.items() if k != "model.layers.2.self_attn.k_proj.bias"}
  with pytest.raises(jr.errors.MissingCheckpointParametersError, match=r"layers\.2\.self_attn"):
    models.llama_params_from_hf(cut, cfg)
  extra = {**tensors, "model.layers.1.self_attn.o_proj.bias": np.zeros(32, np.float32)}
  with pytest.raises(jr.errors.UnexpectedCheckpointParametersError, match="o_proj.bias"):
    models.llama_params_from_hf(dict(extra), cfg)
  assert models.llama_params_from_hf(dict(extra), cfg, strict=False).keys() == (
    models.llama_params_from_hf(dict(tensors), cfg).keys()
  )
  old = {**tensors, "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32)}
  models.llama_params_from_hf(old, cfg)  # old checkpoints' rotary buffers are ignored
  wide = models.LlamaConfig.from_hf(
    {**json.loads((path / "config.json").read_text()), "intermediate_size": 65}
  )
  with pytest.raises(jr.errors.CheckpointShapeMismatchError, match="gate_proj"):
    models.llama_params_from_hf(dict(tensors), wide)


# --- against transformers -------------------------------------------------------


def test_logits_match_the_reference(loaded):
  model, ref = loaded
  mask = ids(ref, "attention_mask")
  logits = _jitted_plain(model, ids(ref, "input_ids"), mask)
  want = np.asarray(ref["logits"], np.float32).reshape(logits.shape)
  real = np.asarray(mask) == 1  # a padding query sees no key: transformers' value is arbitrary
  assert float(np.abs(np.asarray(logits) - want)[real].max()) <= MAX_ABS_DIFF
  eager = model(ids(ref, "input_ids"), mask)
  assert float(np.abs(np.asarray(eager) - want)[real].max()) <= MAX_ABS_DIFF
  # The positions it derives from the mask are the ones the reference was given.
  explicit = _jitted_plain(model, ids(ref, "input_ids"), mask, None, 0, ids(ref, "position_ids"))
  np.testing.assert_array_equal(np.asarray(explicit)[real], np.asarray(logits)[real])


def greedy_args(ref: dict[str, Any]) -> tuple[jax.Array, int, jax.Array]:
  return ids(ref, "generate_input_ids"), ref["max_new_tokens"], ids(ref, "generate_attention_mask")


def test_greedy_tokens_and_step_logits_match_the_reference(loaded):
  model, ref = loaded
  prompt, n, mask = greedy_args(ref)
  steps: list[jax.Array] = []

  def forward(*args: Any) -> Any:
    logits, cache = _jitted_plain(model, *args)
    steps.append(logits[:, -1])
    return logits, cache

  tokens = models.generate_llm(forward, prompt, n, attention_mask=mask, config=model.config)
  np.testing.assert_array_equal(tokens, ref["greedy"])
  want = np.asarray(ref["greedy_logits"], np.float32).reshape(len(prompt), n, -1)
  got = np.stack(steps, axis=1)
  finished = np.asarray(ref["greedy"])[:, :-1] == ref["pad_token_id"]  # no logits once padded
  assert got.shape[1] <= n
  for b in range(len(prompt)):
    live = [s for s in range(got.shape[1]) if s == 0 or not finished[b, s - 1]]
    assert float(np.abs(got[b, live] - want[b, live]).max()) <= STEP_MAX_ABS_DIFF
  stopped = models.generate_llm(
    model, prompt, n, attention_mask=mask, stop_tokens=[ref["stop_token_id"]]
  )
  np.testing.assert_array_equal(stopped, ref["greedy_stopping_at_stop_token"])


# --- sampling -------------------------------------------------------------------


def hf_filter(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None):
  """transformers' TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, in NumPy."""
  scores = logits / temperature
  if top_k is not None:
    kth = np.sort(scores, axis=-1)[..., -top_k][..., None]
    scores = np.where(scores < kth, -np.inf, scores)
  if top_p is not None:
    order = np.argsort(scores, axis=-1, kind="stable")
    ascending = np.take_along_axis(scores, order, axis=-1)
    probs = np.exp(ascending - ascending.max(-1, keepdims=True))
    mass = np.cumsum(probs / probs.sum(-1, keepdims=True), axis=-1)
    drop = mass <= 1 - top_p
    drop[..., -1] = False
    remove = np.zeros_like(drop)
    np.put_along_axis(remove, order, drop, axis=-1)
    scores = np.where(remove, -np.inf, scores)
  return scores


@pytest.mark.parametrize(
  ("temperature", "top_k", "top_p"), [(1.0, 5, None), (0.7, None, 0.8), (1.3, 20, 0.5)]
)
def test_filters_match_transformers(temperature, top_k, top_p):
  logits = np.random.default_rng(0).standard_normal((3, 96)).astype(np.float32) * 3
  got = np.asarray(models.filter_logits(jnp.asarray(logits), temperature, top_k, top_p))
  want = hf_filter(logits, temperature, top_k, top_p)
  np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
  np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)


@requires_safetensors
def test_sampling_is_seeded_and_its_limits_are_greedy(checkpoints):
  model, ref = checkpoints["llama_tiny_untied"]
  prompt, n, mask = greedy_args(ref)

  def sample(**kw: Any) -> np.ndarray:
    kw = {"temperature": 1.0, "stop_tokens": (), **kw}
    return np.asarray(models.generate_llm(model, prompt, n, attention_mask=mask, **kw))

  greedy = sample(temperature=0.0)
  first = sample(seed=0, top_p=0.95)
  np.testing.assert_array_equal(first, sample(seed=0, top_p=0.95))
  assert not np.array_equal(first, sample(seed=1, top_p=0.95))
  np.testing.assert_array_equal(sample(temperature=1e-4, seed=3), greedy)
  np.testing.assert_array_equal(sample(top_k=1, seed=4), greedy)
  with pytest.raises(ValueError, match="temperature=-1"):
    sample(temperature=-1.0)


# --- placement ------------------------------------------------------------------


def policy(name: str, unit: int) -> jr.LayerWeightResidency:
  match name:
    case "fully-resident":
      return jr.FullyResident()
    case "layerwise-host":
      return jr.LayerwiseHost(prefetch_depth=2)
    case "dense":  # a host cache of one unit: every pass reads every unit from disk
      return jr.DenseDiskStream(host_budget_bytes=unit, host_lookahead=1)
    case "experts":  # experts apart (docs/design.md, 4.9): a small device cache, no host one
      cache = jr.ExpertResidency(device_budget_bytes=unit // 2)
      return jr.DenseDiskStream(host_budget_bytes=0, experts=cache)
  raise AssertionError(name)


def mesh_of(devices: int) -> jax.sharding.Mesh:
  shape = (2, 4) if devices == 8 else (1, 1)
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(shape), ("data", "model"))


@pytest.fixture(scope="module")
def stores(checkpoints, saved_store) -> dict[str, jr.StoreInfo]:
  return {name: saved_store(("llama", name), model) for name, (model, _) in checkpoints.items()}


#: Every policy on the 8-device mesh for every fixture; on 1 device for the Llama 3 one.
POLICIES = ("fully-resident", "layerwise-host", "dense")
PLACEMENTS = [
  *[(name, p, 8) for name in NAMES for p in POLICIES],
  *[("llama_tiny_untied", p, 1) for p in POLICIES],
  # Experts read only when picked: Mixtral on 8 devices, Qwen2-MoE (a shared expert) on 1.
  ("mixtral_tiny", "experts", 8),
  ("qwen2_moe_tiny", "experts", 1),
]


#: The plain model's prefill outputs, by fixture and whether eager (`--dist loadfile`: one
#: worker runs them).
_PREFILL: dict[tuple[str, bool], Any] = {}


@pytest.mark.parametrize(("name", "kind", "devices"), PLACEMENTS)
def test_placed_generate_the_same_tokens(name, kind, devices, checkpoints, stores):
  model, ref = checkpoints[name]
  store = stores[name]
  assert store.stacks[0].experts == model.config.num_experts  # a chunk per expert (or none)
  prompt, n, mask = greedy_args(ref)
  dense = kind in ("dense", "experts")
  # The prefill as generate_llm runs it: a dense stream runs a step per layer, against the
  # eager model; FullyResident and LayerwiseHost one program, against the jitted model
  # (docs/parity.md).
  cache = models.LlamaCache.zeros(model.config, len(prompt), prompt.shape[1] + n - 1)
  prefill = (prompt, mask, cache, 0)
  if (name, dense) not in _PREFILL:  # the same for every placement of a fixture
    _PREFILL[name, dense] = model(*prefill) if dense else _jitted_plain(model, *prefill)
  want = _PREFILL[name, dense]
  with jr.place(
    model,
    policy(kind, store.unit_nbytes),
    store=store.path if dense else None,
    mesh=mesh_of(devices),
  ) as p:
    assert p.stacks == ("layers",) and p.unit_count == 3
    tokens = models.generate_llm(p, prompt, n, attention_mask=mask, config=model.config)
    report = p.report()
    again = p(*prefill)
  np.testing.assert_array_equal(tokens, ref["greedy"])
  passes = n - 1 - int((np.asarray(ref["greedy"]) == ref["pad_token_id"]).all(axis=0).sum())
  assert report.prefill.passes == 1 and report.decode.passes == passes
  if kind == "dense":  # one unit fits the host cache: each pass reads every unit
    assert report.total.bytes_read == (1 + passes) * 3 * store.unit_nbytes
  if kind == "experts":  # units read without their experts (the window's bytes keep
    # them all: a unit without its experts is small), and some experts
    cfg = model.config
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    ordinary = store.unit_nbytes - cfg.num_experts * expert
    experts = report.total.experts
    assert report.total.bytes_read == 3 * ordinary + experts.bytes_read
    read = experts.misses - experts.host_hits + experts.read_ahead  # demand, speculative
    assert experts.bytes_read == read * expert > 0
    assert experts.selected == experts.hits + experts.misses > 0
  for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(a, b)


@requires_safetensors
def test_a_streamed_abstract_model_generates_from_its_store(checkpoints, stores):
  """No weights in memory: the abstract model's layers and static weights come from the store."""
  model, ref = checkpoints["qwen2_tiny"]
  cfg = model.config
  abstract = nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))
  prompt, n, mask = greedy_args(ref)
  kind = jr.DenseDiskStream(host_budget_bytes=0)
  with jr.place(abstract, kind, store=stores["qwen2_tiny"].path) as p:
    tokens = models.generate_llm(p, prompt, n, attention_mask=mask, config=cfg)
  np.testing.assert_array_equal(tokens, ref["greedy"])


# --- sliding windows (no fixture has one: checked against their definition) ------


def windowed(layers: int, **kw: Any) -> models.LlamaConfig:
  return models.LlamaConfig(
    architecture="Qwen2ForCausalLM",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=layers,
    num_attention_heads=4,
    num_key_value_heads=2,
    qkv_bias=True,
    **kw,
  )


def test_a_sliding_window_hides_older_keys():
  """One layer: the last query sees the last ``window`` slots (``q - s < window``)."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(4, 64, (1, 10)), jnp.int32)
  for window, sees_slot_6 in ((4, True), (3, False)):
    model = models.init_llama(windowed(1, sliding_window=window))
    changed = tokens.at[0, 6].set((tokens[0, 6] + 1) % 64)
    last = [np.asarray(_jitted_plain(model, t))[0, -1] for t in (tokens, changed)]
    assert (not np.array_equal(*last)) == sees_slot_6, window
    older = tokens.at[0, :6].set(5)  # slots the last query never sees with either window
    np.testing.assert_array_equal(np.asarray(_jitted_plain(model, older))[0, -1], last[0])


def test_sliding_layers_decode_as_the_full_forward_and_place_the_same():
  """Layers 1 and 2 of 3 slide: the per-layer choice goes through the layer loop."""
  cfg = windowed(3, sliding_window=3, sliding_layers=(1, 2))
  model = models.init_llama(cfg, seed=1)
  tokens = jnp.asarray(np.random.default_rng(1).integers(4, 64, (2, 9)), jnp.int32)
  full = np.asarray(_jitted_plain(model, tokens))
  cache = models.LlamaCache.zeros(cfg, 2, 9)
  logits, cache = _jitted_plain(model, tokens[:, :5], None, cache, 0)
  steps = [np.asarray(logits)]
  for i in range(5, 9):
    logits, cache = _jitted_plain(model, tokens[:, i : i + 1], None, cache, jnp.int32(i))
    steps.append(np.asarray(logits))
  np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
  plain = models.generate_llm(model, tokens, 4, stop_tokens=())
  with jr.place(model, jr.LayerwiseHost(prefetch_depth=2)) as p:
    np.testing.assert_array_equal(
      models.generate_llm(p, tokens, 4, config=cfg, stop_tokens=()), plain
    )


# --- the example ----------------------------------------------------------------


@requires_safetensors
def test_the_example_generates_from_a_prompt(tmp_path, zygote):
  tied = FIXTURES / "llama_tiny_tied"
  ref = reference("llama_tiny_tied")
  example = ref["tokenizer_example"]
  cmd = [sys.executable, str(REPO / "examples" / "llm_generate.py"), str(tied), "--policy"]
  proc = run_script(
    [*cmd, "dense", "--store", str(tmp_path / "store"), "--prompt", example["text"], "-n", "6"],
    zygote,
    env=user_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=240,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"prompt ids: {example['ids']}" in proc.stdout
  assert "tokens/s" in proc.stdout
  want = models.generate_llm(models.load_llama(tied), example["ids"], 6)
  assert f"generated ids: {np.asarray(want)[0].tolist()}" in proc.stdout
  # the store it wrote as the draft (models.draft_from): the same greedy tokens
  drafted = [*cmd, "dense", "--store", str(tmp_path / "store"), "--prompt", example["text"]]
  drafted += ["-n", "6", "--draft", str(tmp_path / "store"), "--draft-tokens", "2"]
  proc = run_script(
    drafted, zygote, env=user_env(tmp_path), capture_output=True, text=True, timeout=240, cwd=REPO
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert "KV cache" in proc.stdout and "proposals accepted" in proc.stdout
  assert f"generated ids: {np.asarray(want)[0].tolist()}" in proc.stdout
