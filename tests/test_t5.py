"""T5 against Hugging Face ``T5ForConditionalGeneration``, and under every policy.

The references (``tests/fixtures/t5_tiny_relu`` and ``t5_tiny_gated``: a tiny
random checkpoint each, with ``reference.json``) were written by
``scripts/make_t5_reference.py`` with torch and transformers; these tests need
neither, only ``safetensors`` to read the checkpoints. The two configs differ
on purpose: ReLU with the head tied to the embedding (and scaled), and gated
GELU with its own head; 2 encoder and 3 decoder layers; 4 heads of 12 (inner
width 48, not d_model 32).

Placement: both stacks (``encoder_layers`` and ``decoder_layers``, which
``T5`` declares) under FullyResident, LayerwiseHost and DenseDiskStream, on one
device and on an 8-device mesh; on CPU the dense stream runs a step per layer and
matches the plain model run eagerly bit for bit, and FullyResident and LayerwiseHost
run one program and match the plain model under ``jax.jit`` bit for bit
(docs/parity.md). The prefill runs both stacks, each
decode step only the decoder's; the reports say so per stack. A placement of
one stack alone warns that the other stays on the device.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import models, testing
from jax_residency._src.models.decoding import jitted_plain as _jitted_plain
from jax_residency._src.models.t5 import relative_position_bucket

FIXTURES = Path(__file__).parent / "fixtures"
CONFIGS = ("t5_tiny_relu", "t5_tiny_gated")
#: Bound on |logits - reference| (measured: 1.9e-7 relu, 1.9e-6 gated; the gated
#: reference itself is 1.8e-6 from its float64 value).
MAX_ABS_DIFF = 1e-5

requires_safetensors = pytest.mark.skipif(
  importlib.util.find_spec("safetensors") is None,
  reason="the T5 checkpoints are safetensors files: pip install safetensors",
)


def reference(name: str) -> dict[str, Any]:
  return json.loads((FIXTURES / name / "reference.json").read_text())


def ids(ref: dict[str, Any], key: str) -> jax.Array:
  return jnp.asarray(ref[key], jnp.int32)


class CountingT5(models.T5):
  """Counts the traces (or eager runs) of the encoder."""

  encodes = 0

  def encode(self, *args: Any, **kwargs: Any) -> Any:
    type(self).encodes += 1
    return super().encode(*args, **kwargs)


def load(name: str) -> CountingT5:
  """The checkpoint as a :class:`CountingT5` (one model class: compiled programs are shared)."""
  plain = models.load_t5(FIXTURES / name)
  abstract = nnx.eval_shape(lambda: CountingT5(plain.config, rngs=nnx.Rngs(0)))
  return nnx.merge(nnx.graphdef(abstract), nnx.state(plain))


@pytest.fixture(scope="module")
def checkpoints() -> dict[str, tuple[CountingT5, dict[str, Any]]]:
  if importlib.util.find_spec("safetensors") is None:
    pytest.skip("needs safetensors")
  return {name: (load(name), reference(name)) for name in CONFIGS}


@pytest.fixture(params=CONFIGS)
def loaded(request: pytest.FixtureRequest, checkpoints) -> tuple[CountingT5, dict[str, Any]]:
  return checkpoints[request.param]


@pytest.fixture(scope="module")
def gated(checkpoints) -> tuple[CountingT5, dict[str, Any]]:
  """The gated model; the placement tests use it."""
  return checkpoints["t5_tiny_gated"]


# --- config ---------------------------------------------------------------------


@requires_safetensors
def test_configs_of_the_fixtures():
  relu = models.read_t5_config(FIXTURES / "t5_tiny_relu")
  assert (relu.feed_forward_proj, relu.tie_word_embeddings, relu.scales_output) == (
    "relu",
    True,
    True,
  )
  assert (relu.num_layers, relu.num_decoder_layers, relu.d_kv, relu.num_heads) == (2, 3, 12, 4)
  gated = models.read_t5_config(FIXTURES / "t5_tiny_gated")
  assert gated.gated and not gated.tie_word_embeddings and not gated.scales_output


def test_config_reads_both_forms_of_the_head():
  """transformers 5 writes tie_word_embeddings: true for every T5, with scale_decoder_outputs."""
  v5 = models.T5Config.from_hf({"tie_word_embeddings": True, "scale_decoder_outputs": False})
  assert v5.tie_word_embeddings and not v5.scales_output
  assert models.T5Config.from_hf({}).scales_output  # T5's default: tied and scaled
  hub = models.T5Config.from_hf({"tie_word_embeddings": False, "num_layers": 4})
  assert not hub.scales_output and hub.num_decoder_layers == 4
  start = models.T5Config.from_hf({"pad_token_id": 3, "eos_token_id": [2]})
  assert (start.decoder_start_token_id, start.eos_token_id) == (3, 2)


@pytest.mark.parametrize(
  ("field", "value"),
  [
    ("feed_forward_proj", "gated-silu"),
    ("model_type", "umt5"),
    ("is_encoder_decoder", False),
    ("eos_token_id", [1, 2]),
    ("relative_attention_num_buckets", 2),
  ],
)
def test_unsupported_config_fields_are_refused_by_name(field, value):
  with pytest.raises(jr.errors.ModelConfigError, match=re.escape(f"{field}={value!r}")) as e:
    models.T5Config.from_hf({field: value})
  assert isinstance(e.value, ValueError)


def test_relative_position_buckets_match_transformers():
  for key, table in reference("t5_tiny_relu")["buckets"].items():
    buckets, distance, kind = key.split("/")
    got = relative_position_bucket(
      np.arange(-300, 301),
      bidirectional=kind == "bidirectional",
      num_buckets=int(buckets),
      max_distance=int(distance),
    )
    assert got.tolist() == table, key


# --- the checkpoint -------------------------------------------------------------


@requires_safetensors
def test_loader_names_missing_unexpected_and_misshapen_tensors():
  path = FIXTURES / "t5_tiny_gated"
  cfg, tensors = models.read_t5_config(path), models.read_safetensors(path)
  cut = {
    k: v for k, v in tensors.items() if k != "decoder.block.2.layer.1.EncDecAttention.k.weight"
  }
  with pytest.raises(jr.errors.MissingCheckpointParametersError, match=r"block\.2\.layer\.1\."):
    models.t5_params_from_hf(cut, cfg)
  extra = {**tensors, "decoder.block.1.layer.2.DenseReluDense.wi.weight": np.zeros((64, 32))}
  with pytest.raises(jr.errors.UnexpectedCheckpointParametersError, match="DenseReluDense.wi.w"):
    models.t5_params_from_hf(extra, cfg)
  assert models.t5_params_from_hf(extra, cfg, strict=False).keys() == (
    models.t5_params_from_hf(tensors, cfg).keys()
  )
  wide = models.T5Config.from_hf({**json.loads((path / "config.json").read_text()), "d_ff": 65})
  with pytest.raises(jr.errors.CheckpointShapeMismatchError, match="wi_0"):
    models.t5_params_from_hf(tensors, wide)


@requires_safetensors
def test_a_sharded_checkpoint_loads_the_same_weights(tmp_path):
  from safetensors.numpy import save_file

  src = FIXTURES / "t5_tiny_relu"
  tensors = models.read_safetensors(src)
  names = sorted(tensors)
  weight_map = {}
  for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
    shard = f"model-0000{i + 1}-of-00002.safetensors"
    save_file({k: tensors[k] for k in part}, str(tmp_path / shard))
    weight_map.update(dict.fromkeys(part, shard))
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  (tmp_path / "config.json").write_bytes((src / "config.json").read_bytes())
  got = jax.tree.leaves(nnx.state(models.load_t5(tmp_path)))
  want = jax.tree.leaves(nnx.state(models.load_t5(src)))
  assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))


# --- against transformers -------------------------------------------------------


def test_logits_match_the_reference(loaded):
  model, ref = loaded
  dec = ids(ref, "decoder_input_ids")
  logits = _jitted_plain(model, ids(ref, "input_ids"), dec, ids(ref, "attention_mask"))
  want = np.asarray(ref["logits"], np.float32).reshape(*dec.shape, -1)
  assert logits.shape == want.shape
  assert float(np.abs(np.asarray(logits) - want).max()) <= MAX_ABS_DIFF


def test_greedy_tokens_match_the_reference(loaded):
  model, ref = loaded
  source, mask, n = ref["generate_input_ids"], ref["generate_attention_mask"], ref["max_new_tokens"]
  np.testing.assert_array_equal(models.generate_t5(model, source, n, mask), ref["greedy"])
  # A stop token ends rows at different steps; the rest of a row is padding.
  stopped = models.generate_t5(model, source, n, mask, eos_token_id=ref["stop_token_id"])
  np.testing.assert_array_equal(stopped, ref["greedy_stopping_at_stop_token"])


def test_generation_encodes_once_and_steps_the_cache(gated):
  model, ref = gated
  source, mask, n = ref["generate_input_ids"], ref["generate_attention_mask"], ref["max_new_tokens"]
  calls: list[bool] = []

  def forward(*args: Any) -> Any:
    calls.append(args[0] is not None)  # input_ids given: the encoder runs
    return _jitted_plain(model, *args)

  CountingT5.encodes = 0
  tokens = models.generate_t5(forward, source, n, mask, config=model.config)
  np.testing.assert_array_equal(tokens, ref["greedy"])
  assert calls == [True] + [False] * (n - 1)
  assert CountingT5.encodes <= 1  # one trace of the prefill (none if already compiled)


# --- placement ------------------------------------------------------------------


def policy(name: str, unit: int) -> jr.LayerWeightResidency:
  match name:
    case "fully-resident":
      return jr.FullyResident()
    case "layerwise-host":
      return jr.LayerwiseHost(prefetch_depth=2)
    case "dense":  # a host cache of one unit: every pass reads every unit from disk
      return jr.DenseDiskStream(host_budget_bytes=unit, host_lookahead=1)
  raise AssertionError(name)


POLICIES = ["fully-resident", "layerwise-host", "dense"]


@pytest.fixture(scope="module")
def store(gated, saved_store) -> jr.StoreInfo:
  """Both stacks in one store (the ones ``T5`` declares)."""
  model, _ = gated
  return saved_store("t5_tiny_gated", model)


def placed(model: CountingT5, name: str, store: jr.StoreInfo, **kw: Any):
  dense = name == "dense"
  return jr.place(model, policy(name, store.unit_nbytes), store=store.path if dense else None, **kw)


@pytest.fixture(scope="module")
def prefill_args(gated) -> tuple[Any, ...]:
  """A prefill exactly as ``generate_t5`` runs it (the same compiled program)."""
  model, ref = gated
  source = ids(ref, "generate_input_ids")
  cache = models.T5Cache.zeros(model.config, *source.shape, max_len=ref["max_new_tokens"])
  start = jnp.zeros((source.shape[0], 1), jnp.int32)
  return source, start, ids(ref, "generate_attention_mask"), cache, 0


@pytest.fixture(scope="module")
def plain_prefill(gated, prefill_args) -> Callable[[str], Any]:
  """``plain_prefill(policy name)``: the plain model's prefill (logits, cache) that policy
  gives on CPU: eager for a dense stream's per-layer steps, jitted for the one program of
  the others."""
  model, _ = gated
  refs: dict[bool, Any] = {}

  def get(name: str) -> Any:
    eager = name == "dense"
    if eager not in refs:
      refs[eager] = model(*prefill_args) if eager else _jitted_plain(model, *prefill_args)
    return refs[eager]

  return get


def assert_same_prefill(got: Any, want: Any) -> None:
  (logits, cache), (want_logits, want_cache) = got, want
  np.testing.assert_array_equal(logits, want_logits)
  for a, b in zip(cache, want_cache, strict=True):
    np.testing.assert_array_equal(a, b)


def mesh_of(devices: int) -> jax.sharding.Mesh:
  shape = (2, 4) if devices == 8 else (1, 1)
  return jax.sharding.Mesh(np.array(jax.devices()[:devices]).reshape(shape), ("data", "model"))


@pytest.mark.parametrize("devices", [1, 8])
@pytest.mark.parametrize("name", POLICIES)
def test_both_stacks_placed_generate_the_same_tokens(
  name, devices, gated, store, prefill_args, plain_prefill
):
  model, ref = gated
  source, mask, n = ref["generate_input_ids"], ref["generate_attention_mask"], ref["max_new_tokens"]
  CountingT5.encodes = 0
  with placed(model, name, store, mesh=mesh_of(devices)) as p:
    assert p.stacks == ("encoder_layers", "decoder_layers") and p.unit_count == 5
    assert p.metadata.unplaced_stacks == ()
    tokens = models.generate_t5(p, source, n, mask, config=model.config)
    report = p.report()
    again = p(*prefill_args)  # the prefill again, as generate ran it
  np.testing.assert_array_equal(tokens, ref["greedy"])
  assert report.prefill.passes == 1 and report.decode.passes == n - 1
  assert CountingT5.encodes == 1  # the prefill's one trace; decode steps never encode
  prefill, *steps = report.passes
  assert {k: v.units_run for k, v in prefill.stacks.items()} == {
    "encoder_layers": 2,
    "decoder_layers": 3,
  }
  for step in steps:  # decode steps run the decoder stack only
    assert step.stacks["encoder_layers"].units_run == 0
    assert step.stacks["decoder_layers"].units_run == 3
  enc, dec = store.stacks
  if name == "dense":  # one unit fits the host cache: each pass reads all it runs
    assert report.total.bytes_read == 2 * enc.unit_nbytes + n * 3 * dec.unit_nbytes
  if name == "layerwise-host":
    assert prefill.stacks["encoder_layers"].bytes_moved == 2 * enc.unit_nbytes
    assert steps[0].stacks["decoder_layers"].bytes_moved == 3 * dec.unit_nbytes
  assert_same_prefill(again, plain_prefill(name))


@pytest.mark.parametrize("name", POLICIES)
def test_one_stack_alone_warns_that_the_other_stays_on_the_device(
  name, gated, store, tmp_path, prefill_args, plain_prefill
):
  model, _ = gated
  dense = name == "dense"
  path = str(tmp_path / "decoder") if dense else None
  if path:
    jr.save(model, path, units="decoder_layers", progress=False)
  kind = policy(name, store.unit_nbytes)
  with jr.place(model, kind, units="decoder_layers", store=path) as p:
    with pytest.warns(UserWarning, match="'encoder_layers'"):
      got = p(*prefill_args)
    assert p.metadata.unplaced_stacks == ("encoder_layers",)
    assert tuple(p.report().metadata["unplaced_stacks"]) == ("encoder_layers",)
    # The encoder's weights are static: on the device (as every static array is).
    assert "encoder_layers.attention.q.kernel" in p.arrays()
    testing.assert_memory_kinds(p)
  assert_same_prefill(got, plain_prefill(name))


def test_an_encoder_only_placement_cannot_generate(gated):
  model, ref = gated
  with jr.place(model, jr.FullyResident(), units="encoder_layers") as p:
    with (
      pytest.warns(UserWarning, match="'decoder_layers'"),
      pytest.raises(jr.errors.PlacementError, match="encoder_layers"),
    ):
      models.generate_t5(p, ref["generate_input_ids"], 2, config=model.config)
