"""Throughput mode: many sequences a streamed pass, each unit read once a pass for the
whole batch (docs/throughput.md).

Model: a Llama-family decoder of random weights, float32: hidden 2048, intermediate 5632,
32 query / 4 key-value heads (176 MB a layer), ``--layers`` layers (default 8), a
vocabulary of 8192 tied to the head (SmolLM2's 49152 would make the prefill's logits,
batch x prompt x vocabulary, outweigh a layer), written once as a store under ``--dir``
and placed ``DenseDiskStream(host_budget_bytes=0)``: every pass streams the layers from
the store (the abstract model: no weights in memory).

Rows: ``models.generate_batch`` of B prompts in one batch, for each B of ``--batches``
(1, 8, 32, 64), greedy, ``--prompt`` random ids a prompt (seeded: prompt ``i`` is the
same in every row) and ``--tokens`` new tokens; batch 1 generates the first ``--alone``
prompts one at a time. Two regimes: ``cache`` (the store's files read into the page cache first) and
``disk`` (the store's pages dropped before every pass, outside the pass's time, as a
model larger than memory reads them). Each row runs in a fresh process, ``--repeat``
times; its figures are medians. From the placed model's report, compile time taken
out: decode tokens/s (tokens the decode passes made / their seconds), end-to-end
tokens/s (every generated token / the generation's seconds, prefill included), bytes
read per generated token and per decode pass, and the fraction of the decode passes
spent waiting on unit reads (``stall_seconds``: on CPU a unit's pages are mapped, so a
read from disk also faults pages in during the step, which counts as the step's time,
not as a wait). The anchor: the plain model (the same weights in memory) under
``jax.jit`` (`_measure.plain_jitted`), batch 1, where it fits in half the memory.

Parity (every run): each row's first ``--alone`` sequences are the batch-1 row's tokens
for the same prompts, generated alone. Targets (exit 1 on a miss): disk-bound, decode
tokens/s at batch 32 >= 16x batch 1's and at batch 64 >= 25x; from the page cache,
batch 32 >= 5x.

  python benchmarks/throughput.py                        # files under $TMPDIR/jr_throughput
  python benchmarks/throughput.py --layers 4 --repeat 1  # the reduced run
  python benchmarks/throughput.py --quick                # a tiny model, batch 1 and 4,
                                                         # cache only, 1 run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import _child
import _decoding
import _measure
import _result

REGIMES = ("cache", "disk")
BATCHES = (1, 8, 32, 64)
#: (regime, batch) -> the least ratio of its decode tokens/s to batch 1's.
TARGETS = {("disk", 32): 16.0, ("disk", 64): 25.0, ("cache", 32): 5.0}
#: (hidden, intermediate, heads, key-value heads, vocabulary) of the full and quick models.
SHAPE = (2048, 5632, 32, 4, 8192)
QUICK_SHAPE = (64, 128, 4, 2, 256)
QUICK_LAYERS = 3  # more than the device window of 2 units: every pass reads
PROMPT_SEED = 0


def config(layers: int, shape: tuple[int, ...]):
  return _decoding.llama_config(layers, *shape, tie_word_embeddings=True)


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
  """``count`` prompts of ``length`` random ids; prompt ``i`` the same for every count."""
  import numpy as np

  rng = np.random.default_rng(PROMPT_SEED)
  return [rng.integers(3, vocab, length).tolist() for _ in range(count)]


def child_build(args: argparse.Namespace) -> dict:
  import jax_residency as jr
  from jax_residency import models

  cfg = config(args.layers, json.loads(args.shape))
  info = jr.save(models.init_llama(cfg, seed=0), args.store, progress=False, overwrite=True)
  return {"unit_nbytes": info.unit_nbytes, "units": info.unit_count}


def child_run(args: argparse.Namespace) -> dict:
  """One row in one regime: its tokens and figures, from the placed model's report."""
  from flax import nnx

  import jax_residency as jr
  from jax_residency import models

  cfg = config(args.layers, json.loads(args.shape))
  batch = args.batch
  rows = prompts(max(batch, args.alone), args.prompt, cfg.vocab_size)
  rows = rows[: args.alone] if batch == 1 else rows[:batch]
  abstract = nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))
  if args.regime == "cache":
    _measure.read_files(args.store)
  placed = jr.place(abstract, jr.DenseDiskStream(host_budget_bytes=0), store=args.store)
  dropping = [0.0]

  def forward(*a):
    if args.regime == "disk":
      start = time.perf_counter()
      _measure.drop_page_cache(args.store)
      dropping[0] += time.perf_counter() - start
    return placed(*a)

  start = time.perf_counter()
  tokens = models.generate_batch(
    forward, rows, args.tokens, config=cfg, batch_size=batch, stop_tokens=()
  )
  wall = time.perf_counter() - start - dropping[0]
  report = placed.report()
  placed.close()
  decode_s = report.decode.seconds - report.decode.compile_seconds
  generated = len(rows) * args.tokens
  return {
    "tokens": tokens[: args.alone],
    "decode_tok_s": len(rows) * (args.tokens - 1) / decode_s,
    "e2e_tok_s": generated / (wall - report.total.compile_seconds),
    "bytes_per_token": report.total.bytes_read / generated,
    "bytes_per_pass": report.decode.bytes_read / report.decode.passes,
    "read_wait": report.decode.stall_seconds / decode_s,
    "prefill_s": report.prefill.seconds - report.prefill.compile_seconds,
    "decode_s": decode_s,
    "passes": report.total.passes,
  }


