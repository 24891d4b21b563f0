"""Writes the tiny Llama-family checkpoints and reference outputs the Llama tests compare against.

Builds four small random decoder-only models (seeded), saves each with
``save_pretrained(..., safe_serialization=True, max_shard_size=SHARD_SIZE)`` (so
each is sharded, as Hub checkpoints are: ``model-0000k-of-0000N.safetensors``
and ``model.safetensors.index.json``, with ``config.json`` and
``generation_config.json``), reloads it with ``from_pretrained`` (eager
attention, float32) and records, from the reloaded model, in ``reference.json``
beside the checkpoint:

* ``logits``: the logits of every position of ``input_ids`` (batch 2, length 12,
  LEFT-padded with ``pad_token_id``; row 0 has no padding), flattened to
  ``(batch * length, vocab)``, float32. The forward is given ``position_ids``
  (recorded) = ``cumsum(attention_mask) - 1``, 0 at the padding, as
  ``generate`` makes them, so the padded row's tokens sit at the positions they
  would have unpadded (the script checks that they give the same logits).
  Compare only positions where ``attention_mask`` is 1: a padding query sees no
  key, and what HF returns there is an artefact of its mask;
* ``float32_vs_float64_max_abs_diff``: the same logits in float64 minus float32
  (how well conditioned the fixture is);
* ``greedy``: ``model.generate(..., do_sample=False, num_beams=1,
  max_new_tokens=8)`` for three left-padded prompts (``generate_input_ids``,
  ``generate_attention_mask``), only the new tokens, rows that stop early padded
  with ``pad_token_id`` to 8 tokens; ``greedy_logits``, the logits ``generate``
  computed for each of those 8 steps ((batch, 8, vocab): step 0 is the prompt's
  last position, the rest are decoded against the KV cache); and
  ``greedy_stopping_at_stop_token``, the same prompts with ``eos_token_id`` set
  to ``stop_token_id``, a token the model does emit (the reference covers rows
  that stop while others go on);
* ``rope_inv_freq`` (what the rotary embedding uses, after any scaling) and
  ``rope_inv_freq_unscaled`` (plain ``rope_theta ** (-2i / head_dim)``), float32;
* the versions, the family, the config in brief and its ``config_json_form``,
  ``seed``, ``embed_scale`` and ``logit_scale`` (see below).

The six configs (``tests/fixtures/<name>``), all with grouped-query attention
(4 query heads sharing 2 key/value heads), SwiGLU MLP (intermediate 64), 3
layers, vocab 96, hidden 32, token ids pad 0, bos 1, eos 2:

* ``llama_tiny_tied``: ``LlamaForCausalLM``, head_dim 8, ``tie_word_embeddings:
  true`` (only ``model.embed_tokens.weight`` is in the checkpoint), default rope,
  rope_theta 10000, rms_norm_eps 1e-6, max_position_embeddings 64. Its
  ``config.json`` is as transformers 5 writes it:
  ``"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}``, no
  ``rope_theta`` or ``rope_scaling`` key, ``"dtype": "float32"``. It also holds
  a tiny ``tokenizer.json`` (a ``tokenizers`` WordLevel model over 96 tokens:
  ``<pad> <s> </s> <unk>`` then 92 lower-case English words, whitespace
  pre-tokenizer, ``<s>`` prepended by its post-processor) and a
  ``tokenizer_config.json`` so ``AutoTokenizer`` loads it; ``tokenizer_example``
  in ``reference.json`` is a sentence and its ids.
* ``llama_tiny_untied``: ``LlamaForCausalLM``, head_dim 8, its own ``lm_head``,
  Llama 3 style: rope_theta 500000 with ``llama3`` scaling (factor 8,
  low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 256;
  max_position_embeddings 2048), rms_norm_eps 1e-5, ``eos_token_id: [2, 3]`` (a
  list, as Llama 3.1 has). With head_dim 8 the four wavelengths are 6.3, 168,
  4443 and 118000: 256 puts one in each llama3 band (kept, smoothed, divided by
  8; the script checks that). Its ``config.json`` is rewritten in the Hub's
  (transformers 4) form, as the Llama 3.x checkpoints have it: top-level
  ``"rope_theta": 500000.0`` and ``"rope_scaling": {"factor": 8.0,
  "high_freq_factor": 4.0, "low_freq_factor": 1.0,
  "original_max_position_embeddings": 256, "rope_type": "llama3"}``,
  ``"torch_dtype"`` for ``"dtype"``, no ``rope_parameters``; the script checks
  that transformers 5 reads it back to the same rope.
* ``mistral_tiny``: ``MistralForCausalLM``, untied, ``head_dim: 12`` (so the
  attention width, 48, is not hidden_size: read head_dim from the config),
  ``"sliding_window": null`` (full causal attention; Mistral 7B v0.2 on has
  null), rope_theta 1e6, rms_norm_eps 1e-5, max_position_embeddings 64.
  ``config.json`` as transformers 5 writes it (``rope_parameters``).
* ``qwen2_tiny``: ``Qwen2ForCausalLM``, head_dim 8, biases on q/k/v (not o),
  ``tie_word_embeddings: true`` (as Qwen2/2.5 0.5B-3B are), rope_theta 1e6,
  rms_norm_eps 1e-6. ``config.json`` in the Hub's form as Qwen2.5 has it:
  top-level ``rope_theta``, ``"use_sliding_window": false`` with
  ``"sliding_window": 32768`` and ``"max_window_layers": 2`` (transformers
  ignores the window when ``use_sliding_window`` is false: every layer is full
  attention; the script checks that), no ``layer_types``, ``torch_dtype``.
* ``mixtral_tiny``: ``MixtralForCausalLM``, untied, 4 experts of width 64 per
  layer, 2 picked per token (renormalized), ``"sliding_window": null``, rope_theta
  1e6, rms_norm_eps 1e-5; experts saved as the Hub has them
  (``block_sparse_moe.experts.<j>.w1/w2/w3``). ``config.json`` as transformers 5
  writes it.
* ``qwen2_moe_tiny``: ``Qwen2MoeForCausalLM``, untied, q/k/v biases, 4 experts of
  width 48, 2 picked per token, ``norm_topk_prob: false`` (not renormalized), a
  shared expert of width 64 with its sigmoid gate, no sliding window.
  ``config.json`` as transformers 5 writes it.

For the two mixtures of experts the reloaded model runs its experts one by one
(``experts_implementation="eager"``), and the script records
``router_min_topk_gap``, the smallest gap between a router's k-th and (k+1)-th
probabilities over the reference tokens, and ``router_picks_layer0``; it refuses a
fixture whose gap is under ``MIN_ROUTER_GAP`` (a pick float32 could flip) or whose
first layer leaves an expert unused. ``--only NAME ...`` writes those fixtures alone.

The random init is changed so that a wrong implementation shows: RMSNorm
weights are drawn from U(0.5, 1.5) (not ones) and Qwen2's biases from N(0, 0.5)
(not zeros). Weights use ``initializer_range`` 0.3 (Qwen2 0.4) and the
embedding is then scaled by ``embed_scale`` (0.3 or 0.5): at the default 0.02,
or with the embedding at full scale, greedy decoding mostly repeats one token.
Then the final norm's weights (``model.norm.weight``) are multiplied by
``logit_scale`` (recorded in ``reference.json``): 0.5 for ``llama_tiny_tied``
and ``qwen2_tiny``, 0.25 for ``llama_tiny_untied`` and ``mistral_tiny``. That
multiplies every logit by it exactly (a power of two: each float32 and float64
product and sum is the unscaled one times it), so the greedy tokens, stop tokens
and argmax margins are those of the unscaled model, and the logits' absolute
float32 error shrinks by the same factor. Without it the logits reached about 7
and transformers' own float32 logits were 4e-6 to 9.5e-6 from its float64 ones
(mistral_tiny the worst), too close to a 1e-5 bound for a float32
implementation to meet; with it max |logit| is 1.4 to 2.0 and
``float32_vs_float64_max_abs_diff`` is 1.8e-6 to 2.4e-6, so the tests hold
logits to a flat 1e-5. (This is a smaller magnitude, not a better relative
conditioning: the relative float32 error is unchanged.)
The script checks that greedy rows are varied, never emit the padding token
before they stop, and that every greedy step's top-1 logit beats the top-2 by
at least ``MIN_GAP`` (``greedy_min_top2_gap``: 0.0057 to 0.023 here, after the
scaling), so the argmax is no float32 coin toss.

The fixtures were made with torch 2.13.0, transformers 5.23.0 (the newest the
package registry here holds; the project's notes name 5.24.0), safetensors
0.8.0 and tokenizers 0.23.3 (recorded in each ``reference.json``). transformers
is not a dependency of the project; make a throwaway environment::

  python -m venv /tmp/llamaref
  /tmp/llamaref/bin/pip install torch==2.13.0 transformers==5.23.0 safetensors numpy
  /tmp/llamaref/bin/python scripts/make_llama_reference.py [--out tests/fixtures]

The tests need neither torch nor transformers.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata as md
import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import (
  AutoTokenizer,
  LlamaConfig,
  LlamaForCausalLM,
  MistralConfig,
  MistralForCausalLM,
  MixtralConfig,
  MixtralForCausalLM,
  Qwen2Config,
  Qwen2ForCausalLM,
  Qwen2MoeConfig,
  Qwen2MoeForCausalLM,
)

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
SHARD_SIZE = "60KB"
SIZES = dict(
  vocab_size=96,
  hidden_size=32,
  intermediate_size=64,
  num_hidden_layers=3,
  num_attention_heads=4,
  num_key_value_heads=2,
  pad_token_id=0,
  bos_token_id=1,
  eos_token_id=2,
)
LLAMA3_ROPE = {
  "rope_type": "llama3",
  "factor": 8.0,
  "low_freq_factor": 1.0,
  "high_freq_factor": 4.0,
  "original_max_position_embeddings": 256,
}
CONFIGS = {
  "llama_tiny_tied": dict(
    family="llama",
    classes=(LlamaConfig, LlamaForCausalLM),
    config=dict(
      initializer_range=0.3,
      tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
      rms_norm_eps=1e-6,
      max_position_embeddings=64,
    ),
    config_json_form="transformers5",
    seed=0,
    embed_scale=0.5,
    logit_scale=0.5,
    tokenizer=True,
  ),
  "llama_tiny_untied": dict(
    family="llama",
    classes=(LlamaConfig, LlamaForCausalLM),
    config=dict(
      initializer_range=0.3,
      tie_word_embeddings=False,
      rope_parameters={**LLAMA3_ROPE, "rope_theta": 500000.0},
      rms_norm_eps=1e-5,
      max_position_embeddings=2048,
      eos_token_id=[2, 3],
    ),
    config_json_form="hub",
    seed=3,
    embed_scale=0.3,
    logit_scale=0.25,
  ),
  "mistral_tiny": dict(
    family="mistral",
    classes=(MistralConfig, MistralForCausalLM),
    config=dict(
      initializer_range=0.3,
      tie_word_embeddings=False,
      head_dim=12,
      sliding_window=None,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      rms_norm_eps=1e-5,
      max_position_embeddings=64,
    ),
    config_json_form="transformers5",
    seed=2,
    embed_scale=0.5,
    logit_scale=0.25,
  ),
  "qwen2_tiny": dict(
    family="qwen2",
    classes=(Qwen2Config, Qwen2ForCausalLM),
    config=dict(
      initializer_range=0.4,
      tie_word_embeddings=True,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      rms_norm_eps=1e-6,
      max_position_embeddings=64,
      use_sliding_window=False,
      max_window_layers=2,
    ),
    # What the Hub's Qwen2.5 config.json has and transformers 5 does not write.
    hub_extra=dict(sliding_window=32768),
    config_json_form="hub",
    seed=3,
    embed_scale=0.5,
    logit_scale=0.5,
  ),
  "mixtral_tiny": dict(
    family="mixtral",
    classes=(MixtralConfig, MixtralForCausalLM),
    config=dict(
      initializer_range=0.3,
      tie_word_embeddings=False,
      num_local_experts=4,
      num_experts_per_tok=2,
      sliding_window=None,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      rms_norm_eps=1e-5,
      max_position_embeddings=64,
    ),
    config_json_form="transformers5",
    seed=4,
    embed_scale=0.5,
    logit_scale=0.25,
  ),
  "qwen2_moe_tiny": dict(
    family="qwen2_moe",
    classes=(Qwen2MoeConfig, Qwen2MoeForCausalLM),
    config=dict(
      initializer_range=0.3,
      tie_word_embeddings=False,
      num_experts=4,
      num_experts_per_tok=2,
      moe_intermediate_size=48,
      shared_expert_intermediate_size=64,
      norm_topk_prob=False,
      use_sliding_window=False,
      rope_parameters={"rope_type": "default", "rope_theta": 1e6},
      rms_norm_eps=1e-6,
      max_position_embeddings=64,
    ),
    config_json_form="transformers5",
    seed=5,
    embed_scale=0.5,
    logit_scale=0.25,
  ),
}
MAX_NEW_TOKENS = 8
SEQ_LEN = 12
BIAS_STD = 0.5
MIN_GAP = 1e-3  # greedy steps closer than this to a tie would make the argmax fragile
MIN_ROUTER_GAP = 1e-4  # a router's k-th and (k+1)-th probabilities closer: a fragile pick
WORDS = (
  "the a an and or but of to in on at by for with from up down over under again then once here"
  " there when where why how all any both each few more most other some such no not only own"
  " same so than too very can will just now cat dog bird fish tree house river road sun moon"
  " star rain snow wind fire stone water light dark red blue green old new big small good bad"
  " happy sad run walk sing read write see hear say go come make"
).split()
SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
TOKENIZER_EXAMPLE = "the old cat can see a red bird by the river and the dog will run"


def prompt_batch(rng: np.random.Generator, lengths: list[int], width: int, vocab: int) -> tuple:
  """``<s>`` then random ids (4..vocab-1, no special token), LEFT-padded with 0; the mask."""
  ids = np.zeros((len(lengths), width), np.int64)
  mask = np.zeros_like(ids)
  for row, n in enumerate(lengths):
    ids[row, width - n] = SIZES["bos_token_id"]
    ids[row, width - n + 1 :] = rng.integers(4, vocab, n - 1)
    mask[row, width - n :] = 1
  return ids, mask


def positions(mask: np.ndarray) -> np.ndarray:
  """``generate``'s position ids: ``cumsum(mask) - 1``, 0 at the padding."""
  return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, 0)


