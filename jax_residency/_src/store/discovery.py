"""Finding a store: where it lives (`locate`) and what arrays it holds (`discover`).

Everything here reads metadata only, never tensor data: Orbax's `_METADATA`,
the `jax_residency.json` sidecar, and each array's zarr (v2 or v3) metadata.
Each file's shape is checked as it is read: a file that is not UTF-8 JSON, or
a field of the wrong type, raises `StoreLayoutError` naming the file and the
field. It also names the on-disk format: the sidecar's key and version, and the
OCDBT settings stores are written with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import reprlib
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store import raw_chunks, remote
from jax_residency._src.store.pointers import generation_base
from jax_residency._src.store.read_options import ReadOptions
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
  reads: ReadOptions = ReadOptions()  # retries and time-out of its reads


def locate(path: str | os.PathLike[str], reads: ReadOptions | None = None) -> Location:
  """Resolves a local path (a `str` or `os.PathLike`), `file://` URL or other
  kvstore URL (`memory://`, `gs://`...), to be read with ``reads`` (default
  `ReadOptions()`)."""
  reads = ReadOptions() if reads is None else reads
  if not isinstance(reads, ReadOptions):
    raise errors.StoreError(
      f"read_options must be a jax_residency.ReadOptions; got {reprlib.repr(reads)} "
      f"({type(reads).__name__}). Pass e.g. read_options=jr.ReadOptions(retries=4)."
    )
  if isinstance(path, os.PathLike):
    path = os.fspath(path)
  if not isinstance(path, str) or not path:
    raise errors.StoreError(
      f"A store path must be a non-empty str or os.PathLike; got path={reprlib.repr(path)} "
      f"({type(path).__name__}). Pass a directory or a kvstore URL such as 'memory://name'."
    )
  if path.startswith("s3://") and s3_endpoint() is not None:
    return Location(path, s3_spec(path), None, reads)
  if "://" in path and not path.startswith("file://"):
    return Location(path, path if path.endswith("/") else path + "/", None, reads)
  local = urllib.parse.unquote(path[len("file://") :]) if path.startswith("file://") else path
  local = os.path.abspath(os.path.expanduser(local))
  return Location(path, {"driver": "file", "path": local + "/"}, local, reads)


#: Environment variables that name an S3-compatible endpoint (MinIO, Ceph, R2, a local
#: test server), first found first: the AWS SDKs' own. TensorStore's ``s3://`` URLs
#: ignore them and go to AWS, so `locate` turns such a URL into a spec with the endpoint.
S3_ENDPOINT_ENV = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")


def s3_endpoint() -> str | None:
  """The S3-compatible endpoint the environment names (`S3_ENDPOINT_ENV`), or None."""
  return next((os.environ[k] for k in S3_ENDPOINT_ENV if os.environ.get(k)), None)


def s3_spec(url: str) -> dict[str, Any]:
  """The TensorStore kvstore spec of ``s3://bucket/key`` at the environment's endpoint:
  its region from ``AWS_REGION`` / ``AWS_DEFAULT_REGION``, and its credentials from
  ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` where those are set (else the AWS
  default chain: profile files, instance metadata).

  Example:
    >>> import os
    >>> os.environ["AWS_ENDPOINT_URL_S3"] = "http://127.0.0.1:9000"
    >>> spec = s3_spec("s3://models/gpt/store")
    >>> spec["bucket"], spec["path"], spec["endpoint"]
    ('models', 'gpt/store/', 'http://127.0.0.1:9000')
    >>> del os.environ["AWS_ENDPOINT_URL_S3"]
  """
  bucket, _, key = url[len("s3://") :].partition("/")
  if not bucket:
    raise errors.StoreError(f"{url}: an s3:// store needs a bucket, as in s3://BUCKET/PATH.")
  spec: dict[str, Any] = {
    "driver": "s3",
    "bucket": bucket,
    "path": key if not key or key.endswith("/") else key + "/",
    "endpoint": s3_endpoint(),
  }
  region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
  if region:
    spec["aws_region"] = region
  if os.environ.get("AWS_ACCESS_KEY_ID"):
    spec["aws_credentials"] = {"type": "environment"}
  return spec


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
  # A part of a chunk can be read alone: raw, with no checksum to check over the whole chunk.
  partial_reads: bool = False
  name: str = ""  # its name in the store; "" means `path_str(path)`

  @property
  def stored_name(self) -> str:
    return self.name or path_str(self.path)


_REWRITE = "The file is damaged or not one this version reads; write the store again."
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
_REQUIRED: Any = object()
#: What a metadata field must be: (how messages say it, the test).
_Kind = tuple[str, Callable[[Any], bool]]


def _is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def _dims(minimum: int) -> _Kind:
  ok = lambda v: isinstance(v, list) and all(_is_int(d) and d >= minimum for d in v)  # noqa: E731
  return f"an array of ints >= {minimum}, one per dimension", ok


def _is_codec(v: Any) -> bool:
  name, config = (v.get("name"), v.get("configuration", {})) if isinstance(v, dict) else (0, 0)
  return isinstance(name, str) and isinstance(config, dict)


def _is_keys(v: Any) -> bool:
  keys = [k.get("key") if isinstance(k, dict) else None for k in v] if isinstance(v, list) else []
  return bool(keys) and all(isinstance(k, str | int) for k in keys)


_OBJECT: _Kind = ("an object", lambda v: isinstance(v, dict))
_STRING: _Kind = ("a string", lambda v: isinstance(v, str))
_BOOL: _Kind = ("true or false", lambda v: isinstance(v, bool))
_INT: _Kind = ("an int", _is_int)
_COUNT: _Kind = ("an int >= 0", lambda v: _is_int(v) and v >= 0)
_CODECS: _Kind = (
  'an array of codec objects, each with a "name" string and any "configuration" an object',
  lambda v: isinstance(v, list) and all(_is_codec(c) for c in v),
)
_KEYS: _Kind = ('a non-empty array of objects, each with a "key" string or int', _is_keys)
_PREFIX: _Kind = (
  'an array of strings (the unit prefix, e.g. ["layers"])',
  lambda v: isinstance(v, list) and all(isinstance(p, str) and p for p in v),
)

_TENSORS: _Kind = (
  'a non-empty array of objects, each {"path": [...], "shape": [...], "axis": n, "dtype": s}',
  lambda v: isinstance(v, list) and bool(v) and all(isinstance(e, dict) for e in v),
)
_STACKS: _Kind = (
  'a non-empty array of objects, each {"prefix": [...], "count": n}',
  lambda v: isinstance(v, list) and bool(v) and all(isinstance(e, dict) for e in v),
)


def _described(value: Any) -> str:
  """A decoded JSON value as messages show it: ``an array ([1, 2])``."""
  if value is None:
    return "null"
  return f"{_JSON_TYPES.get(type(value), 'a number')} ({reprlib.repr(value)})"


def _field(
  doc: dict[str, Any], field: str, kind: _Kind, file: str, default: Any = _REQUIRED
) -> Any:
  """The value of ``field`` (a dotted path; its last part is the key in ``doc``) if it is
  of ``kind``; ``default`` if absent, or if no default, a `StoreLayoutError` naming
  ``file``, the field and the value, as for a value of another kind."""
  key = field.rsplit(".", 1)[-1]
  if key not in doc and default is not _REQUIRED:
    return default
  found = f"is {_described(doc[key])}" if key in doc else "is missing"
  if key not in doc or not kind[1](doc[key]):
    raise errors.StoreLayoutError(
      f"{file}: field {field} {found}; it must be {kind[0]}. {_REWRITE}"
    )
  return doc[key]


def _decode(raw: bytes, file: str) -> dict[str, Any]:
  """The JSON object in a metadata file; anything else raises `StoreLayoutError`."""
  try:
    doc = json.loads(bytes(raw).decode("utf-8"))
  except UnicodeDecodeError as e:
    raise errors.StoreLayoutError(
      f"{file} is not UTF-8 text ({e.reason} at byte {e.start}). {_REWRITE}"
    ) from None
  except (ValueError, RecursionError) as e:  # JSONDecodeError; a number or nesting too big
    raise errors.StoreLayoutError(f"{file} is not valid JSON ({e}). {_REWRITE}") from None
  if not isinstance(doc, dict):
    raise errors.StoreLayoutError(f"{file} holds {_described(doc)}, not a JSON object. {_REWRITE}")
  return doc


def _dtype(name: Any, file: str, field: str) -> np.dtype:
  try:
    return np.dtype(name)
  except (TypeError, ValueError):
    pass
  try:
    return ts.dtype(name).numpy_dtype
  except (TypeError, ValueError):
    raise errors.StoreLayoutError(
      f"{file}: field {field} is {_described(name)}, not a data type this version reads "
      f'(e.g. "float32", "bfloat16"). {_REWRITE}'
    ) from None


def _parse_array(path: ParamPath, meta: dict[str, Any], file: str) -> ArrayInfo:
  """An `ArrayInfo` from an array's zarr v3 (``zarr.json``) or v2 (``.zarray``) metadata."""
  shape = _field(meta, "shape", _dims(0), file)
  if meta.get("zarr_format") == 3:
    config = _field(
      _field(meta, "chunk_grid", _OBJECT, file), "chunk_grid.configuration", _OBJECT, file
    )
    chunk = _field(config, "chunk_grid.configuration.chunk_shape", _dims(1), file)
    codecs, field = _field(meta, "codecs", _CODECS, file, []), "codecs"
    while codecs and codecs[0]["name"] == "sharding_indexed":
      config, field = codecs[0].get("configuration", {}), f"{field}[0].configuration"
      chunk = _field(config, f"{field}.chunk_shape", _dims(1), file)
      codecs, field = _field(config, f"{field}.codecs", _CODECS, file, []), f"{field}.codecs"
    compressed = any(c["name"] not in _UNCOMPRESSED_CODECS for c in codecs)
    driver, field = "zarr3", "data_type"
  else:
    chunk = _field(meta, "chunks", _dims(1), file)
    compressed = meta.get("compressor") is not None or bool(meta.get("filters"))
    driver, field = "zarr", "dtype"
  dtype = _dtype(_field(meta, field, ("a data type", lambda v: v is not None), file), file, field)
  if len(chunk) != len(shape):
    raise errors.StoreLayoutError(
      f"{file}: the chunk shape {chunk} and the shape {shape} differ in their number of "
      f"dimensions. {_REWRITE}"
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
    _decode(r.value, _file(loc, k)) if r.state == "value" else None
    for k, r in zip(keys, results, strict=True)
  ]


def _tree_paths(metadata: dict[str, Any], file: str) -> list[ParamPath] | None:
  """Array leaves of an Orbax `_METADATA` file, or None if it lists no tree."""
  tree = _field(
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
        f"{file}: field {field} is {_described(entry)}; it must be an object with "
        f"key_metadata and value_metadata. {_REWRITE}"
      )
    value = _field(entry, f"{field}.value_metadata", _OBJECT, file, {})
    kind = _field(value, f"{field}.value_metadata.value_type", _STRING, file, None)
    if kind in _ARRAY_VALUE_TYPES and not value.get("skip_deserialize"):
      keys = _field(entry, f"{field}.key_metadata", _KEYS, file)
      paths.append(tuple(str(k["key"]) for k in keys))
  return paths


def _checked_sidecar(sidecar: dict[str, Any], file: str) -> dict[str, Any]:
  """The sidecar, once the fields readers use (each optional) have the right types."""
  _field(sidecar, "format_version", _INT, file, None)
  _field(sidecar, "unit_count", _COUNT, file, None)
  _field(sidecar, "unit_prefix", _PREFIX, file, None)
  stacks = _field(sidecar, "stacks", _STACKS, file, None)
  for k, entry in enumerate(stacks or ()):
    _field(entry, f"stacks[{k}].prefix", _PREFIX, file)
    _field(entry, f"stacks[{k}].count", _COUNT, file)
  quant = _field(sidecar, "quantization", _OBJECT, file, None)
  if quant is not None:
    _field(quant, "quantization.scheme", _STRING, file)
    tensors = _field(quant, "quantization.tensors", _TENSORS, file)
    for k, entry in enumerate(tensors):
      where = f"quantization.tensors[{k}]"
      _field(entry, f"{where}.path", _PREFIX, file)
      _field(entry, f"{where}.shape", _dims(1), file)
      _field(entry, f"{where}.axis", _INT, file)
      _field(entry, f"{where}.dtype", _STRING, file)
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
    raise errors.StoreNotFoundError(f"No unit store at {loc.path}: not a directory.")
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
    use_ocdbt = _field(metadata, "use_ocdbt", _BOOL, file, has_manifest)
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
