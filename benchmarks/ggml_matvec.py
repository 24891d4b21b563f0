"""One-token products with GGUF matrices on CPU: the native kernels against XLA's and float32.

A one-token decode step multiplies one activation row by every matrix of a unit. For a
matrix kept in a GGML type (`models.convert_gguf`), this times that product three ways
in a fresh process: the native kernel (``matvec.cc``'s ``jr_ggml_matvec``, what a step
on one CPU device calls), XLA's product with the decode fused into it (what a step on a
mesh, or lowered for an accelerator, runs), and XLA's float32 product by the decoded
matrix (what a float32 store's step runs). Each GGML type is timed but F32 (the
float32 product's bytes), and a Q4_K layer of a stack in llama.cpp's Q4_K_M mix
(``Q4_K+Q6_K``: Q4_K rows padded to Q6_K's and a type byte, `quant.ggml_mixed`; the
other layers' rows are Q6_K's). The blocks are random with finite float16 scales (F16
and BF16 rows: normal values); the median of ``--iters`` calls per
process, the median of ``--repeat`` processes.

Parity gate: the native and XLA-fused products are within float32 rounding (1e-6 of the
sum of the terms' magnitudes) of the float64 product by the matrix `quant.ggml` decodes
(XLA's own float32 product's error is reported beside it: its sums round differently,
1.4e-6 at worst in one run). Targets: the
native product <= 0.75x the float32 one for every type (the codes are 0.16-0.5 of the
float32 bytes), and <= 0.5x XLA's fused one. The script exits 1 when a gate fails or
(unless ``--quick``) a target is missed; a full run writes
``benchmarks/results/ggml_matvec.json`` (``benchmarks/_result.py``).

  python benchmarks/ggml_matvec.py                   # 4096 x 4096, 3 processes
  python benchmarks/ggml_matvec.py --quick           # 512 x 256, one process
"""

from __future__ import annotations

import argparse
import statistics
import sys

import _child
import _ggml_blocks
import _result

#: The matrices timed: each type the native kernel takes, and Q4_K_M's mix.
TYPES = (
  *("F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K"),
  *("Q6_K", "IQ4_NL", "IQ4_XS", "Q4_K+Q6_K"),
)
WAYS = ("native", "xla_fused", "float32")
NATIVE_VS_FLOAT32 = 0.75  # target: the native product <= this x the float32 one
NATIVE_VS_XLA = 0.5  # target: the native product <= this x XLA's fused one
QUICK = {"n": 512, "rows": 256, "iters": 5, "repeat": 1}


