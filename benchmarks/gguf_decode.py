"""Greedy decoding from converted GGUF files, streamed from the page cache and from disk,
against a float32 store of the same weights.

Two llama.cpp GGUF files of one Llama shape are written under ``--dir`` with the
``gguf`` package: ``q4_k_m``, laid out as llama.cpp's Q4_K_M preset lays a model out
(Q4_K matrices; ``attn_v`` and ``ffn_down`` Q6_K in the first and last eighth of the
layers and every third between, so those two are mixed stacks; the head Q6_K), and
``q8_0`` (every matrix Q8_0). The blocks are random with set float16 scales (gguf-py
cannot quantize the K-quants), so the decoded weights have a chosen spread. Each file is
converted with ``models.convert_gguf``; the ``f32`` store holds the Q4_K_M file's
weights as gguf-py dequantizes them, saved with ``jr.save`` (what a float32 checkpoint
of the same model would give). By default: 8 layers, hidden 2048, feed-forward 5632,
16 query / 4 key-value heads, vocabulary 32000; a layer is 181 MB in float32, 29 MB as
Q4_K_M, 48 MB as Q8_0.

Each row places its store with ``DenseDiskStream(host_budget_bytes=0)`` in a fresh
process, warms up (a prefill and one step of another prompt), then times a prefill
and ``--steps`` greedy one-token steps in each regime: ``page-cache`` (the store read
into the page cache first) and ``disk`` (the store's pages dropped before the prefill
and every step, outside the timing, as a model larger than RAM sees).

Parity gates: each row's greedy tokens equal the plain model's, the model holding the
values gguf-py dequantizes from its file (``f32`` and ``q4_k_m``: the Q4_K_M file's), in
both regimes, in every run. Targets, on the medians (the int8/int4 targets of
benchmarks/decode.py, for GGUF's own types):

* ``q8_0``: decode step <= 0.6x ``f32``'s from the page cache, <= 0.35x from disk;
* ``q4_k_m``: <= 0.45x and <= 0.25x.

Figures are medians of ``--repeat`` runs (default 3). Exits 1 when a gate fails or
(unless ``--quick``) a target is missed; a full run writes
``benchmarks/results/gguf_decode.json``.

  python benchmarks/gguf_decode.py            # builds under $TMPDIR/jr_gguf_decode once
  python benchmarks/gguf_decode.py --quick    # toy size, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from typing import Any

import _child
import _decoding
import _ggml_blocks
import _result

ROWS = ("f32", "q8_0", "q4_k_m")
#: (page-cache, disk) targets: a row's decode step <= this x the f32 row's.
TARGETS = {"q8_0": (0.6, 0.35), "q4_k_m": (0.45, 0.25)}
MODEL_ARGS = ("layers", "hidden", "ffn", "heads", "kv_heads", "vocab", "prompt_len", "steps")
QUICK = {
  "layers": 2,
  "hidden": 256,
  "ffn": 512,
  "heads": 4,
  "kv_heads": 2,
  "vocab": 512,
  "prompt_len": 8,
  "steps": 3,
  "repeat": 1,
}
WEIGHT_STD, EMBED_STD = 0.02, 1.0


def paths(args: argparse.Namespace) -> dict[str, str]:
  key = "llama-{layers}x{hidden}x{ffn}-h{heads}-kv{kv_heads}-v{vocab}".format(**vars(args))
  base = os.path.join(args.dir, key)
  out = {"base": base, "reference": os.path.join(base, "reference.json")}
  for name in ("q4_k_m", "q8_0"):
    out[f"{name}.gguf"] = os.path.join(base, f"{name}.gguf")
  for row in ROWS:
    out[row] = os.path.join(base, f"{row}-store")
  return out


def more_bits(i: int, n: int) -> bool:
  """llama.cpp's rule for the layers its _M presets give a larger type."""
  return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_types(args: argparse.Namespace, preset: str) -> dict[str, str]:
  """Each tensor's GGML type under ``preset``, by name."""
  roles = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
  if preset == "q8_0":
    out = {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"}
    out |= {f"blk.{i}.{r}.weight": "Q8_0" for i in range(args.layers) for r in roles}
    return out
  out = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
  for i in range(args.layers):
    for r in roles:
      wide = r in ("attn_v", "ffn_down") and more_bits(i, args.layers)
      out[f"blk.{i}.{r}.weight"] = "Q6_K" if wide else "Q4_K"
  return out


def random_blocks(rng, name: str, rows: int, cols: int, std: float):
  """Random ``name`` rows whose decoded values have about the standard deviation ``std``:
  random codes, the float16 scales set (measured on the first rows, then set again)."""
  import gguf
  import numpy as np

  qtype = gguf.GGMLQuantizationType[name]
  block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)

  def set_scales(scale: float) -> None:
    d = (scale * rng.uniform(0.5, 1.5, raw.shape[:2])).astype(np.float16)
    _ggml_blocks.set_scales(raw, name, lambda: d)  # one draw: d and dmin alike

  set_scales(1e-3)
  sample = gguf.quants.dequantize(raw[:16].reshape(16, -1), qtype)
  set_scales(1e-3 * std / float(np.sqrt(np.mean(sample**2))))
  return raw.reshape(rows, -1)