def child_plain(args: argparse.Namespace) -> dict:
  """The plain model jitted, batch 1: its decode tokens/s after a warm-up generation."""
  import jax

  from jax_residency import models

  cfg = config(args.layers, json.loads(args.shape))
  rows = prompts(args.alone, args.prompt, cfg.vocab_size)
  jitted = _measure.plain_jitted(models.init_llama(cfg, seed=0))  # the store's weights
  times: list[float] = []

  def forward(*a):
    start = time.perf_counter()
    out = jax.block_until_ready(jitted(*a))
    times.append(time.perf_counter() - start)
    return out

  models.generate_batch(forward, rows[:1], args.tokens, config=cfg, stop_tokens=())  # compiles
  decode_s = 0.0
  for row in rows:
    times.clear()
    models.generate_batch(forward, [row], args.tokens, config=cfg, stop_tokens=())
    decode_s += sum(times[1:])
  return {"decode_tok_s": len(rows) * (args.tokens - 1) / decode_s}


def plain_fits(cfg) -> bool:
  """Whether the plain model's weights take at most half the machine's memory."""
  per_layer = 4 * (
    cfg.hidden_size * (2 * cfg.hidden_size + 2 * cfg.num_key_value_heads * cfg.head_width)
    + 3 * cfg.hidden_size * cfg.intermediate_size
  )
  weights = cfg.num_hidden_layers * per_layer + 4 * cfg.vocab_size * cfg.hidden_size
  return 2 * weights <= _result.machine()["memory_bytes"]


def run_all(args: argparse.Namespace, shape: tuple[int, ...]) -> tuple[dict, dict | None]:
  """Every (regime, batch) row ``--repeat`` times, each a fresh process; the anchor once."""
  common = ["--shape", json.dumps(list(shape)), "--store", args.store]
  common += _child.flags(args, ("layers", "prompt", "tokens", "alone"))
  if not os.path.exists(os.path.join(args.store, "commit_success.txt")):
    print(f"writing {args.store} ...", file=sys.stderr)
    _child.run(__file__, "--child", "build", *common, what="build")
  found: dict = {}
  for r in range(args.repeat):
    for regime in args.regimes.split(","):
      for batch in map(int, args.batches.split(",")):
        print(f"run {r + 1}/{args.repeat}: {regime} batch {batch} ...", file=sys.stderr)
        argv = ["--child", "run", *common, "--regime", regime, "--batch", str(batch)]
        found.setdefault((regime, batch), []).append(
          _child.run(__file__, *argv, what=f"{regime} batch {batch}")
        )
  plain = None
  if plain_fits(config(args.layers, shape)):
    print("the plain jitted model, batch 1 ...", file=sys.stderr)
    plain = _child.run(__file__, "--child", "plain", *common, what="plain")
  return found, plain


