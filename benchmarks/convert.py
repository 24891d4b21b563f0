"""Converting a Hugging Face checkpoint holds about one unit in memory, whatever its size.

Writes (once, under --dir) a seeded random Llama-architecture checkpoint of at
least 2 GiB, sharded as the Hub's are (``model-0000x-of-0000n.safetensors`` plus
``model.safetensors.index.json`` and ``config.json``; written shard by shard
with numpy, no torch), then runs ``jax_residency.models.convert_hf`` on it in a
fresh process and reports:

* ``peak_rss_growth``: the converting process's peak RSS (``VmHWM``, reset just
  before the conversion) minus its RSS then, against one unit + 64 MiB (the
  target);
* the conversion's time and write bandwidth, and, for context, the raw time to
  read the checkpoint's files once.

The checkpoint reads are unbuffered reads into fresh arrays (nothing of the
files is mapped) and at most ``CONVERT_IN_FLIGHT_BYTES`` of chunk writes are in
flight, so the peak is about the largest tensor (read, then transposed into a
copy) plus that cap. Linux only (``/proc``). ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from _measure import MiB, drop_page_cache, files_under

GiB = 1 << 30

CHILD = r"""
import json, os, sys, time
sys.path.insert(0, sys.argv[3])
from _measure import peak_rss_bytes, reset_peak_rss, rss_bytes
from jax_residency._src.models.hf_convert import convert_hf
import jax_residency.models  # imports done before the baseline
src, dst = sys.argv[1], sys.argv[2]
base = rss_bytes()
reset_peak_rss()
start = time.perf_counter()
info = convert_hf(src, dst, progress=False, overwrite=True)
seconds = time.perf_counter() - start
print(json.dumps({
  "baseline_rss_bytes": base,
  "peak_rss_growth_bytes": peak_rss_bytes() - base,
  "convert_seconds": seconds,
  "unit_bytes": max(s.unit_nbytes for s in info.stacks),
  "units": info.unit_count,
  "total_bytes": info.total_unit_bytes + info.static_nbytes,
}))
"""


def hf_config(args: argparse.Namespace) -> dict:
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": args.hidden,
    "intermediate_size": args.intermediate,
    "num_hidden_layers": args.layers,
    "num_attention_heads": args.heads,
    "num_key_value_heads": args.kv_heads,
    "head_dim": args.hidden // args.heads,
    "vocab_size": args.vocab,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
  }


def layer_tensors(args: argparse.Namespace, i: int, rng: np.random.Generator) -> dict:
  d, f, hd = args.hidden, args.intermediate, args.hidden // args.heads
  kv = args.kv_heads * hd

  def w(rows: int, cols: int) -> np.ndarray:
    return (rng.standard_normal((rows, cols), np.float32) * 0.02).astype(np.float32)

  p = f"model.layers.{i}."
  return {
    p + "input_layernorm.weight": np.ones(d, np.float32),
    p + "post_attention_layernorm.weight": np.ones(d, np.float32),
    p + "self_attn.q_proj.weight": w(d, d),
    p + "self_attn.k_proj.weight": w(kv, d),
    p + "self_attn.v_proj.weight": w(kv, d),
    p + "self_attn.o_proj.weight": w(d, d),
    p + "mlp.gate_proj.weight": w(f, d),
    p + "mlp.up_proj.weight": w(f, d),
    p + "mlp.down_proj.weight": w(d, f),
  }


def write_checkpoint(args: argparse.Namespace, path: str) -> None:
  """The checkpoint, one shard (a few layers) at a time; written to a temporary sibling."""
  from safetensors.numpy import save_file

  tmp = path + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  os.makedirs(tmp)
  rng = np.random.default_rng(0)
  groups = [list(range(i, min(i + 2, args.layers))) for i in range(0, args.layers, 2)]
  n = len(groups) + 1
  weight_map = {}
  for k, layers in enumerate([None, *groups]):
    if layers is None:  # embeddings, final norm, head
      tensors = {
        "model.embed_tokens.weight": rng.standard_normal((args.vocab, args.hidden), np.float32),
        "model.norm.weight": np.ones(args.hidden, np.float32),
        "lm_head.weight": rng.standard_normal((args.vocab, args.hidden), np.float32),
      }
    else:
      tensors = {}
      for i in layers:
        tensors.update(layer_tensors(args, i, rng))
    name = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
    save_file(tensors, os.path.join(tmp, name), metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(tensors, name))
    del tensors
  with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(os.path.join(tmp, "config.json"), "w") as f:
    json.dump(hf_config(args), f, indent=1)
  shutil.rmtree(path, ignore_errors=True)
  os.rename(tmp, path)


def raw_read_seconds(path: str) -> float:
  drop_page_cache(path)
  buf = bytearray(64 * MiB)
  start = time.perf_counter()
  for name in files_under(path):
    with open(name, "rb", buffering=0) as f:
      while f.readinto(buf):
        pass
  return time.perf_counter() - start


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--dir", default="/tmp/jax_residency_convert_bench")
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--intermediate", type=int, default=5632)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--json", action="store_true")
  args = parser.parse_args()
  tag = f"llama-{args.layers}x{args.hidden}x{args.intermediate}-v{args.vocab}"
  src = os.path.join(args.dir, tag)
  dst = os.path.join(args.dir, tag + "-store")
  if not os.path.exists(os.path.join(src, "config.json")):
    os.makedirs(args.dir, exist_ok=True)
    write_checkpoint(args, src)
  checkpoint = sum(os.path.getsize(f) for f in files_under(src))
  raw = raw_read_seconds(src)
  drop_page_cache(src)
  here = os.path.dirname(os.path.abspath(__file__))
  done = subprocess.run(
    [sys.executable, "-c", CHILD, src, dst, here], capture_output=True, text=True, check=False
  )
  if done.returncode != 0:
    print(done.stdout + done.stderr, file=sys.stderr)
    return 1
  r = json.loads(done.stdout.strip().splitlines()[-1])
  limit = r["unit_bytes"] + 64 * MiB
  result = {
    "checkpoint_bytes": checkpoint,
    "units": r["units"],
    "unit_bytes": r["unit_bytes"],
    "convert_seconds": r["convert_seconds"],
    "convert_gb_per_s": checkpoint / r["convert_seconds"] / 1e9,
    "raw_read_seconds": raw,
    "peak_rss_growth_bytes": r["peak_rss_growth_bytes"],
    "limit_bytes": limit,
    "targets_met": {"peak_rss_growth_le_unit_plus_64MiB": r["peak_rss_growth_bytes"] <= limit},
  }
  missed = [name for name, ok in result["targets_met"].items() if not ok]
  if args.json:
    print(json.dumps(result))
    return 1 if missed else 0
  print(f"checkpoint             {checkpoint / GiB:.2f} GiB, {r['units']} units")
  print(f"unit                   {r['unit_bytes'] / MiB:.0f} MiB")
  print(
    f"convert                {r['convert_seconds']:.1f} s  {result['convert_gb_per_s']:.2f} GB/s"
  )
  print(f"raw read (context)     {raw:.1f} s")
  print(
    f"peak RSS growth        {r['peak_rss_growth_bytes'] / MiB:.0f} MiB"
    f"  (limit: one unit + 64 MiB = {limit / MiB:.0f} MiB)"
  )
  print(f"targets met: {result['targets_met']}" if not missed else f"targets MISSED: {missed}")
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main())