def write_gguf(
  args: argparse.Namespace,
  path: str,
  preset: str,
  *,
  types: dict[str, str] | None = None,
  metadata: Callable[[Any], None] | None = None,
) -> None:
  """The Llama file of ``args``' shape with random blocks: each tensor's GGML type from
  ``types`` (default: `tensor_types` of ``preset``); ``metadata``, where given, is called
  with the ``gguf.GGUFWriter`` before the header is written, to add fields."""
  import gguf
  import numpy as np

  h, f, kv = args.hidden, args.ffn, args.kv_heads * (args.hidden // args.heads)
  writer = gguf.GGUFWriter(path, "llama")
  writer.add_block_count(args.layers)
  writer.add_context_length(args.prompt_len + args.steps + 64)
  writer.add_embedding_length(h)
  writer.add_feed_forward_length(f)
  writer.add_head_count(args.heads)
  writer.add_head_count_kv(args.kv_heads)
  writer.add_rope_dimension_count(h // args.heads)
  writer.add_layer_norm_rms_eps(1e-5)
  rng = np.random.default_rng(0 if preset == "q4_k_m" else 1)
  shapes = {"token_embd.weight": (args.vocab, h), "output.weight": (args.vocab, h)}
  layer = dict(attn_q=(h, h), attn_k=(kv, h), attn_v=(kv, h), attn_output=(h, h))
  layer |= dict(ffn_gate=(f, h), ffn_up=(f, h), ffn_down=(h, f))
  types = tensor_types(args, preset) if types is None else types
  norm = np.ones(h, np.float32)
  writer.add_tensor("output_norm.weight", norm)
  for i in range(args.layers):
    writer.add_tensor(f"blk.{i}.attn_norm.weight", norm)
    writer.add_tensor(f"blk.{i}.ffn_norm.weight", norm)
    shapes |= {f"blk.{i}.{r}.weight": s for r, s in layer.items()}
  for name, (rows, cols) in shapes.items():
    std = EMBED_STD if name == "token_embd.weight" else WEIGHT_STD
    t = types[name]
    raw = random_blocks(rng, t, rows, cols, std)
    writer.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[t])
  if metadata is not None:
    metadata(writer)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def prompts(args: argparse.Namespace):
  import numpy as np

  rng = np.random.default_rng(2)
  return tuple(rng.integers(3, args.vocab, (1, args.prompt_len), dtype=np.int32) for _ in range(2))


def build(args: argparse.Namespace) -> dict:
  """The files, the stores and the plain models' greedy tokens (once; reused)."""
  import numpy as np

  import jax_residency as jr
  from jax_residency import models
  from jax_residency._src.models.gguf_reference import dequantized_model

  p = paths(args)
  if os.path.exists(p["reference"]):
    with open(p["reference"]) as f:
      return json.load(f)
  os.makedirs(p["base"], exist_ok=True)
  prompt, _ = prompts(args)
  reference = {}
  for preset in ("q4_k_m", "q8_0"):
    write_gguf(args, p[f"{preset}.gguf"], preset)
    models.convert_gguf(p[f"{preset}.gguf"], p[preset], progress=False, overwrite=True)
    model = dequantized_model(p[f"{preset}.gguf"], p[preset])
    tokens = models.generate_llm(model, prompt, args.steps + 1, stop_tokens=())
    reference[preset] = np.asarray(tokens)[0].tolist()
    if preset == "q4_k_m":
      jr.save(model, p["f32"], progress=False, overwrite=True)
    del model
  with open(p["reference"], "w") as f:
    json.dump(reference, f)
  return reference


def row_child(args: argparse.Namespace, row: str) -> dict:
  """One row in this process: per regime, the tokens, the prefill, the median step, the
  bytes read a decode token."""
  import jax_residency as jr
  from jax_residency import models

  store = paths(args)[row]
  model = models.load(paths(args)["q4_k_m"])  # the abstract Llama (f32's store has no config)
  cfg = model.config
  length = args.prompt_len + args.steps + 1
  placed = jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=store)
  step = _decoding.llama_step(placed, cfg, length)

  def greedy(prompt, steps: int, before=None) -> dict:
    cache = models.LlamaCache.zeros(cfg, 1, length)  # made outside the timing
    return _decoding.greedy(step, prompt, steps, cache=cache, before=before)

  prompt, warm = prompts(args)
  greedy(warm, 1)
  out: dict = {"unit_nbytes": placed.metadata.stacks[0].unit_bytes, "regimes": {}}
  for regime in _decoding.REGIMES:
    placed.clear_caches()
    before = _decoding.prepare_regime(regime, store)
    first = len(placed.report().passes)
    run = greedy(prompt, args.steps, before)
    decode = [q for q in placed.report().passes[first:] if q.phase == "decode"]
    out["regimes"][regime] = {
      **_decoding.summary(run),
      "bytes_per_token": statistics.mean(q.bytes_read for q in decode),
    }
  placed.close()
  return out


