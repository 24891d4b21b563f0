"""A benchmark's measurements in child processes: the command line of one, its JSON answer.

Every benchmark measures in fresh processes (``python SCRIPT --child ...``): each prints
one JSON object as the last line of its stdout (`answer`), and the parent gathers them.
`flags` writes a child's command line from the parent's options; `run` runs it (through
the zygote, `_zygote.run`) and reads its answer.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable

import _zygote


def answer(result: dict) -> int:
  """A child's side: prints ``result`` as its answer, the last line of its stdout; its
  exit status (0)."""
  print(json.dumps(result))
  return 0


def flags(args: argparse.Namespace, names: Iterable[str]) -> list[str]:
  """``--name value`` for each option ``name`` of ``args`` (``dest`` spelling, written
  with dashes); a ``True`` switch is its flag alone and a ``False`` one nothing."""
  out: list[str] = []
  for name in names:
    value, flag = getattr(args, name), f"--{name.replace('_', '-')}"
    if isinstance(value, bool):
      out += [flag] if value else []
    else:
      out += [flag, str(value)]
  return out


def run(
  script: str,
  *argv: str,
  what: str,
  may_fail: bool = False,
  env: dict[str, str] | None = None,
  timeout: float | None = None,
) -> dict:
  """``python script *argv``'s answer: the JSON object on its last stdout line (``{}``
  when it prints nothing).

  A child that fails shows the end of its output on stderr (a child's stderr, its
  progress bars and warnings, is shown only then) and ends the run with a message naming
  ``what``; with ``may_fail`` it answers ``{"error": ...}`` instead.
  """
  done = _zygote.run(
    [sys.executable, script, *argv], capture_output=True, text=True, env=env, timeout=timeout
  )
  if done.returncode:
    sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
    if may_fail:
      tail = done.stderr.strip().splitlines()[-1:] or [""]
      return {"error": f"exit {done.returncode}: {tail[0]}"}
    raise SystemExit(f"{what} failed (exit {done.returncode})")
  out = done.stdout.strip()
  return json.loads(out.splitlines()[-1]) if out else {}
