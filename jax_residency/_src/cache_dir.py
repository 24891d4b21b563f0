"""The library's cache directory: demo stores, compiled XLA programs and the native kernels
live under it; and whether a directory is private enough to load code from."""

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


def unsafe_to_load_from(path: str) -> str | None:
  """Why code must not be loaded from the directory ``path`` (created, mode 0700, if it
  is missing), or None where it is safe: owned by this process's user and writable by
  no one else. A directory another user can write (a shared ``/tmp`` or cluster cache)
  could hold a planted library or program that every process loading from it would run.

  Example:
    >>> import os, tempfile
    >>> from jax_residency._src.cache_dir import unsafe_to_load_from
    >>> d = tempfile.mkdtemp()  # mode 0700, this user's
    >>> unsafe_to_load_from(d) is None
    True
    >>> os.chmod(d, 0o777)
    >>> unsafe_to_load_from(d).endswith("writable by group and others (mode 0o777)")
    True
  """
  try:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
  except OSError as e:
    return f"{path} cannot be created or read ({e})"
  getuid = getattr(os, "getuid", None)
  if getuid is not None and st.st_uid != getuid():
    return f"{path} is owned by user id {st.st_uid}, not this process's ({getuid()})"
  if st.st_mode & 0o022:
    who = {0o020: "group", 0o002: "others", 0o022: "group and others"}[st.st_mode & 0o022]
    return f"{path} is writable by {who} (mode {oct(st.st_mode & 0o777)})"
  return None
