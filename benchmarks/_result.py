"""What every benchmark's result carries, and how its exit status follows from its checks.

Each script in ``benchmarks/`` builds one JSON object: its figures, a ``stamp`` (which
benchmark, the commit, the date, the machine, the command) and a list of ``checks``.
A check is a parity gate (``kind="parity"``: the outputs agree with the plain model,
or with the peer's reference) or a performance target (``kind="target"``). A script
exits 1 when a parity gate fails, and when a target is missed unless it ran with
``--quick`` (toy size: the same code paths, figures that mean nothing).

A full run writes its object to ``benchmarks/results/<name>.json`` (``--result PATH``
elsewhere); ``benchmarks/report.py`` renders the README's tables from those files.
A ``--quick`` run writes only where ``--result`` says.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PARITY, TARGET = "parity", "target"


def add_args(parser: argparse.ArgumentParser) -> None:
  """``--quick``, ``--json`` and ``--result``, the options every benchmark takes."""
  parser.add_argument(
    "--quick",
    action="store_true",
    help="toy size, under a minute: checks the parity gates, reports but ignores the targets",
  )
  parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
  parser.add_argument(
    "--result",
    help="write the result here (default: benchmarks/results/NAME.json; none with --quick)",
  )


def quick_requested() -> bool:
  """Whether the command line asks for ``--quick`` (before the parser that uses it to
  pick its defaults is built)."""
  pre = argparse.ArgumentParser(add_help=False)
  pre.add_argument("--quick", action="store_true")
  return pre.parse_known_args()[0].quick


def quick_sizes(args: argparse.Namespace, parser: argparse.ArgumentParser, sizes: dict) -> None:
  """With ``--quick``, the toy ``sizes`` (option dest -> value) for every option the
  command line left at its default; an option given explicitly keeps its value."""
  if args.quick:
    for name, small in sizes.items():
      if getattr(args, name) == parser.get_default(name):
        setattr(args, name, small)


@contextlib.contextmanager
def work_dir(args: argparse.Namespace, name: str) -> Iterator[str]:
  """Sets ``args.dir`` for the run: as given; else with ``--quick`` a fresh temporary
  directory, removed afterwards; else ``$TMPDIR/name`` (``name`` itself if absolute), kept
  for later runs to reuse."""
  scratch = None
  if args.dir is None:
    if args.quick:
      args.dir = scratch = tempfile.mkdtemp(prefix=f"{os.path.basename(name)}_quick_")
    else:
      args.dir = os.path.join(tempfile.gettempdir(), name)
  args.dir = os.path.abspath(args.dir)
  try:
    yield args.dir
  finally:
    if scratch is not None:
      shutil.rmtree(scratch, ignore_errors=True)


def commit(*paths: str) -> str:
  """The short commit of the checkout, ``+dirty`` when the library or ``paths`` differ."""
  try:
    head = subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(
      ["git", "diff", "--quiet", "HEAD", "--", "jax_residency", *paths], cwd=ROOT, check=False
    )
  except (OSError, subprocess.CalledProcessError):
    return "unknown"
  return head + ("+dirty" if dirty.returncode else "")


#: CPU features that change which kernel loops run (matvec.cc) and how llama.cpp builds.
CPU_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8")


def machine() -> dict[str, Any]:
  """Cores, memory, platform, and the CPU's model and vector features (VMs of one name
  differ: the same benchmark ran on Sapphire Rapids and on AVX2-only EPYC hosts)."""
  memory, model, flags = 0, platform.processor(), set()
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemTotal:"):
          memory = int(line.split()[1]) * 1024
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
          model = value.strip()
        elif key.strip() == "flags":
          flags = set(value.split())
  except OSError:
    pass
  return {
    "cpus": os.cpu_count(),
    "memory_bytes": memory,
    "platform": platform.platform(),
    "python": platform.python_version(),
    "cpu_model": model,
    "cpu_features": [f for f in CPU_FEATURES if f in flags],
  }


def stamp(name: str, argv: list[str] | None, quick: bool) -> dict[str, Any]:
  """Which benchmark ran, where, when and how: the fields every result starts with."""
  args = sys.argv[1:] if argv is None else argv
  return {
    "benchmark": name,
    "commit": commit(f"benchmarks/{name}.py"),
    "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    "machine": machine(),
    "command": shlex.join(["python", f"benchmarks/{name}.py", *args]),
    "quick": quick,
  }


def text_table(header: list[str], rows: list[list[str]]) -> str:
  """``rows`` under ``header``, each column padded to its widest cell (a terminal's table)."""
  table = [header, *rows]
  widths = [max(len(r[i]) for r in table) for i in range(len(header))]
  return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in table)


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
  """``rows`` under ``header`` as the lines of a Markdown table."""
  out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  return out + ["| " + " | ".join(r) + " |" for r in rows]


def check(checks: list[dict], name: str, ok: bool, value: Any, kind: str = TARGET) -> None:
  """Appends one check: its name, whether it held, the value it looked at, and its kind."""
  if kind not in (PARITY, TARGET):
    raise ValueError(f"check kind {kind!r}: expected {PARITY!r} or {TARGET!r}")
  checks.append({"name": name, "kind": kind, "ok": bool(ok), "value": value})


def failed(checks: list[dict], quick: bool) -> list[dict]:
  """The checks that fail the run: every failed parity gate, and missed targets unless quick."""
  return [c for c in checks if not c["ok"] and (c["kind"] == PARITY or not quick)]


def verdict(c: dict, quick: bool) -> str:
  if c["kind"] == TARGET and quick:
    return "not checked (--quick)" if not c["ok"] else "met (not checked: --quick)"
  return "met" if c["ok"] else ("FAILED" if c["kind"] == PARITY else "MISSED")


def lines(checks: list[dict], quick: bool) -> list[str]:
  """One line per check, with its verdict; the last says whether the run passes."""
  out = [f"  [{c['kind']}] {c['name']}: {verdict(c, quick)} ({c['value']})" for c in checks]
  bad = failed(checks, quick)
  out.append("all checks passed" if not bad else f"{len(bad)} check(s) failed or missed")
  return out


def finish(result: dict[str, Any], args: argparse.Namespace, render: Any = None) -> int:
  """Writes ``result`` where it goes, prints it (JSON or ``render(result)`` and the
  checks), and returns the exit status: 1 when a check fails the run (:func:`failed`)."""
  quick = bool(result.get("quick"))
  checks = result.setdefault("checks", [])
  result["ok"] = not failed(checks, quick)
  path = args.result or (None if quick else str(RESULTS / f"{result['benchmark']}.json"))
  if path:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
      json.dump(result, f, indent=1)
      f.write("\n")
    os.replace(tmp, path)
  if args.json:
    print(json.dumps(result))
  else:
    if render is not None:
      print(render(result))
    print("\n".join(lines(checks, quick)))
  return 0 if result["ok"] else 1
