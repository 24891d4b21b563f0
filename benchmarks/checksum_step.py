"""What chunk checksums cost a decode step served from the page cache.

Writes (or reuses, under ``--dir``) the same GPT decoder twice as a store, with
checksums (as `jax_residency.save` writes stores) and without (``WRITE_CHECKSUMS``
off, as stores were written before they had them), and times one-token decode
steps under ``DenseDiskStream(host_budget_bytes=0)`` with the store in the page
cache: the median of ``--steps`` steps in a fresh process, per store, ``--repeat``
times in alternation. A chunk is checked when its bytes come from disk
(docs/memory.md, "Checksums on the read path"), so a step served from the page
cache should cost what it costs without checksums.

Parity gates: every run, on either store, gives the same logits, bit for bit
(the prefill's and every step's; the two stores hold the same weights and run
the same steps), and the stores are what they should be (``crc32c`` on every
array of one, on none of the other). Target: the step with checksums <= 1.1x the step without, on
the medians. The script exits 1 when the gate fails or (unless ``--quick``) the
target is missed; a full run writes ``benchmarks/results/checksum_step.json``
(``benchmarks/_result.py``).

  python benchmarks/checksum_step.py                  # GPT 4 x 2048/8192, vocab 16000
  python benchmarks/checksum_step.py --layers 2 --d-model 256 --d-ff 1024 --vocab 1000
  python benchmarks/checksum_step.py --quick          # 2 x 256/1024, vocab 1000, one run each
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import time

import _child
import _measure
import _result

STEP_RATIO_TARGET = 1.1  # target: page-cache step with checksums <= 1.1x without
#: ``--quick``'s sizes, where the flags are left at their defaults.
QUICK = {
  "layers": 2,
  "d_model": 256,
  "d_ff": 1024,
  "heads": 4,
  "vocab": 1000,
  "steps": 6,
  "repeat": 1,
}
#: The size flags a child process gets from its parent.
SIZES = ("layers", "d_model", "d_ff", "heads", "vocab", "steps")
KINDS = ("crc", "plain")


def child(args: argparse.Namespace, checksums: bool) -> dict:
  """The median one-token step, in seconds, of the store with or without checksums,
  and a digest of every logit the run computed (prefill and steps)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models
  from jax_residency._src.store import verify, writer
  from jax_residency._src.store.unit_store import UnitStore

  max_len = 8 + args.steps + 4
  cfg = _measure.gpt_config(args, max_len)
  tag = f"gpt-{args.layers}x{args.d_model}x{args.d_ff}-v{args.vocab}-t{max_len}"
  store = os.path.join(args.dir, f"{tag}-{'crc' if checksums else 'plain'}")
  if not os.path.exists(store):
    writer.WRITE_CHECKSUMS = checksums
    jr.save(models.init_gpt(cfg, seed=0), store, progress=False)
  with UnitStore.open(store) as opened:
    stored_checksums = verify.checksums(opened)
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  digest = hashlib.sha256()
  total = 0.0

  def keep(logits) -> None:
    nonlocal total
    a = np.ascontiguousarray(np.asarray(logits))
    digest.update(a.tobytes())
    total += float(a.astype(np.float64).sum())

  with jr.place(abstract, jr.DenseDiskStream(host_budget_bytes=0), store=store) as placed:
    logits, cache = placed(jnp.ones((1, 8), jnp.int32))  # the prefill reads (and checks)
    keep(logits)
    times = []
    for pos in range(8, 8 + args.steps):
      start = time.perf_counter()
      logits, cache = placed(jnp.ones((1, 1), jnp.int32), cache, jnp.asarray(pos, jnp.int32))
      np.asarray(logits)
      times.append(time.perf_counter() - start)
      keep(logits)
  return {
    "step_s": statistics.median(times[2:]),  # the first steps compile
    "logits_sha256": digest.hexdigest(),
    "logits_sum": total,
    "backend": jax.default_backend(),
    "store_checksums": stored_checksums,
  }


