"""The ``jax-residency`` command: ``demo``, ``inspect``, ``plan``, ``run``, ``rechunk``.

``jax-residency demo`` is the main job: with no configuration it writes a seeded
toy transformer of a few hundred MB to a local store under the user cache
directory (once, with a progress bar), runs it under all three policies, checks
each output against the plain model and prints one table. The other commands
work on any store written by :func:`jax_residency.save` (``inspect``, ``plan``,
``rechunk``) or by this command (``run``, which needs the model's class).

Exit codes: 0 success; 1 a check failed (demo parity, or nothing fits in
``plan``); 2 a usage or library error, reported on one line of stderr.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from jax_residency._src.cli.console import (
  PROG,
  CommandError,
  emit,
  emit_json,
  fmt_bytes,
  one_line,
  plural,
  table,
)
from jax_residency._src.cli.demo import DEMO_CONFIG, DEMO_TOKENS, POLICY_NAMES, cmd_demo
from jax_residency._src.cli.plan_table import plan_budgets
from jax_residency._src.cli.stored_models import (
  MODEL_FILE,
  abstract_from_factory,
  abstract_toy,
  load_concrete,
  model_file,
  open_store,
  parse_prefix,
  read_model_record,
  single_device_mesh,
  toy_config,
)

#: Default of `run`'s budget flags: not given (the policy's default applies).
_UNSET: Any = object()


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
  from jax_residency import __version__  # noqa: PLC0415

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

  plan = sub.add_parser(
    "plan",
    help="which policies and depths fit given byte budgets",
    description=(
      "Checks every policy against the budgets with the store's sizes (one device):\n"
      "static + window = required, against the device and host budgets. Exit code 1\n"
      "if nothing fits.\n\n"
      "Budgets: bytes (123), sizes (512MiB, 2GB, 1.5GiB) or 'unbounded'."
    ),
    epilog="Example: jax-residency plan ./store --device-budget 2GiB --host-budget 8GiB",
    formatter_class=fmt,
  )
  plan.add_argument("path", help="store directory or TensorStore kvstore URL")
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
    default=_UNSET,
    help="e.g. 2GiB or 'unbounded' (default: the policy's; dense 4 GiB, layerwise unbounded)",
  )
  run.add_argument(
    "--host-budget",
    metavar="BYTES",
    type=_budget,
    default=_UNSET,
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
  rechunk.add_argument("--units", metavar="PREFIX", help="unit prefix, e.g. params.layers")
  rechunk.add_argument("--overwrite", action="store_true", help="replace an existing DST")
  rechunk.set_defaults(handler=cmd_rechunk)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the command line; returns the exit code."""
  parser = build_parser()
  try:
    args = parser.parse_args(argv)
  except SystemExit as e:  # --help, --version, or a usage error already printed
    return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
  from jax_residency._src.policy.errors import ResidencyError  # noqa: PLC0415

  where = f"{PROG} {args.command}"
  try:
    return int(args.handler(args))
  except (CommandError, ResidencyError) as e:
    print(f"{where}: error: {one_line(str(e))}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{where}: interrupted", file=sys.stderr)
    return 130


# --- output ------------------------------------------------------------------


# --- stores and models -------------------------------------------------------


# --- demo --------------------------------------------------------------------


