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

Parity gate: the store holds exactly the parameters the Llama tensor map
(``models.hf_tensor_map``) names, every checkpoint tensor is one of them, and
each stored tensor equals its checkpoint tensor (read back with safetensors,
transposed where the map says), bit for bit. ``--quick`` converts a 4-layer
checkpoint of hidden size 64 in a temporary directory (the target is reported,
not gated: one toy unit is far below what a process allocates anyway); a full
run writes ``benchmarks/results/convert.json`` (``benchmarks/_result.py``).

    python benchmarks/convert.py            # 2.46 GiB, 12 units
    python benchmarks/convert.py --quick    # toy size, a few seconds
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time

import _child
import _hf_checkpoint
import _result
import numpy as np
from _measure import MiB, drop_page_cache, files_under

GiB = 1 << 30
#: ``--quick``'s checkpoint, where the size flags are left at their defaults.
QUICK = {"hidden": 64, "intermediate": 128, "layers": 4, "heads": 4, "kv_heads": 2, "vocab": 256}

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
  return _hf_checkpoint.llama_config(
    "LlamaForCausalLM",
    "llama",
    args,
    intermediate=args.intermediate,
    rope_theta=500000.0,
    max_position=2048,
    head_dim=args.hidden // args.heads,
    attention_bias=False,
    mlp_bias=False,
    torch_dtype="float32",
  )


def layer_tensors(args: argparse.Namespace, i: int, rng: np.random.Generator) -> dict:
  d, f, w = args.hidden, args.intermediate, _hf_checkpoint.normal(rng)
  p = f"model.layers.{i}."
  return _hf_checkpoint.attention_tensors(args, i, w) | {
    p + "mlp.gate_proj.weight": w(f, d),
    p + "mlp.up_proj.weight": w(f, d),
    p + "mlp.down_proj.weight": w(d, f),
  }


def write_checkpoint(args: argparse.Namespace, path: str) -> None:
  """The checkpoint, one shard (a few layers) at a time; written to a temporary sibling."""
  from safetensors.numpy import save_file

  tmp = path + ".tmp"
  shutil.rmtree(tmp, ignore_errors=True)
  rng = np.random.default_rng(0)
  groups = [list(range(i, min(i + 2, args.layers))) for i in range(0, args.layers, 2)]
  n = len(groups) + 1

  def shards():
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
      yield f"model-{k + 1:05d}-of-{n:05d}.safetensors", tensors
      del tensors

  def save(tensors: dict, file: str) -> None:
    save_file(tensors, file, metadata={"format": "pt"})

  _hf_checkpoint.write(tmp, shards(), hf_config(args), save)
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


def check_store(src: str, dst: str, layers: int, checks: list[dict]) -> dict:
  """Compares every tensor of the converted store ``dst`` with the checkpoint ``src``'s
  (safetensors' own reader, one tensor at a time); parity checks into ``checks``."""
  from safetensors import safe_open

  from jax_residency._src.store.unit_store import UnitStore
  from jax_residency.models import hf_tensor_map, read_llama_config

  with open(os.path.join(src, "model.safetensors.index.json")) as f:
    weight_map = json.load(f)["weight_map"]
  static_map, unit_map = hf_tensor_map(read_llama_config(src))
  files: dict = {}
  used: set[str] = set()

  def source(t, layer: int | None, shape: tuple) -> np.ndarray:
    name = t.name if layer is None else t.name.format(i=layer)
    used.add(name)
    shard = weight_map[name]
    if shard not in files:
      files[shard] = safe_open(os.path.join(src, shard), framework="numpy")
    a = files[shard].get_tensor(name)
    return (a.T if t.transpose else a).reshape(shape)

  bad, compared = [], 0

  def compare(what: str, got: np.ndarray, t, layer: int | None) -> None:
    nonlocal compared
    want = source(t, layer, got.shape)
    compared += 1
    if got.dtype != want.dtype or not np.array_equal(got, want):
      bad.append(what)

  with UnitStore.open(dst) as store:
    stacks = [(s.prefix, s.count) for s in store.stacks]
    layout = {
      "static": sorted(map(".".join, store.static_specs)) == sorted(map(".".join, static_map)),
      "units": sorted(map(".".join, store.unit_specs)) == sorted(map(".".join, unit_map)),
      "stacks": stacks == [(("layers",), layers)],
    }
    for path, t in static_map.items():
      if path in store.static_specs:
        compare(".".join(path), store.read_static_tensor(path), t, None)
    for i in range(store.unit_count):
      tensors = store.read_unit(i)
      for rel, t in unit_map.items():
        if rel in tensors:
          compare(f"layers.{i}.{'.'.join(rel)}", tensors[rel], t, i)
      del tensors
  unconverted = sorted(set(weight_map) - used)
  _result.check(
    checks,
    "the store holds exactly the parameters the tensor map names, in one stack",
    all(layout.values()),
    layout,
    _result.PARITY,
  )
  _result.check(
    checks,
    "every checkpoint tensor is in the store",
    not unconverted,
    f"{len(used)}/{len(weight_map)} tensors"
    + (f"; not converted: {unconverted[:5]}" if unconverted else ""),
    _result.PARITY,
  )
  _result.check(
    checks,
    "each stored tensor == its checkpoint tensor (transposed as mapped), bit for bit",
    compared > 0 and not bad,
    f"{compared - len(bad)}/{compared} equal" + (f"; differ: {bad[:5]}" if bad else ""),
    _result.PARITY,
  )
  return {"tensors_compared": compared, "tensors_differing": bad, "unconverted": unconverted}


