"""GGUF files to quantized unit stores (``models.convert_gguf``) against transformers.

The fixtures (``tests/fixtures/gguf_tiny_untied``, ``gguf_tiny_tied``: a tiny
random Llama GGUF file each, with ``reference.json``) were written by
``scripts/make_gguf_reference.py``, which loaded them with transformers
(``from_pretrained(dir, gguf_file=...)``, float32, eager attention): logits of a
prompt, 8 greedy tokens and the tokenizer's ids of 20 strings. Together their
tensors cover every GGML type the library decodes (F32, F16, BF16, Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; checked below), a tied and an
untied head, and both tokenizer models
(byte-level BPE, ``gpt2``; SentencePiece-style, ``llama``). The tests need
neither torch nor transformers, only ``gguf`` (the test extra).

Each converted store is placed under FullyResident, LayerwiseHost and
DenseDiskStream(host_budget_bytes=0). Logits are held to `MAX_ABS_DIFF`, an
absolute bound (max |logit| is 3.0 and 4.5; transformers' own float32 logits are
2.6e-6 and 2.5e-5 from its float64 ones). Measured: 5.4e-6 untied, 2.5e-5 tied. Each
fixture has a tensor name with two types across its layers (untied: attn_v Q5_0 and
Q6_K, ffn_down Q6_K and Q4_K as llama.cpp's Q4_K_M writes it; tied: attn_k IQ4_NL and
Q5_K, through the Q/K un-permutation).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import gguf  # the test extras install it
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from user_env import run_script, user_env

import jax_residency as jr
from jax_residency import models
from jax_residency._src.cli import main as cli
from jax_residency._src.models import gguf_convert
from jax_residency._src.models.gguf_convert import permute_rows, unpermute_rows
from jax_residency._src.models.gguf_reference import dequantized_model
from jax_residency._src.quant import ggml, native
from jax_residency._src.store.unit_store import UnitStore

REPO = Path(__file__).resolve().parents[1]
FIXTURES = REPO / "tests" / "fixtures"
NAMES = ("gguf_tiny_untied", "gguf_tiny_tied")
#: Bound on |logits - transformers'| (absolute) at every position of the prompt.
MAX_ABS_DIFF = 1e-4
POLICIES = {
  "fully_resident": jr.FullyResident,
  "layerwise_host": jr.LayerwiseHost,
  "dense_direct": lambda: jr.DenseDiskStream(host_budget_bytes=0),
}


def reference(name: str) -> dict[str, Any]:
  return json.loads((FIXTURES / name / "reference.json").read_text(encoding="utf-8"))


def gguf_file(name: str) -> Path:
  return FIXTURES / name / "model.gguf"


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[str, Any]:
  """Each fixture converted once: name -> (store path, StoreInfo)."""
  out = {}
  for name in NAMES:
    path = str(tmp_path_factory.mktemp(name) / "store")
    out[name] = (path, models.convert_gguf(gguf_file(name), path, progress=False))
  return out


@pytest.fixture(scope="module")
def stores(converted) -> dict[str, str]:
  return {name: path for name, (path, _) in converted.items()}


# --- against transformers ---------------------------------------------------------


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("name", NAMES)
def test_logits_and_greedy_tokens_match_transformers(name, policy, stores, converted):
  ref = reference(name)
  model = models.load(stores[name])
  ids = jnp.asarray([ref["input_ids"]], jnp.int32)
  with jr.place(model, POLICIES[policy](), store=stores[name]) as placed:
    logits = np.asarray(placed(ids))[0]
    tokens = models.generate_llm(placed, ids, ref["max_new_tokens"], config=model.config)
    decode_temps = placed.report().decode.step_temp_bytes
  want = np.asarray(ref["logits"], np.float32)
  assert float(np.abs(logits - want).max()) <= MAX_ABS_DIFF
  np.testing.assert_array_equal(np.asarray(tokens)[0], ref["greedy"])
  if policy == "dense_direct":  # one-token steps decode every type inside its product:
    # their temporaries hold less than the smallest of the unit's matrices decoded
    unit = [t for t in converted[name][1].quantization.tensors if t.path[0] == "layers"]
    smallest = min(4 * int(np.prod(t.shape[-2:])) for t in unit)
    assert 0 < decode_temps < smallest, (decode_temps, smallest)


@pytest.mark.parametrize("name", NAMES)
def test_a_one_token_step_multiplies_by_the_native_kernel(name, converted):
  """On one CPU device, a one-token step multiplies by every GGUF matrix (every type,
  mixed stacks too; `quant.native.GGML_TYPES`) with the native kernel, once a step each:
  the head too, and the tied fixture's embedding where it is the head; a prefill uses
  XLA's products (the logits are checked against transformers above)."""
  if not native.available():
    pytest.skip(f"no native kernels here: {native.build_error()}")
  assert set(native.GGML_TYPES) == {t.name for t in ggml.GGML_TYPES}
  path, info = converted[name]
  tied = reference(name)["tied_lm_head"]
  products = [t for t in info.quantization.tensors if tied or t.path[-1] != "embedding"]
  assert any(len(t.encoding.ggml_types) > 1 for t in products)  # a mixed stack among them
  with jr.place(models.load(path), jr.FullyResident(), store=path) as placed:
    one = placed.lower(jnp.zeros((1, 1), jnp.int32)).compile().as_text()
    many = placed.lower(jnp.zeros((1, 5), jnp.int32)).compile().as_text()
  assert one.count('custom_call_target="jax_residency_ggml_matvec"') == len(products)
  assert "jax_residency_ggml_matvec" not in many


