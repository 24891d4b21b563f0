"""Writes the tiny Llama GGUF files and reference outputs the GGUF tests compare against.

Builds two small seeded decoder-only models straight into llama.cpp's GGUF format
with the ``gguf`` package's ``GGUFWriter`` (``tests/fixtures/<name>/model.gguf``),
loads each back with transformers (``AutoModelForCausalLM.from_pretrained(dir,
gguf_file="model.gguf", dtype=torch.float32, attn_implementation="eager")``, which
dequantizes every tensor with gguf-py and undoes llama.cpp's Q/K row permutation)
and ``AutoTokenizer.from_pretrained(dir, gguf_file=...)``, and records in
``reference.json`` beside the file:

* ``input_ids``: a prompt (the tokenizer's ids of ``PROMPT``, with its BOS);
  ``logits``: transformers' float32 logits at every position, ``(t, vocab)``;
  ``float32_vs_float64_max_abs_diff``: the same forward in float64 minus float32;
* ``greedy``: ``generate(..., do_sample=False, max_new_tokens=8)`` from the
  prompt, the new tokens only (the script checks that none is EOS, so the
  library's default stop tokens cannot cut them short), and
  ``greedy_min_top2_gap``, the smallest top-1 minus top-2 logit over those steps;
* ``tokenizer_cases``: 20 strings (ASCII, accents, emoji, CJK, code, tabs,
  whitespace runs, newlines, the empty string) and transformers' ids of each;
* ``tensor_types``: the GGML type of every tensor, and the config in brief.

The two fixtures (hidden 256 and intermediate 256, so K-quant rows are whole
256-value blocks; 2 layers; 4 query heads over 2 key/value heads, head_dim 64):

* ``gguf_tiny_untied``: its own ``output.weight``; a byte-level BPE tokenizer
  (``tokenizer.ggml.model = "gpt2"``, ``pre = "llama-bpe"``: Llama 3's split
  regex) of about 300 tokens trained with ``tokenizers`` on ``TEXT``, with
  merges and three control tokens, BOS added. Types: token_embd Q8_0, output
  Q6_K, attn_q Q4_K, attn_k Q5_K, attn_v Q5_0 in layer 0 and Q6_K in layer 1,
  attn_output Q4_0, ffn_gate Q4_1, ffn_up Q3_K, ffn_down Q6_K then Q4_K (a tensor
  name with two types across layers, as llama.cpp's Q4_K_M writes attn_v and
  ffn_down), norms F32.
* ``gguf_tiny_tied``: no ``output.weight`` (the head is the embedding); a
  SentencePiece-style tokenizer (``tokenizer.ggml.model = "llama"``: ``<unk>``,
  ``<s>``, ``</s>``, the 256 byte tokens ``<0x00>``.. ``<0xFF>``, then pieces
  with scores and no merges, so the merges are derived from the scores), a
  user-defined token. Types: token_embd IQ4_XS, attn_q Q4_0, attn_k IQ4_NL then
  Q5_K (mixed rows un-permuted), attn_v Q2_K, attn_output BF16, ffn_gate Q6_K,
  ffn_up Q5_1, ffn_down F32, norms F16; rope_theta 500000 and
  ``attention.key_length`` written.

F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 tensors are seeded normal weights quantized
with ``gguf.quants.quantize``; gguf-py cannot quantize Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
IQ4_NL and IQ4_XS, so those are seeded random blocks whose float16 scales are set (finite,
positive, scaled so the decoded weights have the standard deviation asked for). RMSNorm weights are
drawn from U(0.5, 1.5), and the final norm's are multiplied by ``logit_scale``
to keep the logits near 1-3 (see scripts/make_llama_reference.py for why).

The fixtures were made with torch 2.13.0, transformers 5.23.0, gguf 0.19.0 and
tokenizers 0.23.3 (recorded in each ``reference.json``). transformers is not a
dependency of the project; make a throwaway environment::

  python -m venv --system-site-packages /tmp/ggufref
  /tmp/ggufref/bin/pip install transformers==5.23.0
  /tmp/ggufref/bin/python scripts/make_gguf_reference.py [--out tests/fixtures]

The tests need neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
FILE = "model.gguf"
SIZES = dict(hidden=256, intermediate=256, layers=2, heads=4, kv_heads=2, context=128)
MAX_NEW_TOKENS = 8
MIN_GAP = 1e-3  # greedy steps closer than this to a tie would make the argmax fragile
TEXT = """The quick brown fox jumps over the lazy dog. A small cat sat on the warm mat,
and the old dog slept by the river while the sun went down over the hills.
Café, naïve, résumé, déjà vu, Ünïcödé: ñ ß Ω ∑ √. 中文 日本語 한국어. Emoji 🙂 🚀 ✨.
def greet(name):
    return f"Hello, {name}!"  # code with    spaces
