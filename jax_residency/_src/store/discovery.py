"""Finding what arrays a store holds (`discover`), at a `locations.Location`.

Everything here reads metadata only, never tensor data: Orbax's `_METADATA`,
the `jax_residency.json` sidecar, and each array's zarr (v2 or v3) metadata.
Each file's shape is checked as it is read (`metadata_fields`): a file that is not
UTF-8 JSON, or a field of the wrong type, raises `StoreLayoutError` naming the file
and the field. It also names the on-disk format: the sidecar's key and version.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store import metadata_fields as fields
from jax_residency._src.store import raw_chunks, remote
from jax_residency._src.store.locations import Location, ocdbt_spec
from jax_residency._src.store.pointers import generation_base
from jax_residency._src.store.unit_reads import read_advice
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes

#: The sidecar's ``format`` field.
FORMAT_NAME = "jax_residency.unit_store"
#: The newest sidecar format this version writes and reads: 2 adds quantized tensors
#: (the ``quantization`` field), which readers of format 1 cannot decode.
FORMAT_VERSION = 2
#: The format of a store without quantized tensors (readable by every version).
PLAIN_FORMAT_VERSION = 1
#: Key of the sidecar (format, unit prefix, unit count) in a store's directory.
SIDECAR_KEY = "jax_residency.json"

_ARRAY_VALUE_TYPES = frozenset({"np.ndarray", "jax.Array", "scalar"})
_UNCOMPRESSED_CODECS = frozenset({"bytes", "transpose", "crc32c"})


def as_path(key: Any) -> ParamPath:
  """A parameter path from a path tuple or a single key; components become `str`.

  Example:
    >>> as_path(("layers", 0)), as_path("embed")
    (('layers', '0'), ('embed',))
  """
  return tuple(str(k) for k in (key if isinstance(key, tuple) else (key,)))


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
  # A part of a chunk can be read alone: raw, with no checksum to check over the whole chunk.
  partial_reads: bool = False
  name: str = ""  # its name in the store; "" means `path_str(path)`

  @property
  def stored_name(self) -> str:
    return self.name or path_str(self.path)


def _parse_array(path: ParamPath, meta: dict[str, Any], file: str) -> ArrayInfo:
  """An `ArrayInfo` from an array's zarr v3 (``zarr.json``) or v2 (``.zarray``) metadata."""
  shape = fields.value(meta, "shape", fields.dims(0), file)
  if meta.get("zarr_format") == 3:
    config = fields.value(
      fields.value(meta, "chunk_grid", fields.OBJECT, file),
      "chunk_grid.configuration",
      fields.OBJECT,
      file,
    )
    chunk = fields.value(config, "chunk_grid.configuration.chunk_shape", fields.dims(1), file)
    codecs, field = fields.value(meta, "codecs", fields.CODECS, file, []), "codecs"
    while codecs and codecs[0]["name"] == "sharding_indexed":
      config, field = codecs[0].get("configuration", {}), f"{field}[0].configuration"
      chunk = fields.value(config, f"{field}.chunk_shape", fields.dims(1), file)
      codecs, field = (
        fields.value(config, f"{field}.codecs", fields.CODECS, file, []),
        f"{field}.codecs",
      )
    compressed = any(c["name"] not in _UNCOMPRESSED_CODECS for c in codecs)
    driver, field = "zarr3", "data_type"
  else:
    chunk = fields.value(meta, "chunks", fields.dims(1), file)
    compressed = meta.get("compressor") is not None or bool(meta.get("filters"))
    driver, field = "zarr", "dtype"
  dtype = fields.data_type(
    fields.value(meta, field, ("a data type", lambda v: v is not None), file), file, field
  )
  if len(chunk) != len(shape):
    raise errors.StoreLayoutError(
      f"{file}: the chunk shape {chunk} and the shape {shape} differ in their number of "
      f"dimensions. {fields.REWRITE}"
    )
  raw = raw_chunks.mappable(meta)
  partial = raw_chunks.chunk_trailer(meta) == 0 or (driver == "zarr" and not compressed)
  return ArrayInfo(path, driver, tuple(shape), dtype, tuple(chunk), compressed, raw, partial)


def _file(loc: Location, key: str) -> str:
  """How messages name the file under ``key`` in the store at ``loc``."""
  return f"{loc.path.rstrip('/')}/{key}"


def _wait(future: Any, loc: Location) -> Any:
  """A metadata read's result, within the store's time-out."""
  return remote.wait(future, loc.reads, loc.path, "metadata")


