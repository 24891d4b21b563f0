"""The base of every error jax_residency raises on purpose, and a helper for messages.

The root of the hierarchy, which every other module of the ``errors`` package
imports; the package re-exports every type.
"""

from __future__ import annotations

from collections.abc import Iterable


class ResidencyError(Exception):
  """Base class of every error jax_residency raises on purpose.

  Catch it to handle any of them; each also derives from `ValueError` (bad input)
  or `RuntimeError` (a failure while running a placed model).

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   jr.parse_bytes("12 potatoes")
    ... except jr.ResidencyError as e:
    ...   print(type(e).__name__, isinstance(e, ValueError))
    InvalidBudgetError True
  """


def format_paths(paths: Iterable[str], *, limit: int = 50) -> str:
  """Formats paths one per line, sorted, eliding past `limit`."""
  items = sorted(paths)
  shown = [f"  {p}" for p in items[:limit]]
  if len(items) > limit:
    shown.append(f"  ... and {len(items) - limit} more")
  return "\n".join(shown)