# --- inspect -----------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
  with open_store(args.path, units=args.units, streamable=False) as store:
    streamable = bool(store.chunked_per_unit)
    compressed = bool(getattr(store, "compressed", False))
    specs = store.unit_specs
    info = {
      "path": args.path,
      "unit_prefix": ".".join(store.unit_prefix),
      "unit_count": store.unit_count,
      "unit_bytes": store.unit_nbytes,
      "total_unit_bytes": store.total_unit_bytes,
      "static_bytes": store.static_nbytes,
      "static_tensors": len(store.static_specs),
      "unit_tensors": {
        ".".join(p): {"shape": list(shape), "dtype": str(dtype)}
        for p, (shape, dtype) in sorted(specs.items())
      },
      "chunked_per_unit": streamable,
      "compressed": compressed,
      "streamable": streamable,
      "model": None,
    }
  record = read_model_record(args.path)
  if record is not None:
    info["model"] = {"kind": "toy", "config": record.get("config")}
  if args.json:
    emit_json(info)
    return 0
  rows = [
    ("store", args.path),
    ("units", f"{info['unit_count']} under {info['unit_prefix']!r}"),
    (
      "unit bytes",
      f"{fmt_bytes(info['unit_bytes'])} each, {fmt_bytes(info['total_unit_bytes'])} total",
    ),
    (
      "static bytes",
      f"{fmt_bytes(info['static_bytes'])} ({plural(info['static_tensors'], 'tensor')})",
    ),
    (
      "chunking",
      ("one chunk per unit" if streamable else "several units per chunk")
      + (", compressed" if compressed else ", uncompressed"),
    ),
  ]
  if streamable:
    verdict = "yes: DenseDiskStream reads each unit in place"
    if compressed:
      verdict += " (compressed: slower; `rechunk` writes it uncompressed)"
  else:
    verdict = f"no: run `{PROG} rechunk {args.path} DST` and stream DST"
  rows.append(("streamable", verdict))
  if record is not None:
    rows.append(("model", f"toy {record.get('config')} (`{PROG} run` works)"))
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {v}" for k, v in rows]
  lines += ["", f"unit tensors ({len(specs)}, per unit):"]
  tensor_rows = [
    [".".join(p), "x".join(map(str, shape)) or "()", str(dtype), fmt_bytes(_nbytes(shape, dtype))]
    for p, (shape, dtype) in sorted(specs.items())
  ]
  lines += ["  " + line for line in table(("path", "shape", "dtype", "bytes"), tensor_rows)]
  emit("\n".join(lines))
  return 0


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
  import numpy as np  # noqa: PLC0415

  n = 1
  for d in shape:
    n *= int(d)
  return n * np.dtype(dtype).itemsize


# --- plan --------------------------------------------------------------------


def _default_platform() -> str:
  import jax  # noqa: PLC0415 - only plan without --platform needs the backend

  return jax.default_backend()


def cmd_plan(args: argparse.Namespace) -> int:
  with open_store(args.path, units=args.units, streamable=False) as store:
    n, unit, static = store.unit_count, store.unit_nbytes, store.static_nbytes
    streamable = bool(store.chunked_per_unit)
  plan = plan_budgets(
    args.path,
    units=n,
    unit_bytes=unit,
    static_bytes=static,
    device_budget=args.device_budget,
    host_budget=args.host_budget,
    lookahead=args.lookahead,
    streamable=streamable,
    device_is_host=(args.platform or _default_platform()) == "cpu",
  )
  if args.json:
    emit_json(plan.to_dict())
  else:
    emit(str(plan))
  return 0 if plan.fitting else 1


# --- run ---------------------------------------------------------------------


def _policy_from_args(args: argparse.Namespace) -> Any:
  from jax_residency._src.policy.options import (  # noqa: PLC0415
    DenseDiskStreamLoadOptions,
    LayerwiseLoadOptions,
    OffloadConfig,
  )
  from jax_residency._src.policy.types import DenseDiskStream, FullyResident, LayerwiseHost  # noqa: PLC0415

  given = {
    "--device-budget": args.device_budget is not _UNSET,
    "--host-budget": args.host_budget is not _UNSET,
    "--lookahead": args.lookahead is not None,
    "--queue": args.queue is not None,
    "--prefetch-depth": args.prefetch_depth is not None,
  }
  allowed = {
    "fully_resident": set(),
    "layerwise_host": {"--device-budget", "--host-budget", "--prefetch-depth"},
    "dense_disk_stream": {"--device-budget", "--host-budget", "--lookahead", "--queue"},
  }[args.policy]
  extra = sorted(flag for flag, set_ in given.items() if set_ and flag not in allowed)
  if extra:
    raise CommandError(f"{', '.join(extra)} does not apply to --policy {args.policy}")
  if args.policy == "fully_resident":
    return FullyResident()
  if args.policy == "layerwise_host":
    return LayerwiseHost(
      LayerwiseLoadOptions(
        offload=OffloadConfig(
          device_budget_bytes=args.device_budget if given["--device-budget"] else None,
          host_budget_bytes=args.host_budget if given["--host-budget"] else None,
          prefetch_depth=args.prefetch_depth or 1,
        ),
        sample_process_memory=True,
        sample_backend_memory=True,
      )
    )
  defaults = DenseDiskStreamLoadOptions()
  host = args.host_budget if given["--host-budget"] else defaults.host_budget_bytes
  device = args.device_budget if given["--device-budget"] else defaults.device_budget_bytes
  direct = host == 0
  return DenseDiskStream(
    DenseDiskStreamLoadOptions(
      device_budget_bytes=device,
      host_budget_bytes=host,
      host_lookahead=args.lookahead if args.lookahead is not None else (0 if direct else 2),
      background_queue_capacity=args.queue if args.queue is not None else (0 if direct else 2),
      sample_process_memory=True,
      sample_backend_memory=True,
    )
  )


