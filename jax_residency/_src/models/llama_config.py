"""The sizes and variant of a Llama-family decoder, read from a Hugging Face ``config.json``.

One config covers ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM``: the same pre-norm decoder (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU MLP) that differs in which projections have a
bias (Llama: all four with ``attention_bias``; Qwen2: q/k/v, never o; Mistral:
none), in the rotary frequencies (Llama 3's scaled ones) and in a sliding
attention window (Mistral on every layer; Qwen2 from ``max_window_layers`` on,
with ``use_sliding_window``). It also covers two mixtures of experts, whose MLP
is ``num_experts`` SwiGLU experts of which a router picks ``num_experts_per_tok``
per token: ``MixtralForCausalLM`` (Mistral's attention, top-k weights
renormalized) and ``Qwen2MoeForCausalLM`` (Qwen2's attention, renormalized if
``norm_topk_prob``, plus a shared expert scaled by a sigmoid gate). A field that
asks for math the model does not implement raises
:class:`~jax_residency.errors.ModelConfigError` naming the field, its value and what
is supported.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from jax_residency._src.models.hf_config import unsupported

#: ``architectures`` the config reads, and the ``model_type`` of each.
ARCHITECTURES = {
  "LlamaForCausalLM": "llama",
  "MistralForCausalLM": "mistral",
  "Qwen2ForCausalLM": "qwen2",
  "MixtralForCausalLM": "mixtral",
  "Qwen2MoeForCausalLM": "qwen2_moe",
}
#: Rotary frequency schemes implemented (``rope_scaling`` / ``rope_parameters`` ``rope_type``).
ROPE_TYPES = ("default", "llama3")


#: The error for a field this model does not implement (``Llama config <field>=...``).
_unsupported = functools.partial(unsupported, "Llama")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Sizes and variant of a Llama-family decoder (the names of Hugging Face's configs).

  Attributes:
    architecture: ``"LlamaForCausalLM"``, ``"MistralForCausalLM"`` or ``"Qwen2ForCausalLM"``.
    vocab_size: token vocabulary.
    hidden_size: residual width.
    intermediate_size: SwiGLU MLP width.
    num_hidden_layers: decoder layers (units of ``layers``).
    num_attention_heads: query heads.
    num_key_value_heads: key/value heads (divides ``num_attention_heads``; fewer: GQA).
    head_dim: width of one head; ``None``: ``hidden_size // num_attention_heads``.
    rms_norm_eps: RMSNorm epsilon.
    rope_theta: rotary base.
    rope_type: ``"default"`` or ``"llama3"`` (frequencies scaled as Llama 3.1 does).
    rope_factor, low_freq_factor, high_freq_factor, original_max_position_embeddings:
      the ``llama3`` scaling's parameters.
    max_position_embeddings: the context the checkpoint was trained for (informative).
    tie_word_embeddings: the LM head is the token embedding (no ``lm_head``).
    qkv_bias: the q/k/v projections have biases (Qwen2; Llama's ``attention_bias``).
    o_bias: the output projection has a bias (Llama's ``attention_bias``).
    sliding_window: keys older than this many positions are not attended to, on
      the layers :attr:`layer_sliding` marks; ``None``: no window.
    sliding_layers: the layers that use ``sliding_window`` (``None``: all of them).
    bos_token_id, pad_token_id: special tokens (``None`` if the config has none).
    eos_token_ids: the tokens that end a sequence (``eos_token_id``, one or a list).
    num_experts: experts per MLP (0: a dense SwiGLU MLP of ``intermediate_size``).
    num_experts_per_tok: experts the router picks for each token.
    moe_intermediate_size: one expert's SwiGLU width.
    shared_expert_intermediate_size: the shared expert's width (0: none).
    norm_topk_prob: the picked experts' router probabilities are renormalized to sum to 1.
    dtype: parameter, compute and cache dtype.

  Raises:
    ModelConfigError: an unknown ``architecture`` or ``rope_type``, or head
      counts that do not divide.
  """

  architecture: str = "LlamaForCausalLM"
  vocab_size: int = 32000
  hidden_size: int = 4096
  intermediate_size: int = 11008
  num_hidden_layers: int = 32
  num_attention_heads: int = 32
  num_key_value_heads: int = 32
  head_dim: int | None = None
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  rope_type: str = "default"
  rope_factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  max_position_embeddings: int = 2048
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  sliding_window: int | None = None
  sliding_layers: tuple[int, ...] | None = None
  bos_token_id: int | None = 1
  pad_token_id: int | None = None
  eos_token_ids: tuple[int, ...] = (2,)
  num_experts: int = 0
  num_experts_per_tok: int = 2
  moe_intermediate_size: int = 0
  shared_expert_intermediate_size: int = 0
  norm_topk_prob: bool = True
  dtype: str = "float32"

  def __post_init__(self) -> None:
    if self.architecture not in ARCHITECTURES:
      raise _unsupported("architectures", [self.architecture], f"one of {list(ARCHITECTURES)}")
    if self.rope_type not in ROPE_TYPES:
      raise _unsupported("rope_type", self.rope_type, f"this decoder implements {ROPE_TYPES}")
    if self.num_attention_heads % self.num_key_value_heads:
      raise _unsupported(
        "num_key_value_heads",
        self.num_key_value_heads,
        f"it must divide num_attention_heads={self.num_attention_heads}",
      )
    if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
      raise _unsupported(
        "num_experts_per_tok",
        self.num_experts_per_tok,
        f"between 1 and num_experts={self.num_experts}",
      )
    if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
      raise _unsupported(
        "high_freq_factor", self.high_freq_factor, "llama3 needs it to differ from low_freq_factor"
      )

  @property
  def model_type(self) -> str:
    """``"llama"``, ``"mistral"``, ``"qwen2"``, ``"mixtral"`` or ``"qwen2_moe"``."""
    return ARCHITECTURES[self.architecture]

  @property
  def head_width(self) -> int:
    """``head_dim``, or ``hidden_size // num_attention_heads`` when it is ``None``."""
    return self.head_dim or self.hidden_size // self.num_attention_heads

  @property
  def layer_sliding(self) -> tuple[bool, ...]:
    """Per layer, whether it attends within ``sliding_window`` only."""
    n = self.num_hidden_layers
    if self.sliding_window is None:
      return (False,) * n
    if self.sliding_layers is None:
      return (True,) * n
    return tuple(i in self.sliding_layers for i in range(n))

  @classmethod
  def from_hf(cls, config: Mapping[str, Any], *, dtype: str = "float32") -> LlamaConfig:
    """Reads a Hugging Face ``config.json`` of a Llama, Mistral, Qwen2, Mixtral or Qwen2-MoE
    causal LM.

    The rotary settings are read from ``rope_scaling`` (transformers 4) or
    ``rope_parameters`` (transformers 5), ``rope_theta`` from the top level or
    from either of those. Training-only fields (``attention_dropout``,
    ``initializer_range``, ``pretraining_tp``, ``use_cache``...) are ignored.

    Raises:
      ModelConfigError: a field asks for math this decoder does not implement
        (``architectures``, ``rope_type``, ``hidden_act``, ``mlp_bias``,
        ``partial_rotary_factor``, ``layer_types``); the message names the
        field and its value.

    Example:
      >>> cfg = LlamaConfig.from_hf({"architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
      ...                            "num_attention_heads": 4, "num_key_value_heads": 2,
      ...                            "eos_token_id": [5, 6], "tie_word_embeddings": True})
      >>> cfg.head_width, cfg.qkv_bias, cfg.o_bias, cfg.eos_token_ids
      (16, True, False, (5, 6))
    """
    arch = _architecture(config)
    model_type = ARCHITECTURES[arch]
    act = config.get("hidden_act", "silu")
    if act != "silu":
      raise _unsupported("hidden_act", act, "this decoder's MLP is SwiGLU ('silu')")
    if config.get("mlp_bias", False):
      raise _unsupported("mlp_bias", config["mlp_bias"], "the MLP projections have no bias")
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    rope_type = str(rope.get("rope_type", rope.get("type", "default")))
    if rope_type not in ROPE_TYPES:
      raise _unsupported(
        "rope_type", rope_type, f"this decoder implements {' and '.join(map(repr, ROPE_TYPES))}"
      )
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
      raise _unsupported("partial_rotary_factor", partial, "rotary embeddings span whole heads")
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    heads = int(config.get("num_attention_heads", 32))
    kv_heads = config.get("num_key_value_heads")
    head_dim = config.get("head_dim")
    attention_bias = bool(config.get("attention_bias", False))
    eos = config.get("eos_token_id", 2)
    eos_ids = (
      () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
    )
    window, sliding_layers = _sliding(config, model_type)
    experts = _experts(config, model_type)
    max_pos = int(config.get("max_position_embeddings", 2048))
    bos, pad = config.get("bos_token_id", 1), config.get("pad_token_id")
    return cls(
      architecture=arch,
      vocab_size=int(config.get("vocab_size", 32000)),
      hidden_size=int(config.get("hidden_size", 4096)),
      intermediate_size=int(config.get("intermediate_size", 11008)),
      num_hidden_layers=int(config.get("num_hidden_layers", 32)),
      num_attention_heads=heads,
      num_key_value_heads=heads if kv_heads is None else int(kv_heads),
      head_dim=None if head_dim is None else int(head_dim),
      rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
      rope_theta=float(theta),
      rope_type=rope_type,
      rope_factor=float(rope.get("factor", 1.0)),
      low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
      high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
      original_max_position_embeddings=int(rope.get("original_max_position_embeddings", max_pos)),
      max_position_embeddings=max_pos,
      tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
      qkv_bias=(model_type == "qwen2")
      or (model_type == "qwen2_moe" and bool(config.get("qkv_bias", True)))
      or (model_type == "llama" and attention_bias),
      o_bias=model_type == "llama" and attention_bias,
      sliding_window=window,
      sliding_layers=sliding_layers,
      bos_token_id=None if bos is None else int(bos),
      pad_token_id=None if pad is None else int(pad),
      eos_token_ids=eos_ids,
      dtype=dtype,
      **experts,
    )


