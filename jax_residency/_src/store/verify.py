"""``verify_store``: read every chunk of a store and list the damaged tensors.

Stores written by this library carry a CRC-32C checksum after each chunk's
data (the zarr3 ``crc32c`` codec). Reads check it: TensorStore when it decodes
a chunk, `mapped` when a read maps the chunk in place. This module reads the
whole store, chunk by chunk, and reports every tensor (and unit) that fails,
instead of stopping at the first one. A store written without checksums (by an
older version, or by Orbax) is still read whole, which finds missing or
truncated files but not changed bytes; the result says which kind it was.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_residency._src import errors
from jax_residency._src.report.progress import progress_bar
from jax_residency._src.store.stored_stack import per_expert
from jax_residency._src.store.unit_reads import read_error
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.typing import ParamPath, path_str, tensor_nbytes

#: Bytes of chunk reads `verify_store` keeps in flight.
VERIFY_IN_FLIGHT_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True)
class Damage:
  """One chunk that could not be read, or whose data does not match its checksum.

  Attributes:
    tensor: the tensor's full path, dot-separated.
    unit: the unit, or None for a static tensor.
    corrupt: True for a checksum mismatch, False for any other read failure.
    message: what went wrong.
    expert: the expert, for a tensor stored one chunk per expert (else None).
  """

  tensor: str
  unit: int | None
  corrupt: bool
  message: str
  expert: int | None = None


@dataclasses.dataclass(frozen=True)
class VerifyResult:
  """What `verify_store` found.

  Attributes:
    path: the store.
    checksummed: whether every array of the store has checksums (else changed
      bytes go undetected; only unreadable chunks are found).
    chunks: chunks read.
    nbytes: bytes of tensor data read.
    damaged: every chunk that failed, in store order.
  """

  path: str
  checksummed: bool
  chunks: int
  nbytes: int
  damaged: tuple[Damage, ...]

  @property
  def ok(self) -> bool:
    return not self.damaged


def verify_store(path: str, *, progress: bool | None = None) -> VerifyResult:
  """Reads every chunk of the store at ``path`` and returns what failed.

  Each chunk is read through TensorStore, which checks its checksum when the
  store has them. At most `VERIFY_IN_FLIGHT_BYTES` of reads are in flight (and
  one chunk more when a chunk is larger), so memory stays bounded whatever the
  store's size.

  Args:
    path: a store directory or TensorStore kvstore URL.
    progress: show a progress bar over bytes read (default: when stderr is a
      terminal).

  Raises:
    StoreError: the store cannot be opened at all (its metadata is missing or
      unreadable); damage to tensor data is reported in the result instead.

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> path = tempfile.mkdtemp() + "/toy"
    >>> _ = jr.save(ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0)), path, progress=False)
    >>> result = verify_store(path, progress=False)
    >>> result.ok, result.checksummed, result.chunks > 2
    (True, True, True)
  """
  store = UnitStore.open(path, require_unit_chunks=False, max_cached_shards=1, spare_unit_buffers=0)
  try:
    jobs = _chunk_jobs(store)
    checksummed = checksums(store) == "crc32c"
    total = sum(job[3] for job in jobs)
    with progress_bar(total, desc="verify", progress=progress) as bar:
      damaged = _read_all(store, jobs, bar)
  finally:
    store.close()
  return VerifyResult(
    path=path,
    checksummed=checksummed,
    chunks=len(jobs),
    nbytes=sum(job[3] for job in jobs),
    damaged=tuple(damaged),
  )


#: One chunk to read: the tensor's path, its unit (None for a static tensor), its expert
#: (None unless stored one chunk per expert), its bytes.
_Job = tuple[ParamPath, int | None, int | None, int]


def _chunk_jobs(store: UnitStore) -> list[_Job]:
  """Every chunk of the store: each static tensor whole, each unit of each stack (each
  expert of a unit, for a tensor stored one chunk per expert)."""
  jobs: list[_Job] = [
    (p, None, None, tensor_nbytes(shape, dtype)) for p, (shape, dtype) in store.static_specs.items()
  ]
  for k, stack in enumerate(store.stored_stacks):
    for rel, (shape, dtype) in store.stack_specs(k).items():
      path = stack.prefix + rel
      if per_expert(stack.arrays[rel]):
        one = tensor_nbytes(shape[1:], dtype)
        jobs += [(path, i, e, one) for i in range(stack.count) for e in range(shape[0])]
      else:
        jobs += [(path, i, None, tensor_nbytes(shape, dtype)) for i in range(stack.count)]
  return jobs


def _read_all(store: UnitStore, jobs: Sequence[_Job], bar: Any) -> list[Damage]:
  """Reads every chunk, at most `VERIFY_IN_FLIGHT_BYTES` in flight (one chunk more when
  a chunk is larger), and returns each failure, typed by `read_error`."""
  damaged: list[Damage] = []
  pending: collections.deque[tuple[ParamPath, int | None, int | None, int, Any]] = (
    collections.deque()
  )
  in_flight = 0

  def finish() -> None:
    nonlocal in_flight
    tensor_path, unit, expert, nbytes, future = pending.popleft()
    in_flight -= nbytes
    try:
      future.result()
    except Exception as e:  # noqa: BLE001 - every failure is listed, typed by read_error
      error = read_error(e, store.path, path_str(tensor_path), unit)
      damaged.append(
        Damage(
          path_str(tensor_path),
          unit,
          isinstance(error, errors.StoreCorruptionError),
          str(error),
          expert,
        )
      )
    bar.update(nbytes)

  for tensor_path, unit, expert, nbytes in jobs:
    handle = store.array_handle(tensor_path)
    index = () if unit is None else unit if expert is None else (unit, expert)
    pending.append((tensor_path, unit, expert, nbytes, handle[index].read()))
    in_flight += nbytes
    while in_flight > VERIFY_IN_FLIGHT_BYTES and len(pending) > 1:
      finish()
  while pending:
    finish()
  return damaged


def checksums(store: UnitStore) -> str:
  """Which arrays of an open store carry chunk checksums: ``"crc32c"`` (all of them),
  ``"none"``, or ``"some"``."""
  found = set()
  units = [s.prefix + rel for k, s in enumerate(store.stacks) for rel in store.stack_specs(k)]
  for path in [*store.static_specs, *units]:
    metadata = store.array_handle(path).spec().to_json().get("metadata", {})
    found.add(has_checksum_codec(metadata.get("codecs")))
  return "crc32c" if found == {True} else "some" if True in found else "none"


def has_checksum_codec(codecs: Any) -> bool:
  """Whether a zarr3 codec list (sharded or not) ends its chunks with a ``crc32c``."""
  if not isinstance(codecs, list):
    return False
  for codec in codecs:
    if not isinstance(codec, dict):
      continue
    if codec.get("name") == "crc32c":
      return True
    if codec.get("name") == "sharding_indexed":
      inner = (codec.get("configuration") or {}).get("codecs")
      if has_checksum_codec(inner):
        return True
  return False
