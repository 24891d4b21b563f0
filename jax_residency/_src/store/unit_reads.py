"""Reading one unit: `issue_unit_read` starts the copies, `UnitRead` is their future.

All tensors of a unit are read concurrently into one pooled slab (see
`buffers.BufferPool`); large tensors are copied in pieces of `READ_PIECE_BYTES`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store import remote
from jax_residency._src.store.buffers import BufferPool, buffer_layout
from jax_residency._src.typing import path_str

#: Bytes a unit read copies per request: larger tensors are read in pieces.
READ_PIECE_BYTES = 32 << 20


class UnitRead:
  """The pending read of one unit; `result()` returns its tensors.

  All tensors of the unit are read concurrently. Errors surface from `result()`
  as `StoreError` naming the tensor, the unit and the store.
  """

  def __init__(
    self,
    unit: int,
    arrays: Mapping[Any, np.ndarray],
    futures: Sequence[tuple[Any, Any]],
    where: str,
    prefix: tuple[str, ...] = (),
    timeout_s: float | None = None,
    attempts: int | None = None,
    on_timeout: Callable[[], None] | None = None,
  ):
    self.unit = unit
    #: The unit's id in the store (`unit` is its index in its stack).
    self.id = unit
    self._prefix = prefix
    self._arrays = dict(arrays)
    self._futures = list(futures)
    self._where = where
    self._timeout_s = timeout_s
    self._attempts = attempts
    self._on_timeout = on_timeout
    self._issued = time.monotonic()
    self.nbytes = sum(a.nbytes for a in self._arrays.values())
    #: The tensors read through TensorStore (not mapped, not read directly).
    self.tensorstore_keys: list[Any] = []

  def done(self) -> bool:
    return all(f.done() for _, f in self._futures)

  def cancel(self) -> None:
    """Cancels the reads not yet finished (best effort); `result()` then raises."""
    for _, future in self._futures:
      future.cancel()

  def result(self, timeout: float | None = None) -> dict[Any, np.ndarray]:
    """The unit's tensors, once every copy finished.

    Raises:
      TimeoutError: not done within ``timeout`` seconds (the read goes on).
      StoreTimeoutError: without ``timeout``, not done within the store's
        ``ReadOptions.timeout_s`` from when the read was issued (it is cancelled).
      StoreError: a copy failed (`read_error`).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    own = timeout is None and self._timeout_s is not None
    if own:
      deadline = self._issued + (self._timeout_s or 0.0)
    for key, future in self._futures:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      try:
        future.result(timeout=left)
      except TimeoutError:
        if not own:
          raise
        self.cancel()  # the buffer stays alive while a cancelled copy still holds it
        if self._on_timeout is not None:
          self._on_timeout()
        raise remote.timed_out(self._where, f"unit {self.id}", self._timeout_s or 0.0) from None
      except errors.StoreError:  # a direct read's or a mapped check's: typed already
        self._settle()
        raise
      except Exception as e:  # TensorStore reports IO errors as ValueError.
        self._settle()
        tensor = path_str(self._prefix + tuple(key))
        raise read_error(e, self._where, tensor, self.unit, attempts=self._attempts) from e
    self._futures.clear()
    return dict(self._arrays)

  def _settle(self) -> None:
    """Waits for every read still writing into this unit's buffer, so that a failed
    read does not hand the buffer back for reuse while a copy still lands in it."""
    for _, future in self._futures:
      try:
        future.result()
      except Exception:  # noqa: BLE001 - the first error is the one raised (again if asked)
        pass


def read_error(
  error: BaseException, where: str, tensor: str, unit: int | None, *, attempts: int | None = None
) -> errors.StoreError:
  """The typed error for a failed TensorStore read of ``tensor`` (of unit ``unit``,
  or a static tensor when None) from the store ``where``.

  A chunk whose data does not match its checksum (TensorStore's ``DATA_LOSS``
  "Digest mismatch") gives `StoreCorruptionError`; any other failure `StoreError`.
  """
  what = f"tensor {tensor!r}" if unit is None else f"unit {unit} of tensor {tensor!r}"
  text = str(error)
  down = remote.unavailable(error, where, what, attempts)
  if down is not None:
    return down
  if "DATA_LOSS" in text and "igest mismatch" in text:
    return errors.StoreCorruptionError(
      f"{what[0].upper()}{what[1:]} in the store {where} is corrupt: its data does not match "
      f"its checksum ({text}). The store's files changed after it was written: write it again "
      "from the original model or checkpoint (`jax-residency verify PATH` lists every damaged "
      "tensor).",
      store=where,
      tensor=tensor,
      unit=unit,
    )
  return errors.StoreError(f"Reading {what} from {where} failed: {text}. {read_advice(text)}")