def _experts(config: Mapping[str, Any], model_type: str) -> dict[str, Any]:
  """The mixture-of-experts fields of a Mixtral or Qwen2-MoE config (none for the others)."""
  if model_type == "mixtral":
    return {
      "num_experts": int(config.get("num_local_experts", 8)),
      "num_experts_per_tok": int(config.get("num_experts_per_tok", 2)),
      "moe_intermediate_size": int(config.get("intermediate_size", 14336)),
      "norm_topk_prob": True,
    }
  if model_type != "qwen2_moe":
    return {}
  only = config.get("mlp_only_layers") or []
  if only:
    raise _unsupported("mlp_only_layers", only, "every layer a mixture of experts ([])")
  step = config.get("decoder_sparse_step", 1)
  if step != 1:
    raise _unsupported("decoder_sparse_step", step, "every layer a mixture of experts (1)")
  return {
    "num_experts": int(config.get("num_experts", 60)),
    "num_experts_per_tok": int(config.get("num_experts_per_tok", 4)),
    "moe_intermediate_size": int(config.get("moe_intermediate_size", 1408)),
    "shared_expert_intermediate_size": int(config.get("shared_expert_intermediate_size", 5632)),
    "norm_topk_prob": bool(config.get("norm_topk_prob", False)),
  }


