"""Lint, format and type checks, run as tests so the README's test command covers them.

Each check runs the tool on the repository root in a subprocess, as CI would,
and fails with the tool's own output.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECKS = {
  "ruff check": ["ruff", "check", "."],
  "ruff format": ["ruff", "format", "--check", "."],
  "mypy": ["mypy", "jax_residency"],
}


def _tool(name: str) -> list[str]:
  """The tool as a module of this interpreter (the one pip installed it into), else on PATH."""
  probe = subprocess.run(
    [sys.executable, "-m", name, "--version"], capture_output=True, text=True, check=False
  )
  if probe.returncode == 0:
    return [sys.executable, "-m", name]
  path = shutil.which(name)
  if path is None:
    pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
  return [path]


@pytest.mark.parametrize("check", list(CHECKS), ids=lambda c: c.replace(" ", "_"))
def test_tool_passes(check: str) -> None:
  tool, *args = CHECKS[check]
  result = subprocess.run(
    [*_tool(tool), *args],
    cwd=ROOT,
    capture_output=True,
    text=True,
    timeout=280,
    check=False,
  )
  assert result.returncode == 0, (
    f"`{check}` exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
  )