for i in range(10):
\tprint(i * 2, i ** 2)
Numbers 1234567890 and 3.14159; it's what you're doing, isn't it? We'll see, they'd say.
"""
PROMPT = "The old cat sat by the river and"
TOKENIZER_CASES = [
  "Hello world",
  "The quick brown fox jumps over the lazy dog.",
  "  leading spaces",
  "trailing spaces   ",
  "Café naïve résumé déjà vu",
  "emoji 🙂🚀 mixed ✨",
  "def f(x):\n    return x * 2\n",
  "\ttab\tseparated\tvalues",
  "multiple\n\n\nnewlines",
  "numbers 1234567890 and 3.14159",
  "It's we're they'll I'd you've",
  "中文 日本語 한국어",
  "URL: https://example.com/path?q=1&r=2",
  "a",
  "",
  "    ",
  "\r\n windows line",
  "ALL CAPS SHOUTING!!!",
  "mixed-case CamelCaseWords snake_case",
  "Ünïcödé ñ ß Ω ∑ √ 𝔘𝔫𝔦",
]
TENSOR_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
CONFIGS = {
  "gguf_tiny_untied": dict(
    seed=11,
    tokenizer="gpt2",
    tied=False,
    rope_theta=10000.0,
    eps=1e-5,
    embed_std=1.0,
    weight_std=0.08,
    logit_scale=0.5,
    types=dict(
      token_embd=Q.Q8_0,
      output=Q.Q6_K,
      attn_q=Q.Q4_K,
      attn_k=Q.Q5_K,
      attn_v=(Q.Q5_0, Q.Q6_K),  # a type per layer
      attn_output=Q.Q4_0,
      ffn_gate=Q.Q4_1,
      ffn_up=Q.Q3_K,
      ffn_down=(Q.Q6_K, Q.Q4_K),
      norm=Q.F32,
    ),
  ),
  "gguf_tiny_tied": dict(
    seed=5,
    tokenizer="llama",
    tied=True,
    rope_theta=500000.0,
    eps=1e-6,
    embed_std=0.5,
    weight_std=0.15,
    logit_scale=0.125,
    key_length=True,
    types=dict(
      token_embd=Q.IQ4_XS,
      attn_q=Q.Q4_0,
      attn_k=(Q.IQ4_NL, Q.Q5_K),
      attn_v=Q.Q2_K,
      attn_output=Q.BF16,
      ffn_gate=Q.Q6_K,
      ffn_up=Q.Q5_1,
      ffn_down=Q.F32,
      norm=Q.F16,
    ),
  ),
}


# --- tokenizers -------------------------------------------------------------------


def byte_level_vocab() -> dict:
  """A byte-level BPE (GPT-2 spelling) trained on ``TEXT``: tokens, merges, types, ids."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(
    vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
  )
  tok.train_from_iterator([TEXT] * 4, trainer)
  model = json.loads(tok.to_str())["model"]
  tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
  merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
  if not merges:
    raise SystemExit("byte-level BPE: no merges learned")
  specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"]
  n = len(tokens)
  return dict(
    model="gpt2",
    pre="llama-bpe",
    tokens=tokens + specials,
    merges=merges,
    types=[1] * n + [3] * len(specials),
    bos=n,
    eos=n + 1,
    pad=n + 2,
    add_bos=True,
  )