def random_rows(types: list[str], rows: int, n: int, seed: int):
  """Rows of ``types[0]`` (with several, in `quant.ggml_mixed`'s layout: one layer of a
  mixed stack), random codes and float16 scales of both signs, 2**-8 to 2**-4."""
  import ml_dtypes
  import numpy as np

  from jax_residency._src.quant import ggml, ggml_mixed

  rng = np.random.default_rng(seed)
  t = ggml.ggml_type(types[0])
  width = ggml_mixed.mixed_row_bytes(types, n) if len(types) > 1 else ggml.row_bytes(t, n)
  raw = np.zeros((rows, width), np.uint8)  # a mixed row's type byte: 0, types[0]
  if t.name in ("F16", "BF16"):  # normal values
    dtype = np.float16 if t.name == "F16" else ml_dtypes.bfloat16
    raw[:, : ggml.row_bytes(t, n)] = rng.standard_normal((rows, n)).astype(dtype).view(np.uint8)
    return raw
  blocks = rng.integers(0, 256, (rows, n // t.block_size, t.block_bytes), dtype=np.uint8)

  def draw():
    shape = blocks.shape[:2]
    return rng.choice([-1.0, 1.0], shape) * np.exp2(rng.uniform(-8, -4, shape))

  _ggml_blocks.set_scales(blocks, t.name, draw)
  raw[:, : ggml.row_bytes(t, n)] = blocks.reshape(rows, -1)
  return raw


def child(args: argparse.Namespace) -> dict:
  """Per type: the median seconds of each way, and each way's largest error against the
  float64 product over the sum of the terms' magnitudes."""
  import time

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_residency._src.quant import fused, native
  from jax_residency._src.quant.encoding import Encoding, QuantizedTensor, decode_tree
  from jax_residency._src.quant.schemes import Quantization

  if not native.available():
    raise SystemExit(f"the native kernels are not available here: {native.build_error()}")
  x = jnp.asarray(np.random.default_rng(0).standard_normal((1, args.n)), jnp.float32)
  out: dict[str, dict] = {}
  for i, types in enumerate(TYPES):
    enc = Encoding(Quantization.of({"scheme": "gguf"}), -2, "float32", types, True)
    t = QuantizedTensor((jnp.asarray(random_rows(types.split("+"), args.rows, args.n, i)),), enc)
    w = jax.jit(enc.decode)(t.parts)  # (n, rows): the values llama.cpp decodes
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    programs = {
      way: jax.jit(
        lambda t, x, kernels=("exact" if way == "native" else None): fused.fenced(
          lambda t, x: x @ decode_tree(t), t, x, kernels=kernels
        )
      )
      .lower(t, x)
      .compile()
      for way in WAYS[:2]
    }
    programs["float32"] = jax.jit(lambda w, x: x @ w).lower(w, x).compile()
    row: dict[str, dict] = {}
    for way, program in programs.items():
      operand = w if way == "float32" else t
      got = np.asarray(program(operand, x))
      times = []
      for _ in range(args.iters):
        start = time.perf_counter()
        program(operand, x).block_until_ready()
        times.append(time.perf_counter() - start)
      error = float(np.max(np.abs(got - want) / scale))
      row[way] = {"s": statistics.median(times), "error": error}
    row["bytes"] = int(t.parts[0].nbytes)
    out[types] = row
  return {"rows": out, "float32_bytes": 4 * args.n * args.rows}


def markdown(result: dict) -> str:
  """The table `benchmarks/report.py` renders: per type, the bytes and each way's time."""
  lines = [
    f"One-token product, {result['n']} inputs by {result['rows']} outputs (float32: "
    f"{result['float32_bytes'] / 1e6:.1f} MB); medians of {result['repeat']} fresh "
    f"process(es), each the median of {result['iters']} calls:",
    "",
    "| type | bytes | native kernel | XLA, decode fused | float32 | native / float32 |",
    "|---|---|---|---|---|---|",
  ]
  for types, r in result["types"].items():
    lines.append(
      f"| {types} | {r['bytes'] / 1e6:.2f} MB | {1e3 * r['native_s']:.2f} ms | "
      f"{1e3 * r['xla_fused_s']:.2f} ms | {1e3 * r['float32_s']:.2f} ms | "
      f"{r['native_s'] / r['float32_s']:.2f}x |"
    )
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--n", type=int, default=4096, help="inputs (a multiple of 256)")
  parser.add_argument("--rows", type=int, default=4096, help="outputs (even)")
  parser.add_argument("--iters", type=int, default=15, help="timed calls per process")
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes")
  _result.add_args(parser)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(child(args))
  _result.quick_sizes(args, parser, QUICK)
  if args.n % 256 or args.rows % 2:
    parser.error("--n must be a multiple of 256 and --rows even")
  flags = _child.flags(args, ("n", "rows", "iters"))
  runs = [_child.run(__file__, *flags, "--child", what="child") for _ in range(args.repeat)]
  result = _result.stamp("ggml_matvec", None, args.quick)
  result.update({name: getattr(args, name) for name in ("n", "rows", "iters", "repeat")})
  types = {}
  for name in TYPES:
    rows = [run["rows"][name] for run in runs]
    types[name] = {"bytes": rows[0]["bytes"]}
    for way in WAYS:
      types[name][f"{way}_s"] = statistics.median(r[way]["s"] for r in rows)
      types[name][f"{way}_error"] = max(r[way]["error"] for r in rows)
  result["types"] = types
  result["float32_bytes"] = runs[0]["float32_bytes"]
  checks: list[dict] = []
  worst = max(r[f"{way}_error"] for r in types.values() for way in WAYS[:2])
  result["float32_error"] = max(r["float32_error"] for r in types.values())  # XLA's own
  _result.check(
    checks,
    "native and XLA-fused products within 1e-6 of the float64 product (of the terms' magnitudes)",
    worst <= 1e-6,
    f"{worst:.2g} (XLA's float32 product: {result['float32_error']:.2g})",
    _result.PARITY,
  )
  for name, r in types.items():
    ratio = r["native_s"] / r["float32_s"]
    _result.check(
      checks,
      f"{name}: native product <= {NATIVE_VS_FLOAT32:g}x the float32 one",
      ratio <= NATIVE_VS_FLOAT32,
      round(ratio, 3),
    )
    ratio = r["native_s"] / r["xla_fused_s"]
    _result.check(
      checks,
      f"{name}: native product <= {NATIVE_VS_XLA:g}x XLA's fused one",
      ratio <= NATIVE_VS_XLA,
      round(ratio, 3),
    )
  result["checks"] = checks
  return _result.finish(result, args, markdown)


if __name__ == "__main__":
  sys.exit(main())