def render(result: dict) -> str:
  crc, plain = result["step_s_with_checksums"], result["step_s_without_checksums"]
  return "\n".join(
    [
      f"page-cache decode step, medians of {result['repeat']} fresh process(es):",
      f"  with checksums     {statistics.median(crc):.4f} s  (runs: {crc})",
      f"  without checksums  {statistics.median(plain):.4f} s  (runs: {plain})",
      f"  ratio {result['ratio']:.2f} (target <= {STEP_RATIO_TARGET:g})",
    ]
  )


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  rows = [
    f"GPT {result['layers']} x {result['d_model']}/{result['d_ff']}, vocab {result['vocab']}; "
    f"medians of {result['repeat']} fresh process(es), each the median of "
    f"{result['steps'] - 2} timed steps:",
    "",
    "| store | page-cache decode step | runs |",
    "|---|---|---|",
  ]
  for label, key in (("with checksums", "with"), ("without checksums", "without")):
    runs = result[f"step_s_{key}_checksums"]
    listed = ", ".join(f"{x:.4f}" for x in runs)
    rows.append(f"| {label} | {statistics.median(runs):.4f} s | {listed} |")
  rows.append(f"| ratio | {result['ratio']:.2f}x | target <= {result['target']:g}x |")
  return "\n".join(rows)


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--dir",
    help="keep the stores here and reuse them (default: a temporary directory named"
    " jr_checksum_step; with --quick, a fresh one removed afterwards)",
  )
  _measure.add_gpt_args(parser, layers=4, d_model=2048, d_ff=8192, heads=16, vocab=16000)
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes per store")
  _result.add_args(parser)
  parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(child(args, args.child == "crc"))
  _result.quick_sizes(args, parser, QUICK)
  if args.steps < 3:
    parser.error("--steps must be at least 3 (the first two steps compile)")
  runs: dict[str, list[dict]] = {kind: [] for kind in KINDS}
  with _result.work_dir(args, "jr_checksum_step"):
    os.makedirs(args.dir, exist_ok=True)
    flags = ["--dir", args.dir, *_child.flags(args, SIZES)]
    for _ in range(args.repeat):
      for kind in KINDS:
        runs[kind].append(_child.run(__file__, *flags, "--child", kind, what=kind))
  steps = {kind: [r["step_s"] for r in runs[kind]] for kind in KINDS}
  with_crc, without = statistics.median(steps["crc"]), statistics.median(steps["plain"])
  ratio = with_crc / without
  digests = {kind: sorted({r["logits_sha256"] for r in runs[kind]}) for kind in KINDS}
  result = _result.stamp("checksum_step", None, args.quick)
  result.update({name: getattr(args, name) for name in (*SIZES, "repeat")})
  result.update(
    {
      "backend": runs["crc"][0]["backend"],
      "step_s_with_checksums": steps["crc"],
      "step_s_without_checksums": steps["plain"],
      "ratio": ratio,
      "target": STEP_RATIO_TARGET,
      "logits_sha256": digests,
      "logits_sum": {kind: [r["logits_sum"] for r in runs[kind]] for kind in KINDS},
    }
  )
  checks: list[dict] = []
  same = len(digests["crc"]) == 1 and digests["crc"] == digests["plain"]
  _result.check(
    checks,
    "logits with checksums == logits without, every run (bit for bit)",
    same,
    f"{len(set(digests['crc']) | set(digests['plain']))} distinct digest(s)",
    _result.PARITY,
  )
  stored = {kind: sorted({r["store_checksums"] for r in runs[kind]}) for kind in KINDS}
  result["store_checksums"] = stored
  _result.check(
    checks,
    "one store has checksums on every array, the other on none",
    stored == {"crc": ["crc32c"], "plain": ["none"]},
    stored,
    _result.PARITY,
  )
  _result.check(
    checks,
    f"page-cache step with checksums <= {STEP_RATIO_TARGET:g}x without (medians)",
    ratio <= STEP_RATIO_TARGET,
    round(ratio, 3),
  )
  result["checks"] = checks
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
