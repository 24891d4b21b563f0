"""Greedy decoding of a mixture of experts from disk: expert residency against a dense
stream of the same store and Hugging Face Accelerate's disk offload (docs/moe.md).

The model is Mixtral-shaped (``MixtralForCausalLM``: top-2 of 8 SwiGLU experts a
layer) and sized so that its experts are most of its bytes: by default 6 layers, hidden
1024, expert width 3584, 16 query / 4 key-value heads, vocabulary 32000, float32; an
expert is 44 MB, a layer 363 MB (352 MB of it experts), the model 2.44 GB. Its weights
are random (seeded) and written once under ``--dir`` as a Hugging Face checkpoint (one
safetensors shard a layer, Mixtral's tensor names) and converted with
``models.convert_hf`` to a store that holds each expert as its own chunk.

One generation is a 128-token prompt (the prefill), then 32 greedy one-token steps over
a KV cache. Each row runs in a fresh process (``--child``), places or loads the model,
runs one warm-up generation of another prompt (prefill and one step: XLA compiles,
torch warms up), then times one generation in each of two regimes, the caches cleared
(``placed.clear_caches()``) before each:

* ``page-cache``: the weights' files read into the page cache first; nothing dropped;
* ``disk``: every file of the weights (the store, the checkpoint, Accelerate's offload
  folder) dropped from the page cache before the prefill and before every step
  (outside the timed region), as a model larger than RAM sees.

Rows:

* ``experts``: ``DenseDiskStream(host_budget_bytes=0, experts=ExpertResidency(...))``
  with a device expert cache of ``--cache-experts`` experts (default 16, a third of
  them), no host expert cache (the defaults otherwise: no speculative prefetch);
* ``experts-speculative``: the same with ``speculative_prefetch=True``;
* ``dense``: ``DenseDiskStream(host_budget_bytes=0)`` of the same store, which reads
  every expert of every layer;
* ``accelerate``: transformers' ``MixtralForCausalLM.from_pretrained`` with every
  layer on ``"disk"`` (embeddings, final norm and head on ``"cpu"``) and an
  ``offload_folder``: Accelerate's disk offload through transformers. Skipped, with a
  message, where torch, transformers or accelerate cannot be imported (none is a
  jax_residency dependency).

Figures per row and regime: the prefill's time, the median decode step, decode tokens/s,
bytes read a decode token (jax_residency: its report's ``bytes_read``; every row: the
process's ``/proc/self/io`` ``read_bytes``, which counts disk reads only), the expert
counts (picks, hits, speculative precision), and the peak RSS growth over the timed
generations against the plan (``metadata.planned_process_bytes``).

Parity gates: each jax_residency row's greedy tokens equal the plain model's
(``models.generate_llm`` of the model loaded whole), in both regimes; Accelerate's
prefill logits within 1e-3 of the logit scale of the plain model's.

Targets (the ``experts`` row):

* bytes read a decode token <= 1.1 x (the units' ordinary bytes + k/E of the expert
  bytes, less the hits), in both regimes (its report's ``bytes_read``);
* disk-bound decode tokens/s >= 2.5 x the dense stream's;
* peak RSS growth <= the planned bytes + ``RUNTIME_ALLOWANCE_BYTES``.

Figures are medians of ``--repeat`` runs (default 3), each row a fresh process in each
run; the gates hold in every run. Exits 1 when a gate fails or (unless ``--quick``) a
target is missed; a full run writes ``benchmarks/results/moe_decode.json``.

  python benchmarks/moe_decode.py              # builds under $TMPDIR/jr_moe_decode once
  python benchmarks/moe_decode.py --quick      # toy size, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import _child
import _hf_checkpoint
import _result
import _torch_peer
from _decoding import REGIMES, greedy, llama_step, prepare_regime, summary
from _measure import peak_rss_bytes, reset_peak_rss

ROWS = ("experts", "experts-speculative", "dense", "accelerate")
LABELS = {
  "experts": "experts apart",
  "experts-speculative": "experts apart, speculative prefetch",
  "dense": "dense stream (every expert read)",
  "accelerate": "accelerate disk offload",
}
BYTES_TARGET = 1.1
DISK_SPEEDUP_TARGET = 2.5


def add_args(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--dir", help="where the checkpoint and store live (reused)")
  parser.add_argument("--layers", type=int, default=6)
  parser.add_argument("--hidden", type=int, default=1024)
  parser.add_argument("--expert-width", type=int, default=3584)
  parser.add_argument("--experts", type=int, default=8)
  parser.add_argument("--top-k", type=int, default=2)
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--prompt-len", type=int, default=128)
  parser.add_argument("--steps", type=int, default=32)
  parser.add_argument("--cache-experts", type=int, default=16)
  parser.add_argument("--rows", default=",".join(ROWS), help="comma list of rows to run")
  parser.add_argument("--repeat", type=int, default=3, help="fresh processes a row (medians)")
  parser.add_argument("--child", help=argparse.SUPPRESS)
  _result.add_args(parser)


#: The options a row's process takes from the run (the model, the generation, the cache).
MODEL_ARGS = (
  "layers",
  "hidden",
  "expert_width",
  "experts",
  "top_k",
  "heads",
  "kv_heads",
  "vocab",
  "prompt_len",
  "steps",
  "cache_experts",
)

QUICK = {
  "layers": 2,
  "hidden": 64,
  "expert_width": 128,
  "experts": 4,
  "heads": 4,
  "kv_heads": 2,
  "vocab": 256,
  "prompt_len": 8,
  "steps": 4,
  "cache_experts": 2,
  "repeat": 1,
}


# --- the model ----------------------------------------------------------------------


def hf_config(args: argparse.Namespace) -> dict:
  return _hf_checkpoint.llama_config(
    "MixtralForCausalLM",
    "mixtral",
    args,
    intermediate=args.expert_width,
    rope_theta=1e6,
    max_position=4096,
    num_local_experts=args.experts,
    num_experts_per_tok=args.top_k,
    sliding_window=None,
    router_jitter_noise=0.0,
    dtype="float32",
  )


def paths(args: argparse.Namespace) -> dict[str, str]:
  return {
    "hf": os.path.join(args.dir, "hf"),
    "store": os.path.join(args.dir, "store"),
    "offload": os.path.join(args.dir, "accelerate-offload"),
    "reference": os.path.join(args.dir, "reference.json"),
  }


def write_safetensors(path: str, tensors: dict) -> None:
  """The safetensors format (a JSON header, then each tensor's bytes), written here so
  the build needs no package beyond numpy."""
  header, offset = {}, 0
  for name, a in tensors.items():
    header[name] = {
      "dtype": "F32",
      "shape": list(a.shape),
      "data_offsets": [offset, offset + a.nbytes],
    }
    offset += a.nbytes
  text = json.dumps(header).encode()
  text += b" " * (-len(text) % 8)
  with open(path, "wb") as f:
    f.write(len(text).to_bytes(8, "little") + text)
    for a in tensors.values():
      f.write(a.tobytes())


def build(args: argparse.Namespace) -> None:
  """Writes the checkpoint (a shard a layer) and converts it to a store, once."""
  import numpy as np

  from jax_residency import models

  p = paths(args)
  if os.path.exists(os.path.join(p["store"], "jax_residency.json")):
    return
  d, f_, w = args.hidden, args.expert_width, _hf_checkpoint.normal(np.random.default_rng(0))
  shards = [("embed", {"model.embed_tokens.weight": w(args.vocab, d)})]
  for i in range(args.layers):
    pre = f"model.layers.{i}."
    layer = _hf_checkpoint.attention_tensors(args, i, w)
    layer[pre + "block_sparse_moe.gate.weight"] = w(args.experts, d, scale=0.1)
    for e in range(args.experts):
      ex = f"{pre}block_sparse_moe.experts.{e}."
      layer |= {ex + "w1.weight": w(f_, d), ex + "w2.weight": w(d, f_), ex + "w3.weight": w(f_, d)}
    shards.append((f"layer{i}", layer))
  shards.append(
    ("head", {"model.norm.weight": np.ones(d, np.float32), "lm_head.weight": w(args.vocab, d)})
  )
  files = ((f"model-{name}.safetensors", tensors) for name, tensors in shards)
  _hf_checkpoint.write(p["hf"], files, hf_config(args), lambda t, f: write_safetensors(f, t))
  models.convert_hf(p["hf"], p["store"], progress=False)


def prompts(args: argparse.Namespace):
  import numpy as np

  rng = np.random.default_rng(1)
  return (
    rng.integers(3, args.vocab, (1, args.prompt_len), dtype=np.int32),
    rng.integers(3, args.vocab, (1, args.prompt_len), dtype=np.int32),  # the warm-up's
  )


def reference(args: argparse.Namespace) -> dict:
  """The plain model's greedy tokens and prefill logits (computed once, saved)."""
  import numpy as np

  from jax_residency import models

  p = paths(args)
  if os.path.exists(p["reference"]):
    with open(p["reference"]) as f:
      return json.load(f)
  model = models.load_llama(p["hf"])
  prompt, _ = prompts(args)
  logits = model(prompt)[0, -1]
  tokens = models.generate_llm(model, prompt, args.steps + 1, stop_tokens=())
  out = {"tokens": np.asarray(tokens)[0].tolist(), "prefill_logits": np.asarray(logits).tolist()}
  with open(p["reference"], "w") as f:
    json.dump(out, f)
  return out


# --- a row, in its own process -------------------------------------------------------------


def jr_policy(args: argparse.Namespace, row: str, expert_bytes: int):
  import jax_residency as jr

  if row == "dense":
    return jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=None)
  cache = jr.ExpertResidency(
    device_budget_bytes=args.cache_experts * expert_bytes,
    speculative_prefetch=row == "experts-speculative",
  )
  return jr.DenseDiskStream(host_budget_bytes=0, device_budget_bytes=None, experts=cache)


