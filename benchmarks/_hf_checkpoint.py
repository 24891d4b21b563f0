"""Random-weight Hugging Face checkpoints as the benchmarks write them: sharded safetensors
files, their index and a ``config.json`` of the Llama family (Llama, Mixtral)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable


def llama_config(
  architecture: str,
  model_type: str,
  *,
  hidden: int,
  intermediate: int,
  layers: int,
  heads: int,
  kv_heads: int,
  vocab: int,
  rope_theta: float,
  max_position: int,
  **extra,
) -> dict:
  """A ``config.json`` of the Llama family: ``architecture`` (``"LlamaForCausalLM"``)
  and ``model_type`` (``"llama"``) of the given shape, RMS norms (eps 1e-5), SiLU, an
  untied head; ``extra``: the architecture's own fields."""
  return {
    "architectures": [architecture],
    "model_type": model_type,
    "hidden_size": hidden,
    "intermediate_size": intermediate,
    "num_hidden_layers": layers,
    "num_attention_heads": heads,
    "num_key_value_heads": kv_heads,
    "vocab_size": vocab,
    "rms_norm_eps": 1e-5,
    "rope_theta": rope_theta,
    "max_position_embeddings": max_position,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    **extra,
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
