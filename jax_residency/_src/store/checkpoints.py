"""Orbax checkpoint directories: finding the checkpoint a path means (`resolve`).

An ``orbax.checkpoint.CheckpointManager`` directory holds one subdirectory per
step (``<root>/<step>/``), each with one subdirectory per item
(``<step>/default/`` for a single item saved with ``StandardSave``), and the
item directory is the checkpoint. `resolve` takes a store path that names a
checkpoint, a step, or a manager's root, and returns the checkpoint's directory:
the latest complete step, and its only item (or the one named ``default``).
Steps Orbax has not finished writing (temporary names, no commit marker) are
skipped. Only local directories are looked into; a URL is returned as given.
"""

from __future__ import annotations

import os

from jax_residency._src import errors

#: Files whose presence makes a directory a checkpoint (an Orbax item, or a store).
_CHECKPOINT_FILES = ("_METADATA", "manifest.ocdbt")
#: Files Orbax writes into a step directory once the step is complete.
_STEP_DONE_FILES = ("_CHECKPOINT_METADATA", "commit_success.txt")
#: The item name Orbax gives a single item saved without a name.
DEFAULT_ITEM = "default"


def _is_checkpoint(directory: str) -> bool:
  return any(os.path.isfile(os.path.join(directory, f)) for f in _CHECKPOINT_FILES)


def _subdirs(directory: str) -> list[str]:
  try:
    return sorted(e.name for e in os.scandir(directory) if e.is_dir())
  except OSError:
    return []


def _steps(directory: str) -> list[int]:
  """The complete steps of a CheckpointManager root, oldest first."""
  return sorted(
    int(name)
    for name in _subdirs(directory)
    if name.isdigit()
    and any(os.path.isfile(os.path.join(directory, name, f)) for f in _STEP_DONE_FILES)
  )


def _item(step_dir: str, given: str) -> str | None:
  """The checkpoint item of a step directory; None if it holds none."""
  items = [n for n in _subdirs(step_dir) if _is_checkpoint(os.path.join(step_dir, n))]
  if not items:
    return None
  if len(items) == 1 or DEFAULT_ITEM in items:
    return os.path.join(step_dir, items[0] if len(items) == 1 else DEFAULT_ITEM)
  choices = ", ".join(os.path.join(step_dir, n) for n in items)
  raise errors.StoreError(
    f"{given} holds the checkpoint items {', '.join(items)}; which one has the model's "
    f"weights is not clear. Pass store= one of: {choices}."
  )


def resolve(path: str) -> str:
  """The checkpoint directory ``path`` means: itself if it is one; for a step of a
  ``CheckpointManager``, its item; for a manager's root, its latest complete step's
  item. Anything else (a URL, a missing directory) is returned as given.

  Raises:
    StoreError: a step holds several checkpoint items, none named ``default``.

  Example:
    >>> import tempfile, os, pathlib
    >>> root = tempfile.mkdtemp()
    >>> for step in (3, 12):
    ...   item = pathlib.Path(root, str(step), "default")
    ...   item.mkdir(parents=True)
    ...   _ = (item / "_METADATA").write_text("{}")
    ...   _ = (item.parent / "commit_success.txt").write_text("")
    >>> os.path.relpath(resolve(root), root), os.path.relpath(resolve(root + "/3"), root)
    ('12/default', '3/default')
  """
  if "://" in path and not path.startswith("file://"):
    return path
  local = path[len("file://") :] if path.startswith("file://") else path
  local = os.path.abspath(os.path.expanduser(local))
  if not os.path.isdir(local) or _is_checkpoint(local):
    return path
  item = _item(local, path)
  if item is not None:  # a step directory
    return item
  steps = _steps(local)
  if steps:
    item = _item(os.path.join(local, str(steps[-1])), path)
    if item is not None:
      return item
  return path
