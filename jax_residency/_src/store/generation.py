"""Whether the store a placement opened is still the one on disk.

A placement serves the store it opened. A store replaced on disk (``jr.save(...,
overwrite=True)`` exchanges the directories) or rewritten in place (Orbax writes a
new OCDBT manifest) no longer matches what the open store cached: its index, its
chunk locations, its mapped files. Reading on could fail half-way or mix two
versions' weights in one pass, so every read from disk first compares the
store's `fingerprint` with the one taken when it was opened, and a change raises
`StoreReplacedError`, telling the user to place the model again.

Only local stores are watched: a remote store (``gs://``, ``s3://``) must not be
replaced under a live placement. Arrays already read (cached units, mapped
chunks, the weights `FullyResident` and `LayerwiseHost` load at placement) keep
their values.
"""

from __future__ import annotations

import os

from jax_residency._src import errors

#: Files whose replacement marks a new version of a store: OCDBT's manifest (new
#: for every commit), then Orbax's tree metadata and our sidecar (plain zarr stores).
_MARKERS = ("manifest.ocdbt", "_METADATA", "jax_residency.json")

Fingerprint = tuple[int, ...]


def fingerprint(root: str) -> Fingerprint | None:
  """The identity of the store directory ``root`` and of its newest version's marker
  file, or None if there is no directory there."""
  try:
    where = os.stat(root)
  except OSError:
    return None
  for name in _MARKERS:
    try:
      marker = os.stat(os.path.join(root, name))
    except OSError:
      continue
    return (where.st_dev, where.st_ino, marker.st_ino, marker.st_mtime_ns, marker.st_size)
  return (where.st_dev, where.st_ino)


class Watch:
  """The fingerprint of a local store when it was opened, checked before each read.

  Example:
    >>> import os, tempfile
    >>> root = tempfile.mkdtemp()
    >>> def commit(text):  # as OCDBT commits: a new manifest renamed over the old
    ...   with open(os.path.join(root, "new"), "w") as f:
    ...     _ = f.write(text)
    ...   os.replace(os.path.join(root, "new"), os.path.join(root, "manifest.ocdbt"))
    >>> commit("version 1")
    >>> watch = Watch(root, root)
    >>> watch.check()  # unchanged
    >>> commit("version 2")
    >>> try:
    ...   watch.check()
    ... except errors.StoreReplacedError as e:
    ...   print(type(e).__name__)
    StoreReplacedError
  """

  def __init__(self, root: str, path: str):
    self._root = root
    self._path = path
    self._opened = fingerprint(root)

  def check(self) -> None:
    """Raises `StoreReplacedError` if the store changed since it was opened."""
    now = fingerprint(self._root)
    if now == self._opened:
      return
    what = "is gone" if now is None else "was replaced or rewritten"
    raise errors.StoreReplacedError(
      f"The store at {self._path} {what} after this placement opened it. A placement "
      "serves the store it opened and cannot read another version: place the model "
      f"again (jr.place(..., store={self._path!r})) to use the store there now.",
      store=self._path,
    )
