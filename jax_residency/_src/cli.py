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
import contextlib
import dataclasses
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, NoReturn

PROG = "jax-residency"
#: Where `run` finds a store's model class: a JSON file inside the store directory.
MODEL_FILE = "jax_residency_model.json"
#: Bumped when the demo's store or model recipe changes, so old caches are rebuilt.
DEMO_FORMAT = 1
DEMO_SEED = 0
#: The demo model: 12 units of 48 MiB (≈ 577 MiB of unit weights, float32).
DEMO_CONFIG = {"vocab": 512, "d_model": 1024, "n_heads": 8, "d_ff": 4096, "n_layers": 12}
DEMO_TOKENS = 32
#: Parity tolerance when outputs are not bit-identical: |Δ| <= ATOL + RTOL * |expected|.
PARITY_ATOL = 1e-5
PARITY_RTOL = 1e-5
POLICY_NAMES = ("fully_resident", "layerwise_host", "dense_disk_stream")
#: Default of `run`'s budget flags: not given (the policy's default applies).
_UNSET: Any = object()


class CommandError(Exception):
  """A mistake the user can fix (bad argument, missing file); one line on stderr, exit code 2."""


class _Parser(argparse.ArgumentParser):
  """An argument parser whose errors are one line on stderr (exit code 2)."""

  def error(self, message: str) -> NoReturn:
    self.exit(2, f"{self.prog}: error: {_one_line(message)} (see --help)\n")


