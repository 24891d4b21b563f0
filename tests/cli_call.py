"""Running the ``jax-residency`` command in-process, for the tests that check its output.
Imported by name (``conftest.py`` puts this directory on ``sys.path``)::

  from cli_call import call

  code, out, err = call("inspect", store)
"""

from __future__ import annotations

import contextlib
import io

from jax_residency._src.cli import main as cli


def call(*argv: str) -> tuple[int, str, str]:
  """Runs ``main(argv)`` in-process; returns (exit code, stdout, stderr)."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(list(argv))
  return code, out.getvalue(), err.getvalue()
