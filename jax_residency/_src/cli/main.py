"""The ``jax-residency`` command: ``demo``, ``inspect``, ``verify``, ``plan``, ``run``,
``rechunk``, ``convert``, ``generate``, ``chat``.

``jax-residency demo`` is the main job: with no configuration it writes a seeded
toy transformer of a few hundred MB to a local store under the user cache
directory (once, with a progress bar), runs it under all three policies, checks
each output against the plain model and prints one table. The other commands
work on any store written by :func:`jax_residency.save` (``inspect``, ``verify``,
``plan``, ``rechunk``) or by this command or ``convert`` (``run``, which needs the model).

This module holds the parser and `main`; `commands.py` the commands other than
``demo`` (`demo.py`), ``generate`` and ``chat`` (`generating.py`, parsed by
`generation_args.py`).

Exit codes: 0 success; 1 a check failed (demo parity, nothing fits in ``plan``,
or ``verify`` found damage); 2 a usage or library error (a missing, unreadable or
malformed store included), reported on one line of stderr, never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from jax_residency._src.cli.arguments import FORMAT as _FORMAT
from jax_residency._src.cli.arguments import Parser as _Parser
from jax_residency._src.cli.arguments import add_budgets as _add_budgets
from jax_residency._src.cli.arguments import command as _command
from jax_residency._src.cli.arguments import count as _count
from jax_residency._src.cli.commands import (
  UNSET,
  cmd_convert,
  cmd_plan,
  cmd_rechunk,
  cmd_run,
  cmd_verify,
)
from jax_residency._src.cli.console import PROG, CommandError, one_line
from jax_residency._src.cli.demo import DEMO_CONFIG, DEMO_TOKENS, POLICY_NAMES, cmd_demo
from jax_residency._src.cli.generation_args import add_chat, add_generate
from jax_residency._src.cli.inspection import cmd_inspect
from jax_residency._src.cli.measuring import cmd_measure
from jax_residency._src.version import __version__


def _shape(text: str) -> tuple[int, ...]:
  try:
    dims = tuple(int(d) for d in text.replace("x", ",").split(","))
  except ValueError:
    dims = ()
  if not dims or any(d < 1 for d in dims):
    raise argparse.ArgumentTypeError(f"{text!r} is not a shape; write it like 1,16 (batch,tokens)")
  return dims


# --- parser ------------------------------------------------------------------

_STORE_HELP = "store directory or TensorStore kvstore URL"


def build_parser() -> argparse.ArgumentParser:
  """The ``jax-residency`` argument parser (every subcommand has ``--help``)."""
  parser = _Parser(
    prog=PROG,
    description="Run Flax models whose weights do not fit in accelerator memory.",
    epilog="Start with `jax-residency demo`. Exit codes: 0 ok, 1 a check failed, 2 an error.",
    formatter_class=_FORMAT,
  )
  parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
  sub.required = True
  for add in (
    _add_demo,
    _add_inspect,
    _add_verify,
    _add_plan,
    _add_measure,
    _add_run,
    _add_rechunk,
    _add_convert,
    add_generate,
    add_chat,
  ):
    add(sub)
  return parser


# Argument groups more than one subcommand takes.


def _add_store(command: argparse.ArgumentParser) -> None:
  command.add_argument("path", help=_STORE_HELP)


def _add_units(command: argparse.ArgumentParser) -> None:
  command.add_argument("--units", metavar="PREFIX", help="unit prefix (plain Orbax checkpoints)")


def _add_json(command: argparse.ArgumentParser, text: str = "print JSON") -> None:
  command.add_argument("--json", action="store_true", help=text)


def _add_overwrite(command: argparse.ArgumentParser) -> None:
  command.add_argument("--overwrite", action="store_true", help="replace an existing DST")


def _add_lookahead(
  command: argparse.ArgumentParser, *, minimum: int, default: int | None = None
) -> None:
  command.add_argument(
    "--lookahead",
    metavar="N",
    type=_count(minimum),
    default=default,
    help="dense host_lookahead (default 2)",
  )


# One function per subcommand, in the order `--help` lists them.


def _add_demo(sub: argparse._SubParsersAction[_Parser]) -> None:
  demo = _command(
    sub,
    "demo",
    cmd_demo,
    summary="run a seeded toy model under all three policies and compare them",
    description=(
      "Writes a toy transformer with seeded weights (12 layers, ~577 MiB of unit weights)\n"
      "to a local store under the cache directory on first run (reused afterwards), runs\n"
      "it under FullyResident, LayerwiseHost (depth 2) and DenseDiskStream (host cache of\n"
      "3 units, device budget of static + 2 units), checks every output against the plain\n"
      "model and prints one table. Exit code 1 if any output differs."
    ),
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
  _add_json(demo, "print JSON instead of the table")
  # Hidden knobs for tests and experiments.
  hidden = (("--d-model", "d_model"), ("--d-ff", "d_ff"), ("--heads", "n_heads"))
  for flag, key in (*hidden, ("--vocab", "vocab")):
    demo.add_argument(
      flag, dest=key, type=_count(1), default=DEMO_CONFIG[key], help=argparse.SUPPRESS
    )
  demo.add_argument("--tokens", type=_count(1), default=DEMO_TOKENS, help=argparse.SUPPRESS)


def _add_inspect(sub: argparse._SubParsersAction[_Parser]) -> None:
  inspect = _command(
    sub,
    "inspect",
    cmd_inspect,
    summary="describe a unit store: units, bytes, chunking",
    description=(
      "Shows a store's units (count, per-unit and total bytes, tensors), its static bytes,\n"
      "its chunking, and whether DenseDiskStream can stream it in place (one chunk per\n"
      "unit); if not, how to rechunk it."
    ),
  )
  _add_store(inspect)
  _add_units(inspect)
  _add_json(inspect)


def _add_verify(sub: argparse._SubParsersAction[_Parser]) -> None:
  verify = _command(
    sub,
    "verify",
    cmd_verify,
    summary="read every chunk of a store and list the damaged tensors",
    description=(
      "Reads every chunk of a store, checking each chunk's CRC-32C (stores written by\n"
      "jr.save carry one), and lists every tensor and unit that is corrupt or unreadable.\n"
      "Exit status: 0 when nothing is damaged, 1 when something is."
    ),
  )
  _add_store(verify)
  _add_json(verify)


def _add_quantize(parser: argparse.ArgumentParser, help_text: str) -> None:
  """``--quantize int8|int4`` and ``--group-size 32|64|128`` (``plan``, ``convert``)."""
  parser.add_argument("--quantize", choices=["int8", "int4"], help=help_text)
  parser.add_argument(
    "--group-size",
    type=int,
    choices=[32, 64, 128],
    help="int4: values per group along the input dimension (default 64)",
  )


def _add_plan(sub: argparse._SubParsersAction[_Parser]) -> None:
  plan = _command(
    sub,
    "plan",
    cmd_plan,
    summary="which policies and depths fit given byte budgets",
    description=(
      "Checks every policy against the budgets with the store's sizes (one device):\n"
      "static + window = required, against the device and host budgets. Exit code 1\n"
      "if nothing fits.\n\n"
      "Budgets: bytes (123), sizes (512MiB, 2GB, 1.5GiB) or 'unbounded'."
    ),
    epilog=(
      "Examples: jax-residency plan ./store --device-budget 2GiB --host-budget 8GiB\n"
      "          jax-residency plan ./Llama-3.1-8B/config.json --device-budget 16GiB "
      "--platform gpu\n"
      "          jax-residency plan ./Llama-3.1-8B/config.json --quantize int4 "
      "--device-budget 8GiB --platform gpu\n"
      "          jax-residency plan ./Llama-3.1-8B/config.json --auto --accelerator t4.json "
      "--device-budget 14GiB --host-budget 24GiB"
    ),
  )
  plan.add_argument(
    "path",
    help=f"{_STORE_HELP}; or a Hugging Face config.json (or a\n"
    "directory with one and no store): plans from the model's sizes, no weights needed",
  )
  plan.add_argument(
    "--dtype", help="with a config.json: the weights' dtype (default: its torch_dtype, or float32)"
  )
  _add_quantize(
    plan,
    "with a config.json: plan the model as `convert hf --quantize` would store it:\n"
    "int8 (a scale per output channel) or int4 (groups along the input dimension)",
  )
  _add_budgets(plan, default=None, device_help="default unbounded", host_help="default unbounded")
  _add_lookahead(plan, minimum=1, default=2)
  _add_units(plan)
  plan.add_argument(
    "--auto",
    action="store_true",
    help="rank every placement that fits by predicted time (jr.plan), from this machine's\n"
    "measurement of the store (jr.measure, cached; measured now if there is none)",
  )
  plan.add_argument(
    "--prompt-len", metavar="N", type=_count(1), default=128, help="--auto: prompt tokens (128)"
  )
  plan.add_argument(
    "--steps", metavar="N", type=_count(0), default=32, help="--auto: decode steps (32)"
  )
  plan.add_argument("--batch", metavar="N", type=_count(1), default=1, help="--auto: batch (1)")
  plan.add_argument(
    "--regime",
    choices=("disk", "page cache"),
    default="disk",
    help="--auto: streamed units come from disk (default) or from the page cache",
  )
  plan.add_argument(
    "--model", metavar="MODULE:FACTORY", help="--auto: the model, to time its unit step"
  )
  plan.add_argument(
    "--accelerator",
    metavar="FILE",
    help="--auto: predict from an accelerator's figures given as numbers (a JSON file of\n"
    "jr.Accelerator's fields) instead of measuring here; needed for a config.json",
  )
  plan.add_argument(
    "--platform",
    choices=("cpu", "gpu", "tpu"),
    default=None,
    help="where the model will run (default: JAX's default backend here). On an\n"
    "accelerator a dense stream's staging unit counts against the host budget",
  )
  _add_json(plan)


def _add_run(sub: argparse._SubParsersAction[_Parser]) -> None:
  run = _command(
    sub,
    "run",
    cmd_run,
    summary="one forward pass of a stored model under a policy, with its report",
    description=(
      "Runs one forward pass on random token ids of the given shape and prints the\n"
      "pass report. The store must record its model (stores written by `demo`), or\n"
      "name one with --model module:factory (an NNX model; called under nnx.eval_shape,\n"
      "so no weights are materialised twice)."
    ),
    epilog="Example: jax-residency run ./store --policy dense_disk_stream --host-budget 1GiB "
    "--shape 1,16",
  )
  _add_store(run)
  run.add_argument("--policy", choices=POLICY_NAMES, required=True)
  run.add_argument(
    "--shape", metavar="B,T", type=_shape, required=True, help="token ids shape, e.g. 1,16"
  )
  _add_budgets(
    run,
    default=UNSET,
    device_help="e.g. 2GiB or 'unbounded' (default: the policy's; dense 4 GiB, layerwise "
    "unbounded)",
    host_help="default: dense 16 GiB, layerwise unbounded; 0 = dense direct disk-to-device",
  )
  _add_lookahead(run, minimum=0)
  run.add_argument(
    "--queue", metavar="N", type=_count(0), help="dense background_queue_capacity (default 2)"
  )
  run.add_argument(
    "--prefetch-depth", metavar="N", type=_count(1), help="layerwise prefetch_depth (default 1)"
  )
  run.add_argument(
    "--device-resident-units",
    metavar="N",
    type=_count(0),
    help="layerwise and dense: the first N units of each stack stay on the device "
    "(as `plan --auto` may advise)",
  )
  run.add_argument(
    "--host-resident-units",
    metavar="N",
    type=_count(0),
    help="dense with a host budget: the next N units stay in host memory",
  )
  run.add_argument("--model", metavar="MODULE:FACTORY", help="build the model with this factory")
  run.add_argument(
    "--vocab", metavar="N", type=_count(1), help="token ids are drawn from [0, N) (default: toy's)"
  )
  run.add_argument("--seed", metavar="N", type=int, default=0, help="seed of the random tokens")
  _add_json(run)


def _add_measure(sub: argparse._SubParsersAction[_Parser]) -> None:
  measure = _command(
    sub,
    "measure",
    cmd_measure,
    summary="measure a store's read bandwidth, host-to-device bandwidth and a unit step",
    description=(
      "Measures, on this machine's backend: the store's disk bandwidth (its files read\n"
      "raw by one thread, and its units read by the library, each after the store's pages\n"
      "were dropped from the page cache), the same reads from the page cache, host-to-\n"
      "device bandwidth, and, where the store records its model (stores written by `demo`)\n"
      "or --model names one, a unit step's time for a decode step and a prompt. The result\n"
      "is cached under the library's cache directory, keyed by the store and the backend."
    ),
    epilog="Example: jax-residency measure ./store --prompt-len 128",
  )
  _add_store(measure)
  measure.add_argument(
    "--model", metavar="MODULE:FACTORY", help="build the model with this factory"
  )
  measure.add_argument("--batch", metavar="N", type=_count(1), default=1, help="batch (default 1)")
  measure.add_argument(
    "--prompt-len", metavar="N", type=_count(1), default=16, help="prompt tokens (default 16)"
  )
  measure.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
  _add_json(measure)


def _add_rechunk(sub: argparse._SubParsersAction[_Parser]) -> None:
  rechunk = _command(
    sub,
    "rechunk",
    cmd_rechunk,
    summary="copy a checkpoint into a streamable store (one chunk per unit)",
    description=(
      "Copies SRC (any chunking or compression, e.g. an Orbax checkpoint) to DST with one\n"
      "uncompressed chunk per unit, one unit at a time, so DenseDiskStream can stream it."
    ),
  )
  rechunk.add_argument("src", help="the checkpoint to convert")
  rechunk.add_argument("dst", help="where to write the streamable store")
  rechunk.add_argument(
    "--units",
    metavar="PREFIX[,PREFIX...]",
    help="the layer stack(s), e.g. layers or encoder_layers,decoder_layers (default: the\n"
    "stacks SRC records; needed for a plain Orbax checkpoint)",
  )
  rechunk.add_argument(
    "--experts",
    metavar="PATH[,PATH...]",
    help="modules inside a unit stacked per expert, e.g. mlp.experts: each expert of each\n"
    "unit becomes a chunk of its own, read alone (default: as SRC holds them; 'none'\n"
    "writes every unit whole)",
  )
  _add_overwrite(rechunk)


def _add_convert(sub: argparse._SubParsersAction[_Parser]) -> None:
  convert = _command(
    sub,
    "convert",
    cmd_convert,
    summary="convert a Hugging Face checkpoint or a GGUF file into a unit store",
    description=(
      "convert hf SRC DST: a Hugging Face checkpoint directory into a unit store.\n"
      "convert gguf FILE DST: a llama.cpp GGUF file into a unit store.\n"
      "See `convert hf --help` and `convert gguf --help` for each one's options."
    ),
  )
  formats = convert.add_subparsers(
    dest="format", metavar="{hf,gguf}", required=True, parser_class=_Parser
  )
  hf = formats.add_parser(
    "hf",
    help="a Hugging Face checkpoint directory",
    formatter_class=_FORMAT,
    description=(
      "Reads a Hugging Face checkpoint directory (config.json and safetensors, sharded or\n"
      "not; Llama, Mistral, Qwen2, Mixtral, Qwen2-MoE) one tensor at a time and writes a\n"
      "unit store every policy can place (host memory: about one tensor)."
    ),
  )
  hf.add_argument("src", help="the checkpoint directory")
  hf.add_argument("dst", help="where to write the store")
  hf.add_argument(
    "--dtype", help="store floating weights in this dtype (e.g. bfloat16); default float32"
  )
  _add_quantize(
    hf,
    "store the floating matrices quantized: int8 (a scale per output channel) or int4\n"
    "(groups along the input dimension, two values a byte); norms, biases and small\n"
    "tensors stay as they are",
  )
  _add_overwrite(hf)
  gguf = formats.add_parser(
    "gguf",
    help="a llama.cpp GGUF file",
    formatter_class=_FORMAT,
    description=(
      "Reads a llama.cpp GGUF file of the Llama architecture and writes a store whose\n"
      "matrices keep their GGML types (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K,\n"
      "Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, and mixed presets such as Q4_K_M), decoded\n"
      "where each layer runs, with a config.json and a tokenizer.json derived from its\n"
      "metadata. Its tensors are not quantized again: there is no --quantize here."
    ),
  )
  gguf.add_argument("src", help="the .gguf file")
  gguf.add_argument("dst", help="where to write the store")
  gguf.add_argument(
    "--dtype", help="the dtype the model decodes its blocks to and computes in (float32)"
  )
  gguf.set_defaults(quantize=None, group_size=None)
  _add_overwrite(gguf)


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # --help, --version, or a usage error already printed
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
  from jax_residency._src.errors import ResidencyError  # noqa: PLC0415

  where = f"{PROG} {args.command}"

  def show_warning(message: Warning | str, category: type[Warning], *_: object, **__: object):
    """A warning as one line naming the command, not the library's source line."""
    print(f"{where}: warning: {one_line(str(message))}", file=sys.stderr)

  try:
    with warnings.catch_warnings():
      warnings.showwarning = show_warning
      return int(args.handler(args))
  except (CommandError, ResidencyError) as e:
    print(f"{where}: error: {one_line(str(e))}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{where}: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
