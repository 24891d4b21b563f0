"""Where a :class:`~jax_residency._src.models.llama.Llama`'s weights come from: a Hugging Face
``LlamaForCausalLM`` / ``MistralForCausalLM`` / ``Qwen2ForCausalLM`` safetensors checkpoint
(one file or sharded), or seeded random draws.

Every parameter is one Hugging Face tensor: :func:`hf_tensor_map` names it, and
says whether to transpose it (``torch.nn.Linear`` stores ``weight`` as
``(out, in)``, ``nnx.Linear``'s ``kernel`` is ``(in, out)``). Layer ``i``'s
tensor ``model.layers.<i>.<name>`` is row ``i`` of the stacked parameter. A
converter can therefore move a checkpoint one tensor at a time; :func:`load_llama`
uses the same map to build the model in memory.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from jax_residency._src.models import hf_loader
from jax_residency._src.models.hf_config import read_config
from jax_residency._src.models.hf_loader import HFTensor
from jax_residency._src.models.init import seeded_weights
from jax_residency._src.models.llama import Llama
from jax_residency._src.models.llama_config import LlamaConfig
from jax_residency._src.typing import ParamPath

#: The model's layer stack (its parameters' paths start with it).
STACK = "layers"
#: Tensors a checkpoint may hold that the model does not read (old checkpoints
#: stored the rotary frequencies; a tied head's copy of the embedding).
IGNORED = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")


def hf_tensor_map(
  config: LlamaConfig,
) -> tuple[dict[ParamPath, HFTensor], dict[ParamPath, HFTensor]]:
  """The Hugging Face tensor of every parameter of a :class:`Llama` of ``config``.

  Returns:
    ``(static, per_unit)``: static parameters by their full path (as in
    ``nnx.state(model)``, ``.value`` dropped), and the parameters of one layer
    by their path inside ``layers``, whose names hold ``{i}`` for the layer
    index. A parameter is its tensor, transposed if ``transpose``, reshaped
    (row-major) to the parameter's shape (per layer: without the layer axis).
    A tied head has no entry (the logits use ``embed_tokens``).

  Example:
    >>> cfg = LlamaConfig(architecture="Qwen2ForCausalLM", tie_word_embeddings=True,
    ...                   qkv_bias=True)
    >>> static, unit = hf_tensor_map(cfg)
    >>> sorted(static)
    [('embed_tokens', 'embedding'), ('norm', 'scale')]
    >>> unit[("self_attn", "q_proj", "bias")]
    HFTensor(name='model.layers.{i}.self_attn.q_proj.bias', transpose=False, experts=0)
  """
  static: dict[ParamPath, HFTensor] = {
    ("embed_tokens", "embedding"): HFTensor("model.embed_tokens.weight", False),
    ("norm", "scale"): HFTensor("model.norm.weight", False),
  }
  if not config.tie_word_embeddings:
    static[("lm_head", "kernel")] = HFTensor("lm_head.weight", True)
  layer = "model.layers.{i}"
  unit: dict[ParamPath, HFTensor] = {
    ("input_layernorm", "scale"): HFTensor(f"{layer}.input_layernorm.weight", False),
    ("post_attention_layernorm", "scale"): HFTensor(
      f"{layer}.post_attention_layernorm.weight", False
    ),
  }
  for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
    unit[("self_attn", proj, "kernel")] = HFTensor(f"{layer}.self_attn.{proj}.weight", True)
    if config.o_bias if proj == "o_proj" else config.qkv_bias:
      unit[("self_attn", proj, "bias")] = HFTensor(f"{layer}.self_attn.{proj}.bias", False)
  if config.num_experts:
    unit.update(_experts_map(config, layer))
    return static, unit
  for proj in ("gate_proj", "up_proj", "down_proj"):
    unit[("mlp", proj, "kernel")] = HFTensor(f"{layer}.mlp.{proj}.weight", True)
  return static, unit


def _experts_map(config: LlamaConfig, layer: str) -> dict[ParamPath, HFTensor]:
  """A mixture of experts' tensors: Mixtral's ``block_sparse_moe`` (experts ``w1`` gate,
  ``w3`` up, ``w2`` down), Qwen2-MoE's ``mlp`` (experts and a shared expert by their
  projections' names, and the shared expert's gate)."""
  e = config.num_experts
  if config.model_type == "mixtral":
    block = f"{layer}.block_sparse_moe"
    names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
  else:
    block = f"{layer}.mlp"
    names = {p: p for p in ("gate_proj", "up_proj", "down_proj")}
  unit: dict[ParamPath, HFTensor] = {
    ("mlp", "gate", "kernel"): HFTensor(f"{block}.gate.weight", True)
  }
  for proj, name in names.items():
    unit[("mlp", "experts", proj)] = HFTensor(f"{block}.experts.{{j}}.{name}.weight", True, e)
  if config.shared_expert_intermediate_size:
    for proj in ("gate_proj", "up_proj", "down_proj"):
      unit[("mlp", "shared_expert", proj, "kernel")] = HFTensor(
        f"{block}.shared_expert.{proj}.weight", True
      )
    unit[("mlp", "shared_expert_gate", "kernel")] = HFTensor(
      f"{block}.shared_expert_gate.weight", True
    )
  return unit


def read_llama_config(path: str | Path, *, dtype: str = "float32") -> LlamaConfig:
  """The :class:`LlamaConfig` of the ``config.json`` in (or beside) ``path``.

  Example:
    >>> import json, pathlib, tempfile
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> config = {"architectures": ["MistralForCausalLM"], "sliding_window": 4096}
    >>> _ = (folder / "config.json").write_text(json.dumps(config))
    >>> read_llama_config(folder).sliding_window
    4096
  """
  return LlamaConfig.from_hf(read_config(path, "LlamaConfig"), dtype=dtype)


def _abstract(cfg: LlamaConfig) -> Llama:
  return hf_loader.abstract_of(Llama, cfg)


def _checkpoint_map(cfg: LlamaConfig) -> hf_loader.CheckpointMap:
  static, unit = hf_tensor_map(cfg)
  n = cfg.num_hidden_layers

  def ignored(name: str) -> bool:
    return bool(IGNORED.match(name)) or (cfg.tie_word_embeddings and name == "lm_head.weight")

  return hf_loader.CheckpointMap(
    static=static,
    stacks={STACK: (n, unit)},
    ignored=ignored,
    unused_note=f"a {cfg.architecture} of this config does not use ({n} layers)",
    missing_note=f"a {cfg.architecture} of this config needs; is it a checkpoint of this config?",
    reshape=True,
  )


#: How the loader reads a Llama-family checkpoint.
LOADER = hf_loader.Loader(abstract=_abstract, checkpoint_map=_checkpoint_map)


def llama_params_from_hf(
  tensors: Mapping[str, np.ndarray], cfg: LlamaConfig, *, strict: bool = True
) -> dict[ParamPath, np.ndarray]:
  """Maps checkpoint tensors to the model's parameters, as :func:`hf_tensor_map` says.

  Args:
    tensors: name → array, as read from the checkpoint.
    cfg: the model's sizes; every tensor's size is checked against them.
    strict: reject tensors that map to nothing (other than old checkpoints'
      rotary frequencies and a tied head's copy of the embedding).

  Returns:
    Parameter path (as in ``nnx.state(model)``) → array in ``cfg.dtype``; a
    parameter of ``layers`` stacks its ``cfg.num_hidden_layers`` tensors.

  Raises:
    MissingCheckpointParametersError: tensors :func:`hf_tensor_map` names are absent.
    UnexpectedCheckpointParametersError: with ``strict``, tensors it does not name.
    CheckpointShapeMismatchError: a tensor's size is not its parameter's, or
      its shape (transposed, for a Linear weight) is not when its rank is.

  Example:
    >>> import jax_residency as jr
    >>> cfg = LlamaConfig(vocab_size=8, hidden_size=4, intermediate_size=8,
    ...                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
    >>> tensors = {"model.embed_tokens.weight": np.zeros((8, 4)), "model.norm.weight": np.ones(4)}
    >>> try:
    ...   llama_params_from_hf(tensors, cfg)
    ... except jr.errors.MissingCheckpointParametersError as e:
    ...   print(str(e).split(";")[0])
    the checkpoint lacks 10 tensors a LlamaForCausalLM of this config needs
  """
  return hf_loader.params_from_hf(tensors, cfg, LOADER, strict=strict)


def load_llama(
  path: str | Path,
  *,
  config: LlamaConfig | None = None,
  strict: bool = True,
  dtype: str = "float32",
) -> Llama:
  """Builds a :class:`Llama` holding a Hugging Face Llama-family checkpoint (Llama, Mistral,
  Qwen2, Mixtral or Qwen2-MoE).

  Args:
    path: the checkpoint, as transformers' ``save_pretrained`` writes it: a
      ``.safetensors`` file, or a directory with ``model.safetensors`` or a
      sharded ``model.safetensors.index.json``.
    config: the decoder's sizes and variant; default: :func:`read_llama_config` of ``path``.
    strict: reject tensors the decoder does not use (see :func:`llama_params_from_hf`).
    dtype: parameter, compute and cache dtype, with the default config.

  Returns:
    The model; nothing is compiled to build it. Its weights are read into
    memory whole; to run a checkpoint larger than memory, convert it to a
    store and place an abstract model from there.

  Example:
    >>> from jax_residency.models import load_llama
    >>> model = load_llama("tests/fixtures/llama_tiny_tied")  # doctest: +SKIP
  """
  cfg = read_llama_config(path, dtype=dtype) if config is None else config
  return hf_loader.load_checkpoint(path, cfg, LOADER, strict=strict)


def init_llama(cfg: LlamaConfig, seed: int = 0) -> Llama:
  """A :class:`Llama` with seeded random weights, drawn host-side so nothing compiles.

  Linear kernels ``normal(0, 1/sqrt(fan_in))``, embeddings ``normal(0, 1)``,
  zero biases, unit norm scales.

  Example:
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> init_llama(cfg).layers.mlp.down_proj.kernel.shape
    (2, 32, 16)
  """
  return seeded_weights(_abstract(cfg), seed)