def jr_row(args: argparse.Namespace, row: str) -> dict:
  import jax_residency as jr
  from jax_residency import models

  p = paths(args)
  cfg = models.read_llama_config(p["hf"])
  expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
  from flax import nnx

  model = nnx.eval_shape(lambda: models.Llama(cfg, rngs=nnx.Rngs(0)))  # no weights in memory
  prompt, warm = prompts(args)
  length = args.prompt_len + args.steps
  placed = jr.place(model, jr_policy(args, row, expert_bytes), store=p["store"])
  step = llama_step(placed, cfg, length)
  greedy(step, warm, 1)
  out = {"planned_process_bytes": placed.metadata.planned_process_bytes, "regimes": {}}
  for name in REGIMES:
    placed.clear_caches()
    before = prepare_regime(name, p["store"])
    start = len(placed.report().passes)
    reset_peak_rss()
    rss0 = peak_rss_bytes()
    run = greedy(step, prompt, args.steps, before=before)
    passes = placed.report().passes[start:]
    decode = [q for q in passes if q.phase == "decode"]
    e = [q.experts for q in decode if q.experts is not None]
    out["regimes"][name] = {
      **summary(run),
      "bytes_per_token": statistics.mean(q.bytes_read for q in decode),
      "io_per_token": statistics.mean(run["step_read_bytes"].tolist()),
      "selected": sum(x.selected for x in e) / len(decode) if e else None,
      "hits": sum(x.hits for x in e) / len(decode) if e else None,
      "precision": (sum(x.predicted_used for x in e) / max(1, sum(x.predicted for x in e)))
      if e
      else None,
      "rss_growth": peak_rss_bytes() - rss0,
      "prefill_logits": [float(x) for x in run["logits"][0]],
    }
  placed.close()
  return out


