"""The ``jax-residency`` command: ``demo``, ``inspect``, ``verify``, ``plan``, ``run``,
``rechunk``, ``convert``.

``jax-residency demo`` is the main job: with no configuration it writes a seeded
toy transformer of a few hundred MB to a local store under the user cache
directory (once, with a progress bar), runs it under all three policies, checks
each output against the plain model and prints one table. The other commands
work on any store written by :func:`jax_residency.save` (``inspect``, ``verify``,
``plan``, ``rechunk``) or by this command (``run``, which needs the model's class).

This module holds the parser and `main`; `commands.py` the commands other than
``demo`` (`demo.py`).

Exit codes: 0 success; 1 a check failed (demo parity, nothing fits in ``plan``,
or ``verify`` found damage); 2 a usage or library error (a missing, unreadable or
malformed store included), reported on one line of stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from jax_residency._src.cli.commands import (
  UNSET,
  cmd_convert,
  cmd_inspect,
  cmd_plan,
  cmd_rechunk,
  cmd_run,
  cmd_verify,
)
from jax_residency._src.cli.console import PROG, CommandError, one_line
from jax_residency._src.cli.demo import DEMO_CONFIG, DEMO_TOKENS, POLICY_NAMES, cmd_demo
from jax_residency._src.version import __version__


class _Parser(argparse.ArgumentParser):
  """An argument parser whose errors are one line on stderr (exit code 2)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {one_line(message)} (see --help)\n")