FIGURES = ("decode_tok_s", "e2e_tok_s", "bytes_per_token", "bytes_per_pass", "read_wait")


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the store here (default: $TMPDIR/jr_throughput)")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--prompt", type=int, default=128, help="tokens a prompt")
  parser.add_argument("--tokens", type=int, default=64, help="new tokens a prompt")
  parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
  parser.add_argument("--alone", type=int, default=2, help="prompts batch 1 generates")
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument("--child", choices=("build", "run", "plain"), help=argparse.SUPPRESS)
  for name in ("shape", "store", "regime"):
    parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
  parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
  _result.add_args(parser)
  args = parser.parse_args()
  if args.child:
    children = {"build": child_build, "run": child_run, "plain": child_plain}
    return _child.answer(children[args.child](args))
  sizes = {"layers": QUICK_LAYERS, "prompt": 16, "tokens": 8, "batches": "1,4", "repeat": 1}
  _result.quick_sizes(args, parser, {**sizes, "regimes": "cache"})
  shape = QUICK_SHAPE if args.quick else SHAPE
  with _result.work_dir(args, "jr_throughput"):
    os.makedirs(args.dir, exist_ok=True)
    args.store = os.path.join(args.dir, f"llama-{args.layers}x{shape[0]}-{shape[-1]}-store")
    found, plain = run_all(args, shape)
  result = _result.stamp("throughput", None, args.quick)
  result.update(layers=args.layers, shape=list(shape), prompt=args.prompt, tokens=args.tokens)
  result.update(repeat=args.repeat, alone=args.alone)
  result["plain_decode_tok_s"] = None if plain is None else plain["decode_tok_s"]
  rows: dict = {}
  checks: list[dict] = []
  for (regime, batch), outs in found.items():
    row = {f: statistics.median(o[f] for o in outs) for f in FIGURES}
    row["decode_tok_s_runs"] = [o["decode_tok_s"] for o in outs]
    rows.setdefault(regime, {})[str(batch)] = row
  for regime, per in rows.items():
    alone = found[(regime, 1)][0]["tokens"] if (regime, 1) in found else None
    for batch in per:
      if alone is None or batch == "1":
        continue
      outs = found[(regime, int(batch))]
      differ = sum(a != b for o in outs for a, b in zip(o["tokens"], alone, strict=False))
      _result.check(
        checks,
        f"{regime}, batch {batch}: the first {len(alone)} sequences' greedy tokens == each "
        "generated alone (every run)",
        differ == 0,
        "equal" if differ == 0 else f"{differ} of {len(alone) * len(outs)} differ",
        _result.PARITY,
      )
    for (where, batch), want in TARGETS.items():
      if where != regime or str(batch) not in per or "1" not in per:
        continue
      ratio = per[str(batch)]["decode_tok_s"] / per["1"]["decode_tok_s"]
      _result.check(
        checks,
        f"{regime}: batch {batch} decode tokens/s >= {want:g}x batch 1's",
        ratio >= want,
        f"{ratio:.1f}x ({per[str(batch)]['decode_tok_s']:.1f} vs {per['1']['decode_tok_s']:.2f})",
      )
  result["rows"] = rows
  result["checks"] = checks
  return _result.finish(result, args, render)


def _table(result: dict) -> list[list[str]]:
  out = []
  for regime, per in result["rows"].items():
    base = per.get("1", {}).get("decode_tok_s")
    for batch, r in per.items():
      out.append(
        [
          regime,
          batch,
          f"{r['decode_tok_s']:.2f}",
          "-" if base is None else f"{r['decode_tok_s'] / base:.1f}x",
          f"{r['e2e_tok_s']:.2f}",
          _measure.fmt_bytes(r["bytes_per_token"]),
          f"{r['read_wait']:.0%}",
        ]
      )
  return out


HEADER = [
  "regime",
  "batch",
  "decode tok/s",
  "vs batch 1",
  "end-to-end tok/s",
  "read / token",
  "read wait",
]


def render(result: dict) -> str:
  plain = result.get("plain_decode_tok_s")
  anchor = "" if plain is None else f"\nplain jitted model, batch 1: {plain:.2f} decode tok/s"
  return _result.text_table(HEADER, _table(result)) + anchor


def markdown(result: dict) -> str:
  """The result as a Markdown table (``benchmarks/report.py``)."""
  hidden, inter, heads, kv, vocab = result["shape"]
  plain = result.get("plain_decode_tok_s")
  lines = [
    f"A random Llama of {result['layers']} layers (hidden {hidden}, intermediate {inter}, "
    f"{heads} / {kv} heads, vocabulary {vocab}, float32), streamed "
    "DenseDiskStream(host_budget_bytes=0); `models.generate_batch`, greedy, prompts of "
    f"{result['prompt']} random ids, {result['tokens']} new tokens; batch 1 generates "
    f"{result['alone']} prompts one at a time. Medians of {result['repeat']} run(s), each "
    "row a fresh process; `disk`: the store's pages dropped before every pass. Read wait: "
    "the decode passes' waits on unit reads (mapped pages faulted in during a step count "
    "as the step's). "
    + (
      "The plain model is not run (its weights exceed half the memory)."
      if plain is None
      else f"The plain jitted model, batch 1: {plain:.2f} decode tok/s."
    ),
    "",
  ]
  return "\n".join(lines + _result.markdown_table(HEADER, _table(result)))


if __name__ == "__main__":
  sys.exit(main())