def accelerate_row(args: argparse.Namespace) -> dict:
  import shutil

  import numpy as np
  import torch
  import transformers

  p = paths(args)
  shutil.rmtree(p["offload"], ignore_errors=True)
  device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
  device_map |= {"model.rotary_emb": "cpu"}
  device_map |= {f"model.layers.{i}": "disk" for i in range(args.layers)}
  model = transformers.MixtralForCausalLM.from_pretrained(
    p["hf"], device_map=device_map, offload_folder=p["offload"], dtype=torch.float32
  )
  model.eval()
  prompt, warm = prompts(args)

  def step(ids, cache, pos):
    with torch.no_grad():
      out = model(torch.from_numpy(np.asarray(ids)), past_key_values=cache, use_cache=True)
    return out.logits[0, -1].numpy(), out.past_key_values

  greedy(step, warm, 1)
  out = {"regimes": {}}
  for name in REGIMES:
    before = prepare_regime(name, p["offload"], p["hf"])
    reset_peak_rss()
    rss0 = peak_rss_bytes()
    run = greedy(step, prompt, args.steps, before=before)
    out["regimes"][name] = {
      **summary(run),
      "bytes_per_token": None,
      "io_per_token": statistics.mean(run["step_read_bytes"].tolist()),
      "rss_growth": peak_rss_bytes() - rss0,
      "prefill_logits": [float(x) for x in run["logits"][0]],
    }
  return out