def to_hub_form(directory: Path, spec: dict) -> None:
  """Rewrites ``config.json`` as transformers 4 wrote it (the form of most Hub checkpoints)."""
  path = directory / "config.json"
  config = json.loads(path.read_text())
  rope = dict(config.pop("rope_parameters"))
  config["rope_theta"] = rope.pop("rope_theta")
  config["rope_scaling"] = None if rope == {"rope_type": "default"} else rope
  if config["rope_scaling"] is None:
    del config["rope_scaling"]  # the Qwen2.5 configs have none
  config["torch_dtype"] = config.pop("dtype")
  config.pop("layer_types", None)
  config.update(spec.get("hub_extra", {}))
  path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def head_dim_of(cfg) -> int:
  return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def inv_freqs(model) -> tuple[np.ndarray, np.ndarray]:
  """(the rope inverse frequencies the model uses, the unscaled ones), float32."""
  head_dim = head_dim_of(model.config)
  theta = model.config.rope_parameters["rope_theta"]
  plain = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
  return model.model.rotary_emb.inv_freq.numpy(), plain.numpy()


def check_llama3_bands(scaled: np.ndarray, plain: np.ndarray) -> None:
  """The llama3 scaling keeps, smooths and divides (by ``factor``) at least one frequency each."""
  factor = LLAMA3_ROPE["factor"]
  kept = np.isclose(scaled, plain, rtol=1e-6)
  divided = np.isclose(scaled, plain / factor, rtol=1e-6)
  smoothed = ~kept & ~divided
  if not (kept.any() and divided.any() and smoothed.any()):
    wavelengths = 2 * math.pi / plain
    raise SystemExit(f"llama3 rope: not all three bands used; wavelengths {wavelengths}")


