"""Terminal output of the ``jax-residency`` command: one-line errors, tables, sizes."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any

PROG = "jax-residency"


class CommandError(Exception):
  """A mistake the user can fix (bad argument, missing file); one line on stderr, exit code 2."""


def one_line(text: str, *, limit: int = 600) -> str:
  """``text`` on one line; past ``limit`` characters, its middle is elided."""
  line = " ".join(str(text).split())
  if len(line) <= limit:
    return line
  head, tail = line[: limit * 2 // 3], line[-(limit // 3) :]
  return f"{head} ... ({len(line) - len(head) - len(tail)} characters elided) ... {tail}"


def emit(text: str) -> None:
  """Prints ``text``, replacing characters stdout's encoding cannot show."""
  try:
    print(text)
  except UnicodeEncodeError:
    enc = sys.stdout.encoding or "ascii"
    print(text.encode(enc, "replace").decode(enc))


def emit_json(data: Any) -> None:
  print(json.dumps(data, indent=2, sort_keys=False))


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

  def line(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

  return [line(headers), *(line(r) for r in rows)]


def status(message: str) -> None:
  print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def can_encode(text: str) -> bool:
  try:
    text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
  except (UnicodeEncodeError, LookupError):
    return False
  return True


def plural(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def fmt_seconds(seconds: float) -> str:
  return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def fmt_bytes(n: int | None) -> str:
  from jax_residency._src.policy.sizes import format_bytes  # noqa: PLC0415

  return format_bytes(n)


def quantize_flags(args: argparse.Namespace) -> dict[str, Any] | None:
  """``--quantize`` / ``--group-size`` as a ``quantize=`` value (None without them)."""
  if args.group_size is not None and args.quantize != "int4":
    raise CommandError(f"--group-size {args.group_size} is for --quantize int4; leave it out")
  if args.quantize is None:
    return None
  return {"scheme": args.quantize, "group_size": args.group_size}
