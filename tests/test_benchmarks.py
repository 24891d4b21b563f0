"""Every benchmark runs its ``--quick`` mode in the default suite (examples: test_examples.py):
the streaming and placement benchmarks here, the quantized ones in
test_benchmarks_quantized.py (two files, which ``--dist loadfile`` runs side by side).

A benchmark's ``--quick`` run is the full run's code at toy size: it must pass its parity
gates (the outputs agree with the plain model, or with the peer's reference), report
every performance target without gating on it, and write the same result object a full
run writes (``benchmarks/_result.py``). The timings mean nothing at that size; what is
checked is that the script runs, that its gates hold and that its result is complete.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import _result  # benchmarks/ is not a package: user_env.py puts it on sys.path
import _zygote
import pytest
from benchmark_runs import NAMES, QUANTIZED, check_quick


def test_every_benchmark_is_found():
  listed = {"decode", "dense_stream", "quant_error", "orbax_in_place", "peers", "throughput"}
  assert listed <= set(NAMES)
  assert set(QUANTIZED) < set(NAMES)  # each runs in tests/test_benchmarks_quantized.py


@pytest.mark.parametrize("name", [n for n in NAMES if n not in QUANTIZED])
def test_quick_run_passes_its_parity_gates_and_reports_its_targets(name, quick):
  check_quick(name, *quick(name))


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
