"""What the dense stream reads through: the `UnitReader` protocol (docs/design.md, 4.2).

The stream (`stream/`) reads units, hints the kernel, bounds and releases read buffers and
reads counters through these members and nothing else. Every member is required: a
reader with nothing to do for one (no page cache to hint, no mapped pages to retire)
implements it as a no-op that returns 0 or False. `UnitStore` is the reader of every
store, local or remote; tests may give the stream any other object with these members.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jax_residency._src.store.stored_stack import StoredStack
from jax_residency._src.typing import ParamPath

#: Per-tensor boxes of a unit to read (a process's share of each tensor), or None: all of it.
Index = Mapping[ParamPath, tuple[Any, ...]] | None


@dataclasses.dataclass(frozen=True)
class ReadCounters:
  """A reader's counters at one moment, each since the reader opened except the peak.

  Attributes:
    advised_bytes: chunk bytes found out of the page cache and asked for ahead
      (`UnitReader.advise_unit`) or faulted in by mapped reads.
    mapped_bytes: tensor bytes that reads mapped in place of copying.
    fetched_bytes: bytes fetched from the reader's storage, metadata included.
    buffer_bytes: bytes of unit buffers alive now, mapped chunk ranges included.
    buffer_peak_bytes: most bytes of unit buffers (live and idle) and mapped ranges
      held at once since `UnitReader.reset_buffer_peak`.
  """

  advised_bytes: int = 0
  mapped_bytes: int = 0
  fetched_bytes: int = 0
  buffer_bytes: int = 0
  buffer_peak_bytes: int = 0


class PendingRead(Protocol):
  """A unit read in flight (`unit_reads.UnitRead` is one)."""

  def result(self, timeout: float | None = None) -> Mapping[Any, np.ndarray]: ...

  def done(self) -> bool: ...

  def cancel(self) -> None: ...


class UnitReader(Protocol):
  """What the dense stream needs of a store."""

  @property
  def path(self) -> str:
    """Where the units are, as errors name it."""
    ...

  @property
  def unit_count(self) -> int:
    """Units over all stacks; ids run through the stacks in order."""
    ...

  @property
  def stored_stacks(self) -> tuple[StoredStack, ...]:
    """Every stack, with its arrays' chunking (which tensors hold experts a chunk each)."""
    ...

  def read_unit(
    self, i: int, *, index: Index = None, skip: Collection[ParamPath] = ()
  ) -> Mapping[ParamPath, np.ndarray]:
    """Unit ``i``'s tensors keyed by path relative to its stack: only the boxes of
    ``index`` if given, without the tensors in ``skip``."""
    ...

  def read_unit_async(
    self, i: int, *, index: Index = None, skip: Collection[ParamPath] = ()
  ) -> PendingRead:
    """Issues `read_unit`'s read and returns at once."""
    ...

  def read_experts_async(
    self,
    i: int,
    experts: Sequence[int],
    tensors: Sequence[ParamPath],
    *,
    into: Mapping[ParamPath, np.ndarray] | None = None,
  ) -> PendingRead:
    """Issues the read of only ``experts``' chunks of unit ``i``'s ``tensors``."""
    ...

  def advise_unit(self, i: int, *, experts: bool = True) -> int:
    """Asks the kernel to read unit ``i``'s chunks into the page cache, without waiting;
    returns the bytes asked for (0 where there is nothing to ask)."""
    ...

  def retire_mapped(self, arrays: Any) -> int:
    """Lets go of the pages of mapped unit arrays whose last step has completed; returns
    the bytes retired (0 where reads map nothing)."""
    ...

  def limit_buffers(self, units: int | None, *, reclaim: Callable[[], None] | None = None) -> None:
    """Holds read buffers, live and idle, to ``units`` whole-unit buffers."""
    ...

  def use_mapped_reads(self) -> bool:
    """Maps whole-unit reads where it can in place of copying; returns whether any can."""
    ...

  def read_counters(self) -> ReadCounters:
    """The counters now."""
    ...

  def reset_buffer_peak(self) -> None:
    """Starts `ReadCounters.buffer_peak_bytes` over from the buffers held now."""
    ...