def _budget(text: str) -> int | None:
  from jax_residency._src.policy.sizes import parse_bytes  # noqa: PLC0415

  try:
    return parse_bytes(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(one_line(str(e))) from e


def _shape(text: str) -> tuple[int, ...]:
  try:
    dims = tuple(int(d) for d in text.replace("x", ",").split(","))
  except ValueError:
    dims = ()
  if not dims or any(d < 1 for d in dims):
    raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write it like 1,16 (batch,tokens)")
  return dims


def _count(minimum: int) -> Callable[[str], int]:
  def parse(text: str) -> int:
    try:
      n = int(text)
    except ValueError:
      n = minimum - 1
    if n < minimum:
      raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= {minimum}")
    return n

  return parse


# --- parser ------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
  """The ``jax-residency`` argument parser (every subcommand has ``--help``)."""
  fmt = argparse.RawDescriptionHelpFormatter
  parser = _Parser(
    prog=PROG,
    description="Run Flax models whose weights do not fit in accelerator memory.",
    epilog="Start with `jax-residency demo`. Exit codes: 0 ok, 1 a check failed, 2 an error.",
    formatter_class=fmt,
  )
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
  sub.required = True

  demo = sub.add_parser(
    "demo",
    help="run a seeded toy model under all three policies and compare them",
    description=(
      "Writes a toy transformer with seeded weights (12 layers, ~577 MiB of unit weights)\n"
      "to a local store under the cache directory on first run (reused afterwards), runs\n"
      "it under FullyResident, LayerwiseHost (depth 2) and DenseDiskStream (host cache of\n"
      "3 units, device budget of static + 2 units), checks every output against the plain\n"
      "model and prints one table. Exit code 1 if any output differs."
    ),
    formatter_class=fmt,
  )
  demo.add_argument(
    "--cache-dir",
    metavar="DIR",
    help="directory for demo stores (default: $JAX_RESIDENCY_CACHE_DIR, else "
    "$XDG_CACHE_HOME/jax_residency, else ~/.cache/jax_residency)",
  )
  demo.add_argument(
    "--layers",
    metavar="N",
    type=_count(1),
    default=DEMO_CONFIG["n_layers"],
    help=f"number of layers (units), default {DEMO_CONFIG['n_layers']}",
  )
  demo.add_argument("--fresh", action="store_true", help="rebuild the store even if cached")
  demo.add_argument("--json", action="store_true", help="print JSON instead of the table")
  # Hidden knobs for tests and experiments.
  for flag, key in (("--d-model", "d_model"), ("--d-ff", "d_ff"), ("--heads", "n_heads")):
    demo.add_argument(
      flag, dest=key, type=_count(1), default=DEMO_CONFIG[key], help=argparse.SUPPRESS
    )
  demo.add_argument("--vocab", type=_count(1), default=DEMO_CONFIG["vocab"], help=argparse.SUPPRESS)
  demo.add_argument("--tokens", type=_count(1), default=DEMO_TOKENS, help=argparse.SUPPRESS)
  demo.set_defaults(handler=cmd_demo)

  inspect = sub.add_parser(
    "inspect",
    help="describe a unit store: units, bytes, chunking",
    description=(
      "Shows a store's units (count, per-unit and total bytes, tensors), its static bytes,\n"
      "its chunking, and whether DenseDiskStream can stream it in place (one chunk per\n"
      "unit); if not, how to rechunk it."
    ),
    formatter_class=fmt,
  )
  inspect.add_argument("path", help="store directory or TensorStore kvstore URL")
  inspect.add_argument("--units", metavar="PREFIX", help="unit prefix (plain Orbax checkpoints)")
  inspect.add_argument("--json", action="store_true", help="print JSON")
  inspect.set_defaults(handler=cmd_inspect)

  verify = sub.add_parser(
    "verify",
    help="read every chunk of a store and list the damaged tensors",
    description=(
      "Reads every chunk of a store, checking each chunk's CRC-32C (stores written by\n"
      "jr.save carry one), and lists every tensor and unit that is corrupt or unreadable.\n"
      "Exit status: 0 when nothing is damaged, 1 when something is."
    ),
    formatter_class=fmt,
  )
  verify.add_argument("path", help="store directory or TensorStore kvstore URL")
  verify.add_argument("--json", action="store_true", help="print JSON")
  verify.set_defaults(handler=cmd_verify)

  plan = sub.add_parser(
    "plan",
    help="which policies and depths fit given byte budgets",
    description=(
      "Checks every policy against the budgets with the store's sizes (one device):\n"
      "static + window = required, against the device and host budgets. Exit code 1\n"
      "if nothing fits.\n\n"
      "Budgets: bytes (123), sizes (512MiB, 2GB, 1.5GiB) or 'unbounded'."
    ),
    epilog=(
      "Examples: jax-residency plan ./store --device-budget 2GiB --host-budget 8GiB\n"
      "          jax-residency plan ./Llama-3.1-8B/config.json --device-budget 16GiB "
      "--platform gpu"
    ),
    formatter_class=fmt,
  )
  plan.add_argument(
    "path",
    help="store directory or TensorStore kvstore URL; or a Hugging Face config.json (or a\n"
    "directory with one and no store): plans from the model's sizes, no weights needed",
  )
  plan.add_argument(
    "--dtype", help="with a config.json: the weights' dtype (default: its torch_dtype, or float32)"
  )
  for flag in ("--device-budget", "--host-budget"):
    plan.add_argument(flag, metavar="BYTES", type=_budget, default=None, help="default unbounded")
  plan.add_argument(
    "--lookahead", metavar="N", type=_count(1), default=2, help="dense host_lookahead (default 2)"
  )
  plan.add_argument("--units", metavar="PREFIX", help="unit prefix (plain Orbax checkpoints)")
  plan.add_argument(
    "--platform",
    choices=("cpu", "gpu", "tpu"),
    default=None,
    help="where the model will run (default: JAX's default backend here). On an\n"
    "accelerator a dense stream's staging unit counts against the host budget",
  )
  plan.add_argument("--json", action="store_true", help="print JSON")
  plan.set_defaults(handler=cmd_plan)

  run = sub.add_parser(
    "run",
    help="one forward pass of a stored model under a policy, with its report",
    description=(
      "Runs one forward pass on random token ids of the given shape and prints the\n"
      "pass report. The store must record its model (stores written by `demo`), or\n"
      "name one with --model module:factory (an NNX model; called under nnx.eval_shape,\n"
      "so no weights are materialised twice)."
    ),
    epilog="Example: jax-residency run ./store --policy dense_disk_stream --host-budget 1GiB "
    "--shape 1,16",
    formatter_class=fmt,
  )
  run.add_argument("path", help="store directory or TensorStore kvstore URL")
  run.add_argument("--policy", choices=POLICY_NAMES, required=True)
  run.add_argument(
    "--shape", metavar="B,T", type=_shape, required=True, help="token ids shape, e.g. 1,16"
  )
  run.add_argument(
    "--device-budget",
    metavar="BYTES",
    type=_budget,
    default=UNSET,
    help="e.g. 2GiB or 'unbounded' (default: the policy's; dense 4 GiB, layerwise unbounded)",
  )
  run.add_argument(
    "--host-budget",
    metavar="BYTES",
    type=_budget,
    default=UNSET,
    help="default: dense 16 GiB, layerwise unbounded; 0 = dense direct disk-to-device",
  )
  run.add_argument(
    "--lookahead", metavar="N", type=_count(0), help="dense host_lookahead (default 2)"
  )
  run.add_argument(
    "--queue", metavar="N", type=_count(0), help="dense background_queue_capacity (default 2)"
  )
  run.add_argument(
    "--prefetch-depth", metavar="N", type=_count(1), help="layerwise prefetch_depth (default 1)"
  )
  run.add_argument("--model", metavar="MODULE:FACTORY", help="build the model with this factory")
  run.add_argument(
    "--vocab", metavar="N", type=_count(1), help="token ids are drawn from [0, N) (default: toy's)"
  )
  run.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the random tokens")
  run.add_argument("--json", action="store_true", help="print JSON")
  run.set_defaults(handler=cmd_run)

  rechunk = sub.add_parser(
    "rechunk",
    help="copy a checkpoint into a streamable store (one chunk per unit)",
    description=(
      "Copies SRC (any chunking or compression, e.g. an Orbax checkpoint) to DST with one\n"
      "uncompressed chunk per unit, one unit at a time, so DenseDiskStream can stream it."
    ),
    formatter_class=fmt,
  )
  rechunk.add_argument("src", help="the checkpoint to convert")
  rechunk.add_argument("dst", help="where to write the streamable store")
  rechunk.add_argument(
    "--units",
    metavar="PREFIX[,PREFIX...]",
    help="the layer stack(s), e.g. layers or encoder_layers,decoder_layers (default: the\n"
    "stacks SRC records; needed for a plain Orbax checkpoint)",
  )
  rechunk.add_argument("--overwrite", action="store_true", help="replace an existing DST")
  rechunk.set_defaults(handler=cmd_rechunk)

  convert = sub.add_parser(
    "convert",
    help="convert a Hugging Face checkpoint into a unit store",
    description=(
      "convert hf SRC DST: reads a Hugging Face checkpoint directory (config.json and\n"
      "safetensors, sharded or not; Llama, Mistral or Qwen2) one tensor at a time and\n"
      "writes a unit store every policy can place (host memory: about one tensor)."
    ),
    formatter_class=fmt,
  )
  convert.add_argument("format", choices=["hf"], help="the checkpoint's format")
  convert.add_argument("src", help="the checkpoint directory")
  convert.add_argument("dst", help="where to write the store")
  convert.add_argument(
    "--dtype", help="store floating weights in this dtype (e.g. bfloat16); default float32"
  )
  convert.add_argument("--overwrite", action="store_true", help="replace an existing DST")
  convert.set_defaults(handler=cmd_convert)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # --help, --version, or a usage error already printed
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
  from jax_residency._src.errors import ResidencyError  # noqa: PLC0415

  where = f"{PROG} {args.command}"
  try:
    return int(args.handler(args))
  except (CommandError, ResidencyError) as e:
    print(f"{where}: error: {one_line(str(e))}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{where}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