def cmd_run(args: argparse.Namespace) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.placement.place import place  # noqa: PLC0415

  policy = _policy_from_args(args)
  store = open_store(args.path, streamable=args.policy == "dense_disk_stream")
  with store:
    if args.model is not None:
      if args.vocab is None:
        raise CommandError("--model needs --vocab: token ids are drawn from [0, VOCAB)")
      abstract, vocab = abstract_from_factory(args.model), args.vocab
    else:
      record = read_model_record(args.path)
      if record is None:
        raise CommandError(
          f"{args.path} has no recorded toy config ({MODEL_FILE}); `run` only runs stores "
          f"written by `{PROG} demo`, unless you pass --model module:factory"
        )
      config = toy_config(record)
      if len(args.shape) != 2:
        raise CommandError(f"--shape {args.shape}: the toy model takes (batch, tokens), e.g. 1,16")
      abstract = abstract_toy(config, int(record.get("seed", 0)))
      vocab = args.vocab or config.vocab
    model = abstract
    kwargs: dict[str, Any] = {}
    if args.policy == "dense_disk_stream":
      kwargs["store"] = args.path
    else:
      model = load_concrete(abstract, store)
  tokens = jax.random.randint(jax.random.key(args.seed), args.shape, 0, vocab)
  with place(model, policy, mesh=single_device_mesh(), **kwargs) as placed:
    out = jax.block_until_ready(placed(tokens))
    report = placed.report()
    metadata = placed.metadata
  shape = tuple(np.shape(out))
  if args.json:
    emit_json(
      {
        "path": args.path,
        "policy": report.to_dict()["policy"],
        "input_shape": list(args.shape),
        "output_shape": list(shape),
        "output_dtype": str(out.dtype),
        "report": report.to_dict(),
      }
    )
    return 0
  lines = [
    f"ran {args.policy} on {args.path}: token ids {tuple(args.shape)} -> output {shape} "
    f"{out.dtype} in {report.total.seconds:.3f} s",
    "",
    str(metadata),
    "",
    str(report),
  ]
  emit("\n".join(lines))
  return 0


# --- rechunk -----------------------------------------------------------------


def cmd_rechunk(args: argparse.Namespace) -> int:
  from jax_residency._src.store.writer import rechunk_store  # noqa: PLC0415

  if "://" not in args.src and not os.path.exists(args.src):
    raise CommandError(f"{args.src}: no such file or directory")
  try:
    info = rechunk_store(
      args.src,
      args.dst,
      unit_prefix=parse_prefix(args.units),
      progress=None,
      overwrite=args.overwrite,
    )
  except (OSError, ValueError) as e:
    from jax_residency._src.policy.errors import ResidencyError  # noqa: PLC0415

    if isinstance(e, ResidencyError):
      raise
    raise CommandError(f"cannot rechunk {args.src}: {type(e).__name__}: {e}") from e
  src_model, dst_model = model_file(args.src), model_file(args.dst)
  if src_model and dst_model and os.path.exists(src_model):
    shutil.copyfile(src_model, dst_model)
  emit(
    f"rechunked {args.src} -> {args.dst}: {info.unit_count} units x "
    f"{fmt_bytes(info.unit_nbytes)} under {'.'.join(info.unit_prefix)!r}, static "
    f"{fmt_bytes(info.static_nbytes)}; one uncompressed chunk per unit"
  )
  return 0


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
