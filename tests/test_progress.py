"""Long work reports its progress on stderr where no terminal shows a bar (a log, a CI
job, a notebook's captured stream), and command-line warnings are one line each
(`report/progress.py`, `cli/main.py`)."""

from __future__ import annotations

import argparse
import re
import warnings

import jax.numpy as jnp
from flax import nnx

import jax_residency as jr
from jax_residency._src.cli import main as cli_main
from jax_residency._src.report import progress


def _model() -> nnx.Module:
  return nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.ones((4, 64, 64)))), head=nnx.Param(jnp.ones(3)))


def test_a_save_without_a_terminal_prints_plain_progress_lines(tmp_path, capfd, monkeypatch):
  """pytest's captured stderr is no terminal: the default progress is lines (here from the
  start, as a long save's are after its first seconds), ending at 100%;
  ``progress=False`` prints nothing."""
  monkeypatch.setattr(progress, "LINE_START_SECONDS", 0.0)
  jr.save(_model(), str(tmp_path / "a"), units="layers")
  lines = capfd.readouterr().err.strip().splitlines()
  assert lines and all(re.fullmatch(r"\S.*: \d+% \(.+ of .+\)", line) for line in lines), lines
  assert lines[-1].split(": ", 1)[1].startswith("100% (")
  assert len(lines) <= 11  # every 10% at most (and every 30 s)
  jr.save(_model(), str(tmp_path / "b"), units="layers", progress=False)
  assert capfd.readouterr().err == ""


def test_a_warning_in_a_command_is_one_line_naming_the_command(monkeypatch, capsys):
  def handler(args: argparse.Namespace) -> int:
    warnings.warn("the store is old", UserWarning, stacklevel=1)
    return 0

  class Parser:
    def parse_args(self, argv: object) -> argparse.Namespace:
      return argparse.Namespace(command="inspect", handler=handler)

  monkeypatch.setattr(cli_main, "build_parser", Parser)
  with warnings.catch_warnings():
    warnings.simplefilter("always")  # the suite turns warnings into errors
    assert cli_main.main([]) == 0
  assert capsys.readouterr().err == "jax-residency inspect: warning: the store is old\n"
