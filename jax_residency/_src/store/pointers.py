"""Stores on object stores (``gs://``, ``s3://``, ``memory://``), replaced atomically
through a pointer object (docs/design.md, 5.2 "Commits").

An object store has no rename, so a store at ``URL`` is written as a *generation*: all its
keys under ``URL/g-<random hex>/``, then the small pointer object ``URL/`` +
`POINTER_KEY` is written last, naming it. A single object's write is atomic on every
object store, so at every moment the pointer names a complete generation (or is absent,
and the path holds a store written flat, as Orbax and versions before 0.13 wrote them).
Readers follow the pointer (`follow`); after the switch, the writer removes every other
key under the path (`remove_others`): older generations, a flat store, and the leftovers
of writers that died before their switch.

Example:
  >>> generation_base("memory://models/gpt/", "g-0123abcd")
  'memory://models/gpt/g-0123abcd/'
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
from typing import TYPE_CHECKING, Any

import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store import remote

if TYPE_CHECKING:
  from jax_residency._src.store.locations import Location

#: The pointer object's key under a store's path.
POINTER_KEY = "jax_residency.generation"
#: The pointer object's ``format`` field.
POINTER_FORMAT = "jax_residency.generation"
_NAME = re.compile(r"^g-[0-9a-f]{8,64}$")


def new_name() -> str:
  """A fresh generation name: ``g-`` and 16 random hex digits."""
  return f"g-{secrets.token_hex(8)}"


def generation_base(base: Any, name: str) -> Any:
  """The kvstore spec of the directory ``name`` under the directory spec ``base``
  (a URL ending in ``/`` or a spec whose ``path`` does)."""
  if isinstance(base, dict):
    return {**base, "path": base["path"] + name + "/"}
  return base + name + "/"


def _pointer_text(name: str) -> bytes:
  return json.dumps({"format": POINTER_FORMAT, "generation": name}).encode()


def _parse_pointer(raw: bytes, loc: Location) -> str:
  """The generation a pointer object's bytes name; raises `StoreLayoutError` if damaged."""
  file = f"{loc.path.rstrip('/')}/{POINTER_KEY}"
  try:
    pointer = json.loads(raw.decode())
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    pointer = e
  name = pointer.get("generation") if isinstance(pointer, dict) else None
  if not isinstance(name, str) or not _NAME.match(name):
    raise errors.StoreLayoutError(
      f"{file} is not a generation pointer this version reads (got {raw[:80]!r}; it must "
      f'be {{"format": "{POINTER_FORMAT}", "generation": "g-<hex>"}}). The file is '
      "damaged: write the store again, or restore the pointer from a copy."
    )
  return name


def current(kv: ts.KvStore, loc: Location) -> str | None:
  """The generation the pointer at ``loc`` names (None: no pointer, a flat store or
  nothing); ``kv`` is the kvstore at ``loc.base``."""
  read = remote.wait(kv.read(POINTER_KEY), loc.reads, loc.path, "metadata")
  return _parse_pointer(read.value, loc) if read.state == "value" else None


def follow(loc: Location, context: ts.Context) -> Location:
  """``loc``, or for an object store whose pointer names a generation, that generation's
  directory (a local store is replaced by renames and has no pointer)."""
  if loc.local is not None:
    return loc
  kv = remote.wait(ts.KvStore.open(loc.base, context=context), loc.reads, loc.path, "metadata")
  name = current(kv, loc)
  if name is None:
    return loc
  return dataclasses.replace(loc, base=generation_base(loc.base, name))


def switch(kv: ts.KvStore, name: str) -> None:
  """Points the path (``kv``'s root) at generation ``name``: one object's write."""
  kv.write(POINTER_KEY, _pointer_text(name)).result()


def _prefix_range(name: str) -> ts.KvStore.KeyRange:
  # Every key that starts with "name/": up to "name0", as "0" follows "/".
  return ts.KvStore.KeyRange(name + "/", name + "0")


def remove_generation(kv: ts.KvStore, name: str) -> None:
  """Deletes every key of generation ``name`` (a write that did not finish)."""
  kv.delete_range(_prefix_range(name)).result()


def remove_others(kv: ts.KvStore, keep: str) -> None:
  """Deletes every key under ``kv``'s root but the pointer and generation ``keep``'s
  keys: older generations, a flat store, dead writers' leftovers."""
  ranges = (
    ts.KvStore.KeyRange("", keep + "/"),
    ts.KvStore.KeyRange(keep + "0", POINTER_KEY),
    ts.KvStore.KeyRange(POINTER_KEY + "\x00", ""),
  )
  for future in [kv.delete_range(r) for r in ranges]:
    future.result()
