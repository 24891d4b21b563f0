"""`models.as_store`: a model's source (a store, a Hugging Face checkpoint directory or a
GGUF file) as a store, converted once into the library's cache directory and reused; and
a GGUF file where a checkpoint directory or a store is expected is named as one, with
the fix (docs/checkpoints.md)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models import model_source
from jax_residency._src.store.unit_store import UnitStore

FIXTURES = Path(__file__).parent / "fixtures"
HF = FIXTURES / "llama_tiny_untied"
GGUF = FIXTURES / "gguf_tiny_untied" / "model.gguf"


def test_a_gguf_file_is_converted_once_into_the_cache_and_reused(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  conversions = []
  convert = model_source.convert_gguf

  def counted(*args, **kwargs):
    conversions.append(args[0])
    return convert(*args, **kwargs)

  monkeypatch.setattr(model_source, "convert_gguf", counted)
  store = models.as_store(GGUF, progress=False)
  assert store.startswith(str(tmp_path / "cache" / "stores")) and store.endswith("-gguf")
  assert models.as_store(GGUF, progress=False) == store and len(conversions) == 1
  assert models.as_store(store) == store  # a store is its own store
  gguf_model = models.load(store)  # the file's config and tokenizer came with it
  assert os.path.isfile(os.path.join(store, "tokenizer.json"))
  with UnitStore.open(store) as opened:
    assert opened.unit_count == gguf_model.config.num_hidden_layers
  with pytest.raises(Exception, match="GGML types"):  # QuantizationError
    models.as_store(GGUF, quantize="int8")


def test_a_checkpoint_directory_is_converted_with_its_quantization(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  floats = models.as_store(HF, progress=False)
  int8 = models.as_store(HF, quantize="int8", progress=False)
  assert floats != int8 and floats.endswith("-float") and int8.endswith("-int8")
  assert models.as_store(HF, store=tmp_path / "here", progress=False) == str(tmp_path / "here")
  ids = np.array([[1, 5, 9, 12]])
  want = models.generate_llm(models.load(HF), ids, 4, stop_tokens=())
  model = models.load(floats)
  with jr.place(model, jr.FullyResident(), store=floats) as placed:
    got = models.generate_llm(placed, ids, 4, config=model.config, stop_tokens=())
  np.testing.assert_array_equal(got, want)
  with pytest.raises(FileNotFoundError, match="no config.json"):
    models.as_store(tmp_path / "cache")  # neither of the three


def test_a_gguf_file_where_a_checkpoint_or_a_store_is_expected_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match=r"is a GGUF file.*models\.as_store"):
    models.read_llama_config(GGUF)
  with pytest.raises(FileNotFoundError, match="no config.json beside"):  # not a GGUF file
    models.read_llama_config(tmp_path / "model.bin")
  with pytest.raises(FileNotFoundError, match="convert gguf"):
    UnitStore.open(os.fspath(GGUF))
