"""Byte sizes: parsing "512MiB"-style strings to ints and formatting ints for people.

Budgets in jax_residency are `int | None` numbers of bytes, `None` meaning
unbounded. This module converts between those ints and the strings people
write: IEC units (`KiB`, `MiB`, `GiB`, `TiB`) are powers of 1024, SI units
(`kB`, `MB`, `GB`, `TB`) are powers of 1000, and units are case-insensitive.
"""

from __future__ import annotations

import numbers
import re
import reprlib
from fractions import Fraction

from jax_residency._src.errors import InvalidBudgetError

KiB = 1024
MiB = 1024**2
GiB = 1024**3
TiB = 1024**4
#: The largest byte size `parse_bytes` accepts (int64's maximum, 8 EiB); None is unbounded.
MAX_BYTES = 2**63 - 1

_UNITS: dict[str, int] = {
  "": 1,
  "b": 1,
  "kb": 1000,
  "kib": KiB,
  "mb": 1000**2,
  "mib": MiB,
  "gb": 1000**3,
  "gib": GiB,
  "tb": 1000**4,
  "tib": TiB,
}
_UNBOUNDED = ("none", "unbounded")
_SIZE_RE = re.compile(r"(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[a-z]*)")
_FORMAT_UNITS = ((TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB"))

_ACCEPTED_FORMS = (
  "a non-negative int number of bytes (e.g. 123), a string such as '512MiB', '4 GiB',"
  " '1.5GB', '100kB', '0' or '123' that is a whole number of bytes (units B, kB, KiB,"
  " MB, MiB, GB, GiB, TB, TiB, case-insensitive; KiB = 1024 B, kB = 1000 B),"
  " or None / 'none' / 'unbounded' for no limit"
)


def _shown(x: object) -> str:
  """``repr(x)``, abbreviated past a few dozen characters (and for ints too long to print)."""
  if isinstance(x, numbers.Integral) and int(x).bit_length() > 200:
    return f"<an int of about {int(x).bit_length() * 30103 // 100000 + 1} digits>"
  return reprlib.repr(x)


def _invalid(x: object, name: str | None, reason: str) -> InvalidBudgetError:
  subject = f"{name}={_shown(x)}" if name else _shown(x)
  return InvalidBudgetError(f"{subject} {reason}. Pass {_ACCEPTED_FORMS}.")


def _too_large(x: object, name: str | None) -> InvalidBudgetError:
  return _invalid(x, name, f"is larger than MAX_BYTES = {MAX_BYTES} (8 EiB)")


def parse_bytes(x: int | str | None, *, name: str | None = None) -> int | None:
  """Parses a byte size into an int number of bytes, or `None` for unbounded.

  Args:
    x: a non-negative int (not a bool), a size string such as `"512MiB"`,
      `"4 GiB"`, `"1.5GB"`, `"100kB"`, `"0"` or `"123"`, or `None` /
      `"none"` / `"unbounded"` (case-insensitive) for no limit. The string must
      denote a whole number of bytes, at most `MAX_BYTES`.
    name: the field being parsed, used in error messages (`name=value`).

  Returns:
    The number of bytes, or `None` for unbounded.

  Raises:
    InvalidBudgetError: `x` is negative, larger than `MAX_BYTES`, a bool or
      float, not a whole number of bytes, or not a size string (`"1e9"`,
      `"inf"` and `"nan"` are not); the message names the value (abbreviated
      if long) and lists the accepted forms.

  Example:
    >>> parse_bytes("512MiB")
    536870912
    >>> parse_bytes("1.5GB")
    1500000000
    >>> parse_bytes(123), parse_bytes("unbounded")
    (123, None)
  """
  if x is None:
    return None
  if isinstance(x, bool):
    raise _invalid(x, name, "is a bool, not a byte size")
  if isinstance(x, numbers.Integral):
    if x < 0:
      raise _invalid(x, name, "is negative")
    if x > MAX_BYTES:
      raise _too_large(x, name)
    return int(x)
  if not isinstance(x, str):
    raise _invalid(x, name, f"has type {type(x).__name__}, not int, str or None")
  text = x.strip().lower()
  if text in _UNBOUNDED:
    return None
  match = _SIZE_RE.fullmatch(text)
  if match is None:
    raise _invalid(x, name, "is not a byte size")
  unit = match["unit"]
  if unit not in _UNITS:
    raise _invalid(x, name, f"has unknown unit {reprlib.repr(unit)}")
  try:
    exact = Fraction(match["number"]) * _UNITS[unit]
  except ValueError:  # more digits than Python converts to an int (sys.get_int_max_str_digits)
    raise _invalid(x, name, f"has too many digits ({len(match['number'])})") from None
  if exact > MAX_BYTES:
    raise _too_large(x, name)
  if exact.denominator != 1:
    raise _invalid(x, name, f"is not a whole number of bytes ({float(exact)} B)")
  return int(exact)


def format_bytes(n: int | None) -> str:
  """Formats a number of bytes for people, in IEC units with one decimal.

  Args:
    n: a number of bytes, or `None` for unbounded.

  Returns:
    `"17 B"` below 1 KiB, else e.g. `"512.0 MiB"` or `"4.0 GiB"` (the largest
    unit up to TiB that keeps the number at least 1, rounded to one decimal);
    `"unbounded"` for `None`.

  Raises:
    InvalidBudgetError: `n` is not an int (bools and floats are rejected).

  Example:
    >>> format_bytes(4 * GiB), format_bytes(512 * MiB), format_bytes(17)
    ('4.0 GiB', '512.0 MiB', '17 B')
    >>> format_bytes(None)
    'unbounded'
  """
  if n is None:
    return "unbounded"
  if isinstance(n, bool) or not isinstance(n, numbers.Integral):
    raise InvalidBudgetError(
      f"format_bytes got n={_shown(n)}; pass an int number of bytes or None."
    )
  sign = "-" if n < 0 else ""
  size = abs(int(n))
  for index, (scale, unit) in enumerate(_FORMAT_UNITS):
    if size < scale:
      continue
    text = f"{size / scale:.1f}"
    if float(text) >= 1024 and index > 0:  # 1023.96 KiB rounds up to 1.0 MiB.
      scale, unit = _FORMAT_UNITS[index - 1]
      text = f"{size / scale:.1f}"
    return f"{sign}{text} {unit}"
  return f"{sign}{size} B"
