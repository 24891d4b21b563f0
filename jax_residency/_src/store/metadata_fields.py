"""Checking a store's JSON metadata field by field (`discovery` reads the files).

A metadata file that is not UTF-8 JSON, or a field of the wrong kind, raises
`StoreLayoutError` naming the file, the field and the value found, and saying what the
field must be (a `Kind`: how messages say it, and the test).
"""

from __future__ import annotations

import json
import reprlib
from collections.abc import Callable
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors

REWRITE = "The file is damaged or not one this version reads; write the store again."
_JSON_TYPES = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
_REQUIRED: Any = object()
#: What a metadata field must be: (how messages say it, the test).
Kind = tuple[str, Callable[[Any], bool]]


def is_int(v: Any) -> bool:
  return isinstance(v, int) and not isinstance(v, bool)


def dims(minimum: int) -> Kind:
  ok = lambda v: isinstance(v, list) and all(is_int(d) and d >= minimum for d in v)  # noqa: E731
  return f"an array of ints >= {minimum}, one per dimension", ok


def _is_codec(v: Any) -> bool:
  name, config = (v.get("name"), v.get("configuration", {})) if isinstance(v, dict) else (0, 0)
  return isinstance(name, str) and isinstance(config, dict)


def _is_keys(v: Any) -> bool:
  keys = [k.get("key") if isinstance(k, dict) else None for k in v] if isinstance(v, list) else []
  return bool(keys) and all(isinstance(k, str | int) for k in keys)


OBJECT: Kind = ("an object", lambda v: isinstance(v, dict))
STRING: Kind = ("a string", lambda v: isinstance(v, str))
BOOL: Kind = ("true or false", lambda v: isinstance(v, bool))
INT: Kind = ("an int", is_int)
COUNT: Kind = ("an int >= 0", lambda v: is_int(v) and v >= 0)
CODECS: Kind = (
  'an array of codec objects, each with a "name" string and any "configuration" an object',
  lambda v: isinstance(v, list) and all(_is_codec(c) for c in v),
)
KEYS: Kind = ('a non-empty array of objects, each with a "key" string or int', _is_keys)
PREFIX: Kind = (
  'an array of strings (the unit prefix, e.g. ["layers"])',
  lambda v: isinstance(v, list) and all(isinstance(p, str) and p for p in v),
)

TENSORS: Kind = (
  'a non-empty array of objects, each {"path": [...], "shape": [...], "axis": n, "dtype": s}',
  lambda v: isinstance(v, list) and bool(v) and all(isinstance(e, dict) for e in v),
)
STACKS: Kind = (
  'a non-empty array of objects, each {"prefix": [...], "count": n}',
  lambda v: isinstance(v, list) and bool(v) and all(isinstance(e, dict) for e in v),
)


def described(value: Any) -> str:
  """A decoded JSON value as messages show it: ``an array ([1, 2])``."""
  if value is None:
    return "null"
  return f"{_JSON_TYPES.get(type(value), 'a number')} ({reprlib.repr(value)})"


def value(doc: dict[str, Any], field: str, kind: Kind, file: str, default: Any = _REQUIRED) -> Any:
  """The value of ``field`` (a dotted path; its last part is the key in ``doc``) if it is
  of ``kind``; ``default`` if absent, or if no default, a `StoreLayoutError` naming
  ``file``, the field and the value, as for a value of another kind."""
  key = field.rsplit(".", 1)[-1]
  if key not in doc and default is not _REQUIRED:
    return default
  found = f"is {described(doc[key])}" if key in doc else "is missing"
  if key not in doc or not kind[1](doc[key]):
    raise errors.StoreLayoutError(f"{file}: field {field} {found}; it must be {kind[0]}. {REWRITE}")
  return doc[key]


def decode(raw: bytes, file: str) -> dict[str, Any]:
  """The JSON object in a metadata file; anything else raises `StoreLayoutError`."""
  try:
    doc = json.loads(bytes(raw).decode("utf-8"))
  except UnicodeDecodeError as e:
    raise errors.StoreLayoutError(
      f"{file} is not UTF-8 text ({e.reason} at byte {e.start}). {REWRITE}"
    ) from None
  except (ValueError, RecursionError) as e:  # JSONDecodeError; a number or nesting too big
    raise errors.StoreLayoutError(f"{file} is not valid JSON ({e}). {REWRITE}") from None
  if not isinstance(doc, dict):
    raise errors.StoreLayoutError(f"{file} holds {described(doc)}, not a JSON object. {REWRITE}")
  return doc


def data_type(name: Any, file: str, field: str) -> np.dtype:
  try:
    return np.dtype(name)
  except (TypeError, ValueError):
    pass
  try:
    return ts.dtype(name).numpy_dtype
  except (TypeError, ValueError):
    raise errors.StoreLayoutError(
      f"{file}: field {field} is {described(name)}, not a data type this version reads "
      f'(e.g. "float32", "bfloat16"). {REWRITE}'
    ) from None
