"""What the persistent compilation cache saves a new process: its first pass.

A placed model compiles its XLA programs on its first pass; with JAX's persistent
compilation cache, which the library turns on under its cache directory
(docs/compilation.md), a later process loads them from disk instead. This script
writes (or reuses, under ``--dir``) a GPT decoder's store, then for each policy runs
two fresh processes that share one empty cache directory: the first compiles and
fills it ("cold"), the second loads from it ("warm"). Each times ``jr.place``, the
first prefill and the first one-token step. ``--repeat`` repeats the pair, each time
with a new empty cache.

Parity gates: the warm process computes the same logits as the cold one, bit for
bit, and both match the plain (unplaced, jitted) model to 1e-5 relative. Target:
the warm process's first pass (place + prefill + first step) takes <= 0.5x the cold
one's, on the medians. The script exits 1 when a gate fails or (unless ``--quick``)
the target is missed; a full run writes ``benchmarks/results/compile_time.json``
(``benchmarks/_result.py``).

  python benchmarks/compile_time.py                  # GPT 4 x 1024/4096, vocab 8000
  python benchmarks/compile_time.py --quick          # 2 x 256/1024, vocab 1000, one
                                                     # pair, the dense stream alone
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time

import _child
import _measure
import _result

FIRST_PASS_RATIO_TARGET = 0.5  # target: warm first pass <= 0.5x the cold one
PROMPT = 8
QUICK = {"layers": 2, "d_model": 256, "d_ff": 1024, "heads": 4, "vocab": 1000, "repeat": 1}
SIZES = ("layers", "d_model", "d_ff", "heads", "vocab")
POLICIES = ("resident", "dense-host0")


def gpt(args: argparse.Namespace):
  """The benchmark's :class:`GPTConfig` and the path of its store."""
  cfg = _measure.gpt_config(args, PROMPT + 4)
  return cfg, os.path.join(args.dir, f"gpt-{args.layers}x{args.d_model}x{args.d_ff}-v{args.vocab}")


def child(args: argparse.Namespace) -> dict:
  """Times one process's first pass under ``args.child`` and digests its logits."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  cfg, store = gpt(args)
  if args.child == "resident":
    policy = jr.FullyResident()
  else:
    policy = jr.DenseDiskStream(host_budget_bytes=0)
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  tokens = jnp.arange(PROMPT, dtype=jnp.int32)[None] % args.vocab
  start = time.perf_counter()
  with jr.place(abstract, policy, store=store) as placed:
    placed_s = time.perf_counter() - start
    logits, cache = placed(tokens)
    prefill = np.asarray(logits)
    prefill_s = time.perf_counter() - start - placed_s
    logits, _ = placed(jnp.ones((1, 1), jnp.int32), cache, jnp.asarray(PROMPT, jnp.int32))
    step = np.asarray(logits)
    first_pass_s = time.perf_counter() - start
  # The plain model, after the timings: its own programs are compiled (or loaded) too.
  plain = models.init_gpt(cfg, seed=0)
  want, cache = nnx.jit(lambda m, t: m(t))(plain, tokens)
  want_step, _ = nnx.jit(lambda m, t, c, p: m(t, c, p))(
    plain, jnp.ones((1, 1), jnp.int32), cache, jnp.asarray(PROMPT, jnp.int32)
  )
  got = np.concatenate([prefill.ravel(), step.ravel()])
  ref = np.concatenate([np.asarray(want).ravel(), np.asarray(want_step).ravel()])
  cache_dir = os.path.join(os.environ["JAX_RESIDENCY_CACHE_DIR"], "xla")
  entries = os.listdir(cache_dir) if os.path.isdir(cache_dir) else []
  return {
    "place_s": placed_s,
    "first_prefill_s": prefill_s,
    "first_pass_s": first_pass_s,
    "logits_sha256": hashlib.sha256(np.ascontiguousarray(got).tobytes()).hexdigest(),
    "max_rel_diff": float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-30)),
    "cache_entries": len(entries),
    "cache_bytes": sum(os.path.getsize(os.path.join(cache_dir, e)) for e in entries),
    "backend": jax.default_backend(),
  }


def write_store(args: argparse.Namespace) -> None:
  """Saves the benchmark's GPT (seeded weights) unless its store exists."""
  import jax_residency as jr
  from jax_residency import models

  cfg, store = gpt(args)
  if not os.path.exists(store):
    jr.save(models.init_gpt(cfg, seed=0), store, progress=False)


