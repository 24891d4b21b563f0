"""Ways to damage a copy of a store, shared by the fault tests (``test_integrity.py``,
``test_faults.py``), and `drop_pages`, which sends a store's next reads to disk. Imported
by name: ``conftest.py`` puts this directory on ``sys.path``.

Each helper damages one chunk's data file of a store written by `jax_residency.save`:
the chunk must be stored out of line in the OCDBT data files (chunks of a few KiB and
more are), so that it has a file and a byte range (`mapped.ocdbt_extents`).
"""

from __future__ import annotations

import os
import shutil

from jax_residency._src.store import mapped


def chunk_extent(store: str, tensor: str, unit: int | None) -> mapped.Extent:
  """Where the data of ``tensor``'s chunk ``unit`` lies (unit None: a static tensor's only
  chunk): its data file, offset and length."""
  first = f"{tensor}/c/{0 if unit is None else unit}"
  extents = mapped.ocdbt_extents(store)
  return next(e for k, e in extents.items() if k == first or k.startswith(first + "/"))


def flip_bit(store: str, tensor: str, unit: int | None) -> None:
  """Flips one bit in the middle of the data of ``tensor``'s chunk ``unit``, in place."""
  extent = chunk_extent(store, tensor, unit)
  with open(extent.file, "r+b") as f:
    f.seek(extent.offset + extent.length // 2)
    byte = f.read(1)[0]
    f.seek(extent.offset + extent.length // 2)
    f.write(bytes([byte ^ 0x10]))


def damaged_copy(store: str, dest: str, *chunks: tuple[str, int | None]) -> str:
  """A copy of ``store`` with one bit flipped in the data of each (tensor, unit) chunk
  (unit None: a static tensor's only chunk)."""
  shutil.copytree(store, dest)
  for tensor, unit in chunks:
    flip_bit(dest, tensor, unit)
  return dest


def truncate_chunk_file(store: str, tensor: str, unit: int | None) -> str:
  """Cuts the data file holding ``tensor``'s chunk ``unit`` 8 bytes into that chunk
  (a copy or a download that stopped early); returns the file."""
  extent = chunk_extent(store, tensor, unit)
  os.truncate(extent.file, extent.offset + 8)
  return extent.file


def delete_chunk_file(store: str, tensor: str, unit: int | None) -> str:
  """Removes the data file holding ``tensor``'s chunk ``unit``; returns the file."""
  extent = chunk_extent(store, tensor, unit)
  os.remove(extent.file)
  return extent.file


def flip_bit_on_disk(store: str, tensor: str, unit: int | None) -> mapped.Extent:
  """Flips one bit of ``tensor``'s chunk ``unit`` as a fault of the disk would: the file
  keeps its modification time, and its pages leave the page cache, so the next read
  finds the flipped bit on disk. Returns the chunk's extent."""
  extent = chunk_extent(store, tensor, unit)
  before = os.stat(extent.file)
  flip_bit(store, tensor, unit)
  os.utime(extent.file, ns=(before.st_atime_ns, before.st_mtime_ns))
  fd = os.open(extent.file, os.O_RDONLY)
  try:
    os.fsync(fd)  # dirty pages are not dropped
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
  finally:
    os.close(fd)
  return extent


def drop_pages(path: str) -> None:
  """Drops every file under ``path`` from the page cache (dirty pages written first), so
  that the next read of them comes from disk."""
  for root, _, files in os.walk(path):
    for name in files:
      fd = os.open(os.path.join(root, name), os.O_RDONLY)
      try:
        os.fsync(fd)  # dirty pages (a fresh copy's) are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)
