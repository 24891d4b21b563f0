"""Reading the project's Markdown pages in tests. Imported by name (``conftest.py`` puts
this directory on ``sys.path``)."""

from __future__ import annotations

import re


def python_blocks(text: str) -> list[str]:
  """The bodies of the fenced ``python`` code blocks in ``text``, in order."""
  return re.findall(r"^```python\n(.*?)^```", text, flags=re.S | re.M)