def _one_line(text: str, *, limit: int = 600) -> str:
  """``text`` on one line; past ``limit`` characters, its middle is elided."""
  line = " ".join(str(text).split())
  if len(line) <= limit:
    return line
  head, tail = line[: limit * 2 // 3], line[-(limit // 3) :]
  return f"{head} ... ({len(line) - len(head) - len(tail)} characters elided) ... {tail}"


def _budget(text: str) -> int | None:
  from .sizes import parse_bytes  # noqa: PLC0415

  try:
    return parse_bytes(text)
  except ValueError as e:
    raise argparse.ArgumentTypeError(_one_line(str(e))) from e


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
  from .. import __version__  # noqa: PLC0415

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
    help="directory for demo stores (default: $XDG_CACHE_HOME/jax_residency or "
    "~/.cache/jax_residency)",
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
  from .errors import ResidencyError  # noqa: PLC0415

  where = f"{PROG} {args.command}"
  try:
    return int(args.handler(args))
  except (CommandError, ResidencyError) as e:
    print(f"{where}: error: {_one_line(str(e))}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"{where}: interrupted", file=sys.stderr)
    return 130


# --- output ------------------------------------------------------------------


def _emit(text: str) -> None:
  """Prints ``text``, replacing characters stdout's encoding cannot show."""
  try:
    print(text)
  except UnicodeEncodeError:
    enc = sys.stdout.encoding or "ascii"
    print(text.encode(enc, "replace").decode(enc))


def _emit_json(data: Any) -> None:
  print(json.dumps(data, indent=2, sort_keys=False))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
  widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

  def line(cells: Sequence[str]) -> str:
    return "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()

  return [line(headers), *(line(r) for r in rows)]


def _status(message: str) -> None:
  print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _can_encode(text: str) -> bool:
  try:
    text.encode(getattr(sys.stdout, "encoding", None) or "utf-8")
  except (UnicodeEncodeError, LookupError):
    return False
  return True


# --- stores and models -------------------------------------------------------


def _prefix(text: str | None) -> tuple[str, ...] | None:
  return None if text is None else tuple(p for p in text.split(".") if p)


def _open_store(path: str, *, units: str | None = None, streamable: bool = True) -> Any:
  """Opens a store's metadata; any failure to read it is a one-line error."""
  from .errors import StoreError  # noqa: PLC0415
  from .store import UnitStore  # noqa: PLC0415

  if "://" not in path and not os.path.exists(path):
    raise CommandError(f"{path}: no such file or directory")
  try:
    return UnitStore.open(path, unit_prefix=_prefix(units), require_unit_chunks=streamable)
  except StoreError as e:
    if units is None and "unit prefix is unknown" in str(e):
      raise CommandError(f"{e} [here: pass --units PREFIX, e.g. --units params.layers]") from e
    raise
  except (OSError, ValueError) as e:  # e.g. a corrupt JSON file or a TensorStore failure
    raise CommandError(f"cannot read a unit store at {path}: {type(e).__name__}: {e}") from e


def _model_file(path: str) -> str | None:
  local = path[len("file://") :] if path.startswith("file://") else path
  return None if "://" in local else os.path.join(os.path.expanduser(local), MODEL_FILE)


def _write_model_record(path: str, config: Any, seed: int) -> None:
  """Records the toy config that built the store at ``path`` (local stores only)."""
  target = _model_file(path)
  if target is None:
    return
  record = {
    "format": DEMO_FORMAT,
    "model": "toy",
    "config": dataclasses.asdict(config),
    "seed": seed,
  }
  tmp = f"{target}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, target)


def _read_model_record(path: str) -> dict[str, Any] | None:
  target = _model_file(path)
  if target is None or not os.path.exists(target):
    return None
  try:
    with open(target) as f:
      record = json.load(f)
  except (OSError, ValueError) as e:
    raise CommandError(f"cannot read {target}: {e}") from e
  if not isinstance(record, dict) or record.get("model") != "toy":
    raise CommandError(f"{target} does not record a toy model config")
  return record


def _toy_config(record: Mapping[str, Any]) -> Any:
  from .toy import ToyConfig  # noqa: PLC0415

  try:
    return ToyConfig(**record["config"])
  except (KeyError, TypeError) as e:
    raise CommandError(f"the recorded toy config is not valid: {e}") from e


def _abstract_toy(config: Any, seed: int) -> Any:
  from flax import nnx  # noqa: PLC0415

  from .toy import ToyTransformer  # noqa: PLC0415

  return nnx.eval_shape(lambda: ToyTransformer(config, rngs=nnx.Rngs(seed)))


def _abstract_from_factory(spec: str) -> Any:
  from flax import nnx  # noqa: PLC0415

  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise CommandError(f"--model {spec!r}: write it as module:factory, e.g. mypkg.models:small")
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise CommandError(f"--model {spec!r}: {e}") from e
  model = nnx.eval_shape(factory)
  if not isinstance(model, nnx.Module):
    raise CommandError(f"--model {spec!r} returned {type(model).__name__}, not an nnx.Module")
  return model


def _single_device_mesh() -> Any:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  return jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("devices",))


def _load_concrete(abstract: Any, store: Any, *, desc: str = "loading units") -> Any:
  """The model ``abstract`` with its weights read from ``store`` (each byte once)."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  import tqdm  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from .model import split_model  # noqa: PLC0415

  split = split_model(abstract)
  store.check_against(
    {split.unit_rel_path(leaf): (leaf.shape[1:], leaf.dtype) for leaf in split.unit_leaves()},
    {leaf.path: (leaf.shape, leaf.dtype) for leaf in split.static_leaves()},
    strict=True,
  )
  static = store.read_static()
  values: list[Any] = [None] * len(split.leaves)
  for i in split.static_index:
    values[i] = static[split.leaves[i].path]
  buffers = {i: np.empty(split.leaves[i].shape, split.leaves[i].dtype) for i in split.unit_index}
  rel = {i: split.unit_rel_path(split.leaves[i]) for i in split.unit_index}
  bar = tqdm.tqdm(total=split.unit_count, desc=desc, unit="unit", disable=None, leave=False)
  with bar:
    for u, tensors in store.read_units(range(split.unit_count)):
      for i, buf in buffers.items():
        buf[u] = tensors[rel[i]]
      bar.update(1)
  for i in split.unit_index:
    values[i] = buffers.pop(i)
  values = [jax.device_put(v) for v in values]
  graphdef, state = nnx.split(abstract)
  treedef = jax.tree.structure(state)
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, values))


# --- demo --------------------------------------------------------------------


def _cache_root(cache_dir: str | None) -> str:
  if cache_dir:
    return os.path.abspath(os.path.expanduser(cache_dir))
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jax_residency")


def _demo_store_path(root: str, config: Any) -> str:
  key = json.dumps(
    {"format": DEMO_FORMAT, "seed": DEMO_SEED, "config": dataclasses.asdict(config)},
    sort_keys=True,
  )
  return os.path.join(root, f"demo-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def _demo_store_ready(path: str, config: Any) -> bool:
  from .errors import ResidencyError  # noqa: PLC0415

  try:
    record = _read_model_record(path)
  except CommandError:
    return False
  if record is None or record.get("config") != dataclasses.asdict(config):
    return False
  try:
    _open_store(path).close()
  except (CommandError, ResidencyError):
    return False
  return True


def _build_demo_store(path: str, config: Any) -> None:
  """Builds the seeded model and writes its store, in a child process.

  The child's memory goes back to the system when it exits, so the peak RSS the
  demo then measures is the same on the first run as on later ones.
  """
  size = _fmt_bytes(config.unit_bytes() * config.n_layers)
  _status(
    f"first run: building a seeded {config.n_layers}-layer toy model ({size} of unit weights)"
  )
  _status(f"writing it to {path} (once; later runs reuse it)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  request = json.dumps({"path": path, "config": dataclasses.asdict(config), "seed": DEMO_SEED})
  code = f"from {__name__} import _write_demo_store as w; w({request!r})"
  done = subprocess.run([sys.executable, "-c", code], check=False)
  if done.returncode != 0:
    raise CommandError(
      f"building the demo store at {path} failed (exit code {done.returncode}; the error is "
      "printed above)"
    )


def _write_demo_store(request: str) -> None:
  """The child process of :func:`_build_demo_store`.

  The toy transformer's weights are drawn from a seeded NumPy generator (much
  faster than running the model's own initialisers eagerly): LayerNorm scales 1,
  biases 0, every other tensor uniform with variance ``1 / fan_in``.
  """
  import numpy as np  # noqa: PLC0415

  from .model import split_model  # noqa: PLC0415
  from .toy import ToyConfig  # noqa: PLC0415
  from .writer import save_store  # noqa: PLC0415

  spec = json.loads(request)
  config, path, seed = ToyConfig(**spec["config"]), spec["path"], spec["seed"]
  split = split_model(_abstract_toy(config, seed))
  rng = np.random.default_rng(seed)

  def init(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if name == "scale":
      return np.ones(shape, dtype)
    if name == "bias":
      return np.zeros(shape, dtype)
    fan_in = shape[-1] if name == "embedding" or len(shape) < 2 else shape[-2]
    bound = np.sqrt(3.0 / fan_in)
    return (rng.random(shape, dtype=np.float32) * (2 * bound) - bound).astype(dtype)

  static = {
    leaf.path: init(leaf.path[-1], leaf.shape, leaf.dtype) for leaf in split.static_leaves()
  }
  units = {}
  for leaf in split.unit_leaves():
    stacked = np.empty(leaf.shape, leaf.dtype)
    for i in range(split.unit_count):
      stacked[i] = init(leaf.path[-1], leaf.shape[1:], leaf.dtype)
    units[split.unit_rel_path(leaf)] = stacked
  save_store(
    path,
    static=static,
    units=units,
    unit_prefix=split.unit_path_prefix,
    progress=None,
    overwrite=os.path.exists(path),
  )
  _write_model_record(path, config, seed)


@dataclasses.dataclass
class _PolicyRun:
  name: str
  first_seconds: float
  seconds: float
  peak_rss_bytes: int | None
  outputs: tuple[Any, ...]
  report: Any
  max_abs_diff: float | None = None
  ok: bool | None = None


@contextlib.contextmanager
def _rss_peak() -> Iterator[dict[str, int | None]]:
  """Tracks the process's peak RSS over the block (``None`` off Linux)."""
  from .sampling import ProcessMemorySampler  # noqa: PLC0415

  out: dict[str, int | None] = {"peak": None}
  with ProcessMemorySampler() as sampler:
    try:
      yield out
    finally:
      sample = sampler.sample()
      out["peak"] = None if sample is None else sample["peak_rss_bytes"]


def _run_policy(name: str, model: Any, policy: Any, tokens: Any, **place_kwargs: Any) -> _PolicyRun:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from .placed import place  # noqa: PLC0415

  with _rss_peak() as rss:
    with place(model, policy, mesh=_single_device_mesh(), **place_kwargs) as placed:
      start = time.perf_counter()
      first = np.asarray(jax.block_until_ready(placed(tokens)))
      first_seconds = time.perf_counter() - start
      start = time.perf_counter()
      out = np.asarray(jax.block_until_ready(placed(tokens)))
      seconds = time.perf_counter() - start
      report = placed.report()
  return _PolicyRun(name, first_seconds, seconds, rss["peak"], (first, out), report)


def _parity(expected: Any, run: _PolicyRun) -> None:
  """Compares both passes' outputs with the plain model's."""
  import numpy as np  # noqa: PLC0415

  want = np.asarray(expected, np.float64)
  tolerance = PARITY_ATOL + PARITY_RTOL * np.abs(want)
  run.max_abs_diff, run.ok = 0.0, True
  for out in run.outputs:
    got = np.asarray(out, np.float64)
    if got.shape != want.shape:
      run.max_abs_diff, run.ok = float("inf"), False
      continue
    diff = np.abs(got - want)
    run.max_abs_diff = max(run.max_abs_diff, float(diff.max()) if diff.size else 0.0)
    run.ok = run.ok and bool(np.all(diff <= tolerance)) and bool(np.isfinite(got).all())


def cmd_demo(args: argparse.Namespace) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from . import policy as P  # noqa: PLC0415
  from .model import split_model  # noqa: PLC0415
  from .toy import ToyConfig  # noqa: PLC0415

  started = time.perf_counter()
  if args.d_model % args.n_heads:
    raise CommandError(f"--d-model {args.d_model} is not a multiple of --heads {args.n_heads}")
  config = ToyConfig(
    vocab=args.vocab,
    d_model=args.d_model,
    n_heads=args.n_heads,
    d_ff=args.d_ff,
    n_layers=args.layers,
  )
  path = _demo_store_path(_cache_root(args.cache_dir), config)
  reused = not args.fresh and _demo_store_ready(path, config)
  if not reused:
    _build_demo_store(path, config)

  abstract = _abstract_toy(config, DEMO_SEED)
  split = split_model(abstract)
  static_bytes = sum(leaf.nbytes for leaf in split.static_leaves())
  unit_bytes = sum(leaf.nbytes for leaf in split.unit_leaves()) // split.unit_count
  tokens = jax.random.randint(jax.random.key(1), (1, args.tokens), 0, config.vocab)
  window = min(2, split.unit_count)
  device_budget = static_bytes + window * unit_bytes
  host_units = min(3, split.unit_count)
  dense = P.DenseDiskStream(
    P.DenseDiskStreamLoadOptions(
      device_budget_bytes=device_budget,
      host_budget_bytes=host_units * unit_bytes,
      host_lookahead=min(2, host_units),
      background_queue_capacity=2,
      sample_process_memory=True,
      sample_backend_memory=True,
    )
  )
  layerwise = P.LayerwiseHost(
    P.LayerwiseLoadOptions(
      offload=P.OffloadConfig(device_budget_bytes=device_budget, prefetch_depth=window),
      sample_process_memory=True,
      sample_backend_memory=True,
    )
  )

  # The dense stream runs first, from the abstract model: no weights are in memory
  # but its own windows, so its peak RSS shows what streaming costs.
  runs = {
    "dense_disk_stream": _run_policy("dense_disk_stream", abstract, dense, tokens, store=path)
  }
  with _open_store(path) as store:
    model = _load_concrete(abstract, store)
  expected = np.asarray(jax.block_until_ready(model(tokens)))
  runs["fully_resident"] = _run_policy("fully_resident", model, P.FullyResident(), tokens)
  runs["layerwise_host"] = _run_policy("layerwise_host", model, layerwise, tokens)
  ordered = [runs[name] for name in POLICY_NAMES]
  for run in ordered:
    _parity(expected, run)
  ok = all(run.ok for run in ordered)
  total = time.perf_counter() - started

  described = {
    "model": {"kind": "toy", "config": dataclasses.asdict(config), "seed": DEMO_SEED},
    "store": {"path": path, "reused": reused},
    "tokens_shape": list(tokens.shape),
    "static_bytes": static_bytes,
    "unit_bytes": unit_bytes,
    "units": split.unit_count,
  }
  if args.json:
    _emit_json(
      {
        **described,
        "policies": [_demo_row_json(run) for run in ordered],
        "ok": ok,
        "seconds": total,
        "process_seconds": _process_seconds(),
      }
    )
    return 0 if ok else 1
  device_text = f"device {_fmt_bytes(device_budget)} (static + {window} units)"
  lines = [
    f"model:   seeded toy transformer, {split.unit_count} layers x {_fmt_bytes(unit_bytes)} = "
    f"{_fmt_bytes(unit_bytes * split.unit_count)} of unit weights + "
    f"{_fmt_bytes(static_bytes)} static, {config.dtype}",
    f"store:   {path} ({'reused' if reused else 'created'})",
    f"input:   token ids {tuple(tokens.shape)}; per policy a cold pass, then the timed pass",
    f"budgets: layerwise_host prefetch_depth {window}, {device_text}",
    f"         dense_disk_stream {device_text}, host {_fmt_bytes(host_units * unit_bytes)} "
    f"({host_units} units), host_lookahead {min(2, host_units)}",
    "",
  ]
  headers = (
    "policy",
    "pass time",
    "peak RSS",
    "device window",
    "bytes read",
    "cache hit rate",
    "parity",
  )
  lines += _table(headers, [_demo_row(run) for run in ordered])
  lines += [
    "",
    "peak RSS: the whole process while the policy was placed and run. On CPU the device is",
    "host memory too, and fully_resident / layerwise_host also hold the plain model.",
    f"{'all outputs match the plain model' if ok else 'PARITY FAILED'}; "
    f"{total:.1f} s ({_process_seconds():.1f} s since the process started)",
  ]
  _emit("\n".join(lines))
  return 0 if ok else 1


def _process_seconds() -> float:
  """Wall time since this process started (imports included)."""
  import psutil  # noqa: PLC0415

  return time.time() - psutil.Process().create_time()


def _last_pass(run: _PolicyRun) -> Any:
  return run.report.passes[-1]


def _demo_row(run: _PolicyRun) -> list[str]:
  p = _last_pass(run)
  streams = run.name == "dense_disk_stream"
  hit = p.host.hit_rate if streams and p.host is not None else None
  tick = "✓" if _can_encode("✓") else "ok"
  cross = "✗" if _can_encode("✗") else "FAIL"
  if run.ok:
    parity = tick if run.max_abs_diff == 0 else f"{tick} (max |diff| {run.max_abs_diff:.1e})"
  else:
    parity = f"{cross} max |diff| {run.max_abs_diff:.2e}"
  return [
    run.name,
    _fmt_seconds(run.seconds),
    "n/a" if run.peak_rss_bytes is None else _fmt_bytes(run.peak_rss_bytes),
    f"{p.peak_device_units} units, {_fmt_bytes(p.peak_device_bytes)}",
    _fmt_bytes(p.bytes_read) if streams else "-",
    "-" if hit is None else f"{100 * hit:.0f}% (host)",
    parity,
  ]


def _demo_row_json(run: _PolicyRun) -> dict[str, Any]:
  p = _last_pass(run)
  return {
    "policy": run.name,
    "pass_seconds": run.seconds,
    "first_pass_seconds": run.first_seconds,
    "peak_rss_bytes": run.peak_rss_bytes,
    "device_window_units": p.peak_device_units,
    "device_window_bytes": p.peak_device_bytes,
    "bytes_read": p.bytes_read,
    "host_hit_rate": None if p.host is None else p.host.hit_rate,
    "device_hit_rate": None if p.device is None else p.device.hit_rate,
    "parity": {"ok": run.ok, "max_abs_diff": run.max_abs_diff},
    "report": run.report.to_dict(),
  }


def _plural(n: int, noun: str) -> str:
  return f"{n} {noun}" + ("" if n == 1 else "s")


def _fmt_seconds(seconds: float) -> str:
  return f"{seconds:.2f} s" if seconds >= 1 else f"{seconds * 1000:.1f} ms"


def _fmt_bytes(n: int | None) -> str:
  from .sizes import format_bytes  # noqa: PLC0415

  return format_bytes(n)


# --- inspect -----------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
  with _open_store(args.path, units=args.units, streamable=False) as store:
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
  record = _read_model_record(args.path)
  if record is not None:
    info["model"] = {"kind": "toy", "config": record.get("config")}
  if args.json:
    _emit_json(info)
    return 0
  rows = [
    ("store", args.path),
    ("units", f"{info['unit_count']} under {info['unit_prefix']!r}"),
    (
      "unit bytes",
      f"{_fmt_bytes(info['unit_bytes'])} each, {_fmt_bytes(info['total_unit_bytes'])} total",
    ),
    (
      "static bytes",
      f"{_fmt_bytes(info['static_bytes'])} ({_plural(info['static_tensors'], 'tensor')})",
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
    [".".join(p), "x".join(map(str, shape)) or "()", str(dtype), _fmt_bytes(_nbytes(shape, dtype))]
    for p, (shape, dtype) in sorted(specs.items())
  ]
  lines += ["  " + line for line in _table(("path", "shape", "dtype", "bytes"), tensor_rows)]
  _emit("\n".join(lines))
  return 0


def _nbytes(shape: Sequence[int], dtype: Any) -> int:
  import numpy as np  # noqa: PLC0415

  n = 1
  for d in shape:
    n *= int(d)
  return n * np.dtype(dtype).itemsize


# --- plan --------------------------------------------------------------------


@dataclasses.dataclass
class _Tier:
  """One tier of one plan: static + window (``units`` of ``unit_bytes``) against a budget."""

  tier: str
  static: int
  units: int
  unit_bytes: int
  window: int
  budget: int | None
  note: str = ""

  @property
  def required(self) -> int:
    return self.static + self.window

  @property
  def fits(self) -> bool:
    return self.budget is None or self.required <= self.budget

  def arithmetic(self) -> str:
    window = f"{self.units} x {_fmt_bytes(self.unit_bytes)}"
    text = f"{_fmt_bytes(self.static)} + {window}" if self.tier == "device" else window
    return f"{text} = {_fmt_bytes(self.required)}"

  def to_dict(self) -> dict[str, Any]:
    return {
      "tier": self.tier,
      "static_bytes": self.static,
      "window_units": self.units,
      "window_bytes": self.window,
      "required_bytes": self.required,
      "budget_bytes": self.budget,
      "fits": self.fits,
      "note": self.note,
    }


def _plan(
  n: int, unit: int, static: int, device: int | None, host: int | None, lookahead: int
) -> list[dict[str, Any]]:
  """Every policy against the budgets: the library's load-time verdict, and its arithmetic."""
  from . import policy as P  # noqa: PLC0415
  from .errors import BudgetTooSmallError  # noqa: PLC0415
  from .plan import check_budgets, largest_window  # noqa: PLC0415

  sizes = [unit] * n

  def tier(name: str, units: int, budget: int | None, static_bytes: int = 0) -> _Tier:
    return _Tier(name, static_bytes, units, unit, largest_window(sizes, units), budget)

  def accepted(policy: Any) -> bool:
    """What ``place()`` decides before anything moves."""
    try:
      check_budgets(
        policy,
        static_device_bytes=static,
        unit_bytes=sizes,
        device_unit_bytes=sizes,
        host_unit_bytes=sizes,
      )
    except BudgetTooSmallError:
      return False
    return True

  def layerwise(depth: int) -> Any:
    offload = P.OffloadConfig(
      device_budget_bytes=device, host_budget_bytes=host, prefetch_depth=depth
    )
    return P.LayerwiseHost(P.LayerwiseLoadOptions(offload=offload))

  def dense(look: int) -> Any:
    return P.DenseDiskStream(
      P.DenseDiskStreamLoadOptions(
        device_budget_bytes=device,
        host_budget_bytes=host,
        host_lookahead=look,
        background_queue_capacity=2 if look else 0,
      )
    )

  full = [tier("device", n, device, static)]
  plans: list[dict[str, Any]] = [
    {"policy": "fully_resident", "setting": "", "tiers": full, "fits": full[0].fits}
  ]

  # LayerwiseHost keeps every unit in host memory. (check_budgets skips a host budget
  # of 0, so the host tier is checked here as well.)
  host_all = tier("host", n, host)
  host_all.note = "LayerwiseHost keeps every unit in host memory"
  depths = [d for d in range(1, n + 1) if accepted(layerwise(d))] if host_all.fits else []
  depth = (min(2, n) if device is None else depths[-1]) if depths else 1
  plans.append(
    {
      "policy": "layerwise_host",
      "setting": f"prefetch_depth {depth}",
      "depths": [depths[0], depths[-1]] if depths else None,
      "tiers": [tier("device", depth, device, static), host_all],
      "fits": bool(depths),
    }
  )

  window = min(2, n)
  if host == 0:
    setting, look, look_max = "direct disk-to-device", 0, None
  else:
    look = min(lookahead, n)
    setting = f"host_lookahead {look}"
    look_max = max((k for k in range(1, n + 1) if accepted(dense(k))), default=None)
  host_window = tier("host", look, host)
  if not host_window.fits:
    host_window.note = (
      f"host_lookahead <= {look_max} fits"
      if look_max
      else "--host-budget 0 streams disk-to-device without a host cache"
    )
  plans.append(
    {
      "policy": "dense_disk_stream",
      "setting": setting,
      "lookahead_max": look_max,
      "tiers": [tier("device", window, device, static), host_window],
      "fits": accepted(dense(look)),
    }
  )
  return plans


def cmd_plan(args: argparse.Namespace) -> int:
  with _open_store(args.path, units=args.units, streamable=False) as store:
    n, unit, static = store.unit_count, store.unit_nbytes, store.static_nbytes
    streamable = bool(store.chunked_per_unit)
  plans = _plan(n, unit, static, args.device_budget, args.host_budget, args.lookahead)
  if not streamable:
    dense = plans[-1]
    dense["fits"] = False
    dense["note"] = f"the store is not one chunk per unit; run `{PROG} rechunk` first"
  fitting = [p for p in plans if p["fits"]]
  summary = _plan_summary(plans)
  if args.json:
    _emit_json(
      {
        "path": args.path,
        "units": n,
        "unit_bytes": unit,
        "static_bytes": static,
        "device_budget_bytes": args.device_budget,
        "host_budget_bytes": args.host_budget,
        "plans": [{**p, "tiers": [t.to_dict() for t in p["tiers"]]} for p in plans],
        "fits": [p["policy"] for p in fitting],
        "summary": summary,
      }
    )
    return 0 if fitting else 1
  lines = [
    f"store: {args.path} ({n} units x {_fmt_bytes(unit)} = {_fmt_bytes(n * unit)}, "
    f"static {_fmt_bytes(static)})",
    f"budgets: device {_fmt_bytes(args.device_budget)}, host {_fmt_bytes(args.host_budget)} "
    "(bytes per device; one device)",
    "",
  ]
  rows = []
  for p in plans:
    label = f"{p['policy']} {p['setting']}".strip()
    for k, t in enumerate(p["tiers"]):
      verdict = "yes" if t.fits else "NO"
      rows.append(
        [
          label if k == 0 else "",
          t.tier,
          t.arithmetic() if t.units or t.tier == "device" else "-",
          _fmt_bytes(t.budget),
          verdict + (f" ({t.note})" if t.note and not t.fits else ""),
        ]
      )
    if p.get("note"):
      rows.append(["", "", p["note"], "", "NO"])
  lines += _table(("policy", "tier", "static + window = required", "budget", "fits"), rows)
  lines += ["", summary]
  _emit("\n".join(lines))
  return 0 if fitting else 1


def _plan_summary(plans: list[dict[str, Any]]) -> str:
  fits = []
  for p in plans:
    if not p["fits"]:
      continue
    if p["policy"] == "layerwise_host" and p.get("depths"):
      lo, hi = p["depths"]
      fits.append(f"layerwise_host (prefetch_depth {lo}" + (f"..{hi})" if hi > lo else ")"))
    elif p["policy"] == "dense_disk_stream":
      extra = ""
      if p.get("lookahead_max") is not None:
        extra = f", up to {p['lookahead_max']}"
      fits.append(f"dense_disk_stream ({p['setting']}{extra})")
    else:
      fits.append(p["policy"])
  if fits:
    return "fits: " + ", ".join(fits)
  reasons = []
  for p in plans:
    bad = [t for t in p["tiers"] if not t.fits]
    why = "; ".join(
      f"{t.tier} needs {_fmt_bytes(t.required)} > {_fmt_bytes(t.budget)}" for t in bad
    ) or p.get("note", "")
    reasons.append(f"{p['policy']}: {why}")
  return "nothing fits. " + ". ".join(reasons)


# --- run ---------------------------------------------------------------------


def _policy_from_args(args: argparse.Namespace) -> Any:
  from . import policy as P  # noqa: PLC0415

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
    return P.FullyResident()
  if args.policy == "layerwise_host":
    return P.LayerwiseHost(
      P.LayerwiseLoadOptions(
        offload=P.OffloadConfig(
          device_budget_bytes=args.device_budget if given["--device-budget"] else None,
          host_budget_bytes=args.host_budget if given["--host-budget"] else None,
          prefetch_depth=args.prefetch_depth or 1,
        ),
        sample_process_memory=True,
        sample_backend_memory=True,
      )
    )
  defaults = P.DenseDiskStreamLoadOptions()
  host = args.host_budget if given["--host-budget"] else defaults.host_budget_bytes
  device = args.device_budget if given["--device-budget"] else defaults.device_budget_bytes
  direct = host == 0
  return P.DenseDiskStream(
    P.DenseDiskStreamLoadOptions(
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

  from .placed import place  # noqa: PLC0415

  policy = _policy_from_args(args)
  store = _open_store(args.path, streamable=args.policy == "dense_disk_stream")
  with store:
    if args.model is not None:
      if args.vocab is None:
        raise CommandError("--model needs --vocab: token ids are drawn from [0, VOCAB)")
      abstract, vocab = _abstract_from_factory(args.model), args.vocab
    else:
      record = _read_model_record(args.path)
      if record is None:
        raise CommandError(
          f"{args.path} has no recorded toy config ({MODEL_FILE}); `run` only runs stores "
          f"written by `{PROG} demo`, unless you pass --model module:factory"
        )
      config = _toy_config(record)
      if len(args.shape) != 2:
        raise CommandError(f"--shape {args.shape}: the toy model takes (batch, tokens), e.g. 1,16")
      abstract = _abstract_toy(config, int(record.get("seed", 0)))
      vocab = args.vocab or config.vocab
    model = abstract
    kwargs: dict[str, Any] = {}
    if args.policy == "dense_disk_stream":
      kwargs["store"] = args.path
    else:
      model = _load_concrete(abstract, store)
  tokens = jax.random.randint(jax.random.key(args.seed), args.shape, 0, vocab)
  with place(model, policy, mesh=_single_device_mesh(), **kwargs) as placed:
    out = jax.block_until_ready(placed(tokens))
    report = placed.report()
    metadata = placed.metadata
  shape = tuple(np.shape(out))
  if args.json:
    _emit_json(
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
  _emit("\n".join(lines))
  return 0


# --- rechunk -----------------------------------------------------------------


def cmd_rechunk(args: argparse.Namespace) -> int:
  from .writer import rechunk_store  # noqa: PLC0415

  if "://" not in args.src and not os.path.exists(args.src):
    raise CommandError(f"{args.src}: no such file or directory")
  try:
    info = rechunk_store(
      args.src, args.dst, unit_prefix=_prefix(args.units), progress=None, overwrite=args.overwrite
    )
  except (OSError, ValueError) as e:
    from .errors import ResidencyError  # noqa: PLC0415

    if isinstance(e, ResidencyError):
      raise
    raise CommandError(f"cannot rechunk {args.src}: {type(e).__name__}: {e}") from e
  src_model, dst_model = _model_file(args.src), _model_file(args.dst)
  if src_model and dst_model and os.path.exists(src_model):
    shutil.copyfile(src_model, dst_model)
  _emit(
    f"rechunked {args.src} -> {args.dst}: {info.unit_count} units x "
    f"{_fmt_bytes(info.unit_nbytes)} under {'.'.join(info.unit_prefix)!r}, static "
    f"{_fmt_bytes(info.static_nbytes)}; one uncompressed chunk per unit"
  )
  return 0


if __name__ == "__main__":  # pragma: no cover
  sys.exit(main())
