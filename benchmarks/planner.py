"""The planner's predictions checked against measured decode steps (docs/design.md, 4.8).

Writes (or reuses, under ``--dir``) the GPT decoder of ``benchmarks/decode.py`` as a
store, measures it (``jr.measure``, with a prompt and a decode step as inputs), and asks
``jr.plan`` for every placement that fits budgets holding neither the whole model on the
device nor none of it: device budget = static + 6 units, host budget = 3 units. Then it
runs the planner's first five candidates, and plain ``DenseDiskStream`` with host budget
0 and the same device budget, each in a fresh process (``--repeat`` times): a
``--prompt-len``-token prefill, then ``--steps`` one-token decode steps, each timed, in
two regimes: the store in the page cache, and disk-bound (the store's pages dropped
before the prefill and before every step). Each run's decode step is the median of its
steps after the first two (which compile).

Parity gate: every placement's logits (the prefill's and every step's) agree with plain
``DenseDiskStream``'s within 1e-4 (absolute and relative). Targets, each regime:

* every predicted decode step within 25% of the measured one (medians of the runs);
* the planner's first choice within 10% of the fastest measured candidate;
* disk-bound: the fastest tiered placement (one that keeps units resident) at least
  1.6x plain ``DenseDiskStream``'s tokens/s.

Exits 1 when the gate fails or (unless ``--quick``) a target is missed; a full run
writes ``benchmarks/results/planner.json`` (``benchmarks/_result.py``).

  python benchmarks/planner.py                 # GPT 12 x 2048/8192, vocab 16000: 201 MB units
  python benchmarks/planner.py --quick         # 4 x 256/1024, vocab 1000; top 1; one run each
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _child
import _measure
import _result

DEVICE_UNITS, HOST_UNITS = 6, 3  # the budgets: static + 6 units on the device, 3 in host memory
PREDICTION_TOLERANCE = 0.25  # target: |predicted / measured - 1| <= 25%
FIRST_CHOICE_TOLERANCE = 0.10  # target: first choice <= 1.1x the fastest measured
TIERED_SPEEDUP = 1.6  # target: best tiered disk-bound tok/s >= 1.6x plain DenseDiskStream
REGIMES = ("page cache", "disk")
QUICK = {
  "layers": 4,
  "d_model": 256,
  "d_ff": 1024,
  "heads": 4,
  "vocab": 1000,
  "prompt_len": 8,
  "steps": 3,
  "repeat": 1,
  "top": 1,
}
SIZES = ("layers", "d_model", "d_ff", "heads", "vocab", "prompt_len", "steps")


def _config(args: argparse.Namespace):
  return _measure.gpt_config(args, args.prompt_len + args.steps + 2)


def _store(args: argparse.Namespace) -> str:
  tag = f"gpt-{args.layers}x{args.d_model}x{args.d_ff}-h{args.heads}-v{args.vocab}"
  return os.path.join(args.dir, f"{tag}-t{args.prompt_len + args.steps + 2}")


def child_measure(args: argparse.Namespace) -> dict:
  """Writes the store if absent, measures it, and returns the measurement, the inputs'
  signatures and the store's sizes."""
  import jax.numpy as jnp
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models
  from jax_residency._src.run.measure import signature

  cfg, store = _config(args), _store(args)
  if not os.path.exists(store):
    jr.save(models.init_gpt(cfg, seed=0), store, progress=False)
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  prefill = (jnp.ones((1, args.prompt_len), jnp.int32), None, jnp.asarray(0, jnp.int32))
  cache = models.KVCache.zeros(cfg, 1)
  decode = (jnp.ones((1, 1), jnp.int32), cache, jnp.asarray(args.prompt_len, jnp.int32))
  found = jr.measure(store, abstract, inputs=[decode, prefill], refresh=True)
  return {
    "store": store,
    "measurement": found.to_dict(),
    "decode_input": signature(decode),
    "prefill_input": signature(prefill),
  }


