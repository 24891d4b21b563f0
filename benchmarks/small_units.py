"""Many small layers: what streaming costs per unit beyond the resident compute
(docs/design.md, sections 3.1 and 4).

A Llama-family decoder of a common small shape (30 layers, hidden 576, intermediate 1536,
9 query / 3 key-value heads, vocabulary 49152, float32, random weights: 14 MB a unit), and
one with layers 4x the bytes (hidden 1152, intermediate 3072, 18 / 6 heads: 56 MB a unit),
each written as a store once, then decoded under four placements, each in a fresh process
(``--repeat`` times): ``FullyResident``, ``LayerwiseHost(prefetch_depth=2)``,
``DenseDiskStream`` with a host cache holding every unit ("cached": every unit cached after
the first pass), and ``DenseDiskStream`` with host budget 0 from the page cache ("direct");
and, as the absolute anchor, the plain model (the same weights, in memory) under
``jax.jit`` ("plain": `_measure.plain_jitted`).
A run is a ``--prompt-len``-token prefill, then ``--steps`` one-token decode steps, each
timed to its logits; its decode step is the median after the first two (which compile).

Reported, per shape and placement: decode tokens/s, the ratios to ``FullyResident`` and to
the plain jitted model, and the per-unit cost beyond the resident compute, ``(step -
resident step) / layers`` in ms.

Parity gate: every placement's logits (the prefill's and each step's) equal
``FullyResident``'s within 1e-4 (absolute and relative). Targets, on both shapes:

* ``FullyResident`` >= 1.0x the plain jitted model's tokens/s (a ratio to
  ``FullyResident`` means nothing if it is slower than the model it places);

on the small shape:

* cached: >= 0.8x ``FullyResident``'s tokens/s;
* direct, page cache: >= 0.6x;
* ``LayerwiseHost`` (on CPU): >= 0.9x;
* cached: per-unit cost <= 0.3 ms.

Exits 1 when the gate fails or (unless ``--quick``) a target is missed; a full run writes
``benchmarks/results/small_units.json``.

With ``--breakdown``, instead: where each placement's per-unit time goes on the small
shape, from a profile (``cProfile``, the main thread) of ``--steps`` decode steps after two
untimed ones, in µs per unit visited, by kind of work (`CATEGORIES`). The profiler slows
Python more than compiled code, so the shares, not the sums, are what it shows.

  python benchmarks/small_units.py            # the two shapes above, 3 fresh processes each
  python benchmarks/small_units.py --quick    # 4 x 64/128, vocab 256; one process for all
  python benchmarks/small_units.py --breakdown --dir /tmp/jr_small_units
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

import _child
import _decoding
import _result
from _measure import plain_jitted

POLICIES = ("plain", "resident", "layerwise", "cached", "direct")
LABELS = {
  "plain": "plain model, jax.jit",
  "resident": "FullyResident",
  "layerwise": "LayerwiseHost(prefetch_depth=2)",
  "cached": "DenseDiskStream, every unit cached",
  "direct": "DenseDiskStream, host 0, page cache",
}
#: Shapes: (layers, hidden, intermediate, heads, kv heads, vocab).
SHAPES = {
  "small": (30, 576, 1536, 9, 3, 49152),
  "wide": (30, 1152, 3072, 18, 6, 49152),
}
QUICK_SHAPES = {"small": (4, 64, 128, 4, 2, 256)}
#: Targets on the small shape: placement -> least ratio to FullyResident's tokens/s.
RATIO_TARGETS = {"cached": 0.8, "direct": 0.6, "layerwise": 0.9}
RESIDENT_OVER_PLAIN = 1.0  # both shapes: FullyResident's tok/s over the plain jitted model's
PER_UNIT_TARGET_MS = 0.3  # cached: per-unit cost beyond the resident compute


def _config(shape: tuple[int, ...]):
  return _decoding.llama_config(*shape)


def _policy(name: str):
  import jax_residency as jr

  return {
    "resident": jr.FullyResident(),
    "layerwise": jr.LayerwiseHost(prefetch_depth=2),
    "cached": jr.DenseDiskStream(host_budget_bytes=None),
    "direct": jr.DenseDiskStream(host_budget_bytes=0),
  }[name]


def child_build(args: argparse.Namespace) -> dict:
  import jax_residency as jr
  from jax_residency import models

  cfg = _config(json.loads(args.shape))
  if not os.path.exists(args.store):
    jr.save(models.init_llama(cfg, seed=0), args.store, progress=False)
  return {"store": args.store}


def _placed_runs(args: argparse.Namespace, extra_steps: int = 0):
  """Each placement of ``--policies`` in turn, after its prompt's prefill: ``(name,
  config, placed model, the prefill's logits, the cache)``."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  cfg = _config(json.loads(args.shape))
  abstract = nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))
  for name in args.policies.split(","):
    if name == "plain":  # the store's weights: child_build wrote this model
      placement = contextlib.nullcontext(plain_jitted(models.init_llama(cfg, seed=0)))
    else:
      placement = jr.place(abstract, _policy(name), store=args.store)
    with placement as placed:
      prompt = jnp.asarray(np.arange(1, args.prompt_len + 1)[None] % cfg.vocab_size, jnp.int32)
      cache = models.LlamaCache.zeros(cfg, 1, args.prompt_len + args.steps + extra_steps)
      logits, cache = placed(prompt, None, cache, 0)
      yield name, cfg, placed, logits, cache