def build(name: str, directory: Path):
  """A seeded random model saved (sharded) to ``directory``, reloaded from there (eager)."""
  spec = CONFIGS[name]
  config_cls, model_cls = spec["classes"]
  torch.manual_seed(spec["seed"])
  cfg = config_cls(**{**SIZES, **spec["config"]})
  model = model_cls(cfg).eval()
  with torch.no_grad():
    model.model.embed_tokens.weight.mul_(spec.get("embed_scale", 1.0))
    for key, param in model.named_parameters():
      if key.endswith("norm.weight"):
        param.uniform_(0.5, 1.5)
        if key == "model.norm.weight":  # the final norm: every logit times logit_scale
          param.mul_(spec.get("logit_scale", 1.0))
      elif key.endswith(".bias"):
        param.normal_(0.0, BIAS_STD)
  rotary = model.model.rotary_emb.inv_freq.clone()
  tied = cfg.tie_word_embeddings
  shutil.rmtree(directory, ignore_errors=True)
  model.save_pretrained(directory, safe_serialization=True, max_shard_size=SHARD_SIZE)
  if spec["config_json_form"] == "hub":
    to_hub_form(directory, spec)
  if not (directory / "model.safetensors.index.json").exists():
    raise SystemExit(f"{name}: the checkpoint is not sharded")
  # A mixture of experts runs its experts one by one, in expert order (the eager loop;
  # the grouped kernel takes no float64, which the conditioning check needs).
  moe = {"experts_implementation": "eager"} if spec["family"] in ("mixtral", "qwen2_moe") else {}
  loaded = model_cls.from_pretrained(
    directory, attn_implementation="eager", dtype=torch.float32, **moe
  )
  loaded.eval()
  if (loaded.lm_head.weight is loaded.model.embed_tokens.weight) != tied:
    raise SystemExit(f"{name}: the reloaded LM head is {'not ' if tied else ''}tied")
  if loaded.config.rope_parameters != cfg.rope_parameters:
    raise SystemExit(f"{name}: rope read back as {loaded.config.rope_parameters}")
  if not torch.equal(loaded.model.rotary_emb.inv_freq, rotary):
    raise SystemExit(f"{name}: the reloaded rotary frequencies differ")
  window = getattr(loaded.config, "sliding_window", None)
  layer_types = set(getattr(loaded.config, "layer_types", None) or ["full_attention"])
  if window not in (None, 0) or layer_types != {"full_attention"}:
    raise SystemExit(f"{name}: the reloaded model has a sliding window")
  for key, value in model.state_dict().items():
    if not torch.equal(loaded.state_dict()[key], value):
      raise SystemExit(f"{name}: {key} differs after reloading")
  return loaded