def child(args: argparse.Namespace) -> int:
  run = accelerate_row(args) if args.child == "accelerate" else jr_row(args, args.child)
  return _child.answer(run)


def run_child(args: argparse.Namespace, row: str) -> dict:
  argv = [*_child.flags(args, MODEL_ARGS), "--child", row, "--dir", args.dir]
  return _child.run(os.path.abspath(__file__), *argv, what=f"row {row!r}", timeout=3600)


# --- the run -----------------------------------------------------------------------------


def sizes(args: argparse.Namespace) -> dict:
  d, f_, hd = args.hidden, args.expert_width, args.hidden // args.heads
  expert = 3 * d * f_ * 4
  ordinary = 4 * (2 * d * args.heads * hd + 2 * d * args.kv_heads * hd + args.experts * d + 2 * d)
  return {
    "expert_bytes": expert,
    "ordinary_unit_bytes": ordinary,
    "unit_bytes": ordinary + args.experts * expert,
    "model_bytes": args.layers * (ordinary + args.experts * expert) + 4 * (2 * args.vocab * d + d),
  }


def medians(runs: list[dict]) -> dict:
  """Each row's figures, the median over the runs (tokens and logits: the first run's)."""
  out = {}
  for row, first in runs[0].items():
    regimes = {}
    for regime, r in first["regimes"].items():
      merged = dict(r)
      for name, value in r.items():
        if isinstance(value, int | float) and not isinstance(value, bool):
          merged[name] = statistics.median(run[row]["regimes"][regime][name] for run in runs)
      regimes[regime] = merged
    out[row] = {**first, "regimes": regimes}
  return out


def checks_of(args: argparse.Namespace, result: dict) -> list[dict]:
  from jax_residency._src.plan.memory import RUNTIME_ALLOWANCE_BYTES

  checks: list[dict] = []
  ref, rows, s = result["reference"], result["rows"], result["sizes"]
  for row, first in rows.items():
    for regime in first["regimes"]:
      runs = [each[row]["regimes"][regime] for each in result["runs"]]
      if row == "accelerate":
        want = ref["prefill_logits"]
        scale = max(abs(x) for x in want)
        diff = max(
          max(abs(a - b) for a, b in zip(r["prefill_logits"], want, strict=True)) for r in runs
        )
        name = f"{row} {regime}: prefill logits, every run"
        _result.check(checks, name, diff <= 1e-3 * scale, f"{diff:.2e}", "parity")
      else:
        same = sum(r["tokens"] == ref["tokens"] for r in runs)
        name = f"{row} {regime}: greedy tokens, every run"
        value = f"equal in {same} of {len(runs)}"
        _result.check(checks, name, same == len(runs), value, "parity")
  main = rows.get("experts")
  if main is not None:
    for regime, r in main["regimes"].items():
      bound = (
        args.layers * s["ordinary_unit_bytes"]
        + (args.layers * args.top_k - r["hits"]) * s["expert_bytes"]
      )
      ratio = r["bytes_per_token"] / bound
      _result.check(
        checks,
        f"experts {regime}: bytes a decode token <= {BYTES_TARGET}x ordinary + k/E experts - hits",
        ratio <= BYTES_TARGET,
        f"{ratio:.3f}x",
      )
      allowed = main["planned_process_bytes"] + RUNTIME_ALLOWANCE_BYTES
      _result.check(
        checks,
        f"experts {regime}: peak RSS growth <= plan + allowance",
        r["rss_growth"] <= allowed,
        f"{r['rss_growth'] / 2**20:.0f} MiB of {allowed / 2**20:.0f} MiB",
      )
    if "dense" in rows:
      speed = rows["dense"]["regimes"]["disk"]["step_s"] / main["regimes"]["disk"]["step_s"]
      _result.check(
        checks,
        f"experts disk: decode tokens/s >= {DISK_SPEEDUP_TARGET}x the dense stream's",
        speed >= DISK_SPEEDUP_TARGET,
        f"{speed:.2f}x",
      )
  return checks


