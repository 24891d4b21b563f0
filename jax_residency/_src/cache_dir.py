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


def unsafe_to_load_from(path: str, *, root: str | None = None) -> str | None:
  """Why code must not be loaded from the directory ``path``, or None where it is safe:
  each directory from ``root`` (``path`` or a directory above it; default ``path``)
  down to ``path``, created (mode 0700) where missing, is owned by this process's user
  and writable by no one else. Another user who can write one of them (a shared
  ``/tmp`` or cluster cache) could plant a library or program there, or swap a
  directory below it for their own, and every process loading from it would run it.

  Example:
    >>> import os, tempfile
    >>> from jax_residency._src.cache_dir import unsafe_to_load_from
    >>> d = tempfile.mkdtemp()  # mode 0700, this user's
    >>> unsafe_to_load_from(os.path.join(d, "kernels"), root=d) is None
    True
    >>> os.chmod(d, 0o777)
    >>> unsafe_to_load_from(os.path.join(d, "kernels"), root=d).endswith(
    ...   "writable by group and others (mode 0o777)"
    ... )
    True
  """
  path = os.path.abspath(path)
  below = os.path.relpath(path, os.path.abspath(root or path))
  if below == os.pardir or below.startswith(os.pardir + os.sep):
    raise ValueError(f"root={root!r} is not {path!r} or a directory above it")
  directory = os.path.abspath(root or path)
  for part in [] if below == os.curdir else below.split(os.sep):
    if (why := _unsafe(directory, make=True)) is not None:
      return why
    directory = os.path.join(directory, part)
  return _unsafe(directory, make=True)


def unsafe_file(path: str) -> str | None:
  """Why the file ``path`` must not be loaded as code (another user owns it, or may
  write it), or None where it is this user's and writable by no one else.

  Example:
    >>> import os, tempfile
    >>> from jax_residency._src.cache_dir import unsafe_file
    >>> fd, f = tempfile.mkstemp()  # mode 0600, this user's
    >>> os.close(fd)
    >>> unsafe_file(f) is None
    True
    >>> os.chmod(f, 0o666)
    >>> unsafe_file(f).endswith("writable by group and others (mode 0o666)")
    True
  """
  return _unsafe(path, make=False)


def _unsafe(path: str, *, make: bool) -> str | None:
  try:
    if make:
      os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
  except OSError as e:
    return f"{path} cannot be {'created or ' if make else ''}read ({e})"
  getuid = getattr(os, "getuid", None)
  if getuid is not None and st.st_uid != getuid():
    return f"{path} is owned by user id {st.st_uid}, not this process's ({getuid()})"
  if st.st_mode & 0o022:
    who = {0o020: "group", 0o002: "others", 0o022: "group and others"}[st.st_mode & 0o022]
    return f"{path} is writable by {who} (mode {oct(st.st_mode & 0o777)})"
  return None