def read_advice(text: str) -> str:
  """What to do about a failed store read, from TensorStore's error text."""
  if "PERMISSION_DENIED" in text or "Permission denied" in text:
    return "Check the permissions of the store's files: this process cannot read them."
  return "Check that the store is complete and readable."


def issue_unit_read(
  unit: int,
  sources: Sequence[tuple[Any, ts.TensorStore]],
  pool: BufferPool,
  where: str,
  *,
  ready: Mapping[Any, np.ndarray] | None = None,
  prefix: tuple[str, ...] = (),
  whole: Collection[Any] = (),
  direct: Callable[[Any, np.ndarray], Any] | None = None,
  pending: Sequence[tuple[Any, Any]] = (),
  timeout_s: float | None = None,
  attempts: int | None = None,
  on_timeout: Callable[[], None] | None = None,
  serial: Collection[Any] = (),
  decoder: concurrent.futures.Executor | None = None,
  into: Mapping[Any, np.ndarray] | None = None,
) -> UnitRead:
  """Starts copying each `(key, source)` view into one pooled slab; `ready` arrays
  (mapped, not read) join the result as they are. Errors name a tensor by its full
  path, ``prefix`` + key. Tensors in ``whole`` are read in one request (their chunk
  must be decoded or checked whole, so pieces would each read all of it).
  ``direct(key, out)``, where given, may start a read of the whole tensor into
  ``out`` itself and return its future (None: TensorStore reads it). ``pending``
  futures (the checks of mapped chunks) must succeed too before `result` returns;
  ``timeout_s`` bounds the whole read (see `UnitRead.result`; ``on_timeout`` is
  called when it runs out); ``attempts`` is how many tries a failed request had.
  Tensors in ``serial`` (whose chunk holds several units, so a read decodes all of
  it) are read one after another on ``decoder``, a one-thread pool the store
  shares between its reads: at most one such chunk is decoded at a time. With
  ``into``, each key's data lands in the caller's array there instead of a pooled one."""
  if into is not None:
    buffers = {str(i): into[key] for i, (key, _) in enumerate(sources)}
  else:
    specs = [(str(i), tuple(s.shape), s.dtype.numpy_dtype) for i, (_, s) in enumerate(sources)]
    layout, nbytes = buffer_layout(specs)
    buffers = pool.lease(layout, nbytes)
  arrays: dict[Any, np.ndarray] = dict(ready or {})
  futures = list(pending)
  through_ts = []
  for i, (key, src) in enumerate(sources):
    out = buffers[str(i)]
    arrays[key] = out
    if not out.size:
      continue
    future = direct(key, out) if direct is not None else None
    if future is not None:
      futures.append((key, future))
      continue
    src = src.translate_to[0]
    through_ts.append(key)
    if key in serial and decoder is not None:
      futures.append((key, decoder.submit(_copy, out, src)))
      continue
    # Large tensors are copied in leading-axis pieces: more copies run at once and
    # each touches less memory (page-cache reads measured ~1.8x faster on 2 cores).
    rows = out.shape[0] if out.ndim else 1
    step = (
      rows
      if out.ndim == 0 or key in whole
      else max(1, READ_PIECE_BYTES // max(1, out.nbytes // rows))
    )
    for start in range(0, rows, step):
      stop = min(start + step, rows)
      piece = (out, src) if step >= rows else (out[start:stop], src[start:stop].translate_to[0])
      futures.append((key, ts.array(piece[0], copy=False, write=True).write(piece[1])))
  read = UnitRead(unit, arrays, futures, where, prefix, timeout_s, attempts, on_timeout)
  read.tensorstore_keys = through_ts
  return read


def _copy(out: np.ndarray, src: ts.TensorStore) -> None:
  ts.array(out, copy=False, write=True).write(src).result()


def in_order(
  read_async: Callable[[int], UnitRead], indices: Iterable[int], in_flight: int
) -> Iterator[tuple[int, dict[Any, np.ndarray]]]:
  """Yields ``(id, tensors)`` for each unit of ``indices`` in order, keeping ``in_flight``
  reads (started by ``read_async(i)``) ahead."""
  if in_flight < 1:
    raise errors.StoreError(f"read_units needs in_flight >= 1; got {in_flight=}.")
  pending: collections.deque[UnitRead] = collections.deque()
  todo = iter(indices)
  for i in todo:
    pending.append(read_async(i))
    if len(pending) >= in_flight:
      break
  while pending:
    head = pending.popleft()
    nxt = next(todo, None)
    if nxt is not None:
      pending.append(read_async(nxt))
    yield head.id, head.result()