def test_the_fixtures_hold_every_supported_type():
  """So the comparison with transformers above reaches every type the converter keeps."""
  used = {t for name in NAMES for t in reference(name)["tensor_types"].values()}
  assert used == {t.name for t in ggml.GGML_TYPES}


@pytest.mark.parametrize("name", NAMES)
def test_the_store_keeps_every_matrix_in_its_ggml_type(name, converted):
  ref = reference(name)
  path, info = converted[name]
  plan = info.quantization
  assert plan is not None and plan.quantization.scheme == "gguf"
  types = {t.path: t.encoding.ggml_type for t in plan.tensors}
  file_types = ref["tensor_types"]

  def stacked(role: str) -> str:  # the layers' types, in GGML id order, joined by "+"
    found = {file_types[f"blk.{i}.{role}.weight"] for i in range(2)}
    return "+".join(sorted(found, key=lambda t: ggml.ggml_type(t).type_id))

  config = json.loads((Path(path) / "hf_config.json").read_text())
  for rel, spec in gguf_convert.gguf_tensor_map(config)[1].items():
    if rel[-1] == "kernel":
      assert types[("layers", *rel)] == stacked(spec.name.split(".")[2]), rel
  mixed = [t for t in plan.tensors if "+" in t.encoding.ggml_type]
  assert len(mixed) == (2 if name == "gguf_tiny_untied" else 1)  # as the script wrote
  with UnitStore.open(path) as opened:  # rows padded to the widest type's, then the
    for t in mixed:  # index of their own type
      blocks = opened.read_array((*t.path, "blocks"))
      widest = max(ggml.row_bytes(x, t.shape[-2]) for x in t.encoding.ggml_types)
      assert blocks.shape == (2, t.shape[-1], widest + 1)
      role = gguf_convert.gguf_tensor_map(config)[1][t.path[1:]].name
      for i in range(2):
        own = t.encoding.ggml_types.index(file_types[role.format(i=i)])
        assert (blocks[i, :, -1] == own).all()
  assert types[("embed_tokens", "embedding")] == file_types["token_embd.weight"]
  assert (("lm_head", "kernel") in types) == ("output.weight" in file_types)
  assert not any(p[-1] == "scale" for p in types)  # norms are floats
  assert all(t.encoding.dtype == "float32" for t in plan.tensors)
  assert plan.stored_nbytes < plan.float_nbytes
  assert config["tie_word_embeddings"] == ref["tied_lm_head"]
  assert config["vocab_size"] == ref["vocab_size"]
  assert config["eos_token_id"] == ref["eos_token_id"]


@pytest.mark.parametrize("name", NAMES)
def test_the_carried_tokenizer_matches_transformers(name, stores):
  from tokenizers import Tokenizer

  ref = reference(name)
  tok = Tokenizer.from_file(str(Path(stores[name]) / "tokenizer.json"))
  assert len(ref["tokenizer_cases"]) == 20
  for case in ref["tokenizer_cases"]:
    assert tok.encode(case["text"]).ids == case["ids"], case["text"]
  assert tok.encode(ref["prompt"]).ids == ref["input_ids"]


# --- the Q/K permutation ----------------------------------------------------------


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permutation(heads):
  head_dim, half = 8, 4
  rng = np.random.default_rng(heads)
  rows = rng.integers(0, 256, (heads * head_dim, 34), dtype=np.uint8)  # rows of Q8_0 blocks
  np.testing.assert_array_equal(unpermute_rows(permute_rows(rows, heads), heads), rows)
  np.testing.assert_array_equal(permute_rows(unpermute_rows(rows, heads), heads), rows)
  # llama.cpp moves row a * half + j of head h (a: which half) to row 2j + a.
  permuted = permute_rows(rows, heads)
  for h in range(heads):
    for a in range(2):
      for j in range(half):
        np.testing.assert_array_equal(
          permuted[h * head_dim + 2 * j + a], rows[h * head_dim + a * half + j]
        )


