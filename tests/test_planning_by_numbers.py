"""Planning from an accelerator's figures given as numbers, and from a config.json with
no store (run/accelerator.py, run/model_sizes.py; docs/design.md, 4.8)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from cli_call import call

import jax_residency as jr
from jax_residency import models
from jax_residency._src.run.model_sizes import sizes_of

CHECKPOINT = os.path.join(os.path.dirname(__file__), "fixtures", "llama_tiny_tied")
CONFIG = os.path.join(CHECKPOINT, "config.json")
WORK = jr.Workload(prompt_len=16, decode_steps=4)
FIGURES = {
  "name": "test GPU",
  "memory_bytes_per_s": 1e9,
  "matmul_flops_per_s": 2e9,
  "host_to_device_bytes_per_s": 1e8,
  "disk_bytes_per_s": 1e7,
  "page_cache_bytes_per_s": 1e8,
  "source": "made up for the test",
}
GPU = jr.Accelerator(**FIGURES)


@pytest.fixture(scope="module", params=[None, "int8"])
def converted(request, tmp_path_factory):
  """(quantize, the tiny Llama converted with it)."""
  path = str(tmp_path_factory.mktemp("by_numbers") / "store")
  models.convert_hf(CHECKPOINT, path, progress=False, quantize=request.param)
  return request.param, path


def test_a_config_is_sized_as_its_converted_store(converted):
  quantize, path = converted
  from_config = sizes_of(CONFIG, quantize=quantize)
  from_store = sizes_of(path)
  assert from_config == from_store
  assert (from_config.quantization is None) == (quantize is None)
  # Parameters of one layer, as floats: attention (q, o 32x32; k, v 32x16), MLP (3 of
  # 32x64) and two norms of 32, whether stored as floats or as int8 codes.
  assert from_config.unit_params == (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64 + 2 * 32,)


def test_a_config_is_sized_once_until_its_file_changes(tmp_path):
  """A measurement and a plan of one config share its sizes (building the abstract model
  of a large one takes a second); an edited config is sized again."""
  config = tmp_path / "config.json"
  shutil.copyfile(CONFIG, config)
  first = sizes_of(config)
  assert sizes_of(config) is first and sizes_of(config, quantize="int8") is not first
  hf = json.loads(config.read_text())
  hf["num_hidden_layers"] += 1
  config.write_text(json.dumps(hf))
  again = sizes_of(config)
  assert again.stacks[0][1] == first.stacks[0][1] + 1


def test_given_figures_predict_by_the_roofline(converted):
  quantize, path = converted
  sizes = sizes_of(path)
  (name, count, unit), params = sizes.stacks[0], sizes.unit_params[0]
  found = GPU.measurement(CONFIG, WORK, quantize=quantize)
  assert found.given and found.backend == "given: test GPU"
  # A decode step reads the unit (memory-bound); the prompt's multiplies by each
  # parameter once per token (compute-bound at these figures).
  assert found.step_seconds[WORK.decode_signature] == {name: unit / 1e9}
  prompt = 2 * params * WORK.prompt_len / 2e9
  assert prompt > unit / 1e9
  assert found.step_seconds[WORK.prefill_signature] == {name: prompt}
  ranked = jr.plan(
    CONFIG,
    found,
    device_budget_bytes=None,
    host_budget_bytes=None,
    workload=WORK,
    quantize=quantize,
  )
  first = ranked[0]
  assert isinstance(first.policy, jr.FullyResident)
  assert first.decode_seconds == pytest.approx(count * unit / 1e9)
  assert first.prefill_seconds == pytest.approx(count * prompt)
  # The same figures price the converted store the same way: one model, one ranking.
  same = jr.plan(
    path,
    GPU.measurement(path, WORK),
    device_budget_bytes=None,
    host_budget_bytes=None,
    workload=WORK,
  )
  assert [(c.policy, c.decode_seconds) for c in same] == [
    (c.policy, c.decode_seconds) for c in ranked
  ]


def test_a_budget_short_of_the_model_ranks_kept_units_first(converted):
  quantize, path = converted
  sizes = sizes_of(path)
  unit = sizes.stacks[0][2]
  device = sizes.static + sum(sizes.decoded) + 3 * unit - 1  # a byte short of all 3 units
  ranked = jr.plan(
    CONFIG,
    GPU.measurement(CONFIG, WORK, quantize=quantize),
    device_budget_bytes=device,
    host_budget_bytes=None,
    workload=WORK,
    quantize=quantize,
  )
  assert not any(isinstance(c.policy, jr.FullyResident) for c in ranked)
  first = ranked[0]
  # A unit moved from host memory costs its bytes over 1e8 B/s, 10 times its read from
  # device memory: the first choice keeps as many on the device as fit (one, beside a
  # one-unit window: prefetch depth 1, which moves a unit and then runs it).
  kept = max(
    (c.policy.options.device_resident_units if isinstance(c.policy, jr.LayerwiseHost) else 0)
    for c in ranked
  )
  assert isinstance(first.policy, jr.LayerwiseHost)
  assert first.policy.options.device_resident_units == kept == 1
  assert first.policy.options.offload.prefetch_depth == 1
  step, move = unit / 1e9, unit / 1e8
  assert first.decode_seconds == pytest.approx(step + 2 * (step + move))
  assert first.bytes_per_token == 2 * unit


def test_a_config_needs_given_figures_and_checks_its_arguments(converted, tmp_path):
  quantize, path = converted
  measured = jr.measure(path)  # this machine's figures: of the store, not of a config
  with pytest.raises(jr.PlacementError, match=r"config\.json.*jr\.Accelerator"):
    jr.plan(CONFIG, measured, device_budget_bytes=None, host_budget_bytes=None, workload=WORK)
  with pytest.raises(jr.PlacementError, match=r"is a store, planned as it is stored"):
    GPU.measurement(path, WORK, quantize="int8")
  # Given figures are taken for any store or backend: they are not of this process.
  GPU.measurement(CONFIG, WORK).check(path)
  with pytest.raises(jr.PlacementError, match=r"matmul_flops_per_s=-1.*positive"):
    jr.Accelerator(**{**FIGURES, "matmul_flops_per_s": -1})
  with pytest.raises(jr.PlacementError, match=r"disk_bytes_per_s=True"):
    jr.Accelerator(**{**FIGURES, "disk_bytes_per_s": True})
  with pytest.raises(jr.PlacementError, match=r"source=3\): pass a string"):
    jr.Accelerator(**{**FIGURES, "source": 3})
  with pytest.raises(jr.PlacementError, match=r"name=''\): pass a non-empty string"):
    jr.Accelerator(**{**FIGURES, "name": ""})
  with pytest.raises(jr.PlacementError, match=r"unknown fields \['hbm'\]"):
    jr.Accelerator.from_dict({**FIGURES, "hbm": 1})
  with pytest.raises(jr.PlacementError, match=r"missing fields \['memory_bytes_per_s'\]"):
    jr.Accelerator.from_dict({k: v for k, v in FIGURES.items() if k != "memory_bytes_per_s"})


def test_plan_auto_with_an_accelerator_file(tmp_path):
  figures = tmp_path / "gpu.json"
  figures.write_text(json.dumps(FIGURES))
  code, out, err = call(
    "plan", CONFIG, "--auto", "--accelerator", str(figures), "--prompt-len", "16", "--steps", "4"
  )
  assert code == 0, err
  assert "from figures given for test GPU" in out and "made up for the test" in out
  assert out.splitlines()[2].split()[1] == "FullyResident()"
  code, _, err = call("plan", CONFIG, "--auto")
  assert code == 2 and "--accelerator FILE" in err
  figures.write_text("[1]")
  code, _, err = call("plan", CONFIG, "--auto", "--accelerator", str(figures))
  assert code == 2 and "expected a JSON object" in err
  code, _, err = call("plan", CONFIG, "--auto", "--accelerator", str(tmp_path / "none.json"))
  assert code == 2 and "none.json" in err
