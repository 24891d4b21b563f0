"""Which zarr3 chunks are raw bytes: native-order data, with or without a CRC-32C
trailer, that mapped and direct reads (`mapped`) take straight from the data files."""

from __future__ import annotations

import sys
from typing import Any

#: Bytes of the zarr3 ``crc32c`` codec's trailer: the CRC-32C of the chunk's
#: data, little-endian, after the data.
CHECKSUM_BYTES = 4


def chunk_trailer(meta: Any) -> int | None:
  """Bytes after the data in each chunk of a zarr3 array stored as raw native-order
  bytes: 0, or `CHECKSUM_BYTES` with the ``crc32c`` codec; None if chunks are not raw.

  Example:
    >>> little = {"name": "bytes", "configuration": {"endian": sys.byteorder}}
    >>> chunk_trailer({"zarr_format": 3, "codecs": [little]})
    0
    >>> chunk_trailer({"zarr_format": 3, "codecs": [little, {"name": "crc32c"}]})
    4
    >>> chunk_trailer({"zarr_format": 3, "codecs": [little, {"name": "zstd"}]}) is None
    True
  """
  if not isinstance(meta, dict) or meta.get("zarr_format") != 3:
    return None
  codecs = meta.get("codecs", [])
  if not isinstance(codecs, list) or not codecs or not isinstance(codecs[0], dict):
    return None
  first, rest = codecs[0], codecs[1:]
  if first.get("name") != "bytes":
    return None
  endian = (first.get("configuration") or {}).get("endian", sys.byteorder)
  if endian != sys.byteorder:
    return None
  if not rest:
    return 0
  if len(rest) == 1 and isinstance(rest[0], dict) and rest[0].get("name") == "crc32c":
    return CHECKSUM_BYTES
  return None


def mappable(meta: Any) -> bool:
  """Whether zarr3 array metadata stores each chunk as raw native-order bytes
  (with or without a checksum after them)."""
  return chunk_trailer(meta) is not None
