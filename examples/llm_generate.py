"""Generate text with a Llama, Mistral or Qwen2 checkpoint under a residency policy.

Reads a Hugging Face checkpoint directory (``config.json`` and
``model.safetensors`` or sharded ``model-0000k-of-0000n.safetensors`` with its
index), places the model under the policy you pick and generates from a prompt:
text, tokenized with the directory's ``tokenizer.json`` (the ``tokenizers``
package), or token ids. Prints the prompt and generated ids, the generated text
when there is a tokenizer, the tokens per second, and what the placement moved.

CHECKPOINT_DIR may also be a store written by ``jax-residency convert hf`` (it
carries the checkpoint's config and tokenizer): the model is then placed from
it abstractly, no weights read into memory first. A llama.cpp ``.gguf`` file is
converted once into such a store (``models.as_store``: under the library's cache
directory, or ``--store DIR``) and reused after that. With ``--store DIR``, the
checkpoint is converted into a store there once (``models.convert_hf``: one
tensor at a time) and later runs place from it. The ``dense_disk_stream`` policy
(``dense`` for short; the policies have the names ``jax-residency run`` takes) always
streams from a store (a temporary one without ``--store``).

  python examples/llm_generate.py CHECKPOINT_DIR --policy dense_disk_stream --host-budget 1GiB \\
      --store /tmp/llama-store --prompt "the old cat" -n 32
  python examples/llm_generate.py CHECKPOINT_DIR --policy layerwise_host --ids 1 4 77 55

With ``--draft DRAFT`` (a checkpoint directory, quantized int4 once and cached, a GGUF
file, or a store of a model with the same vocabulary: ``models.draft_from``, which also
checks that it fits beside the placed model's device budget), a FullyResident draft proposes
``--draft-tokens`` tokens a round (or expands the token tree ``--draft-tree``, e.g.
``2,1,1,1``) for the placed model to check in one pass (speculative decoding,
docs/speculative.md), and what it did is printed. ``--draft-activations int8`` rounds a
quantized draft's products on CPU (faster; docs/quantization.md).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from flax import nnx

import jax_residency as jr
from jax_residency import models

#: The policies by the names `jax-residency run --policy` takes ("dense" is short for
#: "dense_disk_stream").
POLICIES = ("fully_resident", "layerwise_host", "dense_disk_stream", "dense")


def make_policy(args: argparse.Namespace) -> jr.LayerWeightResidency:
  device = {"device_budget_bytes": args.device_budget} if args.device_budget else {}
  host = {"host_budget_bytes": args.host_budget} if args.host_budget else {}
  if args.policy == "fully_resident":
    return jr.FullyResident(**device)
  kept = {"device_resident_units": args.device_resident_units}
  if args.policy == "layerwise_host":
    depth = {} if args.prefetch_depth is None else {"prefetch_depth": args.prefetch_depth}
    return jr.LayerwiseHost(**depth, **device, **host, **kept)
  if args.host_resident_units:
    kept["host_resident_units"] = args.host_resident_units
  return jr.DenseDiskStream(**device, **host, **kept)


def prompt_ids(args: argparse.Namespace, tokenizer: object | None) -> list[int]:
  if args.ids:
    return list(args.ids)
  if tokenizer is None:
    raise SystemExit(
      f"{args.checkpoint} has no tokenizer.json: pass the prompt as --ids (token ids)"
    )
  return list(tokenizer.encode(args.prompt).ids)  # type: ignore[attr-defined]


def load_tokenizer(checkpoint: Path) -> object | None:
  path = checkpoint / "tokenizer.json"
  if not path.is_file():
    return None
  from tokenizers import Tokenizer  # noqa: PLC0415 - only needed with a tokenizer.json

  return Tokenizer.from_file(str(path))


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument(
    "checkpoint",
    type=Path,
    help="Hugging Face checkpoint directory, a llama.cpp .gguf file, or a store from convert",
  )
  parser.add_argument("--policy", choices=POLICIES, default="fully_resident")
  parser.add_argument("--device-budget", help="device budget, e.g. 2GiB (default: the policy's)")
  parser.add_argument("--host-budget", help="host budget, e.g. 8GiB (default: the policy's)")
  parser.add_argument(
    "--prefetch-depth", type=int, help="layerwise_host window (default: the policy's, 1)"
  )
  parser.add_argument(
    "--device-resident-units",
    type=int,
    default=0,
    help="layerwise_host, dense_disk_stream: the first N units stay on the device",
  )
  parser.add_argument(
    "--host-resident-units",
    type=int,
    default=0,
    help="dense_disk_stream with a host budget: the next N units stay in host memory",
  )
  parser.add_argument("--store", type=Path, help="unit store: written once, then placed from")
  parser.add_argument(
    "--activations",
    choices=("exact", "int8"),
    default="exact",
    help="quantized weights on CPU: int8 rounds each one-token product's row to 8 bits "
    "first, as llama.cpp does (faster; docs/quantization.md)",
  )
  parser.add_argument(
    "--draft",
    type=Path,
    help="speculative decoding: a draft with the same vocabulary, placed FullyResident: a "
    "checkpoint directory (quantized int4 once, cached), a GGUF file, or a store "
    "(models.draft_from)",
  )
  parser.add_argument(
    "--draft-tokens",
    default="4",
    help="the draft's proposals a round, or auto (docs/speculative.md)",
  )
  parser.add_argument(
    "--draft-tree",
    help="branches per depth of a token tree, e.g. 2,1,1,1 (in place of --draft-tokens)",
  )
  parser.add_argument(
    "--draft-activations",
    choices=("exact", "int8"),
    default="exact",
    help="a quantized draft's products on CPU: int8 rounds each row first (faster)",
  )
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--prompt", help="prompt text (needs tokenizer.json)")
  source.add_argument("--ids", type=int, nargs="+", help="prompt token ids")
  parser.add_argument("-n", "--max-new-tokens", type=int, default=32)
  parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
  parser.add_argument("--top-k", type=int)
  parser.add_argument("--top-p", type=float)
  parser.add_argument("--seed", type=int, default=0)
  args = parser.parse_args(argv)

  if args.checkpoint.is_file():  # a GGUF file: converted once (cached), then a store
    start = time.perf_counter()
    gguf_store = models.as_store(args.checkpoint, store=args.store, progress=None)
    print(f"store: {gguf_store} (from {args.checkpoint.name}, {time.perf_counter() - start:.2f} s)")
    args.checkpoint = Path(gguf_store)
  converted = (args.checkpoint / "hf_config.json").is_file()  # a store from `convert hf`
  if converted:
    args.store = args.checkpoint
  if converted:
    cfg = models.load(args.checkpoint).config
  else:
    cfg = models.read_llama_config(args.checkpoint)
  tokenizer = load_tokenizer(args.checkpoint)
  ids = prompt_ids(args, tokenizer)
  print(f"model: {cfg.architecture}, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}")
  print(f"prompt ids: {ids}")

  tmp = tempfile.TemporaryDirectory()
  store = args.store
  if args.policy == "dense":
    args.policy = "dense_disk_stream"
  if store is None and args.policy == "dense_disk_stream":
    store = Path(tmp.name) / "store"
  model: nnx.Module
  if store is not None:
    if not (store.exists() and any(store.iterdir())):
      start = time.perf_counter()
      info = models.convert_hf(args.checkpoint, str(store), progress=None)
      unit = jr.format_bytes(info.unit_nbytes)
      print(
        f"store: {store} (converted in {time.perf_counter() - start:.2f} s: "
        f"{info.unit_count} units of {unit})"
      )
    else:
      print(f"store: {store} (reused)")
    model = models.load(store)  # abstract: the weights are the store's
  else:
    start = time.perf_counter()
    model = models.load_llama(args.checkpoint, config=cfg)
    print(f"loaded {args.checkpoint} in {time.perf_counter() - start:.2f} s")
  policy = make_policy(args)
  where = None if store is None else str(store)
  draft_tokens = args.draft_tokens if args.draft_tokens == "auto" else int(args.draft_tokens)
  tree = None if args.draft_tree is None else [int(b) for b in args.draft_tree.split(",")]
  with jr.place(model, policy, store=where, activations=args.activations) as placed:
    draft = None
    if args.draft is not None:
      slots = len(ids) + args.max_new_tokens + 2 * 256  # the widest round: 256 nodes
      draft = models.draft_from(
        args.draft, target=placed, max_len=slots, activations=args.draft_activations
      )
      print(f"draft: {draft.store}, {draft.config.num_hidden_layers} layers, FullyResident")
      print(draft.metadata.memory_table())
    tokens = models.generate_llm(
      placed,
      [ids],
      args.max_new_tokens,
      config=cfg,
      temperature=args.temperature,
      top_k=args.top_k,
      top_p=args.top_p,
      seed=args.seed,
      progress=True,  # the prefill time and decode rate, or with a draft what it did
      draft=draft,
      draft_tokens=draft_tokens,
      draft_tree=tree,
    )
    report = placed.report()
    window = placed.metadata.device_window_units
    if draft is not None:
      draft.close()
  out = np.asarray(tokens)[0].tolist()
  print(f"generated ids: {out}")
  if tokenizer is not None:
    print(f"prompt: {tokenizer.decode(ids)}")  # type: ignore[attr-defined]
    print(f"generated: {tokenizer.decode(out)}")  # type: ignore[attr-defined]
  print(
    f"policy: {args.policy}, device window {window} units; passes: prefill "
    f"{report.prefill.passes}, decode {report.decode.passes}; "
    f"read from disk {jr.format_bytes(report.total.bytes_read)}"
  )
  return 0


if __name__ == "__main__":
  sys.exit(main())
