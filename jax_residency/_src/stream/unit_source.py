"""Reading one unit for the dense stream, with failures named by unit.

`UnitSource` is what the engine needs of a store (`store.unit_store.UnitStore` is
one). `read_unit` reads a unit now; `start_read` issues its read and returns a callable
that waits for it (where the source reads asynchronously). Either raises the store's
own `StoreError` as it is, and any other failure as a `StoreError` naming the unit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, NoReturn, Protocol

import numpy as np

from jax_residency._src.errors import ClosedError, StoreError
from jax_residency._src.store.buffers import release_dropped_buffers
from jax_residency._src.typing import ParamPath

Index = Mapping[ParamPath, tuple[Any, ...]] | None


class UnitSource(Protocol):
  """What the engine needs from a unit store."""

  @property
  def unit_count(self) -> int: ...

  def read_unit(self, i: int, /, *, index: Index = None) -> Mapping[ParamPath, np.ndarray]: ...


def read_unit(
  source: UnitSource, i: int, index: Index, skip: tuple[ParamPath, ...] = ()
) -> Mapping[ParamPath, np.ndarray]:
  """Unit ``i`` of ``source`` (only the boxes ``index`` names, on a multi-process mesh;
  without the tensors in ``skip``, a unit's experts read apart)."""
  try:
    if skip:
      return source.read_unit_async(i, skip=skip).result()  # type: ignore[attr-defined]
    return source.read_unit(i) if index is None else source.read_unit(i, index=index)
  except (StoreError, ClosedError):
    raise
  except Exception as e:
    raise_read_error(i, e)
    raise  # unreachable


def start_read(
  source: UnitSource, i: int, index: Index, skip: tuple[ParamPath, ...] = ()
) -> Callable[[], Mapping[ParamPath, np.ndarray]]:
  """Issues the read of unit ``i``; the returned callable waits for it."""
  start_async = getattr(source, "read_unit_async", None)
  if start_async is None:
    return lambda: read_unit(source, i, index, skip)
  try:
    if skip:
      pending = start_async(i, skip=skip)
    else:
      pending = start_async(i) if index is None else start_async(i, index=index)
  except Exception as e:  # noqa: BLE001 - re-raised with the unit named
    return functools.partial(raise_read_error, i, e)

  def finish() -> Mapping[ParamPath, np.ndarray]:
    try:
      return pending.result()
    except (StoreError, ClosedError):
      raise
    except Exception as e:
      raise_read_error(i, e)
      raise  # unreachable

  return finish


def raise_read_error(i: int, e: Exception) -> NoReturn:
  if isinstance(e, StoreError | ClosedError):  # already says what happened, and where
    raise e
  raise StoreError(f"reading unit {i} from the store failed: {type(e).__name__}: {e}") from e


def tune_source(
  source: Any, metadata: Any, *, staging: int, unit_bytes: int, multiprocess: bool
) -> None:
  """Bounds ``source``'s read buffers by the plan (``metadata``: `ModelMetadata`), and
  maps reads where it can.

  Idle read buffers are kept for reuse only while every buffer, live or idle, fits
  what the plan gives host-side unit buffers: the host cache, the ``staging`` unit,
  and (CPU) the device window, whose arrays are read buffers. Where device memory is
  host memory, whole units are mapped from the store's files instead of copied (see
  `mapped`): the page cache is the read buffer.
  """
  limit_buffers = getattr(source, "limit_buffers", None)
  if limit_buffers is not None:
    window = metadata.device_window_units if metadata.device_is_host else 0
    cached = metadata.item_bytes("host cache") + staging
    units = window + (cached // unit_bytes if unit_bytes else 0)
    limit_buffers(units, reclaim=release_dropped_buffers)
  use_mapped = getattr(source, "use_mapped_reads", None)
  if use_mapped is not None and metadata.device_is_host and not multiprocess:
    use_mapped()


def retire_finished(source: Any, arrays: Any) -> None:
  """Unmaps the pages of a unit's mapped arrays whose last step has completed, before
  XLA lets go of them (`mapped.UnitMapper.retire`); nothing for other arrays or
  sources."""
  retire = getattr(source, "retire_mapped", None)
  if retire is not None and arrays is not None:
    retire(arrays)
