"""JAX's persistent compilation cache, on by default under the library's cache directory.

A placed model's first pass compiles its XLA programs; with the persistent cache
a second process loads them from disk instead. :func:`enable_default_cache`
points JAX's cache at ``<library cache dir>/xla`` (see :mod:`.cache_dir`) unless
the user configured a cache themselves or opted out with
``JAX_RESIDENCY_COMPILATION_CACHE=0``.

JAX's cache settings are process-wide: once enabled, every program the process
compiles afterwards may be cached, not only the placed model's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from typing import Any

import jax

from jax_residency._src.cache_dir import library_cache_dir, unsafe_to_load_from

#: Set to ``0`` (or ``false`` / ``no`` / ``off``) to leave JAX's compilation cache alone.
OPT_OUT_ENV = "JAX_RESIDENCY_COMPILATION_CACHE"
_OFF = frozenset({"0", "false", "no", "off"})

#: Subdirectory of the library cache directory that holds compiled programs.
SUBDIR = "xla"

#: Programs are cached however quickly they compiled (JAX's default is 1 s). A dense
#: stream's first pass compiles its per-unit step and a dozen small programs for the
#: parts outside the layer loop, each in 10-90 ms on CPU; with a 1 s floor none of
#: them is cached and a new process compiles them all again. Loading one from disk
#: takes about 2 ms.
MIN_COMPILE_TIME_SECS = 0.0

#: The directory is trimmed to this size, least recently used entries first, when
#: :func:`enable_default_cache` turns it on: once a process. JAX's own bound
#: (``jax_compilation_cache_max_size``) is left at its default, no limit, because JAX
#: enforces it by listing and reading every entry on each write: with 3,500 entries
#: that cost 0.18 s per compiled program, and a first pass compiles about twenty.
MAX_SIZE_BYTES = 1 << 30

#: Suffixes of the two files JAX keeps per entry: the program, and (when JAX's own
#: eviction is on) its last access time.
_ENTRY_SUFFIX, _ATIME_SUFFIX = "-cache", "-atime"

#: JAX's defaults for the two settings above: a value other than these, or one
#: given through JAX's own environment variable, is the user's and is left alone.
_JAX_DEFAULTS = {
  "jax_persistent_cache_min_compile_time_secs": 1.0,
  "jax_compilation_cache_max_size": -1,
}

_lock = threading.Lock()
_enabled: str | None = None
_log = logging.getLogger("jax_residency")
_warned: set[str] = set()


def opted_out() -> bool:
  """Whether ``JAX_RESIDENCY_COMPILATION_CACHE`` turns the default cache off."""
  return os.environ.get(OPT_OUT_ENV, "").strip().lower() in _OFF


def _config(name: str) -> Any:
  return getattr(jax.config, name)  # typed attributes exist only at run time


def _user_set(name: str) -> bool:
  return name.upper() in os.environ or _config(name) != _JAX_DEFAULTS[name]


def _private_dir(path: str) -> bool:
  """Whether ``path`` (created if missing), a directory below the library's cache
  directory, is one this user alone can write, as is each directory from the cache
  directory down, and so one to load compiled programs from; warns once per directory
  where it is not."""
  unsafe = unsafe_to_load_from(path, root=library_cache_dir())
  if unsafe is None:
    return os.access(path, os.W_OK | os.X_OK)
  if path not in _warned:
    _warned.add(path)
    _log.warning(
      "jax_residency: no persistent compilation cache: %s. Make the directory yours and "
      "writable by you alone (chown, chmod 700), or set $%s to one that is.",
      unsafe,
      "JAX_RESIDENCY_CACHE_DIR",
    )
  return False


def enable_default_cache() -> str | None:
  """Turns on JAX's persistent compilation cache under the library's cache directory.

  Idempotent and thread-safe. Leaves JAX's configuration alone (and returns
  ``None``) when ``JAX_RESIDENCY_COMPILATION_CACHE=0`` is set, when a cache
  directory is already configured (``jax_compilation_cache_dir`` or
  ``$JAX_COMPILATION_CACHE_DIR``), when JAX's cache is disabled
  (``jax_enable_compilation_cache=False``), or when the directory cannot be
  created or is not private (owned by this user and writable by no one else: a
  program loaded from it runs in this process; a warning names it and the fix).
  Otherwise it sets the directory and, where the user has not set it,
  :data:`MIN_COMPILE_TIME_SECS`; unless the user set JAX's size limit, it trims the
  directory to :data:`MAX_SIZE_BYTES` (:func:`trim`).

  Returns:
    The cache directory this call (or an earlier one) configured, else ``None``.

  Example:
    >>> import os
    >>> from jax_residency._src.run import compile_cache
    >>> os.environ[compile_cache.OPT_OUT_ENV] = "0"  # as the test suite runs
    >>> compile_cache.enable_default_cache() is None
    True
  """
  global _enabled
  with _lock:
    if _enabled is not None:
      return _enabled
    if opted_out():
      return None
    if _config("jax_compilation_cache_dir") is not None:
      return None  # the user's own cache
    if not _config("jax_enable_compilation_cache"):
      return None
    path = os.path.join(library_cache_dir(), SUBDIR)
    if not _private_dir(path):
      return None
    if not _user_set("jax_persistent_cache_min_compile_time_secs"):
      jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_TIME_SECS)
    if not _user_set("jax_compilation_cache_max_size"):
      trim(path, MAX_SIZE_BYTES)
    jax.config.update("jax_compilation_cache_dir", path)
    _enabled = path
    return path


def trim(path: str, max_bytes: int) -> int:
  """Removes the least recently used entries of a cache directory beyond ``max_bytes``.

  An entry's last use is the later of its file's access and modification times (JAX
  reads an entry whole, and writes it once). Files other processes remove meanwhile
  are skipped. Returns the bytes the entries left in the directory hold.
  """
  entries = []
  try:
    with os.scandir(path) as it:
      for entry in it:
        if entry.name.endswith(_ENTRY_SUFFIX):
          try:
            st = entry.stat()
          except OSError:
            continue
          entries.append((max(st.st_atime_ns, st.st_mtime_ns), st.st_size, entry.path))
  except OSError:
    return 0
  total = sum(size for _, size, _ in entries)
  for _, size, file in sorted(entries):
    if total <= max_bytes:
      break
    with contextlib.suppress(FileNotFoundError):
      os.remove(file)
    with contextlib.suppress(FileNotFoundError):
      os.remove(file.removesuffix(_ENTRY_SUFFIX) + _ATIME_SUFFIX)
    total -= size
  return total
