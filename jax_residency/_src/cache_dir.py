"""The library's cache directory: demo stores and compiled XLA programs live under it."""

from __future__ import annotations

import os

#: Environment variable naming the cache directory (overrides the default below).
CACHE_DIR_ENV = "JAX_RESIDENCY_CACHE_DIR"


def library_cache_dir() -> str:
  """Where jax_residency keeps its caches, as an absolute path (not created here).

  ``$JAX_RESIDENCY_CACHE_DIR`` if set, else ``$XDG_CACHE_HOME/jax_residency``,
  else ``~/.cache/jax_residency``.

  Example:
    >>> import os
    >>> from jax_residency._src.cache_dir import library_cache_dir
    >>> os.path.isabs(library_cache_dir())
    True
  """
  explicit = os.environ.get(CACHE_DIR_ENV)
  if explicit:
    return os.path.abspath(os.path.expanduser(explicit))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(os.path.abspath(base), "jax_residency")