def _architecture(config: Mapping[str, Any]) -> str:
  archs = config.get("architectures")
  if archs is None:  # an old config: its model_type names the family
    by_type = {t: a for a, t in ARCHITECTURES.items()}
    model_type = config.get("model_type", "llama")
    if model_type not in by_type:
      raise _unsupported("model_type", model_type, f"one of {list(by_type)}")
    return by_type[model_type]
  if not isinstance(archs, list) or len(archs) != 1 or archs[0] not in ARCHITECTURES:
    raise _unsupported("architectures", archs, f"one of {list(ARCHITECTURES)}")
  return str(archs[0])


def _sliding(
  config: Mapping[str, Any], model_type: str
) -> tuple[int | None, tuple[int, ...] | None]:
  """``(sliding_window, the layers using it or None for all)`` as transformers decides them."""
  n = int(config.get("num_hidden_layers", 32))
  window = config.get("sliding_window")
  layers: tuple[int, ...] | None = None
  if model_type == "llama":
    window = None
  elif model_type == "qwen2_moe":
    if config.get("use_sliding_window", False):
      raise _unsupported("use_sliding_window", True, "full attention on every layer (false)")
    window = None
  elif model_type == "qwen2":
    if not config.get("use_sliding_window", False):
      window = None
    else:
      first = int(config.get("max_window_layers", n))
      layers = tuple(range(first, n))
  types = config.get("layer_types")
  if types is not None:  # transformers >= 4.53 writes each layer's kind
    known = ("full_attention", "sliding_attention")
    if any(t not in known for t in types) or len(types) != n:
      raise _unsupported("layer_types", types, f"{n} entries of {known}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if sliding and window is None:
      raise _unsupported("layer_types", types, "sliding layers need a sliding_window")
    layers = sliding if window is not None else None
  if window is not None and int(window) < 1:
    raise _unsupported("sliding_window", window, "a window of at least 1 position, or null")
  if layers == ():
    window, layers = None, None
  return (None if window is None else int(window)), layers
