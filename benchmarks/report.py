"""Renders the figures in the README and the docs from the benchmarks' result files.

Every benchmark writes its result to ``benchmarks/results/<name>.json``
(``benchmarks/_result.py``; a script with several modes writes one file per mode). A
Markdown file shows a result's figures between two markers naming its file::

    <!-- report: decode -->
    ...rendered here, never typed...
    <!-- /report -->

(``<!-- report: decode brief -->``: the table, and one line counting the checks.)

This script replaces what lies between each pair with the rendering of that
benchmark's result: a line stamping it (date, commit, machine, command), the
benchmark's own table (its ``markdown(result)`` function, where it has one) and its
checks with their verdicts.

    python benchmarks/report.py            # rewrite the marked sections in place
    python benchmarks/report.py --check    # exit 1 if a section differs from its rendering

The suite runs ``--check``, so a figure in the documentation is always the one the
committed result file holds.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
#: The Markdown files that may hold marked sections.
DOCUMENTS = (
  "README.md",
  "docs/benchmarks.md",
  "docs/quantization.md",
  "docs/checkpoints.md",
  "docs/placement.md",
  "docs/moe.md",
  "docs/speculative.md",
  "docs/throughput.md",
)
SECTION = re.compile(r"(<!-- report: ([\w-]+)( brief)? -->\n)(.*?)(<!-- /report -->)", re.S)

sys.path.insert(0, str(HERE))
import _result  # noqa: E402 - benchmarks/ is not a package


def load(name: str) -> dict[str, Any]:
  path = RESULTS / f"{name}.json"
  try:
    return json.loads(path.read_text())
  except FileNotFoundError:
    raise SystemExit(f"{path}: no result; run `python benchmarks/{name}.py` first") from None


def module(name: str) -> ModuleType | None:
  """The benchmark's script as a module (importing it runs nothing), if there is one."""
  if not (HERE / f"{name}.py").exists():
    return None
  spec = importlib.util.spec_from_file_location(f"benchmark_{name}", HERE / f"{name}.py")
  assert spec is not None and spec.loader is not None
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def gib(n: float) -> str:
  return f"{n / 2**30:.0f} GiB"


def stamp(result: dict[str, Any]) -> str:
  m = result["machine"]
  cpu = ""
  if m.get("cpu_model"):  # recorded since results carried it
    features = ", ".join(m.get("cpu_features", ())) or "no AVX2"
    cpu = f" ({m['cpu_model']}; {features})"
  return (
    f"Measured {result['date']} at commit {result['commit']} on {m['cpus']} cores{cpu} and "
    f"{gib(m['memory_bytes'])} of memory: `{result['command']}`."
  )


def checks_table(result: dict[str, Any]) -> str:
  quick = bool(result.get("quick"))
  rows = ["| check | kind | measured | verdict |", "|---|---|---|---|"]
  for c in result["checks"]:
    value = json.dumps(c["value"]) if not isinstance(c["value"], str) else c["value"]
    name, value = (s.replace("|", "\\|") for s in (c["name"], value))  # a cell's own bars
    rows.append(f"| {name} | {c['kind']} | {value} | {_result.verdict(c, quick)} |")
  return "\n".join(rows)


def summary(result: dict[str, Any]) -> str:
  """One line: how many checks of each kind held (``brief`` sections)."""
  quick = bool(result.get("quick"))
  out = []
  for kind in (_result.PARITY, _result.TARGET):
    of = [c for c in result["checks"] if c["kind"] == kind]
    if not of:  # a benchmark without targets (or gates) says nothing of them
      continue
    held = [c for c in of if c["ok"]]
    missed = [c["name"] for c in of if not c["ok"]]
    line = f"{len(held)} of {len(of)} {kind} checks held"
    out.append(line + (f" (missed: {'; '.join(missed)})" if missed and not quick else ""))
  return "; ".join(out) + "."


def render(name: str, result: dict[str, Any] | None = None, *, brief: bool = False) -> str:
  """The Markdown that stands between a ``report: name`` marker pair: the stamp, the
  benchmark's table and every check (``brief``: one line counting the checks instead)."""
  result = load(name) if result is None else result
  parts = [stamp(result)]
  mod = module(result["benchmark"])  # a result file may be one of a script's modes
  if mod is not None and hasattr(mod, "markdown"):
    parts.append(mod.markdown(result))
  parts.append(summary(result) if brief else checks_table(result))
  return "\n\n".join(parts) + "\n"


def rewrite(text: str, results: dict[str, dict[str, Any]] | None = None) -> str:
  """``text`` with every marked section replaced by its rendering."""

  def one(m: re.Match) -> str:
    name = m.group(2)
    result = None if results is None else results.get(name)
    return m.group(1) + render(name, result, brief=bool(m.group(3))) + m.group(5)

  return SECTION.sub(one, text)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--check", action="store_true", help="exit 1 if a section is stale")
  args = parser.parse_args(argv)
  stale = []
  for doc in DOCUMENTS:
    path = ROOT / doc
    text = path.read_text()
    new = rewrite(text)
    if new != text:
      stale.append(doc)
      if not args.check:
        path.write_text(new)
  if args.check and stale:
    print(f"stale sections in {', '.join(stale)}: run python benchmarks/report.py")
    return 1
  print(f"{'checked' if args.check else 'rendered'}: {', '.join(DOCUMENTS)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