def sentencepiece_vocab() -> dict:
  """``<unk> <s> </s>``, the 256 byte tokens, pieces trained on ``TEXT`` (scored by rank,
  no merges in the file) and a user-defined token."""
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.Metaspace()
  trainer = trainers.BpeTrainer(vocab_size=160, show_progress=False)
  tok.train_from_iterator([TEXT] * 4, trainer)
  vocab = json.loads(tok.to_str())["model"]["vocab"]
  pieces = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
  head = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  tokens = head + pieces + ["<sep>"]
  types = [2, 3, 3] + [6] * 256 + [1] * len(pieces) + [4]
  scores = [0.0] * len(head) + [-float(i) for i in range(len(pieces))] + [0.0]
  return dict(model="llama", tokens=tokens, scores=scores, types=types, bos=1, eos=2, unk=0)


# --- weights ----------------------------------------------------------------------


def random_blocks(rng, qtype: Q, rows: int, cols: int, std: float) -> np.ndarray:
  """Random ``qtype`` (a type gguf-py cannot quantize: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K,
  IQ4_NL, IQ4_XS) rows, their decoded values of standard deviation ``std``."""
  block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
  raw = rng.integers(0, 256, (rows, cols // block_size, block_bytes), dtype=np.uint8)

  def set_scales(scale: float) -> None:
    shape = raw.shape[:-1]
    d = (scale * rng.uniform(0.5, 1.5, shape)).astype(np.float16)
    if qtype in (Q.Q2_K, Q.Q4_K, Q.Q5_K):  # d, dmin; dmin ~ (the mean code) d
      centre = {Q.Q2_K: 1.5, Q.Q4_K: 7.5, Q.Q5_K: 15.5}[qtype]  # centres (c * sc - mn)
      dmin = (scale * centre * rng.uniform(0.5, 1.5, shape)).astype(np.float16)
      at = 80 if qtype == Q.Q2_K else 0  # Q2_K's close the block, the others' lead it
      raw[..., at : at + 2] = d[..., None].view(np.uint8)
      raw[..., at + 2 : at + 4] = dmin[..., None].view(np.uint8)
    elif qtype in (Q.Q3_K, Q.Q6_K):  # d closes the block
      at = 108 if qtype == Q.Q3_K else 208
      raw[..., at : at + 2] = d[..., None].view(np.uint8)
    else:  # IQ4_NL, IQ4_XS: d leads the block
      raw[..., 0:2] = d[..., None].view(np.uint8)

  set_scales(1e-3)
  got = gguf.quants.dequantize(raw.reshape(rows, -1), qtype).std()
  set_scales(1e-3 * std / got)
  out = raw.reshape(rows, -1)
  values = gguf.quants.dequantize(out, qtype)
  if not np.isfinite(values).all():
    raise SystemExit(f"{qtype.name}: non-finite weights")
  return out


#: The types written as random blocks (`random_blocks`): gguf-py cannot quantize them.
RANDOM_BLOCK_TYPES = (Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS)


def tensor_data(rng, qtype: Q, shape: tuple[int, ...], std: float) -> np.ndarray:
  """Weights of numpy ``shape`` (rows, cols) in ``qtype``, as GGUFWriter takes them."""
  if qtype in RANDOM_BLOCK_TYPES:
    return random_blocks(rng, qtype, shape[0], shape[1], std)
  values = (rng.standard_normal(shape) * std).astype(np.float32)
  return gguf.quants.quantize(values, qtype)


def norm_data(rng, qtype: Q, n: int, scale: float = 1.0) -> np.ndarray:
  values = (rng.uniform(0.5, 1.5, n) * scale).astype(np.float32)
  return gguf.quants.quantize(values, qtype)


def add(writer, name: str, data: np.ndarray, qtype: Q) -> None:
  raw = None if qtype in (Q.F32, Q.F16) else qtype
  writer.add_tensor(name, data, raw_dtype=raw)


def write_tokenizer(writer, tok: dict) -> None:
  writer.add_tokenizer_model(tok["model"])
  if "pre" in tok:
    writer.add_tokenizer_pre(tok["pre"])
  writer.add_token_list(tok["tokens"])
  writer.add_token_types(tok["types"])
  if "scores" in tok:
    writer.add_token_scores(tok["scores"])
  if "merges" in tok:
    writer.add_token_merges(tok["merges"])
  writer.add_bos_token_id(tok["bos"])
  writer.add_eos_token_id(tok["eos"])
  if "unk" in tok:
    writer.add_unk_token_id(tok["unk"])
  if "pad" in tok:
    writer.add_pad_token_id(tok["pad"])
  if "add_bos" in tok:
    writer.add_add_bos_token(tok["add_bos"])


def write_gguf(name: str, path: Path) -> dict:
  """Writes fixture ``name`` to ``path``; returns its tokenizer and tensor types."""
  spec = CONFIGS[name]
  rng = np.random.default_rng(spec["seed"])
  tok = byte_level_vocab() if spec["tokenizer"] == "gpt2" else sentencepiece_vocab()
  vocab = len(tok["tokens"])
  h, f, heads, kv = SIZES["hidden"], SIZES["intermediate"], SIZES["heads"], SIZES["kv_heads"]
  head_dim = h // heads
  types = spec["types"]
  writer = gguf.GGUFWriter(str(path), "llama")
  writer.add_name(name)
  writer.add_block_count(SIZES["layers"])
  writer.add_context_length(SIZES["context"])
  writer.add_embedding_length(h)
  writer.add_feed_forward_length(f)
  writer.add_head_count(heads)
  writer.add_head_count_kv(kv)
  writer.add_rope_dimension_count(head_dim)
  if spec.get("key_length"):
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
  writer.add_rope_freq_base(spec["rope_theta"])
  writer.add_layer_norm_rms_eps(spec["eps"])
  writer.add_vocab_size(vocab)
  write_tokenizer(writer, tok)
  written: dict[str, str] = {}

  def put(tensor: str, data: np.ndarray, qtype: Q) -> None:
    add(writer, tensor, data, qtype)
    written[tensor] = qtype.name

  put(
    "token_embd.weight",
    tensor_data(rng, types["token_embd"], (vocab, h), spec["embed_std"]),
    types["token_embd"],
  )
  shapes = dict(
    attn_q=(heads * head_dim, h),
    attn_k=(kv * head_dim, h),
    attn_v=(kv * head_dim, h),
    attn_output=(h, heads * head_dim),
    ffn_gate=(f, h),
    ffn_up=(f, h),
    ffn_down=(h, f),
  )
  std = spec["weight_std"]
  for i in range(SIZES["layers"]):
    put(f"blk.{i}.attn_norm.weight", norm_data(rng, types["norm"], h), types["norm"])
    for role in TENSOR_ROLES:
      qtype = types[role][i] if isinstance(types[role], tuple) else types[role]
      put(f"blk.{i}.{role}.weight", tensor_data(rng, qtype, shapes[role], std), qtype)
    put(f"blk.{i}.ffn_norm.weight", norm_data(rng, types["norm"], h), types["norm"])
  final = norm_data(rng, types["norm"], h, spec["logit_scale"])
  put("output_norm.weight", final, types["norm"])
  if not spec["tied"]:
    put("output.weight", tensor_data(rng, types["output"], (vocab, h), std), types["output"])
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  return dict(tokenizer=tok, tensor_types=written)


# --- the reference ----------------------------------------------------------------


def top2_gap(step_logits: np.ndarray) -> float:
  top = np.sort(step_logits, axis=-1)
  return float((top[:, -1] - top[:, -2]).min())


def floats(array: np.ndarray) -> list:
  """Rows of float32 values at 9 significant digits (they round-trip exactly)."""
  return [[float(f"{x:.9g}") for x in row] for row in array.tolist()]


def to_json(fixture: dict) -> str:
  """One key per line; a list of rows gets one row per line (small, readable diffs)."""
  lines = []
  for k, v in fixture.items():
    if isinstance(v, list) and v and isinstance(v[0], list):
      rows = ",\n  ".join(json.dumps(r, ensure_ascii=False) for r in v)
      lines.append(f" {json.dumps(k)}: [\n  {rows}\n ]")
    else:
      lines.append(f" {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}")
  return "{\n" + ",\n".join(lines) + "\n}\n"


def reference(name: str, directory: Path) -> dict:
  spec = CONFIGS[name]
  shutil.rmtree(directory, ignore_errors=True)
  directory.mkdir(parents=True)
  written = write_gguf(name, directory / FILE)
  tok = written["tokenizer"]
  model = AutoModelForCausalLM.from_pretrained(
    directory, gguf_file=FILE, dtype=torch.float32, attn_implementation="eager"
  ).eval()
  tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=FILE)
  if bool(model.config.tie_word_embeddings) != spec["tied"]:
    raise SystemExit(
      f"{name}: transformers read tie_word_embeddings={model.config.tie_word_embeddings}"
    )
  ids = tokenizer(PROMPT)["input_ids"]
  if ids[0] != tok["bos"]:
    raise SystemExit(f"{name}: the prompt's ids do not start with BOS: {ids}")
  inputs = torch.tensor([ids])
  with torch.no_grad():
    logits = model(input_ids=inputs).logits.numpy()[0]
    exact = copy.deepcopy(model).double()(input_ids=inputs).logits.numpy()[0]
    out = model.generate(
      input_ids=inputs,
      attention_mask=torch.ones_like(inputs),
      max_new_tokens=MAX_NEW_TOKENS,
      do_sample=False,
      num_beams=1,
      eos_token_id=tok["eos"],
      pad_token_id=tok.get("pad", tok["eos"]),
      return_dict_in_generate=True,
      output_logits=True,
    )
  greedy = out.sequences.numpy()[0, len(ids) :].tolist()
  step_logits = torch.stack(out.logits, 1).numpy()[0]
  if len(greedy) != MAX_NEW_TOKENS or tok["eos"] in greedy:
    raise SystemExit(f"{name}: greedy stops early or emits EOS: {greedy}")
  if len(set(greedy)) < 4:
    raise SystemExit(f"{name}: greedy decoding degenerates: {greedy}")
  gap = top2_gap(step_logits)
  if gap < MIN_GAP:
    raise SystemExit(f"{name}: greedy is a near tie (top-2 gap {gap:.2g}): {greedy}")
  cases = [{"text": s, "ids": tokenizer(s)["input_ids"]} for s in TOKENIZER_CASES]
  return {
    "model": "LlamaForCausalLM from a GGUF file, random weights",
    "generator": "scripts/make_gguf_reference.py (eager attention, float32)",
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "gguf_version": md.version("gguf"),
    "tokenizers_version": tokenizers.__version__,
    "seed": spec["seed"],
    "tied_lm_head": spec["tied"],
    "tokenizer_model": tok["model"],
    "vocab_size": len(tok["tokens"]),
    "bos_token_id": tok["bos"],
    "eos_token_id": tok["eos"],
    "rope_theta": spec["rope_theta"],
    "rms_norm_eps": spec["eps"],
    "logit_scale": spec["logit_scale"],
    "tensor_types": written["tensor_types"],
    "prompt": PROMPT,
    "input_ids": ids,
    "float32_vs_float64_max_abs_diff": float(np.abs(exact - logits).max()),
    "max_abs_logit": float(np.abs(logits).max()),
    # (t, vocab)
    "logits": floats(logits),
    "max_new_tokens": MAX_NEW_TOKENS,
    "greedy": greedy,
    "greedy_min_top2_gap": gap,
    "tokenizer_cases": cases,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixtures directory")
  args = parser.parse_args(argv)
  torch.use_deterministic_algorithms(True)
  for name in CONFIGS:
    directory = args.out / name
    fixture = reference(name, directory)
    (directory / "reference.json").write_text(to_json(fixture))
    size = sum(p.stat().st_size for p in directory.iterdir())
    print(
      f"wrote {directory}: {size / 1024:.0f} KiB; greedy {fixture['greedy']} (gap "
      f"{fixture['greedy_min_top2_gap']:.3g}); max |logit| {fixture['max_abs_logit']:.3g}, "
      f"f32 vs f64 {fixture['float32_vs_float64_max_abs_diff']:.2g}"
    )
  return 0


if __name__ == "__main__":
  sys.exit(main())