def slim(result: dict) -> dict:
  """The result without the logits the parity gates compared (32000 floats a row, run
  and regime): the checks keep what they found."""
  result["reference"].pop("prefill_logits", None)
  for rows in (result["rows"], *result["runs"]):
    for run in rows.values():
      for r in run["regimes"].values():
        r.pop("prefill_logits", None)
  return result


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  s = result["sizes"]
  out = [
    f"Mixtral-shaped, {result['args']['layers']} layers, {result['args']['experts']} experts "
    f"(top {result['args']['top_k']}): expert {s['expert_bytes'] / 1e6:.1f} MB, unit "
    f"{s['unit_bytes'] / 1e6:.0f} MB ({s['ordinary_unit_bytes'] / 1e6:.1f} MB ordinary), model "
    f"{s['model_bytes'] / 1e9:.2f} GB",
    "",
    "| row | regime | prefill s | decode tok/s | MB read / token (report) "
    "| MB from disk / token | picks / hits a token | spec. precision | RSS growth MiB |",
    "|---|---|---|---|---|---|---|---|---|",
  ]
  for row, run in result["rows"].items():
    for regime, r in run["regimes"].items():
      mb = "" if r["bytes_per_token"] is None else f"{r['bytes_per_token'] / 1e6:.0f}"
      picks = "" if r.get("selected") is None else f"{r['selected']:.1f} / {r['hits']:.1f}"
      spec = row == "experts-speculative"
      prec = f"{r['precision']:.2f}" if spec and r.get("precision") is not None else ""
      out.append(
        f"| {LABELS[row]} | {regime} | {r['prefill_s']:.2f} | {1 / r['step_s']:.2f} | {mb} | "
        f"{r['io_per_token'] / 1e6:.0f} | {picks} | {prec} | {r['rss_growth'] / 2**20:.0f} |"
      )
  return "\n".join(out)


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  add_args(parser)
  args = parser.parse_args()
  _result.quick_sizes(args, parser, QUICK)
  if args.child:
    return child(args)
  with _result.work_dir(args, "jr_moe_decode"):
    build(args)
    ref = reference(args)
    rows = [r for r in args.rows.split(",") if r]
    missing = ", ".join(_torch_peer.versions(("torch", "transformers", "accelerate"))[1])
    if "accelerate" in rows and missing:
      print(f"skipping the accelerate row: cannot import {missing}", file=sys.stderr)
      rows.remove("accelerate")
    result = _result.stamp("moe_decode", None, args.quick)
    result["args"] = {k: v for k, v in vars(args).items() if k not in ("child", "result", "json")}
    result["sizes"] = sizes(args)
    result["reference"] = ref
    result["runs"] = [{row: run_child(args, row) for row in rows} for _ in range(args.repeat)]
    result["rows"] = medians(result["runs"])
    result["checks"] = checks_of(args, result)
    return _result.finish(slim(result), args, markdown)


if __name__ == "__main__":
  sys.exit(main())