def test_skipping_the_unpermutation_breaks_parity(tmp_path, monkeypatch):
  """Only the un-permutation of attn_q / attn_k separates the converted model from
  transformers': without it the logits are far off."""
  name = "gguf_tiny_untied"
  ref = reference(name)
  monkeypatch.setattr(gguf_convert, "unpermute_rows", lambda rows, heads: np.array(rows))
  store = str(tmp_path / "store")
  models.convert_gguf(gguf_file(name), store, progress=False)
  ids = jnp.asarray([ref["input_ids"]], jnp.int32)
  with jr.place(models.load(store), jr.FullyResident(), store=store) as placed:
    logits = np.asarray(placed(ids))[0]
  assert float(np.abs(logits - np.asarray(ref["logits"], np.float32)).max()) > 100 * MAX_ABS_DIFF


# --- bad input --------------------------------------------------------------------

SMALL = dict(hidden=64, ff=64, heads=2, kv_heads=1, vocab=40, layers=2)


def write_small_gguf(path: Path, *, arch: str = "llama", types: dict[str, Q] | None = None):
  """A small valid Llama GGUF file (F32 tensors, no tokenizer), some tensors of other
  ``types`` (by name)."""
  types = types or {}
  h, f, v = SMALL["hidden"], SMALL["ff"], SMALL["vocab"]
  kv = SMALL["kv_heads"] * h // SMALL["heads"]
  writer = gguf.GGUFWriter(str(path), arch)
  for key, value in (
    ("block_count", SMALL["layers"]),
    ("embedding_length", h),
    ("feed_forward_length", f),
    ("attention.head_count", SMALL["heads"]),
    ("attention.head_count_kv", SMALL["kv_heads"]),
  ):
    writer.add_uint32(f"{arch}.{key}", value)
  writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
  rng = np.random.default_rng(0)
  shapes = {"token_embd.weight": (v, h), "output_norm.weight": (h,), "output.weight": (v, h)}
  layer = dict(attn_q=(h, h), attn_k=(kv, h), attn_v=(kv, h), attn_output=(h, h))
  layer |= dict(ffn_gate=(f, h), ffn_up=(f, h), ffn_down=(h, f), attn_norm=(h,), ffn_norm=(h,))
  for i in range(SMALL["layers"]):
    shapes |= {f"blk.{i}.{n}.weight": s for n, s in layer.items()}
  for name, shape in shapes.items():
    values = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    qtype = types.get(name, Q.F32)
    data = gguf.quants.quantize(values, qtype)
    writer.add_tensor(name, data, raw_dtype=None if qtype == Q.F32 else qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return path


def test_a_small_file_without_a_tokenizer_converts(tmp_path):
  q8 = {f"blk.{i}.ffn_up.weight": Q.Q8_0 for i in range(SMALL["layers"])}
  src = write_small_gguf(tmp_path / "small.gguf", types=q8)
  store = tmp_path / "store"
  info = models.convert_gguf(src, store, progress=False, dtype="bfloat16")
  assert not (store / "tokenizer.json").exists()
  assert {t.encoding.dtype for t in info.quantization.tensors} == {"bfloat16"}
  model = models.load(store)
  with jr.place(model, jr.FullyResident(), store=str(store)) as placed:
    logits = placed(jnp.asarray([[1, 2, 3]], jnp.int32))
  assert logits.dtype == jnp.bfloat16 and bool(jnp.isfinite(logits).all())


def test_a_file_of_mixed_types_places_as_its_dequantized_plain_model(tmp_path):
  """A tensor name with other types in some layers (llama.cpp's Q4_K_M and other mixed
  presets; here a permuted Q/K tensor among them) keeps each layer's type, and every
  policy, on one device and on the 8-device mesh, gives the logits of the plain model
  that holds gguf-py's dequantized weights (to float32 rounding: the eager model's ops
  against one compiled step), the same bits under each."""
  types = {"blk.0.attn_q.weight": Q.Q4_0, "blk.1.attn_q.weight": Q.Q5_1}
  types |= {"blk.1.ffn_down.weight": Q.Q8_0, "blk.0.attn_k.weight": Q.BF16}
  src = write_small_gguf(tmp_path / "mixed.gguf", types=types)
  store = str(tmp_path / "store")
  info = models.convert_gguf(src, store, progress=False)
  by_path = {t.path[1:]: t.encoding.ggml_type for t in info.quantization.tensors}
  assert by_path[("self_attn", "q_proj", "kernel")] == "Q4_0+Q5_1"
  assert by_path[("mlp", "down_proj", "kernel")] == "F32+Q8_0"
  assert by_path[("self_attn", "k_proj", "kernel")] == "F32+BF16"
  assert by_path[("self_attn", "v_proj", "kernel")] == "F32"
  ids = jnp.asarray([[1, 5, 9, 2, 33, 7]], jnp.int32)
  want = np.asarray(dequantized_model(src, store)(ids))
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  first = None
  for policy, on in [(p, None) for p in POLICIES] + [("dense_direct", mesh)]:
    with jr.place(models.load(store), POLICIES[policy](), store=store, mesh=on) as placed:
      got = np.asarray(placed(ids))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=policy)
    first = got if first is None else first
    np.testing.assert_array_equal(got, first, err_msg=policy)