def markdown(result: dict) -> str:
  lines = [
    f"Llama {result['layers']} layers x hidden {result['hidden']} / ffn {result['ffn']}, "
    f"{result['heads']}/{result['kv_heads']} heads, vocab {result['vocab']}; "
    f"DenseDiskStream(host 0); medians of {result['repeat']} run(s), each row a fresh "
    f"process; {result['steps']} decode steps:",
    "",
    "| row | unit | page-cache step | vs f32 | disk step | vs f32 | bytes read a token |",
    "|---|---|---|---|---|---|---|",
  ]
  f32 = result["rows"]["f32"]
  for row, r in result["rows"].items():
    pc, dk = r["page-cache"], r["disk"]
    lines.append(
      f"| {row} | {r['unit_nbytes'] / 2**20:.1f} MiB | {pc['step_s']:.3f} s | "
      f"{pc['step_s'] / f32['page-cache']['step_s']:.2f}x | {dk['step_s']:.3f} s | "
      f"{dk['step_s'] / f32['disk']['step_s']:.2f}x | {dk['bytes_per_token'] / 2**20:.0f} MiB |"
    )
  return "\n".join(lines)


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the files and stores here (default: a temp dir)")
  for name, default in (
    ("layers", 8),
    ("hidden", 2048),
    ("ffn", 5632),
    ("heads", 16),
    ("kv_heads", 4),
    ("vocab", 32000),
    ("prompt_len", 32),
    ("steps", 16),
  ):
    parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
  parser.add_argument("--repeat", type=int, default=3, help="runs, each row a fresh process")
  _result.add_args(parser)
  parser.add_argument("--child", choices=ROWS, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer(row_child(args, args.child))
  _result.quick_sizes(args, parser, QUICK)
  with _result.work_dir(args, "jr_gguf_decode"):
    print(f"building under {paths(args)['base']} (once) ...", file=sys.stderr)
    reference = build(args)
    flags = ["--dir", args.dir, *_child.flags(args, MODEL_ARGS)]
    runs: dict[str, list[dict]] = {row: [] for row in ROWS}
    for k in range(args.repeat):
      print(f"run {k + 1}/{args.repeat} ...", file=sys.stderr)
      for row in ROWS:
        runs[row].append(_child.run(__file__, *flags, "--child", row, what=f"row {row}"))
  result = _result.stamp("gguf_decode", None, args.quick)
  result.update({name: getattr(args, name) for name in (*MODEL_ARGS, "repeat")})
  rows: dict[str, dict] = {}
  checks: list[dict] = []
  for row in ROWS:
    want = reference["q8_0" if row == "q8_0" else "q4_k_m"]
    rows[row] = {"unit_nbytes": runs[row][0]["unit_nbytes"]}
    for regime in _decoding.REGIMES:
      per = [r["regimes"][regime] for r in runs[row]]
      rows[row][regime] = {
        key: statistics.median(x[key] for x in per)
        for key in ("prefill_s", "step_s", "bytes_per_token")
      }
      rows[row][regime]["step_s_runs"] = [x["step_s"] for x in per]
      same = all(x["tokens"] == want for x in per)
      _result.check(
        checks,
        f"{row} {regime}: greedy tokens == the plain model's (every run)",
        same,
        "equal" if same else [x["tokens"] for x in per],
        _result.PARITY,
      )
  result["rows"] = rows
  for row, (page, disk) in TARGETS.items():
    for regime, target in (("page-cache", page), ("disk", disk)):
      ratio = rows[row][regime]["step_s"] / rows["f32"][regime]["step_s"]
      _result.check(
        checks, f"{row} {regime} step <= {target:g}x f32's", ratio <= target, round(ratio, 3)
      )
  result["checks"] = checks
  return _result.finish(result, args, markdown)


if __name__ == "__main__":
  sys.exit(main())