def _read_json(kv: ts.KvStore, keys: Sequence[str], loc: Location) -> list[dict[str, Any] | None]:
  """The JSON objects stored under ``keys``; None where a key is absent."""
  results = [_wait(r, loc) for r in [kv.read(k) for k in keys]]
  return [
    fields.decode(r.value, _file(loc, k)) if r.state == "value" else None
    for k, r in zip(keys, results, strict=True)
  ]


def _tree_paths(metadata: dict[str, Any], file: str) -> list[ParamPath] | None:
  """Array leaves of an Orbax `_METADATA` file, or None if it lists no tree."""
  tree = fields.value(
    metadata,
    "tree_metadata",
    ("an object of tree entries", lambda v: v is None or isinstance(v, dict)),
    file,
    None,
  )
  if tree is None:
    return None
  paths = []
  for name, entry in tree.items():
    field = f"tree_metadata[{name!r}]"
    if not isinstance(entry, dict):
      raise errors.StoreLayoutError(
        f"{file}: field {field} is {fields.described(entry)}; it must be an object with "
        f"key_metadata and value_metadata. {fields.REWRITE}"
      )
    value = fields.value(entry, f"{field}.value_metadata", fields.OBJECT, file, {})
    kind = fields.value(value, f"{field}.value_metadata.value_type", fields.STRING, file, None)
    if kind in _ARRAY_VALUE_TYPES and not value.get("skip_deserialize"):
      keys = fields.value(entry, f"{field}.key_metadata", fields.KEYS, file)
      paths.append(tuple(str(k["key"]) for k in keys))
  return paths


def _checked_sidecar(sidecar: dict[str, Any], file: str) -> dict[str, Any]:
  """The sidecar, once the fields readers use (each optional) have the right types."""
  fields.value(sidecar, "format_version", fields.INT, file, None)
  fields.value(sidecar, "unit_count", fields.COUNT, file, None)
  fields.value(sidecar, "unit_prefix", fields.PREFIX, file, None)
  stacks = fields.value(sidecar, "stacks", fields.STACKS, file, None)
  for k, entry in enumerate(stacks or ()):
    fields.value(entry, f"stacks[{k}].prefix", fields.PREFIX, file)
    fields.value(entry, f"stacks[{k}].count", fields.COUNT, file)
  quant = fields.value(sidecar, "quantization", fields.OBJECT, file, None)
  if quant is not None:
    fields.value(quant, "quantization.scheme", fields.STRING, file)
    tensors = fields.value(quant, "quantization.tensors", fields.TENSORS, file)
    for k, entry in enumerate(tensors):
      where = f"quantization.tensors[{k}]"
      fields.value(entry, f"{where}.path", fields.PREFIX, file)
      fields.value(entry, f"{where}.shape", fields.dims(1), file)
      fields.value(entry, f"{where}.axis", fields.INT, file)
      fields.value(entry, f"{where}.dtype", fields.STRING, file)
  return sidecar


def array_kvstore(loc: Location, name: str, *, use_ocdbt: bool) -> Any:
  """The kvstore spec of the array stored under ``name`` (its Orbax name)."""
  if use_ocdbt:
    return {**ocdbt_spec(loc), "path": name + "/"}
  return generation_base(loc.base, name)


@dataclasses.dataclass(frozen=True)
class Discovered:
  """What a checkpoint directory holds, from its metadata alone."""

  arrays: dict[ParamPath, ArrayInfo]
  sidecar: dict[str, Any] | None
  use_ocdbt: bool

  def largest_chunk_cache_bytes(self) -> int:
    """A chunk cache that holds the store's largest decoded chunk, with a margin."""
    largest = max(tensor_nbytes(a.read_chunk, a.dtype) for a in self.arrays.values())
    return largest + largest // 4 + (1 << 20)


