"""Which zarr3 chunks are raw bytes: native-order data, with or without a CRC-32C
trailer, that mapped and direct reads (`mapped`) take straight from the data files."""

from __future__ import annotations

import sys
from typing import Any

from jax_residency._src import errors
from jax_residency._src.store.extents import Extent

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


def corrupt_chunk_error(
  where: str, tensor: str, unit: int, extent: Extent, stored: int, computed: int
) -> errors.StoreCorruptionError:
  """The error for a raw chunk whose data does not match its CRC-32C trailer."""
  return errors.StoreCorruptionError(
    f"Unit {unit} of tensor {tensor!r} in the store {where} is corrupt: its data "
    f"does not match its checksum (stored CRC-32C {stored:#010x}, computed "
    f"{computed:#010x}; the chunk at byte {extent.offset} of {extent.file}). The file "
    "changed after the store was written: write the store again from the original "
    "model or checkpoint (`jax-residency verify PATH` lists every damaged tensor).",
    store=where,
    tensor=tensor,
    unit=unit,
  )
