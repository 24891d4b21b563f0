"""The environment for a script the suite runs as a user would (an example, a benchmark)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def user_env(tmp_path: Path) -> dict[str, str]:
  """The suite's environment without its eight fake devices (conftest.py's ``XLA_FLAGS``)
  and with the library's compilation cache back at its default, on (conftest.py turns it
  off for the suite's own processes): the script sees the machine as a user does. The
  library's default cache directory (stores the ``demo`` command builds, compiled
  programs) goes to ``tmp_path``, so the script's first process compiles as a new user's
  does, and its later ones (a benchmark's children) load what the first compiled."""
  env = dict(os.environ)
  env.pop("JAX_RESIDENCY_COMPILATION_CACHE", None)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  if not env["XLA_FLAGS"]:
    del env["XLA_FLAGS"]
  env["JAX_RESIDENCY_CACHE_DIR"] = str(tmp_path / "cache")
  return env
