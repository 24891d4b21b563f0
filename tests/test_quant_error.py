"""``benchmarks/quant_error.py`` runs, and its JSON holds every figure docs/quantization.md
reports (``## Quantization error``), on one fixture so that it stays fast."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_error.py"
FIXTURE = "llama_tiny_tied"


@pytest.fixture(scope="module")
def quant_error():
  spec = importlib.util.spec_from_file_location("quant_error", SCRIPT)
  assert spec is not None and spec.loader is not None
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_script_reports_every_figure_on_a_fixture(quant_error, capsys, monkeypatch):
  # Fewer noise draws and generated tokens than the documented run: the same code paths
  # and checks, in half the time.
  monkeypatch.setattr(quant_error, "NOISE_DRAWS", 2)
  monkeypatch.setattr(quant_error, "GENERATED_TOKENS", 8)
  rc = quant_error.main(["--fixtures", FIXTURE, "--json"])
  result = json.loads(capsys.readouterr().out)
  assert rc == (0 if result["ok"] else 1)
  assert result["commit"] and result["generated_tokens"] == quant_error.GENERATED_TOKENS
  (fixture,) = result["fixtures"]
  assert fixture["fixture"] == FIXTURE and fixture["int4_group_size"] == 32  # hidden size 32
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
  failed = [c for c in result["checks"] if not c["ok"]]
  assert not failed
  assert len(result["checks"]) == 7


def test_the_group_size_is_the_largest_that_divides_every_input(quant_error):
  assert quant_error.pick_group_size([32, 64]) == 32
  assert quant_error.pick_group_size([128, 256]) == 128
  assert quant_error.pick_group_size([32, 48, 64]) is None  # mistral_tiny's o_proj takes 48
