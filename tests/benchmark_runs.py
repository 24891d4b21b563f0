"""The benchmarks' ``--quick`` runs, shared by the two test files that run them.

``tests/test_benchmarks.py`` runs the streaming and placement benchmarks and
``tests/test_benchmarks_quantized.py`` the quantized ones (`QUANTIZED`): two files, so
that ``--dist loadfile`` gives each to a worker of its own. conftest.py's ``quick``
fixture runs a benchmark through `run_quick`; `check_quick` is what every quick run must
show.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from user_env import run_script, user_env

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import _result  # noqa: E402 - benchmarks/ is not a package

#: The benchmark scripts (helpers start with ``_``; ``report.py`` renders, measures nothing).
NAMES = sorted(
  p.stem for p in BENCHMARKS.glob("*.py") if not p.stem.startswith("_") and p.stem != "report"
)

#: The benchmarks of quantized weights, GGUF files and drafts: tests/test_benchmarks_quantized.py.
QUANTIZED = (
  "ggml_matvec",
  "gguf_decode",
  "gguf_peers",
  "int8_activations",
  "quant_error",
  "quant_quality",
  "speculative",
)

#: Seconds a quick run may take here (it aims at 15 s alone; the suite shares two cores).
QUICK_TIMEOUT = 240

#: Each quick run's process and result, once per worker process.
_QUICK: dict[str, tuple[subprocess.CompletedProcess, dict]] = {}


def run_quick(
  name: str, zygote: dict[str, str], user: Path, tmp: pytest.TempPathFactory
) -> tuple[subprocess.CompletedProcess, dict]:
  """``benchmarks/NAME.py --quick --json``'s process and result file's object, run once,
  forked from ``zygote`` with ``user``'s cache directory (`user_env.user_env`)."""
  if name not in _QUICK:
    work = tmp.mktemp(f"quick-{name}")
    out = work / "result.json"
    proc = run_script(
      [sys.executable, str(BENCHMARKS / f"{name}.py"), "--quick", "--json", "--result", str(out)],
      zygote,
      env=user_env(user),
      capture_output=True,
      text=True,
      timeout=QUICK_TIMEOUT,
      cwd=work,
    )
    tail = (proc.stdout[-3000:], proc.stderr[-3000:])
    assert proc.returncode == 0, tail
    _QUICK[name] = (proc, json.loads(out.read_text()))
  return _QUICK[name]


def check_quick(name: str, proc: subprocess.CompletedProcess, result: dict) -> None:
  """A quick run passed its parity gates and wrote a complete result: the one it printed."""
  assert json.loads(proc.stdout.strip().splitlines()[-1]) == result, proc.stdout[-3000:]
  assert result["benchmark"] == name and result["quick"] is True and result["ok"] is True
  assert result["commit"] and result["date"] and "--quick" in result["command"]
  assert result["machine"]["cpus"] >= 1 and result["machine"]["memory_bytes"] > 0
  checks = result["checks"]
  assert all(set(c) == {"name", "kind", "ok", "value"} for c in checks), checks
  parity = [c for c in checks if c["kind"] == _result.PARITY]
  assert parity, f"{name} --quick checked no parity gate"
  assert all(c["ok"] for c in parity), parity
