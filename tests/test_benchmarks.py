"""Every benchmark runs its ``--quick`` mode in the default suite (examples: test_examples.py).

A benchmark's ``--quick`` run is the full run's code at toy size: it must pass its parity
gates (the outputs agree with the plain model, or with the peer's reference), report
every performance target without gating on it, and write the same result object a full
run writes (``benchmarks/_result.py``). The timings mean nothing at that size; what is
checked is that the script runs, that its gates hold and that its result is complete.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from user_env import run_script, user_env

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _result  # noqa: E402 - benchmarks/ is not a package
import _zygote  # noqa: E402

#: The benchmark scripts (helpers start with ``_``; ``report.py`` renders, measures nothing).
NAMES = sorted(
  p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "report"
)

#: Seconds a quick run may take here (it aims at 15 s alone; the suite shares two cores).
QUICK_TIMEOUT = 240


def test_every_benchmark_is_found():
  assert {"decode", "dense_stream", "quant_error", "orbax_in_place", "peers"} <= set(NAMES)


_QUICK: dict[str, tuple[subprocess.CompletedProcess, dict]] = {}


@pytest.fixture(scope="module")
def quick(tmp_path_factory, zygote):
  """Runs a benchmark's ``--quick --json`` once per module (``--dist loadfile`` keeps a
  module on one worker), forked from the session's zygote (a fork skips the 2 s of imports
  each fresh ``python`` pays); returns the process and the result file's object. The runs
  share one user's cache directory, as one user's runs of the benchmarks would: what one
  compiled, the next loads (compile_time.py times its cold and warm processes in caches
  of its own)."""
  user = tmp_path_factory.mktemp("quick-user")

  def run(name: str) -> tuple[subprocess.CompletedProcess, dict]:
    if name not in _QUICK:
      tmp = tmp_path_factory.mktemp(f"quick-{name}")
      out = tmp / "result.json"
      proc = run_script(
        [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", "--result", str(out)],
        zygote,
        env=user_env(user),
        capture_output=True,
        text=True,
        timeout=QUICK_TIMEOUT,
        cwd=tmp,
      )
      tail = (proc.stdout[-3000:], proc.stderr[-3000:])
      assert proc.returncode == 0, tail
      _QUICK[name] = (proc, json.loads(out.read_text()))
    return _QUICK[name]

  return run


@pytest.mark.parametrize("name", NAMES)
def test_quick_run_passes_its_parity_gates_and_reports_its_targets(name, quick):
  proc, result = quick(name)
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == result, proc.stdout[-3000:]
  assert result["benchmark"] == name and result["quick"] is True and result["ok"] is True
  assert result["commit"] and result["date"] and "--quick" in result["command"]
  assert result["machine"]["cpus"] >= 1 and result["machine"]["memory_bytes"] > 0
  checks = result["checks"]
  assert all(set(c) == {"name", "kind", "ok", "value"} for c in checks), checks
  parity = [c for c in checks if c["kind"] == _result.PARITY]
  assert parity, f"{name} --quick checked no parity gate"
  assert all(c["ok"] for c in parity), parity


_PROBE = """
import os, sys
print(repr(sys.argv), os.getcwd(), os.environ.get("PROBE"), "jax_residency" in sys.modules)
print("to stderr", file=sys.stderr)
sys.exit(int(sys.argv[1]))
"""


def test_a_zygote_fork_runs_a_command_as_a_fresh_process_would(zygote, tmp_path):
  """Arguments, working directory, environment, both streams, the exit status; a fresh
  process where JAX's import-time environment differs or no zygote answers; a time-out
  kills the fork."""
  script = tmp_path / "probe.py"
  script.write_text(_PROBE)
  env = zygote | {"PROBE": "x"}
  for args, argv in (([str(script), "3"], [str(script), "3"]), (["-c", _PROBE, "4"], ["-c", "4"])):
    done = _zygote.run([sys.executable, *args], capture_output=True, env=env, cwd=tmp_path)
    assert done.stdout == f"{argv!r} {tmp_path} x True\n" and done.stderr == "to stderr\n"
    assert done.returncode == int(argv[1])
  fresh = _zygote.run(
    [sys.executable, str(script), "0"], capture_output=True, env=env | {"JAX_ENABLE_X64": "1"}
  )
  assert fresh.returncode == 0 and fresh.stdout.endswith(" x False\n"), fresh
  with pytest.raises(subprocess.TimeoutExpired):
    _zygote.run([sys.executable, "-c", "import time; time.sleep(30)"], env=env, timeout=0.5)
  with pytest.raises(subprocess.CalledProcessError):
    _zygote.run([sys.executable, str(script), "2"], stdout=subprocess.PIPE, env=env, check=True)
  gone = env | {_zygote.ZYGOTE_ENV: str(tmp_path / "no-zygote.sock")}  # reached by nothing
  fresh = _zygote.run([sys.executable, str(script), "0"], capture_output=True, env=gone)
  assert fresh.returncode == 0 and fresh.stdout.endswith(" x False\n"), fresh


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


def _args(**kw: object) -> argparse.Namespace:
  return argparse.Namespace(**{"json": True, "result": None, **kw})


@pytest.mark.parametrize(
  ("quick", "kind", "status"),
  [(True, _result.TARGET, 0), (False, _result.TARGET, 1), (True, _result.PARITY, 1)],
)
def test_a_failed_gate_always_fails_a_run_and_a_missed_target_unless_quick(
  quick, kind, status, tmp_path, capsys
):
  result = _result.stamp("example", ["--quick"] if quick else [], quick)
  checks: list[dict] = []
  _result.check(checks, "held", True, 1.0, _result.PARITY)
  _result.check(checks, "did not hold", False, 2.0, kind)
  result["checks"] = checks
  path = tmp_path / "out" / "r.json"
  assert _result.finish(result, _args(result=str(path))) == status
  assert json.loads(capsys.readouterr().out) == json.loads(path.read_text()) == result
  assert result["ok"] is (status == 0)
  with pytest.raises(ValueError, match="check kind"):
    _result.check(checks, "x", True, 0, "speed")


def test_the_text_form_names_each_check_with_its_verdict(capsys):
  result = _result.stamp("example", [], False)
  _result.check(result.setdefault("checks", []), "step <= 1.1x raw read", False, 1.3)
  assert _result.finish(result, _args(json=False, result=os.devnull)) == 1
  out = capsys.readouterr().out
  assert "[target] step <= 1.1x raw read: MISSED (1.3)" in out
  assert "1 check(s) failed or missed" in out


def test_documented_figures_are_the_committed_results():
  """Every marked section of the README and the docs is what report.py renders from the
  result file of its benchmark, as committed."""
  import report

  assert report.main(["--check"]) == 0


def test_a_marked_section_is_rendered_from_its_result():
  import report

  result = _result.stamp("nothing", ["--repeat", "3"], False)
  _result.check(result.setdefault("checks", []), "step <= 1.1x raw read", True, 1.04)
  text = "intro\n<!-- report: nothing -->\ntyped by hand\n<!-- /report -->\nafter\n"
  new = report.rewrite(text, {"nothing": result})
  assert "typed by hand" not in new and new.startswith("intro\n") and new.endswith("after\n")
  assert f"at commit {result['commit']} on {os.cpu_count()} cores" in new
  assert "`python benchmarks/nothing.py --repeat 3`" in new
  assert "| step <= 1.1x raw read | target | 1.04 | met |" in new
  assert report.rewrite(new, {"nothing": result}) == new
  brief = report.rewrite(text.replace("nothing -->", "nothing brief -->"), {"nothing": result})
  assert "1 of 1 target checks held" in brief and "| step <= 1.1x" not in brief
  _result.check(result["checks"], "max |diff| <= 0", True, "|x|", _result.PARITY)
  bars = report.rewrite(text, {"nothing": result})  # a cell's own bars are escaped
  assert "| max \\|diff\\| <= 0 | parity | \\|x\\| | met |" in bars


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
