"""``jax-residency demo``: the main job.

With no configuration it writes a seeded toy transformer of a few hundred MB to
a local store under the user cache directory (once, with a progress bar; see
`demo_store.py`), runs it under all three policies, checks each output against
the plain model and prints one table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

from jax_residency._src.cli.console import (
  CommandError,
  can_encode,
  emit,
  emit_json,
  fmt_bytes,
  fmt_seconds,
  table,
)
from jax_residency._src.cli.demo_store import (
  DEMO_SEED,
  build_demo_store,
  cache_root,
  demo_store_path,
  demo_store_ready,
)
from jax_residency._src.cli.stored_models import (
  abstract_toy,
  load_concrete,
  open_store,
  single_device_mesh,
)

#: The demo model: 12 units of 48 MiB (≈ 577 MiB of unit weights, float32).
DEMO_CONFIG = {"vocab": 512, "d_model": 1024, "n_heads": 8, "d_ff": 4096, "n_layers": 12}
DEMO_TOKENS = 32

#: Parity tolerance when outputs are not bit-identical: |Δ| <= ATOL + RTOL * |expected|.
PARITY_ATOL = 1e-5
PARITY_RTOL = 1e-5
POLICY_NAMES = ("fully_resident", "layerwise_host", "dense_disk_stream")


@dataclasses.dataclass
class PolicyRun:
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
  from jax_residency._src.report.sampling import ProcessMemorySampler  # noqa: PLC0415

  out: dict[str, int | None] = {"peak": None}
  with ProcessMemorySampler() as sampler:
    try:
      yield out
    finally:
      sample = sampler.sample()
      out["peak"] = None if sample is None else sample["peak_rss_bytes"]


def _run_policy(name: str, model: Any, policy: Any, tokens: Any, **place_kwargs: Any) -> PolicyRun:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.run.place import place  # noqa: PLC0415

  with _rss_peak() as rss:
    with place(model, policy, mesh=single_device_mesh(), **place_kwargs) as placed:
      start = time.perf_counter()
      first = np.asarray(jax.block_until_ready(placed(tokens)))
      first_seconds = time.perf_counter() - start
      start = time.perf_counter()
      out = np.asarray(jax.block_until_ready(placed(tokens)))
      seconds = time.perf_counter() - start
      report = placed.report()
  return PolicyRun(name, first_seconds, seconds, rss["peak"], (first, out), report)


def check_parity(expected: Any, run: PolicyRun) -> None:
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoBudgets:
  """The demo model's sizes, and what its streaming policies may hold.

  Attributes:
    static_bytes: bytes of the static parameters.
    unit_bytes: bytes of one unit (layer).
    units: number of units.
  """

  static_bytes: int
  unit_bytes: int
  units: int

  @classmethod
  def of(cls, abstract: Any) -> DemoBudgets:
    """The sizes of the abstract model ``abstract``."""
    from jax_residency._src.plan.split import split_model  # noqa: PLC0415

    split = split_model(abstract)
    return cls(
      static_bytes=sum(leaf.nbytes for leaf in split.static_leaves()),
      unit_bytes=sum(leaf.nbytes for leaf in split.unit_leaves()) // split.unit_count,
      units=split.unit_count,
    )

  @property
  def window(self) -> int:
    """Units the device holds besides the static parameters (LayerwiseHost's depth)."""
    return min(2, self.units)

  @property
  def device_bytes(self) -> int:
    return self.static_bytes + self.window * self.unit_bytes

  @property
  def host_units(self) -> int:
    """Units DenseDiskStream's host cache holds."""
    return min(3, self.units)

  def dense(self) -> Any:
    from jax_residency._src.policy.options import DenseDiskStreamLoadOptions  # noqa: PLC0415
    from jax_residency._src.policy.types import DenseDiskStream  # noqa: PLC0415

    return DenseDiskStream(
      DenseDiskStreamLoadOptions(
        device_budget_bytes=self.device_bytes,
        host_budget_bytes=self.host_units * self.unit_bytes,
        host_lookahead=min(2, self.host_units),
        background_queue_capacity=2,
        sample_process_memory=True,
        sample_backend_memory=True,
      )
    )

  def layerwise(self) -> Any:
    from jax_residency._src.policy.options import (  # noqa: PLC0415
      LayerwiseLoadOptions,
      OffloadConfig,
    )
    from jax_residency._src.policy.types import LayerwiseHost  # noqa: PLC0415

    return LayerwiseHost(
      LayerwiseLoadOptions(
        offload=OffloadConfig(device_budget_bytes=self.device_bytes, prefetch_depth=self.window),
        sample_process_memory=True,
        sample_backend_memory=True,
      )
    )

  def lines(self) -> list[str]:
    """The ``budgets:`` lines of the demo's header."""
    device = f"device {fmt_bytes(self.device_bytes)} (static + {self.window} units)"
    host = f"host {fmt_bytes(self.host_units * self.unit_bytes)} ({self.host_units} units)"
    return [
      f"budgets: layerwise_host prefetch_depth {self.window}, {device}",
      f"         dense_disk_stream {device}, {host}, host_lookahead {min(2, self.host_units)}",
    ]


def cmd_demo(args: argparse.Namespace) -> int:
  """Runs the demo; exit 0 if every policy matches the plain model, 1 if one does not."""
  import jax  # noqa: PLC0415

  started = time.perf_counter()
  config = _demo_config(args)
  path, reused = _demo_store(config, cache_dir=args.cache_dir, fresh=args.fresh)
  abstract = abstract_toy(config, DEMO_SEED)
  budgets = DemoBudgets.of(abstract)
  tokens = jax.random.randint(jax.random.key(1), (1, args.tokens), 0, config.vocab)
  runs = _run_policies(abstract, tokens, budgets, path=path)
  result = DemoResult(
    config=config,
    path=path,
    reused=reused,
    tokens_shape=tuple(tokens.shape),
    budgets=budgets,
    runs=runs,
    seconds=time.perf_counter() - started,
  )
  if args.json:
    emit_json(result.to_dict())
  else:
    emit(result.text())
  return 0 if result.ok else 1


def _demo_config(args: argparse.Namespace) -> Any:
  """The toy model's config from the command line."""
  from jax_residency._src.models.toy import ToyConfig  # noqa: PLC0415

  if args.d_model % args.n_heads:
    raise CommandError(f"--d-model {args.d_model} is not a multiple of --heads {args.n_heads}")
  return ToyConfig(
    vocab=args.vocab,
    d_model=args.d_model,
    n_heads=args.n_heads,
    d_ff=args.d_ff,
    n_layers=args.layers,
  )


def _demo_store(config: Any, *, cache_dir: str | None, fresh: bool) -> tuple[str, bool]:
  """The demo store for ``config``, built unless an earlier run's can be reused;
  returns its path and whether it was reused."""
  path = demo_store_path(cache_root(cache_dir), config)
  reused = not fresh and demo_store_ready(path, config)
  if not reused:
    build_demo_store(path, config)
  return path, reused


def _run_policies(
  abstract: Any, tokens: Any, budgets: DemoBudgets, *, path: str
) -> tuple[PolicyRun, ...]:
  """Runs every policy (returned in `POLICY_NAMES` order), each checked against the
  plain model."""
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.policy.types import FullyResident  # noqa: PLC0415

  # The dense stream runs first, from the abstract model: no weights are in memory
  # but its own windows, so its peak RSS shows what streaming costs.
  runs = {
    "dense_disk_stream": _run_policy(
      "dense_disk_stream", abstract, budgets.dense(), tokens, store=path
    )
  }
  with open_store(path) as store:
    model = load_concrete(abstract, store)
  expected = np.asarray(jax.block_until_ready(model(tokens)))
  runs["fully_resident"] = _run_policy("fully_resident", model, FullyResident(), tokens)
  runs["layerwise_host"] = _run_policy("layerwise_host", model, budgets.layerwise(), tokens)
  ordered = tuple(runs[name] for name in POLICY_NAMES)
  for run in ordered:
    check_parity(expected, run)
  return ordered


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoResult:
  """One demo: the model, its store, and every policy's run.

  Attributes:
    config: the toy model's config.
    path: the demo store.
    reused: whether the store was an earlier run's.
    tokens_shape: the shape of the token ids.
    budgets: the model's sizes and the streaming policies' budgets.
    runs: every policy's run, in `POLICY_NAMES` order.
    seconds: wall time of the whole demo.
  """

  config: Any
  path: str
  reused: bool
  tokens_shape: tuple[int, ...]
  budgets: DemoBudgets
  runs: tuple[PolicyRun, ...]
  seconds: float

  @property
  def ok(self) -> bool:
    """Whether every policy's outputs match the plain model's."""
    return all(run.ok for run in self.runs)

  def to_dict(self) -> dict[str, Any]:
    b = self.budgets
    return {
      "model": {"kind": "toy", "config": dataclasses.asdict(self.config), "seed": DEMO_SEED},
      "store": {"path": self.path, "reused": self.reused},
      "tokens_shape": list(self.tokens_shape),
      "static_bytes": b.static_bytes,
      "unit_bytes": b.unit_bytes,
      "units": b.units,
      "policies": [_demo_row_json(run) for run in self.runs],
      "ok": self.ok,
      "seconds": self.seconds,
      "process_seconds": _process_seconds(),
    }

  def text(self) -> str:
    """The header, one table row per policy, and the verdict."""
    b = self.budgets
    lines = [
      f"model:   seeded toy transformer, {b.units} layers x {fmt_bytes(b.unit_bytes)} = "
      f"{fmt_bytes(b.unit_bytes * b.units)} of unit weights + "
      f"{fmt_bytes(b.static_bytes)} static, {self.config.dtype}",
      f"store:   {self.path} ({'reused' if self.reused else 'created'})",
      f"input:   token ids {self.tokens_shape}; per policy a cold pass, then the timed pass",
      *b.lines(),
      "",
    ]
    lines += table(_DEMO_HEADERS, [_demo_row(run) for run in self.runs])
    lines += [
      "",
      "peak RSS: the whole process while the policy was placed and run. On CPU the device is",
      "host memory too, and fully_resident / layerwise_host also hold the plain model.",
      "device window: unit bytes on the device: dense_disk_stream's peak in the pass, the units",
      "fully_resident holds at its end; layerwise_host's window is inside its compiled",
      "program, so its planned size is shown.",
      f"{'all outputs match the plain model' if self.ok else 'PARITY FAILED'}; "
      f"{self.seconds:.1f} s ({_process_seconds():.1f} s since the process started)",
    ]
    return "\n".join(lines)


_DEMO_HEADERS = (
  "policy",
  "pass time",
  "peak RSS",
  "device window",
  "bytes read",
  "cache hit rate",
  "parity",
)


def _process_seconds() -> float:
  """Wall time since this process started (imports included)."""
  import psutil  # noqa: PLC0415

  return time.time() - psutil.Process().create_time()


def _last_pass(run: PolicyRun) -> Any:
  return run.report.passes[-1]


def _demo_row(run: PolicyRun) -> list[str]:
  p = _last_pass(run)
  streams = run.name == "dense_disk_stream"
  hit = p.host.hit_rate if streams and p.host is not None else None
  tick = "✓" if can_encode("✓") else "ok"
  cross = "✗" if can_encode("✗") else "FAIL"
  if run.ok:
    parity = tick if run.max_abs_diff == 0 else f"{tick} (max |diff| {run.max_abs_diff:.1e})"
  else:
    parity = f"{cross} max |diff| {run.max_abs_diff:.2e}"
  return [
    run.name,
    fmt_seconds(run.seconds),
    "n/a" if run.peak_rss_bytes is None else fmt_bytes(run.peak_rss_bytes),
    _window(run),
    fmt_bytes(p.bytes_read) if streams else "-",
    "-" if hit is None else f"{100 * hit:.0f}% (host)",
    parity,
  ]


def _window(run: PolicyRun) -> str:
  """The device window column: the pass's ``peak_device_*`` (a dense stream's measured
  peak; the unit arrays ``fully_resident`` holds at the pass's end), or for
  ``layerwise_host``, whose window is inside its compiled program (no array the
  placement holds), the plan's."""
  p = _last_pass(run)
  if run.name == "layerwise_host":
    meta = run.report.metadata
    units, nbytes = meta["device_window_units"], meta["device_window_bytes"]
    return f"{units} units, {fmt_bytes(nbytes)} (planned)"
  return f"{p.peak_device_units} units, {fmt_bytes(p.peak_device_bytes)}"


def _demo_row_json(run: PolicyRun) -> dict[str, Any]:
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
