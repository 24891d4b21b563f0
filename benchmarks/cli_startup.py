"""How long the command line takes to answer ``--help``: the top level and each command's.

Each ``jax-residency ... --help`` runs in a fresh process (``python -m jax_residency``, as
the installed ``jax-residency`` script runs it), ``--repeat`` times in turn; a figure is
the median wall time of a command's processes, from start to exit. Python's own start
(``python -c pass``) is timed the same way beside them, the absolute anchor: what no
command can take less than.

Parity gate: each help page prints its usage line and exits 0, and no help page imports
JAX (a child's ``-X importtime`` list of modules holds no ``jax`` module): a command
imports JAX only when it runs (docs/cli.md). Target: every help page within 0.3 s, on the
medians. Exits 1 when the gate fails or (unless ``--quick``) the target is missed; a full
run writes ``benchmarks/results/cli_startup.json`` (``benchmarks/_result.py``).

  python benchmarks/cli_startup.py            # 7 runs of each
  python benchmarks/cli_startup.py --quick    # 2 runs of each
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import _result

#: The help pages timed: the top level, then each command a user starts from.
PAGES = (
  (),
  ("generate",),
  ("chat",),
  ("run",),
  ("plan",),
  ("convert", "gguf"),
)
#: Target: a help page's median seconds at most this.
HELP_SECONDS = 0.3
#: ``--quick``'s sizes, where the flags are left at their defaults.
QUICK = {"repeat": 2}


def timed(argv: list[str]) -> tuple[float, subprocess.CompletedProcess]:
  """One fresh process running ``argv``: its wall seconds and what it printed."""
  start = time.perf_counter()
  done = subprocess.run(argv, capture_output=True, text=True, check=False)
  return time.perf_counter() - start, done


def imports_jax(page: tuple[str, ...]) -> bool:
  """Whether ``jax-residency PAGE --help`` imports any ``jax`` module (``-X importtime``
  lists every module a process imports, on stderr)."""
  argv = [sys.executable, "-X", "importtime", "-m", "jax_residency", *page, "--help"]
  done = subprocess.run(argv, capture_output=True, text=True, check=False)
  modules = [line.rsplit("|", 1)[-1].strip() for line in done.stderr.splitlines() if "|" in line]
  return any(m == "jax" or m.startswith("jax.") for m in modules)


def name_of(page: tuple[str, ...]) -> str:
  return " ".join(("jax-residency", *page, "--help"))


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--repeat", type=int, default=7, help="fresh processes per help page")
  _result.add_args(parser)
  args = parser.parse_args()
  _result.quick_sizes(args, parser, QUICK)
  anchor: list[float] = []
  seconds: dict[str, list[float]] = {name_of(p): [] for p in PAGES}
  printed: dict[str, bool] = {name_of(p): True for p in PAGES}
  for _ in range(args.repeat):
    anchor.append(timed([sys.executable, "-c", "pass"])[0])
    for page in PAGES:
      took, done = timed([sys.executable, "-m", "jax_residency", *page, "--help"])
      seconds[name_of(page)].append(took)
      printed[name_of(page)] &= done.returncode == 0 and done.stdout.startswith("usage:")
  result = _result.stamp("cli_startup", None, args.quick)
  medians = {name: statistics.median(s) for name, s in seconds.items()}
  result.update(
    {
      "repeat": args.repeat,
      "python_start_s": statistics.median(anchor),
      "help_s": medians,
      "help_s_runs": seconds,
      "target_s": HELP_SECONDS,
    }
  )
  checks: list[dict] = []
  result["checks"] = checks
  for page in PAGES:
    name = name_of(page)
    _result.check(
      checks,
      f"{name} prints its usage and exits 0, without importing JAX",
      printed[name] and not imports_jax(page),
      "yes" if printed[name] else "no usage line or a non-zero exit",
      kind=_result.PARITY,
    )
  slowest = max(medians, key=medians.__getitem__)
  _result.check(
    checks,
    f"every help page within {HELP_SECONDS} s (median of {args.repeat} fresh processes)",
    medians[slowest] <= HELP_SECONDS,
    f"slowest {slowest}: {medians[slowest]:.3f} s (Python's own start "
    f"{result['python_start_s']:.3f} s)",
  )
  return _result.finish(result, args, render)


def render(result: dict) -> str:
  rows = [[name, f"{s:.3f}"] for name, s in result["help_s"].items()]
  rows.append(["python -c pass (the anchor)", f"{result['python_start_s']:.3f}"])
  return _result.text_table(["command", "median s"], rows)


if __name__ == "__main__":
  sys.exit(main())
