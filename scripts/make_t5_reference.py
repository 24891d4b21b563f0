"""Writes the tiny T5 checkpoints and reference outputs the T5 tests compare against.

Builds two small random ``transformers.T5ForConditionalGeneration`` models
(seeded), saves each with ``save_pretrained(..., safe_serialization=True)``, reloads
it with ``from_pretrained`` (eager attention) and records, from the reloaded
model, in ``reference.json`` beside the checkpoint:

* ``logits``: teacher-forced logits for fixed ``input_ids`` (with padding) and
  ``decoder_input_ids``, float32;
* ``greedy``: ``model.generate(..., do_sample=False, num_beams=1,
  max_new_tokens=8)`` for a few inputs (the decoder start token dropped, rows
  that stop early padded with ``pad_token_id`` to 8 tokens), once with the
  config's EOS and once with ``eos_token_id`` set to a token the model does emit
  (so the reference covers sequences that stop);
* ``float32_vs_float64_max_abs_diff``: the same logits in float64 minus
  float32 (how well conditioned the fixture is: the tests hold the JAX model to
  1e-5 of the float32 logits);
* ``buckets``: ``T5Attention._relative_position_bucket`` for relative positions
  -300..300, for this config's bucketing and T5's default (32 buckets, 128).

The two configs (``tests/fixtures/t5_tiny_relu`` and ``t5_tiny_gated``):

* relu: T5 v1.0, ``feed_forward_proj="relu"``, the LM head tied to ``shared``
  and its input scaled by ``d_model**-0.5``. Its ``config.json`` is as
  transformers 5 writes it (``tie_word_embeddings: true``,
  ``scale_decoder_outputs: true``). ``shared`` is scaled by 0.1 after the
  random init: with the embedding at full scale the tied head mostly sees the
  last token's own embedding and greedy decoding repeats one token.
* gated: T5 v1.1, ``feed_forward_proj="gated-gelu"``, a separate ``lm_head`` and
  no scaling. transformers 5 always ties the head and writes
  ``tie_word_embeddings: true, scale_decoder_outputs: false``; it unties a head
  found in the checkpoint with other values. This script gives the model its
  own ``lm_head`` and writes ``config.json`` as the Hub's v1.1 checkpoints
  have it (``tie_word_embeddings: false``, no ``scale_decoder_outputs``), then
  checks that the reloaded model uses that head unscaled.

Sizes: d_model 32, 4 heads of d_kv 12 (inner width 48 != d_model on purpose),
d_ff 64, 2 encoder and 3 decoder layers (different on purpose), vocab 96, 8
relative-position buckets, max distance 16; sequences reach past the max
distance. Checkpoints are a few hundred KB.

The fixtures were made with torch 2.13.0, transformers 5.23.0 and safetensors
0.8.0 (recorded in each ``reference.json``). transformers is not a dependency of
the project; make a throwaway environment::

  python -m venv --system-site-packages /tmp/t5ref
  /tmp/t5ref/bin/pip install transformers==5.23.0   # torch==2.13.0, safetensors beside it
  /tmp/t5ref/bin/python scripts/make_t5_reference.py [--out tests/fixtures]

The tests (``tests/test_t5.py``) need neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import DynamicCache, EncoderDecoderCache, T5Config, T5ForConditionalGeneration
from transformers.models.t5.modeling_t5 import T5Attention

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SIZES = dict(
  vocab_size=96,
  d_model=32,
  d_kv=12,
  d_ff=64,
  num_layers=2,
  num_decoder_layers=3,
  num_heads=4,
  relative_attention_num_buckets=8,
  relative_attention_max_distance=16,
  decoder_start_token_id=0,
  pad_token_id=0,
  eos_token_id=1,
)
CONFIGS = {
  # shared_scale: the tied embedding is scaled down so the layers, not the embedding of
  # the last token, decide the next one (a random tied T5 repeats its first token).
  "t5_tiny_relu": dict(
    feed_forward_proj="relu", tie_word_embeddings=True, seed=3, shared_scale=0.1
  ),
  "t5_tiny_gated": dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, seed=1),
}
MAX_NEW_TOKENS = 8
SOURCE_LEN = 20  # > relative_attention_max_distance: the clamped bucket is used
TARGET_LEN = 10
BUCKET_RANGE = 300


def source_batch(rng: np.random.Generator, lengths: list[int], vocab: int) -> tuple:
  """Token ids ending in EOS (1), right-padded with 0 to ``SOURCE_LEN``; and the mask."""
  ids = np.zeros((len(lengths), SOURCE_LEN), np.int64)
  mask = np.zeros_like(ids)
  for row, n in enumerate(lengths):
    ids[row, : n - 1] = rng.integers(2, vocab, n - 1)
    ids[row, n - 1] = 1
    mask[row, :n] = 1
  return ids, mask


def build(name: str, directory: Path) -> T5ForConditionalGeneration:
  """A seeded random model saved to ``directory``, reloaded from there (eager attention)."""
  spec = CONFIGS[name]
  torch.manual_seed(spec["seed"])
  cfg = T5Config(
    **SIZES,
    feed_forward_proj=spec["feed_forward_proj"],
    tie_word_embeddings=spec["tie_word_embeddings"],
  )
  model = T5ForConditionalGeneration(cfg).eval()
  with torch.no_grad():
    model.shared.weight.mul_(spec.get("shared_scale", 1.0))
  tied = spec["tie_word_embeddings"]
  if not tied:  # transformers 5 ties the head regardless; give it its own weights
    head = torch.randn(cfg.vocab_size, cfg.d_model) * cfg.d_model**-0.5
    model.lm_head.weight = torch.nn.Parameter(head)
  shutil.rmtree(directory, ignore_errors=True)
  model.save_pretrained(directory, safe_serialization=True)
  if not tied:  # the Hub's v1.1 form of the config
    path = directory / "config.json"
    config = json.loads(path.read_text())
    config.pop("scale_decoder_outputs", None)
    config["tie_word_embeddings"] = False
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
  loaded = T5ForConditionalGeneration.from_pretrained(directory, attn_implementation="eager")
  loaded.eval()
  if (loaded.lm_head.weight is loaded.shared.weight) != tied:
    raise SystemExit(f"{name}: the reloaded LM head is {'not ' if tied else ''}tied")
  if loaded.config.scale_decoder_outputs != tied:
    raise SystemExit(f"{name}: the reloaded model scales its decoder output: {not tied}")
  return loaded


def greedy(model, ids: np.ndarray, mask: np.ndarray, eos: int) -> list[list[int]]:
  """Greedy tokens after the start token, padded with ``pad_token_id`` to ``MAX_NEW_TOKENS``."""
  with torch.no_grad():
    out = model.generate(
      input_ids=torch.from_numpy(ids),
      attention_mask=torch.from_numpy(mask),
      max_new_tokens=MAX_NEW_TOKENS,
      do_sample=False,
      num_beams=1,
      eos_token_id=eos,
      pad_token_id=SIZES["pad_token_id"],
      # generate() sizes its own cache by the encoder's layer count (num_layers) and
      # fails with more decoder layers; caches built without a config grow per layer.
      past_key_values=EncoderDecoderCache(DynamicCache(), DynamicCache()),
    ).numpy()[:, 1:]
  padded = np.full((len(ids), MAX_NEW_TOKENS), SIZES["pad_token_id"], np.int64)
  padded[:, : out.shape[1]] = out
  return padded.tolist()


def buckets() -> dict[str, list[int]]:
  rel = torch.arange(-BUCKET_RANGE, BUCKET_RANGE + 1)
  found = {}
  for nb, dist in ((SIZES["relative_attention_num_buckets"], 16), (32, 128)):
    for bidirectional in (True, False):
      b = T5Attention._relative_position_bucket(rel, bidirectional, nb, dist)
      found[f"{nb}/{dist}/{'bidirectional' if bidirectional else 'causal'}"] = b.tolist()
  return found


def to_json(fixture: dict) -> str:
  """One key per line; a list of rows gets one row per line (small, readable diffs)."""
  lines = []
  for k, v in fixture.items():
    if isinstance(v, list) and v and isinstance(v[0], list):
      rows = ",\n  ".join(json.dumps(r) for r in v)
      lines.append(f" {json.dumps(k)}: [\n  {rows}\n ]")
    else:
      lines.append(f" {json.dumps(k)}: {json.dumps(v)}")
  return "{\n" + ",\n".join(lines) + "\n}\n"


def reference(name: str, directory: Path) -> dict:
  model = build(name, directory)
  vocab = SIZES["vocab_size"]
  rng = np.random.default_rng(CONFIGS[name]["seed"] + 100)
  ids, mask = source_batch(rng, [SOURCE_LEN, 13], vocab)
  decoder_ids = rng.integers(2, vocab, (2, TARGET_LEN))
  decoder_ids[:, 0] = SIZES["decoder_start_token_id"]
  with torch.no_grad():
    logits = model(
      input_ids=torch.from_numpy(ids),
      attention_mask=torch.from_numpy(mask),
      decoder_input_ids=torch.from_numpy(decoder_ids),
    ).logits.numpy()
    # The same forward in float64: how far float32 itself is from exact (conditioning).
    exact = (
      copy.deepcopy(model)
      .double()(
        input_ids=torch.from_numpy(ids),
        attention_mask=torch.from_numpy(mask),
        decoder_input_ids=torch.from_numpy(decoder_ids),
      )
      .logits.numpy()
    )
  gen_ids, gen_mask = source_batch(rng, [SOURCE_LEN, 9, 16], vocab)
  tokens = greedy(model, gen_ids, gen_mask, SIZES["eos_token_id"])
  # A token row 0 first emits at step 3 or later: row 0 stops there, other rows go on.
  stop = next(t for i, t in enumerate(tokens[0]) if i >= 2 and t not in tokens[0][:i])
  stopped = greedy(model, gen_ids, gen_mask, stop)
  return {
    "model": "T5ForConditionalGeneration, random weights",
    "seed": CONFIGS[name]["seed"],
    "shared_scale": CONFIGS[name].get("shared_scale", 1.0),
    "generator": "scripts/make_t5_reference.py (eager attention, float32)",
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "safetensors_version": md.version("safetensors"),
    "feed_forward_proj": CONFIGS[name]["feed_forward_proj"],
    "tied_lm_head": CONFIGS[name]["tie_word_embeddings"],
    "input_ids": ids.tolist(),
    "attention_mask": mask.tolist(),
    "decoder_input_ids": decoder_ids.tolist(),
    # (batch * target, vocab); 9 significant digits round-trip float32 exactly.
    "float32_vs_float64_max_abs_diff": float(np.abs(logits - exact).max()),
    "logits": [[float(f"{x:.9g}") for x in row] for row in logits.reshape(-1, vocab).tolist()],
    "generate_input_ids": gen_ids.tolist(),
    "generate_attention_mask": gen_mask.tolist(),
    "max_new_tokens": MAX_NEW_TOKENS,
    "greedy": tokens,
    "stop_token_id": stop,
    "greedy_stopping_at_stop_token": stopped,
    "buckets": buckets(),
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
    print(f"wrote {directory}: {size / 1024:.0f} KiB; greedy {fixture['greedy']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