def render(result: dict) -> str:
  r, limit = result, result["limit_bytes"]
  return "\n".join(
    [
      f"checkpoint             {r['checkpoint_bytes'] / GiB:.2f} GiB, {r['units']} units",
      f"unit                   {r['unit_bytes'] / MiB:.0f} MiB",
      f"convert                {r['convert_seconds']:.1f} s  {r['convert_gb_per_s']:.2f} GB/s",
      f"raw read (context)     {r['raw_read_seconds']:.1f} s",
      f"peak RSS growth        {r['peak_rss_growth_bytes'] / MiB:.0f} MiB"
      f"  (limit: one unit + 64 MiB = {limit / MiB:.0f} MiB)",
      f"tensors compared       {r['tensors_compared']}",
    ]
  )


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  r = result
  return "\n".join(
    [
      "| checkpoint | units | unit | convert | peak RSS growth | limit (one unit + 64 MiB) |",
      "|---|---|---|---|---|---|",
      f"| {r['checkpoint_bytes'] / GiB:.2f} GiB | {r['units']} | {r['unit_bytes'] / MiB:.0f} MiB "
      f"| {r['convert_seconds']:.1f} s ({r['convert_gb_per_s']:.2f} GB/s; raw read "
      f"{r['raw_read_seconds']:.1f} s) | {r['peak_rss_growth_bytes'] / MiB:.0f} MiB "
      f"| {r['limit_bytes'] / MiB:.0f} MiB |",
    ]
  )


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument(
    "--dir",
    help="keep the checkpoint and store here and reuse the checkpoint (default:"
    " /tmp/jax_residency_convert_bench; with --quick, a temporary directory removed afterwards)",
  )
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--intermediate", type=int, default=5632)
  parser.add_argument("--layers", type=int, default=12)
  parser.add_argument("--heads", type=int, default=32)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=32000)
  _result.add_args(parser)
  args = parser.parse_args()
  _result.quick_sizes(args, parser, QUICK)
  with _result.work_dir(args, "/tmp/jax_residency_convert_bench"):
    return run(args)


def run(args: argparse.Namespace) -> int:
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
  r = _child.run("-c", CHILD, src, dst, here, what="the conversion")
  limit = r["unit_bytes"] + 64 * MiB
  result = _result.stamp("convert", None, args.quick)
  checks: list[dict] = []
  result.update(
    {
      "hidden": args.hidden,
      "intermediate": args.intermediate,
      "layers": args.layers,
      "heads": args.heads,
      "kv_heads": args.kv_heads,
      "vocab": args.vocab,
      "checkpoint_bytes": checkpoint,
      "units": r["units"],
      "unit_bytes": r["unit_bytes"],
      "convert_seconds": r["convert_seconds"],
      "convert_gb_per_s": checkpoint / r["convert_seconds"] / 1e9,
      "raw_read_seconds": raw,
      "peak_rss_growth_bytes": r["peak_rss_growth_bytes"],
      "limit_bytes": limit,
    }
  )
  result.update(check_store(src, dst, args.layers, checks))
  _result.check(
    checks,
    "peak RSS growth <= one unit + 64 MiB",
    r["peak_rss_growth_bytes"] <= limit,
    f"{r['peak_rss_growth_bytes'] / MiB:.0f} MiB (limit {limit / MiB:.0f} MiB)",
  )
  result["checks"] = checks
  return _result.finish(result, args, render)


if __name__ == "__main__":
  sys.exit(main())