def _refuses(src: Path, out: Path, error: type, *words: str) -> None:
  with pytest.raises(error) as caught:
    models.convert_gguf(src, out, progress=False)
  for word in (str(src), *words):
    assert word in str(caught.value), (word, str(caught.value))
  assert not out.exists()


def test_bad_files_are_refused_by_name_and_nothing_is_written(tmp_path):
  out = tmp_path / "out"
  src = gguf_file("gguf_tiny_untied")
  other = write_small_gguf(tmp_path / "gemma.gguf", arch="gemma")
  _refuses(other, out, jr.errors.ModelConfigError, "general.architecture='gemma'", "'llama'")
  whole = src.read_bytes()
  truncated = tmp_path / "truncated.gguf"
  truncated.write_bytes(whole[: len(whole) - 5000])
  _refuses(truncated, out, jr.StoreError, "truncated")
  header_only = tmp_path / "header.gguf"
  header_only.write_bytes(whole[:2000])  # cut inside the metadata
  _refuses(header_only, out, jr.StoreError, "truncated or damaged")
  magic = tmp_path / "magic.gguf"
  magic.write_bytes(b"GGML" + whole[4:])
  _refuses(magic, out, jr.StoreError, "not a GGUF file", "b'GGML'")
  mx = write_small_gguf(tmp_path / "mxfp4.gguf", types={"blk.1.attn_v.weight": Q.MXFP4})
  _refuses(mx, out, jr.errors.ModelConfigError, "blk.1.attn_v.weight: MXFP4", "Q5_K")
  with pytest.raises(FileNotFoundError):
    models.convert_gguf(tmp_path / "nowhere.gguf", out, progress=False)


# --- the command line and the example ---------------------------------------------


def test_cli_convert_gguf(tmp_path, capfd):
  src, dst = gguf_file("gguf_tiny_tied"), str(tmp_path / "store")
  assert cli.main(["convert", "gguf", str(src), dst]) == 0
  out = capfd.readouterr().out
  assert "2 units under 'layers'" in out and "GGML types" in out and "IQ4_XS" in out
  assert cli.main(["verify", dst]) == 0
  capfd.readouterr()
  assert cli.main(["convert", "gguf", str(src), str(tmp_path / "q"), "--quantize", "int8"]) == 2
  assert "unrecognized arguments: --quantize int8" in capfd.readouterr().err
  assert cli.main(["convert", "gguf", "--help"]) == 0
  page = capfd.readouterr().out  # its own help page, without hf's options
  assert "GGML types" in page and "--quantize" not in page.replace("no --quantize", "")
  assert cli.main(["convert", "gguf", str(FIXTURES / "gguf_tiny_tied"), dst + "2"]) == 2
  assert "not a file" in capfd.readouterr().err
  bad = tmp_path / "bad.gguf"
  bad.write_bytes(b"nope" + src.read_bytes()[4:100])
  assert cli.main(["convert", "gguf", str(bad), str(tmp_path / "b")]) == 2
  assert "not a GGUF file" in capfd.readouterr().err
  assert not (tmp_path / "b").exists() and not (tmp_path / "q").exists()


def test_the_example_generates_from_a_gguf_file_through_its_store(tmp_path, zygote):
  """The example takes the .gguf file itself: converted once into a store (under the
  user's cache directory) and generated from as from any converted store."""
  name = "gguf_tiny_untied"
  ref = reference(name)
  gguf_file = FIXTURES / name / "model.gguf"
  cmd = [sys.executable, str(REPO / "examples" / "llm_generate.py"), str(gguf_file)]
  proc = run_script(
    [*cmd, "--policy", "dense", "--prompt", ref["prompt"], "-n", "4"],
    zygote,
    env=user_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=240,
    cwd=REPO,
  )
  assert proc.returncode == 0, proc.stdout + proc.stderr
  assert f"prompt ids: {ref['input_ids']}" in proc.stdout
  assert f"generated ids: {ref['greedy'][:4]}" in proc.stdout
