"""A local store's files as the disk sees them: dropped from the page cache, read raw.

`jax_residency.measure` uses these to take a store's disk bandwidth apart from the
library's read path: `drop_cached` asks the kernel to drop a store's clean pages
(``posix_fadvise(POSIX_FADV_DONTNEED)``; pages a process has mapped stay), and
`read_raw` reads its data files from the start, one thread, in large blocks.
"""

from __future__ import annotations

import os

#: Bytes each raw read asks for.
RAW_BLOCK = 8 << 20


def data_files(root: str) -> list[str]:
  """Every regular file under ``root``, largest first (the data files before the
  index and metadata)."""
  found = []
  for where, _, names in os.walk(root):
    for name in names:
      path = os.path.join(where, name)
      if os.path.isfile(path) and not os.path.islink(path):
        found.append(path)
  return sorted(found, key=lambda p: (-os.path.getsize(p), p))


def drop_cached(root: str) -> bool:
  """Asks the kernel to drop the page cache of every file under ``root``; False where
  the platform has no ``posix_fadvise`` (the pages may then stay cached)."""
  advise = getattr(os, "posix_fadvise", None)
  if advise is None:
    return False
  for path in data_files(root):
    fd = os.open(path, os.O_RDONLY)
    try:
      advise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
      os.close(fd)
  return True


def read_raw(root: str, nbytes: int) -> int:
  """Reads up to ``nbytes`` of the files under ``root``, largest files first, one thread,
  `RAW_BLOCK` at a time; returns the bytes read."""
  done = 0
  buffer = bytearray(RAW_BLOCK)
  view = memoryview(buffer)
  for path in data_files(root):
    with open(path, "rb", buffering=0) as f:
      while done < nbytes:
        n = f.readinto(view[: min(RAW_BLOCK, nbytes - done)])
        if not n:
          break
        done += n
    if done >= nbytes:
      break
  return done
