"""Progress of long work (saving, converting, verifying, reading weights) on stderr.

``progress=None`` (the library's default) shows a bar where stderr is a terminal, and
where it is not (a log file, a CI job, a pipe) a plain line every 10% of the work or
every `LINE_SECONDS`, whichever comes first, once the work has run `LINE_START_SECONDS`
(short work stays quiet, as a bar that tqdm draws for under a second would), so a
multi-GB conversion is never silent; ``True`` always shows the bar, ``False`` shows
nothing.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

import tqdm

from jax_residency._src.policy.sizes import format_bytes

#: At least this many seconds apart, a line-progress prints a line anyway.
LINE_SECONDS = 30.0
#: A line-progress prints nothing before its work has run this long.
LINE_START_SECONDS = 5.0


class LineProgress:
  """Progress as plain lines: ``desc: 40% (1.2 GiB of 3.0 GiB)``.

  Example:
    >>> import io
    >>> out = io.StringIO()
    >>> with LineProgress(total=100, desc="save", unit="B", file=out, start_s=0) as bar:
    ...   for _ in range(4):
    ...     bar.update(25)
    >>> print(out.getvalue().strip().splitlines()[-1])
    save: 100% (100 B of 100 B)
  """

  def __init__(
    self,
    total: float,
    desc: str,
    unit: str = "B",
    file: TextIO | None = None,
    start_s: float | None = None,
  ):
    self.total, self.desc, self.unit = total, desc, unit
    self.n = 0.0
    self._file = file
    self._next_tenth = 1
    self._last = self._start = time.monotonic()
    self._quiet_s = LINE_START_SECONDS if start_s is None else start_s

  def _size(self, n: float) -> str:
    return format_bytes(int(n)) if self.unit == "B" else f"{n:,.0f} {self.unit}"

  def _emit(self) -> None:
    share = 100 * self.n / self.total if self.total else 100.0
    line = f"{self.desc}: {share:.0f}% ({self._size(self.n)} of {self._size(self.total)})"
    print(line, file=self._file or sys.stderr, flush=True)
    self._last = time.monotonic()

  def update(self, n: float = 1) -> None:
    self.n += n
    now = time.monotonic()
    if now - self._start < self._quiet_s:
      return
    tenth = int(10 * self.n / self.total) if self.total else 10
    if tenth >= self._next_tenth or now - self._last >= LINE_SECONDS:
      self._next_tenth = tenth + 1
      self._emit()

  def close(self) -> None:
    pass

  def __enter__(self) -> LineProgress:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def progress_bar(
  total: float, *, desc: str, progress: bool | None, unit: str = "B", leave: bool = True
) -> Any:
  """A tqdm bar, a `LineProgress` or a disabled bar, as ``progress`` says (see above);
  each has ``update(n)``, ``close()`` and works as a context manager."""
  if progress is None and not sys.stderr.isatty():
    return LineProgress(total, desc, unit)
  scale = {"unit_scale": True, "unit_divisor": 1024} if unit == "B" else {}
  return tqdm.tqdm(
    total=total, desc=desc, unit=unit, disable=progress is False, leave=leave, **scale
  )
