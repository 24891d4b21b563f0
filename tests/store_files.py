"""What a store directory holds, as a value to compare: each file's path and a hash of
its bytes. Imported by name (``conftest.py`` puts this directory on ``sys.path``)."""

from __future__ import annotations

import hashlib
import os


def store_digest(path: str) -> dict[str, str]:
  """Each file under ``path`` (its relative path) with the SHA-256 of its bytes."""
  files = {}
  for root, _, names in os.walk(path):
    for name in names:
      full = os.path.join(root, name)
      with open(full, "rb") as f:
        files[os.path.relpath(full, path)] = hashlib.sha256(f.read()).hexdigest()
  return files
