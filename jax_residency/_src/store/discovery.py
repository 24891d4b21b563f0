"""Finding a store: where it lives (`locate`) and what arrays it holds (`discover`).

Everything here reads metadata only, never tensor data: Orbax's `_METADATA`,
the `jax_residency.json` sidecar, and each array's zarr (v2 or v3) metadata.
It also names the on-disk format: the sidecar's key and version, and the OCDBT
settings stores are written with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.parse
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src.placement.split import path_str
from jax_residency._src.policy import errors
from jax_residency._src.store import mapped
from jax_residency._src.typing import ParamPath

#: The sidecar's ``format`` field.
FORMAT_NAME = "jax_residency.unit_store"
#: The newest sidecar format this version writes and reads.
FORMAT_VERSION = 1
#: Key of the sidecar (format, unit prefix, unit count) in a store's directory.
SIDECAR_KEY = "jax_residency.json"

_ARRAY_VALUE_TYPES = frozenset({"np.ndarray", "jax.Array", "scalar"})
_UNCOMPRESSED_CODECS = frozenset({"bytes", "transpose", "crc32c"})
#: OCDBT settings for writing, as Orbax uses them.
#: Values up to this size are stored inside the OCDBT index, not in data files.
OCDBT_INLINE_BYTES = 1024
OCDBT_WRITE_CONFIG = {
  "max_inline_value_bytes": OCDBT_INLINE_BYTES,
  "max_decoded_node_bytes": 100_000_000,
  "manifest_kind": "single",
}


def as_path(key: Any) -> ParamPath:
  """A parameter path from a path tuple or a single key; components become `str`.

  Example:
    >>> as_path(("layers", 0)), as_path("embed")
    (('layers', '0'), ('embed',))
  """
  return tuple(str(k) for k in (key if isinstance(key, tuple) else (key,)))


@dataclasses.dataclass(frozen=True)
class Location:
  """Where a store lives: a local directory or a TensorStore kvstore URL."""

  path: str  # as the caller gave it, for messages
  base: Any  # TensorStore kvstore spec of the directory (ends with "/")
  local: str | None  # absolute directory for local paths, else None


def locate(path: str) -> Location:
  """Resolves a local path, `file://` URL or other kvstore URL (`memory://`, `gs://`...)."""
  if not isinstance(path, str) or not path:
    raise errors.StoreError(f"A store path must be a non-empty string; got {path=}.")
  if "://" in path and not path.startswith("file://"):
    return Location(path, path if path.endswith("/") else path + "/", None)
  local = urllib.parse.unquote(path[len("file://") :]) if path.startswith("file://") else path
  local = os.path.abspath(os.path.expanduser(local))
  return Location(path, {"driver": "file", "path": local + "/"}, local)


def ocdbt_spec(loc: Location, *, write: bool = False) -> dict[str, Any]:
  """The kvstore spec of the OCDBT database at ``loc`` (its index nodes use the
  context's ``cache_pool#ocdbt``); ``write`` adds Orbax's write settings."""
  spec: dict[str, Any] = {"driver": "ocdbt", "base": loc.base, "cache_pool": "cache_pool#ocdbt"}
  if write:
    spec.update(config=dict(OCDBT_WRITE_CONFIG), assume_config=True)
  return spec


@dataclasses.dataclass(frozen=True)
class ArrayInfo:
  """One stored array, from its zarr metadata."""

  path: ParamPath
  driver: str  # "zarr3" or "zarr" (zarr v2, Orbax's default before zarr3)
  shape: tuple[int, ...]
  dtype: np.dtype
  read_chunk: tuple[int, ...]  # the chunk a read of one element must fetch
  compressed: bool
  raw: bool = False  # each chunk stored as plain native-order bytes (mappable)


def _dtype(name: Any) -> np.dtype:
  try:
    return np.dtype(name)
  except TypeError:
    return ts.dtype(name).numpy_dtype


def _parse_array(path: ParamPath, meta: dict[str, Any]) -> ArrayInfo:
  zarr3 = meta.get("zarr_format") == 3
  if zarr3:
    chunk = meta["chunk_grid"]["configuration"]["chunk_shape"]
    codecs = meta.get("codecs", [])
    while codecs and codecs[0].get("name") == "sharding_indexed":
      chunk, codecs = (
        codecs[0]["configuration"]["chunk_shape"],
        codecs[0]["configuration"]["codecs"],
      )
    compressed = any(c.get("name") not in _UNCOMPRESSED_CODECS for c in codecs)
    dtype = _dtype(meta["data_type"])
  else:
    chunk = meta["chunks"]
    compressed = meta.get("compressor") is not None or bool(meta.get("filters"))
    dtype = _dtype(meta["dtype"])
  driver = "zarr3" if zarr3 else "zarr"
  raw = mapped.mappable(meta)
  return ArrayInfo(path, driver, tuple(meta["shape"]), dtype, tuple(chunk), compressed, raw)


def _read_json(kv: ts.KvStore, keys: Sequence[str]) -> list[Any]:
  results = [r.result() for r in [kv.read(k) for k in keys]]
  return [json.loads(r.value) if r.state == "value" else None for r in results]


def _tree_paths(metadata: Any) -> list[ParamPath] | None:
  """Array leaves of an Orbax `_METADATA` file, or None if it is not one."""
  tree = metadata.get("tree_metadata") if isinstance(metadata, dict) else None
  if not isinstance(tree, dict):
    return None
  paths = []
  for entry in tree.values():
    value = entry.get("value_metadata", {})
    if value.get("value_type") in _ARRAY_VALUE_TYPES and not value.get("skip_deserialize"):
      paths.append(tuple(str(k["key"]) for k in entry["key_metadata"]))
  return paths


def array_kvstore(loc: Location, name: str, *, use_ocdbt: bool) -> Any:
  """The kvstore spec of the array stored under ``name`` (its Orbax name)."""
  if use_ocdbt:
    return {**ocdbt_spec(loc), "path": name + "/"}
  if isinstance(loc.base, dict):
    return {**loc.base, "path": loc.base["path"] + name + "/"}
  return loc.base + name + "/"


@dataclasses.dataclass(frozen=True)
class Discovered:
  """What a checkpoint directory holds, from its metadata alone."""

  arrays: dict[ParamPath, ArrayInfo]
  sidecar: dict[str, Any] | None
  use_ocdbt: bool


def discover(loc: Location, context: ts.Context, *, sidecar_key: str) -> Discovered:
  """Reads a checkpoint's metadata (never tensor data): Orbax's `_METADATA`, the
  sidecar, and each array's zarr metadata. Without a usable `_METADATA`, the
  arrays are found by listing the OCDBT keys."""
  if loc.local is not None and not os.path.isdir(loc.local):
    raise errors.StoreNotFoundError(f"No unit store at {loc.path}: not a directory.")
  base = ts.KvStore.open(loc.base, context=context).result()
  metadata, sidecar = _read_json(base, ["_METADATA", sidecar_key])
  has_manifest = base.read("manifest.ocdbt").result().state == "value"
  if metadata is None and not has_manifest:
    raise errors.StoreNotFoundError(
      f"No unit store at {loc.path}: found neither Orbax's _METADATA nor an OCDBT "
      "manifest.ocdbt there. Point at the checkpoint item directory (for a "
      "CheckpointManager, <step>/<item>), or write one with save_store."
    )
  use_ocdbt = bool(metadata.get("use_ocdbt", has_manifest)) if metadata else True
  kv = ts.KvStore.open(ocdbt_spec(loc), context=context).result() if use_ocdbt else base
  paths = _tree_paths(metadata)
  if paths is None:
    keys = [k.decode() for k in kv.list().result()]
    names = {k.rsplit("/", 1)[0] for k in keys if k.endswith(("/zarr.json", "/.zarray"))}
    paths = [tuple(n.split(".")) for n in sorted(names)]
  metas = _read_json(kv, [f"{path_str(p)}/zarr.json" for p in paths])
  v2 = [i for i, m in enumerate(metas) if m is None]
  v2_paths = [f"{path_str(paths[i])}/.zarray" for i in v2]
  for i, m in zip(v2, _read_json(kv, v2_paths), strict=True):
    metas[i] = m
  absent = [path_str(p) for p, m in zip(paths, metas, strict=True) if m is None]
  if absent:
    raise errors.StoreLayoutError(
      f"{loc.path} lists arrays without zarr metadata (an incomplete write?):\n"
      f"{errors.format_paths(absent)}\nWrite the store again."
    )
  arrays = {p: _parse_array(p, m) for p, m in zip(paths, metas, strict=True)}
  return Discovered(arrays=arrays, sidecar=sidecar, use_ocdbt=use_ocdbt)
