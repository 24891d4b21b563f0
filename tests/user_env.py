"""The environment for a script the suite runs as a user would (an example, a benchmark,
a notebook's kernel), and a way to run one without paying for its imports."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import _zygote  # noqa: E402 - benchmarks/ is not a package


def user_env(tmp_path: Path) -> dict[str, str]:
  """The suite's environment without its eight fake devices (conftest.py's ``XLA_FLAGS``)
  and with the library's compilation cache back at its default, on (conftest.py turns it
  off for the suite's own processes): the script sees the machine as a user does. The
  library's default cache directory (stores the ``demo`` command builds, compiled
  programs) goes to ``tmp_path``, so the script's first process compiles as a new user's
  does, and its later ones (a benchmark's children, or the next script given the same
  ``tmp_path``: a user who ran the first) load what the first compiled."""
  env = dict(os.environ)
  env.pop("JAX_RESIDENCY_COMPILATION_CACHE", None)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  if not env["XLA_FLAGS"]:
    del env["XLA_FLAGS"]
  env["JAX_RESIDENCY_CACHE_DIR"] = str(tmp_path / "cache")
  return env


@contextlib.contextmanager
def user_zygote(tmp_path: Path) -> Iterator[dict[str, str]]:
  """A zygote (`_zygote.started`) whose forks see `user_env`'s environment; yields that
  environment, naming the zygote."""
  with _zygote.started(user_env(tmp_path), str(tmp_path)) as env:
    yield env


def run_script(
  cmd: Sequence[str], zygote: dict[str, str], *, env: dict[str, str], **kwargs: Any
) -> subprocess.CompletedProcess:
  """`subprocess.run` of ``python SCRIPT ...``, ``python -c ...`` or ``python -m ...``
  with ``env``, forked from the session's zygote (conftest.py's ``zygote`` fixture,
  `_zygote`): what a fresh ``python`` would do, without its 2-3 s of imports. Where
  ``env`` differs from the zygote's in a variable JAX reads when it is imported (the
  suite's eight devices, say), a fresh process runs it. ``kwargs``: `_zygote.run`'s."""
  return _zygote.run(cmd, env=env | {_zygote.ZYGOTE_ENV: zygote[_zygote.ZYGOTE_ENV]}, **kwargs)