def child_run(args: argparse.Namespace) -> dict:
  """Each placement of ``--policies`` in turn: its decode step and its logits."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  out = {}
  for name, _, placed, logits, cache in _placed_runs(args):
    rows = [np.asarray(logits[0, -1])]
    steps = []
    for i in range(args.steps):
      token = jnp.asarray([[int(np.argmax(rows[-1]))]], jnp.int32)
      start = time.perf_counter()
      logits, cache = placed(token, None, cache, jnp.int32(args.prompt_len + i))
      jax.block_until_ready(logits)
      steps.append(time.perf_counter() - start)
      rows.append(np.asarray(logits[0, -1]))
    out[name] = {"step_s": statistics.median(steps[2:]), "logits": np.stack(rows).tolist()}
  return out


#: The kinds of work a profile's functions are counted under (by their own time).
CATEGORIES = (
  "waiting (on a step, a read, a lock)",
  "mapping, reading, checksums",
  "library Python (caches, ledger, telemetry, futures)",
  "JAX dispatch (arguments, compiled steps, device_put)",
  "other",
)


def _category(file: str, name: str) -> str:
  if "block_until_ready" in name or name.startswith(("<method 'acquire'", "<method 'wait'")):
    return CATEGORIES[0]
  if "/jax_residency/_src/store/" in file or name.startswith(
    (
      "<built-in method posix.",
      "<built-in method mmap",
      "<method 'madvise'",
      "<built-in method _crc",
    )
  ):
    return CATEGORIES[1]
  if (
    "/jax_residency/" in file
    or "/concurrent/" in file
    or file.endswith(("threading.py", "queue.py"))
  ):
    return CATEGORIES[2]
  if "/jax/" in file or "/jaxlib/" in file or file == "~":
    return CATEGORIES[3]
  return CATEGORIES[4]


def child_profile(args: argparse.Namespace) -> dict:
  """``--policies``' decode steps profiled: µs per unit visited, by `CATEGORIES`."""
  import cProfile
  import pstats

  import jax
  import jax.numpy as jnp

  out = {}
  for name, cfg, placed, logits, cache in _placed_runs(args, extra_steps=2):
    token = jnp.asarray([[1]], jnp.int32)
    profile = cProfile.Profile()
    start = time.perf_counter()
    for i in range(args.steps + 2):
      if i == 2:
        profile.enable()
        start = time.perf_counter()
      logits, cache = placed(token, None, cache, jnp.int32(args.prompt_len + i))
      jax.block_until_ready(logits)
    wall = time.perf_counter() - start
    profile.disable()
    visits = args.steps * cfg.num_hidden_layers
    spent = dict.fromkeys(CATEGORIES, 0.0)
    for (file, _, func), (_, _, tottime, _, _) in pstats.Stats(profile).stats.items():
      spent[_category(file, func)] += tottime
    out[name] = {
      "us_per_unit": {k: v / visits * 1e6 for k, v in spent.items()},
      "profiled_step_s": wall / args.steps,
    }
  return out