def child_run(args: argparse.Namespace) -> dict:
  """One placement (``--policy``, a ``to_dict``) in both regimes: the prefill's and each
  decode step's time and logits."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  cfg, store = _config(args), _store(args)
  policy = jr.LayerWeightResidency.from_dict(json.loads(args.policy))
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  out = {}
  with jr.place(abstract, policy, store=store) as placed:
    for regime in REGIMES:
      before = (lambda: _measure.drop_page_cache(store)) if regime == "disk" else (lambda: None)
      logits, step_s = [], []
      before()
      start = time.perf_counter()
      last, cache = placed(jnp.ones((1, args.prompt_len), jnp.int32))
      logits.append(np.asarray(last[0, -1]))
      prefill_s = time.perf_counter() - start
      for i in range(args.steps):
        before()
        start = time.perf_counter()
        token = jnp.asarray([[int(np.argmax(logits[-1]))]], jnp.int32)
        last, cache = placed(token, cache, jnp.asarray(args.prompt_len + i, jnp.int32))
        logits.append(np.asarray(last[0, -1]))
        step_s.append(time.perf_counter() - start)
      out[regime] = {
        "prefill_s": prefill_s,
        "step_s": statistics.median(step_s[2:]),
        "logits": np.stack(logits).tolist(),
      }
  return out


def run_child(args: argparse.Namespace, kind: str, *extra: str) -> dict:
  flags = ["--dir", args.dir, *_child.flags(args, SIZES)]
  return _child.run(__file__, *flags, "--child", kind, *extra, what=f"child {kind}")


def ranked(args: argparse.Namespace, measured: dict) -> tuple[list, list, object]:
  """The planner's candidates for each regime (top ``--top``), and plain DenseDiskStream
  with the same device budget."""
  import jax_residency as jr
  from jax_residency._src.store.unit_store import UnitStore

  m = jr.Measurement.from_dict(measured["measurement"])
  store = measured["store"]
  with UnitStore.open(store) as opened:
    static, unit = opened.info.static_nbytes, opened.info.stacks[0].unit_nbytes
  device, host = static + DEVICE_UNITS * unit, HOST_UNITS * unit
  work = jr.Workload(
    prompt_len=args.prompt_len,
    decode_steps=args.steps,
    decode_input=measured["decode_input"],
    prefill_input=measured["prefill_input"],
  )
  per_regime = [
    jr.plan(store, m, device_budget_bytes=device, host_budget_bytes=host, workload=work, regime=r)[
      : args.top
    ]
    for r in REGIMES
  ]
  plain = jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=device)
  plain_pred = jr.plan(
    store, m, device_budget_bytes=device, host_budget_bytes=0, workload=work, regime="disk"
  )
  return per_regime, [c for c in plain_pred if c.policy == plain], plain


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the store here and reuse it")
  _measure.add_gpt_args(parser, layers=12, d_model=2048, d_ff=8192, heads=16, vocab=16000)
  parser.add_argument("--prompt-len", type=int, default=32)
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes per placement")
  parser.add_argument("--top", type=int, default=5, help="the planner's first candidates run")
  _result.add_args(parser)
  parser.add_argument("--child", choices=("measure", "run"), help=argparse.SUPPRESS)
  parser.add_argument("--policy", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(child_measure(args) if args.child == "measure" else child_run(args))
  _result.quick_sizes(args, parser, QUICK)
  if args.steps < 3:
    parser.error("--steps must be at least 3 (the first two steps compile)")
  import numpy as np

  from jax_residency._src.run.planner import describe

  with _result.work_dir(args, "jr_planner"):
    os.makedirs(args.dir, exist_ok=True)
    measured = run_child(args, "measure")
    per_regime, plain_pred, plain = ranked(args, measured)
    policies = {describe(c.policy): c.policy for cands in per_regime for c in cands}
    policies[describe(plain)] = plain
    runs: dict[str, list[dict]] = {name: [] for name in policies}
    for _ in range(args.repeat):
      for name, policy in policies.items():
        runs[name].append(run_child(args, "run", "--policy", json.dumps(policy.to_dict())))
  result = _result.stamp("planner", None, args.quick)
  result.update({name: getattr(args, name) for name in (*SIZES, "repeat", "top")})
  result["measurement"] = measured["measurement"]
  checks: list[dict] = []
  reference = np.asarray(runs[describe(plain)][0]["disk"]["logits"])
  worst = max(
    float(np.max(np.abs(np.asarray(r[regime]["logits"]) - reference) / (1 + np.abs(reference))))
    for rs in runs.values()
    for r in rs
    for regime in REGIMES
  )
  _result.check(
    checks,
    "every placement's logits == plain DenseDiskStream's within 1e-4",
    worst <= 1e-4,
    worst,
    _result.PARITY,
  )
  measured_step = {
    (name, regime): statistics.median(r[regime]["step_s"] for r in rs)
    for name, rs in runs.items()
    for regime in REGIMES
  }
  table = []
  for regime, cands in zip(REGIMES, per_regime, strict=True):
    for rank, c in enumerate(cands, 1):
      name = describe(c.policy)
      got = measured_step[name, regime]
      table.append([regime, rank, name, c.decode_seconds, got])
      _result.check(
        checks,
        f"{regime}: #{rank} {name}: predicted step within {PREDICTION_TOLERANCE:.0%}",
        abs(c.decode_seconds / got - 1) <= PREDICTION_TOLERANCE,
        f"{c.decode_seconds:.4f} s predicted, {got:.4f} s measured",
      )
    fastest = min(measured_step[describe(c.policy), regime] for c in cands)
    first = measured_step[describe(cands[0].policy), regime]
    _result.check(
      checks,
      f"{regime}: first choice within {FIRST_CHOICE_TOLERANCE:.0%} of the fastest measured",
      first <= (1 + FIRST_CHOICE_TOLERANCE) * fastest,
      f"{first:.4f} s against {fastest:.4f} s",
    )
  tiered = [
    measured_step[describe(c.policy), "disk"]
    for c in per_regime[1]
    if c.metadata.resident.device or c.metadata.resident.host
  ]
  plain_disk = measured_step[describe(plain), "disk"]
  speedup = plain_disk / min(tiered) if tiered else 0.0
  _result.check(
    checks,
    f"disk: best tiered placement >= {TIERED_SPEEDUP:g}x plain DenseDiskStream's tok/s",
    speedup >= TIERED_SPEEDUP,
    f"{speedup:.2f}x",
  )
  result["table"] = table
  result["plain_step_s"] = {r: measured_step[describe(plain), r] for r in REGIMES}
  result["plain_predicted_step_s"] = plain_pred[0].decode_seconds if plain_pred else None
  result["checks"] = checks
  return _result.finish(result, args, render)


def render(result: dict) -> str:
  rows = ["regime      #  placement  predicted  measured"]
  for regime, rank, name, predicted, got in result["table"]:
    rows.append(f"{regime:<10}  {rank}  {name}  {predicted:.4f} s  {got:.4f} s")
  plain = result["plain_step_s"]
  rows.append(
    f"plain DenseDiskStream (host 0): page cache {plain['page cache']:.4f} s, "
    f"disk {plain['disk']:.4f} s"
  )
  return "\n".join(rows)


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  m = result["measurement"]
  mib = 2**20
  rows = [
    f"GPT {result['layers']} x {result['d_model']}/{result['d_ff']}, vocab {result['vocab']}: "
    f"units of {m['unit_bytes'] / mib:.0f} MiB; a {result['prompt_len']}-token prompt, then "
    f"{result['steps']} decode steps; medians of {result['repeat']} fresh process(es). "
    f"Measured: read path {m['read_path_bytes_per_s'] / mib:.0f} MiB/s with the pages "
    f"dropped, {m['page_cache_bytes_per_s'] / mib:.0f} MiB/s from the page cache.",
    "",
    "| regime | rank | placement | predicted step | measured step | predicted / measured |",
    "|---|---|---|---|---|---|",
  ]
  for regime, rank, name, predicted, got in result["table"]:
    rows.append(
      f"| {regime} | {rank} | `{name}` | {predicted:.4f} s | {got:.4f} s | {predicted / got:.2f} |"
    )
  plain = result["plain_step_s"]
  rows.append(
    f"| page cache / disk | - | plain `DenseDiskStream` (host 0) | - | "
    f"{plain['page cache']:.4f} s / {plain['disk']:.4f} s | - |"
  )
  return "\n".join(rows)


if __name__ == "__main__":
  sys.exit(main())
