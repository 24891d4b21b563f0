"""What chunk checksums cost a decode step served from the page cache.

Writes (or reuses, under ``--dir``) the same GPT decoder twice as a store, with
checksums (as `jax_residency.save` writes stores) and without (``WRITE_CHECKSUMS``
off, as stores were written before they had them), and times one-token decode
steps under ``DenseDiskStream(host_budget_bytes=0)`` with the store in the page
cache: the median of ``--steps`` steps in a fresh process, per store, ``--repeat``
times in alternation. A chunk is checked when its bytes come from disk
(docs/memory.md, "Checksums on the read path"), so a step served from the page
cache should cost what it costs without checksums.

Target: the step with checksums <= 1.1x the step without, on the
medians. The script exits 1 when it is missed.

  python benchmarks/checksum_step.py                  # GPT 4 x 2048/8192, vocab 16000
  python benchmarks/checksum_step.py --layers 2 --d-model 256 --d-ff 1024 --vocab 1000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STEP_RATIO_TARGET = 1.1  # target: page-cache step with checksums <= 1.1x without


def child(args: argparse.Namespace, checksums: bool) -> float:
  """The median one-token step, in seconds, of the store with or without checksums."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models
  from jax_residency._src.store import writer

  cfg = models.GPTConfig(
    vocab_size=args.vocab,
    d_model=args.d_model,
    n_heads=args.heads,
    d_ff=args.d_ff,
    n_layers=args.layers,
    max_len=8 + args.steps + 4,
  )
  tag = f"gpt-{args.layers}x{args.d_model}x{args.d_ff}-v{args.vocab}"
  store = os.path.join(args.dir, f"{tag}-{'crc' if checksums else 'plain'}")
  if not os.path.exists(store):
    writer.WRITE_CHECKSUMS = checksums
    jr.save(models.init_gpt(cfg, seed=0), store, progress=False)
  abstract = nnx.eval_shape(lambda: models.GPT(cfg, rngs=nnx.Rngs(0)))
  with jr.place(abstract, jr.DenseDiskStream(host_budget_bytes=0), store=store) as placed:
    logits, cache = placed(jnp.ones((1, 8), jnp.int32))  # the prefill reads (and checks)
    times = []
    for pos in range(8, 8 + args.steps):
      start = time.perf_counter()
      logits, cache = placed(jnp.ones((1, 1), jnp.int32), cache, jnp.asarray(pos, jnp.int32))
      np.asarray(logits)
      times.append(time.perf_counter() - start)
  return statistics.median(times[2:])  # the first steps compile


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "jr_checksum_step"))
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d-model", type=int, default=2048)
  parser.add_argument("--d-ff", type=int, default=8192)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--vocab", type=int, default=16000)
  parser.add_argument("--steps", type=int, default=16)
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes per store")
  parser.add_argument("--json", action="store_true")
  parser.add_argument("--child", choices=("crc", "plain"), help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args, args.child == "crc")))
    return 0
  os.makedirs(args.dir, exist_ok=True)
  steps: dict[str, list[float]] = {"crc": [], "plain": []}
  flags = [a for a in sys.argv[1:] if a != "--json"]
  for _ in range(args.repeat):
    for kind in steps:
      done = subprocess.run(
        [sys.executable, __file__, *flags, "--child", kind], capture_output=True, text=True
      )
      if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        return 1
      steps[kind].append(json.loads(done.stdout.strip().splitlines()[-1]))
  with_crc, without = statistics.median(steps["crc"]), statistics.median(steps["plain"])
  ratio = with_crc / without
  result = {
    "step_s_with_checksums": steps["crc"],
    "step_s_without_checksums": steps["plain"],
    "ratio": ratio,
    "target": STEP_RATIO_TARGET,
    "met": ratio <= STEP_RATIO_TARGET,
  }
  if args.json:
    print(json.dumps(result))
  else:
    print(f"page-cache decode step, medians of {args.repeat} fresh processes:")
    print(f"  with checksums     {with_crc:.4f} s  (runs: {steps['crc']})")
    print(f"  without checksums  {without:.4f} s  (runs: {steps['plain']})")
    verdict = "met" if result["met"] else "MISSED"
    print(f"  ratio {ratio:.2f} (target <= {STEP_RATIO_TARGET:g}): {verdict}")
  return 0 if result["met"] else 1


if __name__ == "__main__":
  sys.exit(main())
