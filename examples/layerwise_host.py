"""Stream a model's layers from pinned host memory, and check it against the plain model.

Builds the toy transformer, places it with ``LayerwiseHost`` — every layer's
weights in ``pinned_host`` memory, moved to the device inside the layer loop
``prefetch_depth`` units ahead — prints what was decided at load time, runs it,
and compares the logits with the plain (unplaced, jitted) model's. Exits 1 when
they differ. Runs on CPU; on a GPU/TPU the same code overlaps copies and compute.

  python examples/layerwise_host.py [--prefetch-depth 2] [--layers 4]
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
from flax import nnx

import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--prefetch-depth", type=int, default=2, help="units in flight (default 2)")
  parser.add_argument("--layers", type=int, default=4, help="stacked blocks (default 4)")
  parser.add_argument("--d-model", type=int, default=64, help="hidden width (default 64)")
  parser.add_argument("--seq", type=int, default=16, help="tokens per sequence (default 16)")
  args = parser.parse_args(argv)

  cfg = ToyConfig(
    vocab=256, d_model=args.d_model, n_heads=4, d_ff=2 * args.d_model, n_layers=args.layers
  )
  model = ToyTransformer(cfg, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, args.seq), 0, cfg.vocab)

  # The plain model, compiled the same way as the placed one: the reference.
  expected = nnx.jit(lambda m, x: m(x))(model, tokens)

  offload = jr.OffloadConfig(prefetch_depth=args.prefetch_depth)
  policy = jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=offload))
  with jr.place(model, policy) as placed:
    print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}")
    print(f"policy: {placed.policy.name}, prefetch_depth={args.prefetch_depth}")
    print(placed.metadata)
    logits = placed(tokens)

  diff = float(np.max(np.abs(np.asarray(logits) - np.asarray(expected))))
  equal = bool(np.array_equal(logits, expected))
  print(f"logits: {logits.shape} {logits.dtype}")
  print(f"max abs diff: {diff:g}")
  print(f"equal: {equal}")
  return 0 if equal else 1


if __name__ == "__main__":
  sys.exit(main())
