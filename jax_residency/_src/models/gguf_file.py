"""Telling a llama.cpp GGUF file by its first bytes (before the ``gguf`` package reads it)."""

from __future__ import annotations

import os

#: The first bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


def is_gguf_file(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` is a file that starts as a GGUF file does.

  Example:
    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile(suffix=".gguf") as f:
    ...   _ = f.write(GGUF_MAGIC + bytes(8)); f.flush()
    ...   is_gguf_file(f.name), is_gguf_file(tempfile.gettempdir())
    (True, False)
  """
  try:
    with open(path, "rb") as f:
      return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
  except OSError:
    return False