def discover(loc: Location, context: ts.Context, *, sidecar_key: str) -> Discovered:
  """Reads a checkpoint's metadata (never tensor data): Orbax's `_METADATA`, the
  sidecar, and each array's zarr metadata. Without a usable `_METADATA`, the
  arrays are found by listing the OCDBT keys."""
  if loc.local is not None and not os.path.isdir(loc.local):
    hint = ""
    if loc.local.endswith(".gguf") and os.path.isfile(loc.local):
      hint = (
        f" It is a llama.cpp GGUF file: convert it once with `jax-residency convert gguf "
        f"{loc.path} STORE` (or models.as_store) and pass the store."
      )
    raise errors.StoreNotFoundError(f"No unit store at {loc.path}: not a directory.{hint}")
  base = _wait(ts.KvStore.open(loc.base, context=context), loc)
  metadata, sidecar = _read_json(base, ["_METADATA", sidecar_key], loc)
  has_manifest = _wait(base.read("manifest.ocdbt"), loc).state == "value"
  if metadata is None and not has_manifest:
    raise errors.StoreNotFoundError(
      f"No unit store at {loc.path}: found neither Orbax's _METADATA nor an OCDBT "
      "manifest.ocdbt there. Point at the checkpoint item directory (for a "
      "CheckpointManager, <step>/<item>), or write one with save_store."
    )
  file = _file(loc, "_METADATA")
  paths, use_ocdbt = None, True
  if metadata is not None:
    use_ocdbt = fields.value(metadata, "use_ocdbt", fields.BOOL, file, has_manifest)
    paths = _tree_paths(metadata, file)
  if sidecar is not None:
    sidecar = _checked_sidecar(sidecar, _file(loc, sidecar_key))
  kv = _wait(ts.KvStore.open(ocdbt_spec(loc), context=context), loc) if use_ocdbt else base
  if paths is None:
    keys = [k.decode() for k in _wait(kv.list(), loc)]
    names = {k.rsplit("/", 1)[0] for k in keys if k.endswith(("/zarr.json", "/.zarray"))}
    paths = [tuple(n.split(".")) for n in sorted(names)]
  keys = [f"{path_str(p)}/zarr.json" for p in paths]
  metas = _read_json(kv, keys, loc)
  v2 = [i for i, m in enumerate(metas) if m is None]
  for i in v2:
    keys[i] = f"{path_str(paths[i])}/.zarray"
  for i, m in zip(v2, _read_json(kv, [keys[i] for i in v2], loc), strict=True):
    metas[i] = m
  absent = [path_str(p) for p, m in zip(paths, metas, strict=True) if m is None]
  if absent:
    raise errors.StoreLayoutError(
      f"{loc.path} lists arrays without zarr metadata (an incomplete write?):\n"
      f"{errors.format_paths(absent)}\nWrite the store again."
    )
  arrays = {
    p: _parse_array(p, m, _file(loc, k))
    for p, m, k in zip(paths, metas, keys, strict=True)
    if m is not None
  }
  if sidecar is None and arrays and all(len(p) > 1 and p[-1] == "value" for p in arrays):
    # Orbax's save of `nnx.state(model)`: each leaf is an NNX Variable, whose array it
    # stores under `<path>.value`. The model's parameter paths leave that `value` out.
    arrays = {
      p[:-1]: dataclasses.replace(a, path=p[:-1], name=path_str(p)) for p, a in arrays.items()
    }
  return Discovered(arrays=arrays, sidecar=sidecar, use_ocdbt=use_ocdbt)


def discover_checked(
  path: str, loc: Location, context: ts.Context, *, sidecar_key: str
) -> Discovered:
  """The store's arrays and sidecar (`discover`), with unreadable metadata,
  manifests or data files raised as typed errors (`opening_error`)."""
  try:
    return discover(loc, context, sidecar_key=sidecar_key)
  except errors.StoreError:
    raise
  except (ValueError, OSError) as e:  # corrupt metadata, manifest or data files
    raise opening_error(e, path) from e


#: A file TensorStore names in its error text.
_NAMED_FILE = re.compile(r'(?:local )?file "([^"]+)"')


def opening_error(error: BaseException, path: str) -> errors.StoreError:
  """The typed error for a store at ``path`` that failed to open, from TensorStore's
  status code (docs/design.md, 5.4 "Integrity"): ``DATA_LOSS`` (a file that fails its
  checksum or cannot be decoded: the manifest, an index node) is a
  `StoreCorruptionError`; ``NOT_FOUND`` (a file the manifest lists is gone, such as
  the data directory ``d/``) a `StoreError` for an incomplete or damaged store;
  ``PERMISSION_DENIED`` a `StoreError` about permissions. Each names the store, the
  file where TensorStore names one, and the fix."""
  text = str(error)
  found = _NAMED_FILE.search(text)
  where = f" ({found.group(1)})" if found else ""
  if "DATA_LOSS" in text:
    return errors.StoreCorruptionError(
      f"The store at {path} is damaged: a file it cannot be read without fails its "
      f"checksum or cannot be decoded{where}: {text}. Write it again from the original "
      "model or checkpoint, or restore it from a copy.",
      store=path,
    )
  if "NOT_FOUND" in text:
    return errors.StoreError(
      f"The store at {path} is incomplete or damaged: a file its index lists is "
      f"missing{where}: {text}. Write it again from the original model or checkpoint, "
      "or restore the missing files."
    )
  advice = read_advice(text)
  if advice.startswith("Check that"):  # not a permission problem: damaged or not a store
    advice = "Write it again with jax_residency.save, or point at the checkpoint directory."
  return errors.StoreError(
    f"{path} is not a readable checkpoint ({type(error).__name__}: {text}). {advice}"
  )