def router_gap(model, inputs: dict) -> tuple[float | None, list[int]]:
  """For a mixture of experts: the smallest gap between a router's k-th and (k+1)-th
  probabilities over the real tokens of ``inputs`` (how safe the picks are), and how
  many tokens picked each expert of layer 0. ``(None, [])`` for a dense model."""
  routers = [m for m in model.modules() if type(m).__name__.endswith("TopKRouter")]
  if not routers:
    return None, []
  seen: list[torch.Tensor] = []
  hooks = [r.register_forward_hook(lambda _m, _i, out: seen.append(out[0])) for r in routers]
  with torch.no_grad():
    model(**inputs)
  for h in hooks:
    h.remove()
  real = inputs["attention_mask"].reshape(-1) == 1
  k = routers[0].top_k
  gap, counts = float("inf"), []
  for n, logits in enumerate(seen):
    probs = torch.softmax(logits.float(), dim=-1)[real]
    top = torch.sort(probs, dim=-1, descending=True).values
    gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
    if n == 0:
      picked = torch.topk(probs, k, dim=-1).indices.reshape(-1)
      counts = torch.bincount(picked, minlength=probs.shape[-1]).tolist()
  return gap, counts


def greedy(model, ids: np.ndarray, mask: np.ndarray, eos) -> tuple[list, np.ndarray]:
  """Greedy new tokens padded with ``pad_token_id`` to ``MAX_NEW_TOKENS``; each step's logits."""
  with torch.no_grad():
    out = model.generate(
      input_ids=torch.from_numpy(ids),
      attention_mask=torch.from_numpy(mask),
      max_new_tokens=MAX_NEW_TOKENS,
      do_sample=False,
      num_beams=1,
      eos_token_id=eos,
      pad_token_id=SIZES["pad_token_id"],
      return_dict_in_generate=True,
      output_logits=True,
    )
  new = out.sequences.numpy()[:, ids.shape[1] :]
  padded = np.full((len(ids), MAX_NEW_TOKENS), SIZES["pad_token_id"], np.int64)
  padded[:, : new.shape[1]] = new
  return padded.tolist(), torch.stack(out.logits, 1).numpy()


