"""The quantized benchmarks' ``--quick`` runs (`benchmark_runs.QUANTIZED`: GGUF files,
quantized stores, int8 activations, drafts), and the figures their documentation shows.

The other benchmarks run in test_benchmarks.py, which says what a quick run must show
(`benchmark_runs.check_quick`); the two files are apart so that ``--dist loadfile`` runs
them side by side.
"""

from __future__ import annotations

import math

import _result  # benchmarks/ is not a package: user_env.py puts it on sys.path
import pytest
from benchmark_runs import QUANTIZED, check_quick


@pytest.mark.parametrize("name", QUANTIZED)
def test_quick_run_passes_its_parity_gates_and_reports_its_targets(name, quick):
  check_quick(name, *quick(name))


def test_quant_error_reports_every_figure_its_documentation_shows(quick):
  """docs/quantization.md, "Quantization error": every figure of a row, on one fixture."""
  import report

  quant_error = report.module("quant_error")
  _, result = quick("quant_error")
  assert result["generated_tokens"] == quant_error.QUICK_GENERATED_TOKENS == 8
  assert result["noise_draws"] == quant_error.QUICK_NOISE_DRAWS == 2
  (fixture,) = result["fixtures"]
  assert fixture["fixture"] == quant_error.QUICK_FIXTURE == "llama_tiny_tied"
  assert fixture["int4_group_size"] == 32  # hidden size 32
  rows = {r["scheme"]: r for r in result["rows"]}
  assert set(rows) == {"int8", "int4"}
  for row in rows.values():
    assert set(row) == set(quant_error.ROW_FIELDS), row
    assert row["error"] is None
    figures = {k: v for k, v in row.items() if k not in ("fixture", "scheme", "error")}
    figures.pop("group_size")
    figures.pop("first_difference")  # None when every token agrees
    assert all(isinstance(v, float | int) and math.isfinite(v) for v in figures.values()), row
    assert 0.0 <= row["token_agreement"] <= 1.0
    assert row["quantized_stored_nbytes"] < row["quantized_float_nbytes"]
    assert row["store_nbytes"] < row["store_float_nbytes"]
  for key in ("max_rel_logit_error", "mean_rel_logit_error", "weight_rel_rms_error"):
    assert 0 < rows["int8"][key] < rows["int4"][key], key
  assert rows["int4"]["group_size"] == 32 and rows["int8"]["group_size"] is None
  # Parity with transformers, dense vs resident, store vs decoded weights, each scheme's
  # error against the noise control, int8 below int4 (max and mean): all parity gates.
  checks = result["checks"]
  assert len(checks) == 7 and all(c["kind"] == _result.PARITY and c["ok"] for c in checks)


def test_quant_error_picks_the_largest_group_size_that_divides_every_input():
  import report

  pick = report.module("quant_error").pick_group_size
  assert pick([32, 64]) == 32
  assert pick([128, 256]) == 128
  assert pick([32, 48, 64]) is None  # mistral_tiny's o_proj takes 48


def test_quant_quality_reports_every_row_against_the_float_model(quick):
  """README, "Quantized stores": the trained model's table, on the tiny GGUF file."""
  import report

  quant_quality = report.module("quant_quality")
  _, result = quick("quant_quality")
  rows = result["rows"]
  assert tuple(rows) == quant_quality.QUICK_VARIANTS
  assert result["tokens"] == quant_quality.QUICK_TOKENS and result["prompts"] == 2
  assert result["scored_tokens"] == quant_quality.QUICK_CHUNKS * (quant_quality.QUICK_CONTEXT - 1)
  for name, row in rows.items():
    for key in ("text_top1_agreement", "teacher_forced_agreement", "generated_agreement"):
      assert 0.0 <= row[key] <= 1.0, (name, key)
    assert math.isfinite(row["perplexity"]) and row["perplexity"] > 1.0
    assert len(row["leading_tokens"]) == result["prompts"]
    assert ("weight_rel_rms_error" in row) is (quant_quality.VARIANTS[name] is not None)
  assert rows["float"]["perplexity_ratio"] == 1.0 and rows["float"]["text_top1_agreement"] == 1.0
  assert 0 < rows["int8"]["weight_rel_rms_error"] < rows["int4/64"]["weight_rel_rms_error"]
  assert rows["int4/64"]["store_bytes"] < rows["int8"]["store_bytes"] < rows["float"]["store_bytes"]
  assert "| int8 |" in quant_quality.markdown(result)