def _breakdown(args: argparse.Namespace) -> int:
  shape = SHAPES["small"]
  store = os.path.join(args.dir, "llama-" + "x".join(map(str, shape)))
  run_child(args, "build", shape, store)
  found = run_child(args, "profile", shape, store, "--policies", ",".join(POLICIES))
  print(
    "µs per unit visited (profiled); "
    + "; ".join(
      f"{LABELS[n]}: {f['profiled_step_s'] * 1e3:.1f} ms a step" for n, f in found.items()
    )
  )
  print("work | " + " | ".join(LABELS[n] for n in found))
  base = found["resident"]["us_per_unit"]
  for cat in CATEGORIES:
    cells = [f"{f['us_per_unit'][cat]:.0f}" for f in found.values()]
    beyond = [f"{f['us_per_unit'][cat] - base[cat]:+.0f}" for f in found.values()]
    print(f"{cat} | " + " | ".join(f"{c} ({b})" for c, b in zip(cells, beyond, strict=True)))
  print("(in parentheses: beyond FullyResident's, which runs the same steps without streaming)")
  return 0


def run_child(args: argparse.Namespace, kind: str, shape: tuple[int, ...], store: str, *extra: str):
  argv = ["--child", kind, "--shape", json.dumps(shape), "--store", store]
  argv += _child.flags(args, ("prompt_len", "steps"))
  return _child.run(__file__, *argv, *extra, what=f"child {kind}")


def _measure(args: argparse.Namespace, shapes: dict) -> dict:
  """``{shape: {policy: [run, ...]}}``: one fresh process per placement and repeat (with
  ``--quick``, one process runs all four)."""
  runs: dict = {}
  for tag, shape in shapes.items():
    store = os.path.join(args.dir, "llama-" + "x".join(map(str, shape)))
    run_child(args, "build", shape, store)
    per = runs.setdefault(tag, {name: [] for name in POLICIES})
    for _ in range(args.repeat):
      if args.quick:
        found = run_child(args, "run", shape, store, "--policies", ",".join(POLICIES))
        for name in POLICIES:
          per[name].append(found[name])
      else:
        for name in POLICIES:
          per[name].append(run_child(args, "run", shape, store, "--policies", name)[name])
  return runs