def varied(tokens: list[list[int]]) -> bool:
  """Every row emits at least 4 different tokens and no token 4 times in a row."""
  for row in tokens:
    if len(set(row)) < 4 or any(len(set(row[i : i + 4])) == 1 for i in range(len(row) - 3)):
      return False
  return True


def steps_taken(tokens: list[list[int]], eos) -> list[int]:
  """How many tokens each row chose itself (up to and with its EOS; the rest is padding)."""
  stops = set(eos) if isinstance(eos, list) else {eos}
  return [next((i + 1 for i, t in enumerate(row) if t in stops), len(row)) for row in tokens]


def top2_gap(step_logits: np.ndarray, taken: list[int]) -> float:
  """The smallest top-1 minus top-2 logit over the steps the rows chose (greedy's margin)."""
  top = np.sort(step_logits, axis=-1)
  return float(min((top[b, :n, -1] - top[b, :n, -2]).min() for b, n in enumerate(taken)))


def write_tokenizer(directory: Path, vocab_size: int) -> dict:
  """A WordLevel ``tokenizer.json`` (and ``tokenizer_config.json``); an example encoding."""
  vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
  if len(vocab) != vocab_size:
    raise SystemExit(f"tokenizer: {len(vocab)} tokens for a vocab of {vocab_size}")
  tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.Whitespace()
  tok.post_processor = processors.TemplateProcessing(
    single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
  )
  tok.add_special_tokens(SPECIAL)
  tok.save(str(directory / "tokenizer.json"))
  config = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "pad_token": "<pad>",
    "unk_token": "<unk>",
    "padding_side": "left",
    "model_max_length": 64,
  }
  (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
  ids = Tokenizer.from_file(str(directory / "tokenizer.json")).encode(TOKENIZER_EXAMPLE).ids
  hf_ids = AutoTokenizer.from_pretrained(directory)(TOKENIZER_EXAMPLE)["input_ids"]
  if hf_ids != ids or SIZES["bos_token_id"] != ids[0] or 3 in ids:
    raise SystemExit(f"tokenizer: {ids} (tokenizers) vs {hf_ids} (AutoTokenizer)")
  return {"text": TOKENIZER_EXAMPLE, "ids": ids}


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


def floats(array: np.ndarray) -> list:
  """Rows of float32 values at 9 significant digits (they round-trip exactly)."""
  return [[float(f"{x:.9g}") for x in row] for row in array.tolist()]


def reference(name: str, directory: Path) -> dict:
  spec = CONFIGS[name]
  model = build(name, directory)
  cfg = model.config
  vocab = SIZES["vocab_size"]
  rng = np.random.default_rng(spec["seed"] + 100)
  ids, mask = prompt_batch(rng, [SEQ_LEN, SEQ_LEN - 4], SEQ_LEN, vocab)
  pos = positions(mask)
  inputs = dict(
    input_ids=torch.from_numpy(ids),
    attention_mask=torch.from_numpy(mask),
    position_ids=torch.from_numpy(pos),
  )
  double = copy.deepcopy(model).double()
  error = 0.0
  with torch.no_grad():
    logits = model(**inputs).logits.numpy()
    for row, n in enumerate(mask.sum(1)):
      # Each row's tokens alone, unpadded: left padding must not change their logits.
      alone = torch.from_numpy(ids[row : row + 1, -n:])
      if np.abs(model(input_ids=alone).logits.numpy()[0] - logits[row, -n:]).max() > 1e-5:
        raise SystemExit(f"{name}: left padding changes the logits")
      # In float64 (run unpadded: HF's float64 mask makes a padding query NaN, which
      # spreads): how far float32 itself is from exact (conditioning).
      exact = double(input_ids=alone).logits.numpy()[0]
      error = max(error, float(np.abs(exact - logits[row, -n:]).max()))
  gen_ids, gen_mask = prompt_batch(rng, [SEQ_LEN, 5, 9], SEQ_LEN, vocab)
  tokens, step_logits = greedy(model, gen_ids, gen_mask, cfg.eos_token_id)
  taken = steps_taken(tokens, cfg.eos_token_id)
  if not varied(tokens):
    raise SystemExit(f"{name}: greedy decoding degenerates: {tokens}")
  if any(SIZES["pad_token_id"] in row[:n] for row, n in zip(tokens, taken, strict=True)):
    raise SystemExit(f"{name}: greedy emits the padding token: {tokens}")
  gap = top2_gap(step_logits, taken)
  if gap < MIN_GAP:
    raise SystemExit(f"{name}: greedy is a near tie (top-2 gap {gap:.2g}): {tokens}")
  # A token row 0 first emits at step 3 or later: row 0 stops there, other rows go on.
  stop = next(t for i, t in enumerate(tokens[0]) if i >= 2 and t not in tokens[0][:i])
  stopped, stopped_logits = greedy(model, gen_ids, gen_mask, stop)
  gap = min(gap, top2_gap(stopped_logits, steps_taken(stopped, stop)))
  routed, picks = router_gap(model, inputs)
  if routed is not None and (routed < MIN_ROUTER_GAP or 0 in picks):
    raise SystemExit(f"{name}: routing is fragile (gap {routed:.2g}) or skips an expert: {picks}")
  scaled, plain = inv_freqs(model)
  if spec["config"]["rope_parameters"]["rope_type"] == "llama3":
    check_llama3_bands(scaled, plain)
  elif not np.array_equal(scaled, plain):
    raise SystemExit(f"{name}: default rope frequencies differ from theta ** (-2i / d)")
  fixture = {
    "model": f"{type(model).__name__}, random weights",
    "family": spec["family"],
    "seed": spec["seed"],
    "embed_scale": spec.get("embed_scale", 1.0),
    "logit_scale": spec.get("logit_scale", 1.0),
    "generator": "scripts/make_llama_reference.py (eager attention, float32)",
    "torch_version": torch.__version__,
    "transformers_version": transformers.__version__,
    "safetensors_version": md.version("safetensors"),
    "tokenizers_version": tokenizers.__version__,
    "config_json_form": spec["config_json_form"],
    "tied_lm_head": bool(cfg.tie_word_embeddings),
    "head_dim": head_dim_of(cfg),
    "attention_bias": spec["family"] in ("qwen2", "qwen2_moe"),
    # mixtures of experts: the smallest gap between a router's k-th and (k+1)-th
    # probabilities over the logits' real tokens, and layer 0's picks per expert
    "router_min_topk_gap": routed,
    "router_picks_layer0": picks,
    "rope_parameters": cfg.rope_parameters,
    "sliding_window": None,
    "eos_token_id": cfg.eos_token_id,
    "pad_token_id": cfg.pad_token_id,
    "rope_inv_freq": [float(f"{x:.9g}") for x in scaled],
    "rope_inv_freq_unscaled": [float(f"{x:.9g}") for x in plain],
    "padding_side": "left",
    "input_ids": ids.tolist(),
    "attention_mask": mask.tolist(),
    "position_ids": pos.tolist(),
    "float32_vs_float64_max_abs_diff": error,
    # (batch * length, vocab)
    "logits": floats(logits.reshape(-1, vocab)),
    "generate_input_ids": gen_ids.tolist(),
    "generate_attention_mask": gen_mask.tolist(),
    "max_new_tokens": MAX_NEW_TOKENS,
    "greedy": tokens,
    # the smallest top-1 minus top-2 logit of the greedy steps (how safe argmax is)
    "greedy_min_top2_gap": gap,
    # (batch * max_new_tokens, vocab): row b * 8 + s is prompt b's step s
    "greedy_logits": floats(step_logits.reshape(-1, vocab)),
    "stop_token_id": stop,
    "greedy_stopping_at_stop_token": stopped,
  }
  if spec.get("tokenizer"):
    fixture["tokenizer_example"] = write_tokenizer(directory, vocab)
  return fixture


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="fixtures directory")
  parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="these fixtures only")
  args = parser.parse_args(argv)
  torch.use_deterministic_algorithms(True)
  for name in args.only or CONFIGS:
    directory = args.out / name
    fixture = reference(name, directory)
    (directory / "reference.json").write_text(to_json(fixture))
    size = sum(p.stat().st_size for p in directory.iterdir())
    shards = len(list(directory.glob("model-*.safetensors")))
    print(f"wrote {directory}: {size / 1024:.0f} KiB, {shards} shards; greedy {fixture['greedy']}")
    print(f"  stop at {fixture['stop_token_id']}: {fixture['greedy_stopping_at_stop_token']}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
