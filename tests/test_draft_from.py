"""`models.draft_from`: a draft made from the target's own checkpoint (docs/speculative.md,
"A draft from the same checkpoint"), planned with its KV cache, checked against the device
memory the target leaves, and run as `generate_llm`'s draft."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import jax_residency as jr
from jax_residency import models

FIXTURES = Path(__file__).parent / "fixtures"
HF = FIXTURES / "llama_tiny_untied"
GGUF = FIXTURES / "gguf_tiny_untied" / "model.gguf"
PROMPT = [[1, 5, 9, 12, 3]]
#: int4 in groups the tiny checkpoint's width (32) divides (the default groups are 64).
INT4 = {"scheme": "int4", "group_size": 32}


@pytest.fixture(scope="module")
def target():
  return models.load(HF)


@pytest.fixture(scope="module")
def want(target):
  return models.generate_llm(target, PROMPT, 10, stop_tokens=())


def test_a_checkpoint_makes_an_int4_draft_that_plans_its_kv_cache(target, want, tmp_path):
  """From a checkpoint directory: an int4 store written once and reused, placed
  FullyResident with its KV cache as a memory item of its own, and the target's greedy
  tokens through speculation without ``draft_config``."""
  store = tmp_path / "draft"
  with models.draft_from(HF, quantize=INT4, store=store, max_len=64, batch=2) as draft:
    assert draft.store == str(store) and draft.config == target.config
    kv = [m for m in draft.metadata.memory if m.name == "KV cache"]
    assert [m.nbytes for m in kv] == [models.kv_cache_bytes(target.config, 2, 64)]
    assert kv[0].counted_in == "device budget"
    assert draft.metadata.planned_device_bytes > kv[0].nbytes
    got, report = models.speculate(target, PROMPT, 10, draft=draft, stop_tokens=())
    np.testing.assert_array_equal(got, want)
    assert report.accepted > 0
  info = (store / "jax_residency_conversion.json").read_text()
  assert "llama_tiny_untied" in info
  written = os.path.getmtime(store / "commit_success.txt")
  with models.draft_from(
    HF, quantize=INT4, store=store, max_len=64
  ) as again:  # reused, not rewritten
    assert os.path.getmtime(store / "commit_success.txt") == written
    np.testing.assert_array_equal(
      models.generate_llm(target, PROMPT, 10, draft=again, stop_tokens=()), want
    )


def test_a_gguf_file_is_a_draft_in_its_own_types_and_refuses_requantizing(tmp_path):
  """A GGUF file is converted as it is; asking to quantize it again (or a store converted
  from it) is refused, naming the fix, before anything is written."""
  with pytest.raises(jr.QuantizationError, match="quantize=None"):
    models.draft_from(GGUF, quantize="int4", store=tmp_path / "q")
  assert not (tmp_path / "q").exists()
  with models.draft_from(GGUF, store=tmp_path / "g", max_len=32) as draft:
    plain = models.load(tmp_path / "g")
    with jr.place(plain, jr.DenseDiskStream(host_budget_bytes=0), store=tmp_path / "g") as t:
      want = models.generate_llm(t, PROMPT, 6, config=plain.config, stop_tokens=())
      got = models.generate_llm(t, PROMPT, 6, config=plain.config, draft=draft, stop_tokens=())
    np.testing.assert_array_equal(got, want)
  with pytest.raises(jr.QuantizationError, match="quantize=None"):  # its store's source too
    models.draft_from(tmp_path / "g", quantize="int8")


def test_a_converted_store_drafts_from_its_recorded_source(tmp_path, monkeypatch):
  """A float store from ``convert`` is used as it is, or, asked to quantize, drafts from
  the checkpoint it records (by default under the library's cache directory)."""
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  store = tmp_path / "float"
  models.convert_hf(HF, store, progress=False)
  with models.draft_from(store, max_len=32) as draft:
    assert draft.store == os.fspath(store)
  with models.draft_from(store, quantize="int8", max_len=32) as draft:
    assert draft.store.startswith(str(tmp_path / "cache" / "drafts"))
    assert "int8" in os.path.basename(draft.store)
  with pytest.raises(FileNotFoundError, match="neither a GGUF file"):
    models.draft_from(tmp_path)


def test_a_draft_over_the_device_memory_left_is_refused_with_the_arithmetic(tmp_path):
  """The draft's weights and KV cache must fit what the target's device budget leaves
  beside its plan (or ``device_budget_bytes``): else a DeviceBudgetTooSmallError naming
  both parts, raised before the draft is placed; the target still runs."""
  store = tmp_path / "draft"
  with models.draft_from(HF, quantize=INT4, store=store, max_len=64) as draft:
    need = draft.metadata.planned_device_bytes
  target_store = tmp_path / "target"
  models.convert_hf(HF, target_store, progress=False)
  model = models.load(target_store)
  probe = jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=target_store)
  plan = probe.metadata.planned_device_bytes
  probe.close()
  tight = jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=plan + need - 1)
  with jr.place(model, tight, store=target_store) as t:
    with pytest.raises(jr.DeviceBudgetTooSmallError, match="KV cache") as e:
      models.draft_from(HF, quantize=INT4, store=store, target=t, max_len=64)
    assert e.value.required == need and e.value.budget == need - 1
    assert "the target leaves" in str(e.value)
    with pytest.raises(jr.DeviceBudgetTooSmallError, match="its weights .* KV cache"):
      models.draft_from(HF, quantize=INT4, store=store, device_budget_bytes="100B", max_len=64)
    for bad in ({"max_len": 0}, {"batch": 1.5}):
      with pytest.raises(ValueError, match=f"{next(iter(bad))}="):
        models.draft_from(HF, quantize=INT4, store=store, **bad)
    assert models.generate_llm(t, PROMPT, 2, config=model.config).shape == (1, 2)
  roomy = jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=plan + need)
  with jr.place(model, roomy, store=target_store) as t:
    with models.draft_from(HF, quantize=INT4, store=store, target=t, max_len=64) as draft:
      assert draft.metadata.planned_device_bytes == need
