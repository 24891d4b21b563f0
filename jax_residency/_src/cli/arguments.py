"""The pieces the ``jax-residency`` parsers are built from: a parser whose errors are one
line, argument types (budgets, counts), a subcommand, and the budget flags.

Nothing here imports JAX: ``jax-residency --help`` builds every parser.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn, TypeAlias

from jax_residency._src.cli.console import one_line

#: The help formatter of every parser: descriptions keep their line breaks.
FORMAT = argparse.RawDescriptionHelpFormatter


class Parser(argparse.ArgumentParser):
  """An argument parser whose errors are one line on stderr (exit code 2)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


#: What ``add_subparsers`` gives a `Parser`.
Subcommands: TypeAlias = "argparse._SubParsersAction[Parser]"


def budget(text: str) -> int | None:
  """A budget flag's value: bytes, a size such as ``2GiB``, or ``unbounded`` (None)."""
  from jax_residency._src.policy.sizes import parse_bytes  # noqa: PLC0415

  try:
    return parse_bytes(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(one_line(str(e))) from e


def count(minimum: int) -> Callable[[str], int]:
  """An argument type: an integer of at least ``minimum``."""

  def parse(text: str) -> int:
    try:
      n = int(text)
    except ValueError:
      n = minimum - 1
    if n < minimum:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
    return n

  return parse


def command(
  sub: Subcommands,
  name: str,
  handler: Callable[[argparse.Namespace], int],
  *,
  summary: str,
  description: str,
  epilog: str | None = None,
) -> argparse.ArgumentParser:
  """Adds subcommand ``name`` (``summary`` is its line in ``--help``), run by ``handler``."""
  parser = sub.add_parser(
    name, help=summary, description=description, epilog=epilog, formatter_class=FORMAT
  )
  parser.set_defaults(handler=handler)
  return parser


def add_budgets(
  parser: argparse.ArgumentParser, *, default: object, device_help: str, host_help: str
) -> None:
  """``--device-budget`` and ``--host-budget``: bytes, a size such as 2GiB, or 'unbounded'."""
  for flag, text in (("--device-budget", device_help), ("--host-budget", host_help)):
    parser.add_argument(flag, metavar="BYTES", type=budget, default=default, help=text)
