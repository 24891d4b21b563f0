"""Hugging Face checkpoints to unit stores (docs/checkpoints.md): the bounded reader, lazy saves,
``convert_hf`` against ``jr.save``, ``models.load`` and ``jax-residency convert hf``.

The conversions read the committed Llama-family fixtures (``tests/fixtures``, made by
``scripts/make_llama_reference.py``); no torch. The bound on memory at real sizes is
measured by ``benchmarks/convert.py`` (a 2+ GiB checkpoint), not here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
from test_llama import NAMES as LLAMA  # every Llama-family fixture, mixtures of experts too

import jax_residency as jr
from jax_residency._src.models import hf_convert as conv
from jax_residency._src.models.safetensors_files import SafetensorsFiles
from jax_residency._src.store import writer as wr
from jax_residency._src.store.unit_store import UnitStore

FIXTURES = Path(__file__).parent / "fixtures"

pytestmark = pytest.mark.skipif(
  importlib.util.find_spec("safetensors") is None, reason="needs safetensors"
)


def _fixture(name: str) -> Path:
  path = FIXTURES / name
  if not (path / "config.json").is_file():
    pytest.skip(f"fixture {name} not present")
  return path


# --- the reader --------------------------------------------------------------------------


def test_reader_reads_whole_tensors_and_row_ranges_of_a_sharded_checkpoint(tmp_path):
  from safetensors.numpy import save_file

  a = np.arange(24, dtype=np.float32).reshape(6, 4)
  b = np.arange(10, dtype=np.int64)
  save_file({"a": a}, str(tmp_path / "model-00001-of-00002.safetensors"))
  save_file({"b": b}, str(tmp_path / "model-00002-of-00002.safetensors"))
  index = {
    "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
  }
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
  files = SafetensorsFiles(tmp_path)
  np.testing.assert_array_equal(files.read("a"), a)
  np.testing.assert_array_equal(files.read("b"), b)
  np.testing.assert_array_equal(files.read("a", slice(2, 5)), a[2:5])
  with pytest.raises(KeyError, match="'c'"):
    files.read("c")


def test_reader_names_a_missing_shard_and_a_truncated_file(tmp_path):
  from safetensors.numpy import save_file

  save_file({"a": np.ones((64, 64), np.float32)}, str(tmp_path / "model.safetensors"))
  index = {"weight_map": {"a": "model-00001-of-00001.safetensors"}}
  sharded = tmp_path / "sharded"
  sharded.mkdir()
  (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(FileNotFoundError, match="model-00001-of-00001.safetensors"):
    SafetensorsFiles(sharded)
  data = (tmp_path / "model.safetensors").read_bytes()
  (tmp_path / "model.safetensors").write_bytes(data[: len(data) - 100])
  with pytest.raises(OSError, match="truncated"):
    SafetensorsFiles(tmp_path).read("a")
  with pytest.raises(FileNotFoundError, match="no safetensors checkpoint"):
    SafetensorsFiles(tmp_path / "nowhere")


# --- lazy arrays in save_store -----------------------------------------------------------


class Lazy:
  """A static array read only when written, in the chunks it asks for."""

  def __init__(self, value: np.ndarray, chunk: tuple[int, ...]) -> None:
    self.value, self.shape, self.dtype, self.ndim = value, value.shape, value.dtype, value.ndim
    self.chunk_shape = chunk
    self.reads: list[tuple[int, ...]] = []

  def __array__(self, dtype=None, copy=None):
    self.reads.append(self.shape)
    return self.value

  def __getitem__(self, region):
    out = self.value[region]
    self.reads.append(out.shape)
    return out


def test_save_store_writes_a_lazy_static_array_chunk_by_chunk(tmp_path):
  embed = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
  lazy = Lazy(embed, (16, 6))
  path = str(tmp_path / "s")
  units = {("w",): np.ones((2, 3), np.float32)}
  wr.save_store(path, static={("embed",): lazy}, units=units, unit_prefix=("layers",))
  assert lazy.reads == [(16, 6), (16, 6), (8, 6)]  # never the whole tensor at once
  with UnitStore.open(path) as store:
    np.testing.assert_array_equal(store.read_static_tensor(("embed",)), embed)


# --- convert_hf -----------------------------------------------------------------------------


def _same_store(a: str, b: str) -> None:
  with UnitStore.open(a) as sa, UnitStore.open(b) as sb:
    assert [(s.prefix, s.count) for s in sa.stacks] == [(s.prefix, s.count) for s in sb.stacks]
    assert sa.static_specs == sb.static_specs and sa.unit_specs == sb.unit_specs
    for path, x in sa.read_static().items():
      np.testing.assert_array_equal(x, sb.read_static_tensor(path))
    for (i, x), (j, y) in zip(
      sa.read_units(range(sa.unit_count)), sb.read_units(range(sb.unit_count)), strict=True
    ):
      assert i == j
      for k in x:
        np.testing.assert_array_equal(x[k], y[k])


@pytest.mark.parametrize("name", LLAMA)
def test_convert_matches_save_of_the_loaded_model(name, tmp_path):
  from jax_residency import models

  src = _fixture(name)
  converted = str(tmp_path / "converted")
  info = models.convert_hf(src, converted, progress=False)
  saved = str(tmp_path / "saved")
  jr.save(models.load_llama(src), saved, progress=False)
  _same_store(converted, saved)
  assert [s.prefix for s in info.stacks] == [("layers",)]
  assert json.loads((Path(converted) / conv.HF_CONFIG_FILE).read_text()) == json.loads(
    (src / "config.json").read_text()
  )


def test_large_static_tensors_are_converted_in_chunks(tmp_path, monkeypatch):
  from jax_residency import models

  src = _fixture("llama_tiny_untied")
  monkeypatch.setattr(conv, "STATIC_CHUNK_BYTES", 1024)  # the embedding and head: many chunks
  reads: list[tuple[str, slice | None]] = []
  real = SafetensorsFiles.read

  def spy(self, name, rows=None):
    reads.append((name, rows))
    return real(self, name, rows)

  monkeypatch.setattr(SafetensorsFiles, "read", spy)
  converted = str(tmp_path / "converted")
  models.convert_hf(src, converted, progress=False)
  embed = [rows for name, rows in reads if name == "model.embed_tokens.weight"]
  assert len(embed) > 1 and all(rows is not None for rows in embed)
  saved = str(tmp_path / "saved")
  jr.save(models.load_llama(src), saved, progress=False)
  _same_store(converted, saved)


def test_a_converted_store_loads_abstract_and_places_under_every_policy(tmp_path):
  import jax.numpy as jnp

  from jax_residency import models

  src = _fixture("llama_tiny_tied")
  store = str(tmp_path / "store")
  models.convert_hf(src, store, progress=False)
  plain = models.load_llama(src)
  abstract = models.load(store)
  tokens = jnp.asarray(json.loads((src / "reference.json").read_text())["input_ids"], jnp.int32)
  want = np.asarray(plain(tokens))
  for policy in (jr.FullyResident(), jr.DenseDiskStream(host_budget_bytes=0)):
    with jr.place(abstract, policy, store=store) as placed:
      got = np.asarray(placed(tokens))
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_convert_refuses_what_it_cannot_convert_and_writes_nothing(tmp_path):
  from jax_residency import models

  src = _fixture("llama_tiny_tied")
  bad = tmp_path / "bad"
  bad.mkdir()
  config = json.loads((src / "config.json").read_text())
  (bad / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(jr.errors.ModelConfigError, match="GPT2LMHeadModel"):
    models.convert_hf(bad, str(tmp_path / "out"), progress=False)
  (bad / "config.json").write_text(json.dumps(config))
  for f in os.listdir(src):  # every shard but the last: a layer's tensors are missing
    if f.endswith(".safetensors") or f.endswith(".json") and f != "config.json":
      (bad / f).write_bytes((src / f).read_bytes())
  index = json.loads((bad / "model.safetensors.index.json").read_text())
  dropped = sorted(k for k in index["weight_map"] if ".layers.1." in k)
  index["weight_map"] = {k: v for k, v in index["weight_map"].items() if k not in dropped}
  files = SafetensorsFiles(bad)
  assert all(k in files.entries for k in dropped)  # the tensors are there, the map drops none
  from safetensors.numpy import load_file, save_file

  for shard in sorted({v for v in index["weight_map"].values()}):
    tensors = {k: v for k, v in load_file(str(bad / shard)).items() if k not in dropped}
    save_file(tensors, str(bad / shard))
  (bad / "model.safetensors.index.json").write_text(json.dumps(index))
  with pytest.raises(jr.StoreError, match=r"model\.layers\.1\..*missing"):
    models.convert_hf(bad, str(tmp_path / "out"), progress=False)
  assert not (tmp_path / "out").exists()


def test_cli_convert_hf(tmp_path, capfd):
  from jax_residency._src.cli import main as cli

  src = _fixture("qwen2_tiny")
  dst = str(tmp_path / "store")
  assert cli.main(["convert", "hf", str(src), dst]) == 0
  out = capfd.readouterr().out
  assert "units under 'layers'" in out
  assert cli.main(["verify", dst]) == 0
  assert cli.main(["convert", "hf", str(tmp_path / "nowhere"), dst]) == 2


def test_plan_from_a_config_json_needs_no_weights(tmp_path, capfd):
  """``jax-residency plan config.json`` plans from the model's sizes: an 8B Llama in
  bfloat16 against a 16 GiB accelerator (as the notebook does), and a fixture's
  config planned as its converted store is."""
  from jax_residency import models
  from jax_residency._src.cli import main as cli

  src = _fixture("llama_tiny_untied")
  assert cli.main(["plan", str(src / "config.json"), "--json", "--platform", "cpu"]) == 0
  from_config = json.loads(capfd.readouterr().out)
  store = str(tmp_path / "store")
  models.convert_hf(src, store, progress=False)
  assert cli.main(["plan", store, "--json", "--platform", "cpu"]) == 0
  from_store = json.loads(capfd.readouterr().out)
  for key in ("units", "unit_bytes", "static_bytes"):
    assert from_config[key] == from_store[key], key
  config = json.loads((src / "config.json").read_text())
  big = {**config, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32}
  big |= {"num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128}
  big |= {"vocab_size": 128256, "tie_word_embeddings": False}
  path = tmp_path / "config.json"
  path.write_text(json.dumps(big))
  argv = ["plan", str(path), "--dtype", "bfloat16", "--device-budget", "14GiB", "--json"]
  assert cli.main([*argv, "--platform", "gpu"]) == 0
  plan = json.loads(capfd.readouterr().out)
  assert plan["units"] == 32 and plan["unit_bytes"] == 2 * (
    2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
  )
  fits = {p["policy"]: p["fits"] for p in plan["plans"]}
  assert fits == {"fully_resident": False, "layerwise_host": True, "dense_disk_stream": True}
