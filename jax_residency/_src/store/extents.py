"""Where a local store's chunks lie: each chunk's file and byte range.

An OCDBT store keeps large values out of line, in data files written once and never
modified; its b-tree maps each chunk key to a file, an offset and a length
(`ocdbt_extents`). A store without OCDBT keeps each chunk as a file of its own, under
``<array name>/c/`` (`chunk_key`). `mapped` maps or copies these ranges directly.
"""

from __future__ import annotations

import dataclasses
import os

import tensorstore as ts


@dataclasses.dataclass(frozen=True)
class Extent:
  """Where one chunk's bytes lie: a file, and an offset and length within it."""

  file: str
  offset: int
  length: int


def _parse_location(root: str, ref: str) -> Extent | None:
  """``value:<base>:<relative file>:<offset>:<length>`` to an `Extent` under ``root``."""
  head, _, sizes = ref.partition(":")
  if head != "value":
    return None
  where, offset, length = sizes.rsplit(":", 2)
  base, _, rel = where.partition(":")
  path = os.path.normpath(os.path.join(root, base, rel))
  if not path.startswith(os.path.normpath(root) + os.sep):
    return None
  return Extent(path, int(offset), int(length))


def ocdbt_extents(root: str) -> dict[str, Extent]:
  """Chunk key → `Extent` of every value stored out of line in the OCDBT database at ``root``.

  Reads the manifest and the b-tree nodes of the newest version. Inline values
  (small ones, kept in the index itself) have no extent.
  """
  base = ts.KvStore.open({"driver": "file", "path": root.rstrip("/") + "/"}).result()
  manifest = ts.ocdbt.dump(base).result()
  versions = manifest.get("versions") or []
  if not versions:
    return {}
  newest = max(versions, key=lambda v: v.get("generation_number", 0))
  location = (newest.get("root") or {}).get("location")
  out: dict[str, Extent] = {}
  pending = [location] if location else []
  while pending:
    node = ts.ocdbt.dump(base, pending.pop()).result()
    for entry in node.get("entries", []):
      if "location" in entry:  # an interior node: its children
        pending.append(entry["location"])
        continue
      ref = entry.get("indirect_value")
      if ref is None:
        continue
      key = entry["key"]
      extent = _parse_location(root, ref)
      if extent is not None:
        out[key.decode() if isinstance(key, bytes) else str(key)] = extent
  return out


def chunk_key(name: str, unit: int | tuple[int, ...], ndim: int) -> str:
  """The zarr3 key (default encoding) of unit ``unit``'s chunk of array ``name`` (with
  a tuple, of the chunk at that leading index: ``(unit, expert)``)."""
  lead = [str(i) for i in (unit if isinstance(unit, tuple) else (unit,))]
  return f"{name}/c/" + "/".join(lead + ["0"] * (ndim - len(lead)))
