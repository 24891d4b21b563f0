"""Disk space for a store being written.

`check_free` refuses, before anything is written, a local save whose tensor
bytes alone exceed the free space of the filesystem it goes to. A disk that
fills up during the write anyway (metadata, other writers) surfaces from
TensorStore as a plain `ValueError`, e.g.::

  RESOURCE_EXHAUSTED: Error writing "layers.u/c/0/0/0" in OCDBT database at local
  file "/data/.s.jax-residency-tmp-.../": Failed writing: "/data/.s.jax-residency-tmp-
  .../d/6c9a...__lock": Failed to write 991512 bytes to file 4: No space left on
  device [os_error_code='28']

(TensorStore maps `ENOSPC` and `ENOMEM` to `RESOURCE_EXHAUSTED`, and `EDQUOT` to
`FAILED_PRECONDITION`; both messages carry `strerror` and the errno). `is_disk_full`
recognises these, and `disk_full_error` turns them into a `StoreError` that names
the destination, not the temporary directory, with the bytes needed.
"""

from __future__ import annotations

import errno
import os
import shutil

from jax_residency._src import errors
from jax_residency._src.policy.sizes import format_bytes

#: errno values that mean "no room": the disk is full, or the user's quota is.
_FULL = tuple(e for e in (errno.ENOSPC, getattr(errno, "EDQUOT", None)) if e is not None)


def _bytes(n: int) -> str:
  return f"{format_bytes(n)} ({n} bytes)"


def free_bytes(directory: str) -> int | None:
  """Free bytes of the filesystem holding `directory`; None when unknown."""
  try:
    return shutil.disk_usage(directory).free
  except OSError:
    return None


def check_free(path: str, directory: str, needed: int, *, replacing: bool) -> int | None:
  """Returns the free bytes at `directory`, after checking that `needed` fit.

  Args:
    path: The destination, as the caller named it (for the message).
    directory: An existing directory on the destination's filesystem.
    needed: The store's tensor bytes (a lower bound on its size).
    replacing: Whether an old store stays at `path` until the new one is complete.

  Raises:
    StoreError: fewer than `needed` bytes are free.
  """
  free = free_bytes(directory)
  if free is not None and free < needed:
    kept = " (the old store there is kept until the new one is complete)" if replacing else ""
    raise errors.StoreError(
      f"Not enough disk space to write the store at {path}{kept}: it needs at least "
      f"{_bytes(needed)} and the filesystem of {directory} has {_bytes(free)} free. Free "
      f"at least {format_bytes(needed - free)}, or choose a path on another filesystem."
    )
  return free


def is_disk_full(exc: BaseException) -> bool:
  """Whether `exc`, or an error it was raised from, says the disk (or quota) is full."""
  seen: set[int] = set()
  current: BaseException | None = exc
  while current is not None and id(current) not in seen:
    seen.add(id(current))
    if isinstance(current, OSError) and current.errno in _FULL:
      return True
    if isinstance(current, ValueError):
      text = str(current)
      if any(os.strerror(e) in text or f"os_error_code='{e}'" in text for e in _FULL):
        return True
    current = current.__cause__ or current.__context__
  return False


def disk_full_error(
  path: str, needed: int, free: int | None, *, replaced: bool
) -> errors.StoreError:
  """The error for a save to `path` that ran out of space (after its cleanup)."""
  before = "an unknown amount" if free is None else _bytes(free)
  kept = "; the old store there is unchanged" if replaced else ""
  return errors.StoreError(
    f"The disk filled up while writing the store at {path}: the store needs at least "
    f"{_bytes(needed)} and {before} was free when the save began. What was written "
    f"has been removed{kept}. Free some space, or choose a path on another filesystem."
  )