def _parity(runs: dict) -> float:
  import numpy as np

  worst = 0.0
  for per in runs.values():
    ref = np.asarray(per["resident"][0]["logits"])
    for rs in per.values():
      for r in rs:
        got = np.asarray(r["logits"])
        worst = max(worst, float(np.max(np.abs(got - ref) / (1 + np.abs(ref)))))
  return worst


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the stores here and reuse them")
  parser.add_argument("--prompt-len", type=int, default=5)
  parser.add_argument("--steps", type=int, default=24)
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes per placement")
  _result.add_args(parser)
  parser.add_argument(
    "--breakdown", action="store_true", help="profile the small shape's steps instead (µs/unit)"
  )
  parser.add_argument("--child", choices=("build", "run", "profile"), help=argparse.SUPPRESS)
  parser.add_argument("--shape", help=argparse.SUPPRESS)
  parser.add_argument("--store", help=argparse.SUPPRESS)
  parser.add_argument("--policies", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    child = {"build": child_build, "run": child_run, "profile": child_profile}[args.child]
    return _child.answer(child(args))
  _result.quick_sizes(args, parser, {"steps": 5, "repeat": 1})
  if args.steps < 3:
    parser.error("--steps must be at least 3 (the first two steps compile)")
  shapes = QUICK_SHAPES if args.quick else SHAPES
  if args.breakdown:
    with _result.work_dir(args, "jr_small_units"):
      os.makedirs(args.dir, exist_ok=True)
      return _breakdown(args)
  with _result.work_dir(args, "jr_small_units"):
    os.makedirs(args.dir, exist_ok=True)
    runs = _measure(args, shapes)
  result = _result.stamp("small_units", None, args.quick)
  result.update(prompt_len=args.prompt_len, steps=args.steps, repeat=args.repeat)
  checks: list[dict] = []
  worst = _parity(runs)
  _result.check(
    checks,
    "every placement's logits == FullyResident's within 1e-4",
    worst <= 1e-4,
    worst,
    _result.PARITY,
  )
  exact = all(
    r["logits"] == per["plain"][0]["logits"] for per in runs.values() for r in per["resident"]
  )
  _result.check(
    checks,
    "FullyResident's logits == the plain jitted model's, bit for bit (docs/parity.md)",
    exact,
    "equal" if exact else "differ",
    _result.PARITY,
  )
  table = []
  for tag, per in runs.items():
    layers = shapes[tag][0]
    step = {name: statistics.median(r["step_s"] for r in rs) for name, rs in per.items()}
    over_plain = step["plain"] / step["resident"]
    _result.check(
      checks,
      f"{tag}: FullyResident >= {RESIDENT_OVER_PLAIN:g}x the plain jitted model's tok/s",
      over_plain >= RESIDENT_OVER_PLAIN,
      f"{over_plain:.2f}x ({1 / step['resident']:.1f} vs {1 / step['plain']:.1f} tok/s)",
    )
    for name in POLICIES:
      ratio = step["resident"] / step[name]
      per_unit = (step[name] - step["resident"]) / layers * 1e3
      table.append(
        [tag, name, step[name], 1 / step[name], ratio, per_unit, step["plain"] / step[name]]
      )
      if tag != "small":
        continue
      if name in RATIO_TARGETS:
        _result.check(
          checks,
          f"small: {LABELS[name]} >= {RATIO_TARGETS[name]:g}x FullyResident's tok/s",
          ratio >= RATIO_TARGETS[name],
          f"{ratio:.2f}x",
        )
      if name == "cached":
        _result.check(
          checks,
          f"small: {LABELS[name]}: per-unit cost <= {PER_UNIT_TARGET_MS:g} ms",
          per_unit <= PER_UNIT_TARGET_MS,
          f"{per_unit:.3f} ms",
        )
  result["shapes"] = {tag: list(shapes[tag]) for tag in runs}
  result["table"] = table
  result["checks"] = checks
  return _result.finish(result, args, render)


def _cells(row: list) -> tuple:
  """A table row's cells; a row of a result from before the plain model's row has no
  ratio to it (None)."""
  tag, name, step, tps, ratio, per_unit, *rest = row
  return tag, name, step, tps, ratio, per_unit, rest[0] if rest else None


def render(result: dict) -> str:
  rows = ["shape  placement  step  tok/s  x FullyResident  x plain jitted  per-unit ms"]
  for tag, name, step, tps, ratio, per_unit, over_plain in map(_cells, result["table"]):
    plain = "-" if over_plain is None else f"{over_plain:.2f}"
    rows.append(
      f"{tag}  {LABELS[name]}  {step:.4f} s  {tps:.1f}  {ratio:.2f}  {plain}  {per_unit:.3f}"
    )
  return "\n".join(rows)


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  shapes = ", ".join(
    f"{tag}: {s[0]} layers, hidden {s[1]}, intermediate {s[2]}, {s[3]}/{s[4]} heads"
    for tag, s in result["shapes"].items()
  )
  rows = [
    f"Llama-family decoders, float32, vocabulary 49152 ({shapes}); a "
    f"{result['prompt_len']}-token prompt, then {result['steps']} decode steps; medians of "
    f"{result['repeat']} fresh process(es).",
    "",
    "| shape | placement | decode step | tok/s | x FullyResident | x plain jitted | "
    "per-unit cost |",
    "|---|---|---|---|---|---|---|",
  ]
  for tag, name, step, tps, ratio, per_unit, over_plain in map(_cells, result["table"]):
    plain = "-" if over_plain is None else f"{over_plain:.2f}"
    rows.append(
      f"| {tag} | {LABELS[name]} | {step * 1e3:.1f} ms | {tps:.1f} | {ratio:.2f} | {plain} | "
      f"{per_unit:.3f} ms |"
    )
  return "\n".join(rows)


if __name__ == "__main__":
  sys.exit(main())
