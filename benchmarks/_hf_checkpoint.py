"""Random-weight Hugging Face checkpoints as the benchmarks write them: sharded safetensors
files, their index and a ``config.json`` of the Llama family (Llama, Mixtral)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from typing import Any


def llama_config(
  architecture: str,
  model_type: str,
  shape: Any,
  *,
  intermediate: int,
  rope_theta: float,
  max_position: int,
  **extra,
) -> dict:
  """A ``config.json`` of the Llama family: ``architecture`` (``"LlamaForCausalLM"``)
  and ``model_type`` (``"llama"``) of ``shape``'s ``layers``, ``hidden``, ``heads``,
  ``kv_heads`` and ``vocab``, RMS norms (eps 1e-5), SiLU, an untied head; ``extra``: the
  architecture's own fields."""
  return {
    "architectures": [architecture],
    "model_type": model_type,
    "hidden_size": shape.hidden,
    "intermediate_size": intermediate,
    "num_hidden_layers": shape.layers,
    "num_attention_heads": shape.heads,
    "num_key_value_heads": shape.kv_heads,
    "vocab_size": shape.vocab,
    "rms_norm_eps": 1e-5,
    "rope_theta": rope_theta,
    "max_position_embeddings": max_position,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    **extra,
  }


def normal(rng) -> Callable[..., Any]:
  """``w(*shape, scale=0.02)``: float32 normal values of that scale, drawn from ``rng``."""
  import numpy as np

  def w(*shape: int, scale: float = 0.02):
    return (rng.standard_normal(shape, np.float32) * scale).astype(np.float32)

  return w


def attention_tensors(shape: Any, i: int, w: Callable[..., Any]) -> dict:
  """Layer ``i``'s norms (ones) and attention projections (``w(rows, cols)``), Hugging
  Face's names, for ``shape``'s ``hidden``, ``heads`` and ``kv_heads``."""
  import numpy as np

  d, kv = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
  p = f"model.layers.{i}."
  return {
    p + "input_layernorm.weight": np.ones(d, np.float32),
    p + "post_attention_layernorm.weight": np.ones(d, np.float32),
    p + "self_attn.q_proj.weight": w(d, d),
    p + "self_attn.k_proj.weight": w(kv, d),
    p + "self_attn.v_proj.weight": w(kv, d),
    p + "self_attn.o_proj.weight": w(d, d),
  }


def write(
  path: str,
  shards: Iterable[tuple[str, dict]],
  config: dict,
  save: Callable[[dict, str], None],
) -> None:
  """The checkpoint in the directory ``path``: each shard (its file name and tensors)
  written by ``save(tensors, file)``, ``model.safetensors.index.json`` naming every
  tensor's shard, and ``config``."""
  os.makedirs(path, exist_ok=True)
  weight_map: dict[str, str] = {}
  for name, tensors in shards:
    save(tensors, os.path.join(path, name))
    weight_map.update(dict.fromkeys(tensors, name))
  with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {}, "weight_map": weight_map}, f)
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f, indent=1)