def run_pair(args: argparse.Namespace, policy: str) -> dict[str, dict]:
  """A cold process and a warm one, sharing a new empty cache directory."""
  flags = ["--dir", args.dir, "--child", policy, *_child.flags(args, SIZES)]
  out = {}
  with tempfile.TemporaryDirectory(prefix="jr_compile_cache_") as cache:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")}
    env.pop("JAX_RESIDENCY_COMPILATION_CACHE", None)  # the suite opts its processes out
    env["JAX_RESIDENCY_CACHE_DIR"] = cache
    for kind in ("cold", "warm"):
      out[kind] = _child.run(__file__, *flags, what=f"{policy} ({kind})", env=env)
  return out


def render(result: dict) -> str:
  lines = []
  for policy, fig in result["policies"].items():
    lines.append(
      f"{policy}: first pass {fig['cold_first_pass_s']:.2f} s compiling, "
      f"{fig['warm_first_pass_s']:.2f} s from the cache ({fig['ratio']:.2f}x); "
      f"{fig['cache_entries']} programs, {fig['cache_bytes'] / 2**20:.1f} MiB"
    )
  return "\n".join(lines)


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  rows = [
    f"GPT {result['layers']} x {result['d_model']}/{result['d_ff']}, vocab {result['vocab']}, "
    f"{PROMPT}-token prompt; medians of {result['repeat']} pair(s) of fresh processes, "
    "the first with an empty cache, the second with what the first wrote:",
    "",
    "| policy | place | first prefill | first pass (place + prefill + step) | ratio | cache |",
    "|---|---|---|---|---|---|",
  ]
  for policy, fig in result["policies"].items():
    rows.append(
      f"| {policy} | {fig['cold_place_s']:.2f} s -> {fig['warm_place_s']:.2f} s "
      f"| {fig['cold_first_prefill_s']:.2f} s -> {fig['warm_first_prefill_s']:.2f} s "
      f"| {fig['cold_first_pass_s']:.2f} s -> {fig['warm_first_pass_s']:.2f} s "
      f"| {fig['ratio']:.2f}x | {fig['cache_entries']} programs, "
      f"{fig['cache_bytes'] / 2**20:.1f} MiB |"
    )
  return "\n".join(rows)


def summarize(runs: list[dict[str, dict]]) -> dict:
  """Medians over the pairs of one policy."""
  fig: dict = {}
  for kind in ("cold", "warm"):
    for key in ("place_s", "first_prefill_s", "first_pass_s"):
      fig[f"{kind}_{key}"] = statistics.median(r[kind][key] for r in runs)
  fig["ratio"] = fig["warm_first_pass_s"] / fig["cold_first_pass_s"]
  fig["cache_entries"] = runs[-1]["cold"]["cache_entries"]
  fig["cache_bytes"] = runs[-1]["cold"]["cache_bytes"]
  fig["runs"] = runs
  return fig


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--dir",
    help="keep the store here and reuse it (default: a temporary directory named"
    " jr_compile_time; with --quick, a fresh one removed afterwards)",
  )
  _measure.add_gpt_args(parser, layers=4, d_model=1024, d_ff=4096, heads=8, vocab=8000)
  parser.add_argument("--repeat", type=int, default=3, help="pairs of processes per policy")
  _result.add_args(parser)
  parser.add_argument("--child", choices=POLICIES, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(child(args))
  _result.quick_sizes(args, parser, QUICK)
  result = _result.stamp("compile_time", None, args.quick)
  result.update({name: getattr(args, name) for name in (*SIZES, "repeat")})
  checks: list[dict] = []
  with _result.work_dir(args, "jr_compile_time"):
    os.makedirs(args.dir, exist_ok=True)
    write_store(args)
    result["policies"] = {
      policy: summarize([run_pair(args, policy) for _ in range(args.repeat)])
      for policy in (POLICIES[-1:] if args.quick else POLICIES)  # quick: the dense stream
    }
  for policy, fig in result["policies"].items():
    digests = {r[kind]["logits_sha256"] for r in fig["runs"] for kind in ("cold", "warm")}
    _result.check(
      checks,
      f"{policy}: logits from the cache == logits compiled, every run (bit for bit)",
      len(digests) == 1,
      f"{len(digests)} distinct digest(s)",
      _result.PARITY,
    )
    worst = max(r[kind]["max_rel_diff"] for r in fig["runs"] for kind in ("cold", "warm"))
    _result.check(
      checks,
      f"{policy}: logits vs the plain model, max relative difference <= 1e-5",
      worst <= 1e-5,
      f"{worst:.2e}",
      _result.PARITY,
    )
    _result.check(
      checks,
      f"{policy}: first pass from the cache <= {FIRST_PASS_RATIO_TARGET:g}x compiling it",
      fig["ratio"] <= FIRST_PASS_RATIO_TARGET,
      f"{fig['ratio']:.2f}x ({fig['warm_first_pass_s']:.2f} s against "
      f"{fig['cold_first_pass_s']:.2f} s)",
    )
  result["backend"] = next(iter(result["policies"].values()))["runs"][0]["cold"]["backend"]
  result["checks"] = checks
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
