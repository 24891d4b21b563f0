"""The environment for a script the suite runs as a user would (an example, a benchmark)."""

from __future__ import annotations

import os
import re
from pathlib import Path


def user_env(tmp_path: Path) -> dict[str, str]:
  """The suite's environment without its eight fake devices (conftest.py's ``XLA_FLAGS``):
  the script sees the machine as a user does. The library's default cache directory
  (stores the ``demo`` command builds, compiled programs) goes to ``tmp_path``."""
  env = dict(os.environ)
  flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", ""))
  env["XLA_FLAGS"] = flags.strip()
  if not env["XLA_FLAGS"]:
    del env["XLA_FLAGS"]
  env["JAX_RESIDENCY_CACHE_DIR"] = str(tmp_path / "cache")
  return env
