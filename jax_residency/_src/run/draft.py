"""A draft for speculative decoding made from the target's own checkpoint
(docs/speculative.md, "A draft from the same checkpoint").

The natural draft for a streamed model is a quantized copy of itself placed
`FullyResident`: it shares the tokenizer, agrees with the target on most tokens, and is a
fraction of its bytes. `draft_from` writes that copy once (from a Hugging Face checkpoint
directory quantized, from a GGUF file in its own GGML types, or from a converted store's
recorded source), places it, and counts what it holds on the device: its weights and the
KV cache a generation allocates for it, checked against the device memory the target
leaves free before anything is placed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from jax_residency._src.errors import DeviceBudgetTooSmallError
from jax_residency._src.models.hf_convert import load
from jax_residency._src.models.llama_config import LlamaConfig
from jax_residency._src.models.model_source import (
  cached_store_path,
  converted_store,
  is_checkpoint_dir,
)
from jax_residency._src.plan.memory import DEVICE_BUDGET, MemoryItem
from jax_residency._src.policy.sizes import parse_bytes
from jax_residency._src.policy.types import FullyResident
from jax_residency._src.quant.schemes import Quantization
from jax_residency._src.report.text import format_bytes
from jax_residency._src.run.place import place, plan_beside

#: The quantization of a draft made from a float checkpoint.
DEFAULT_DRAFT_QUANTIZATION = "int4"
#: The memory item a draft's KV cache is planned as.
KV_CACHE_ITEM = "KV cache"


def kv_cache_bytes(cfg: LlamaConfig, batch: int, max_len: int) -> int:
  """Bytes of a `LlamaCache` of ``max_len`` slots for ``batch`` rows: keys and values for
  every layer in the model's dtype, and the int32 slot marks.

  Example:
    >>> cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
    ...                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> kv_cache_bytes(cfg, batch=1, max_len=10)  # 2 x 2 layers x 10 x 2 heads x 4 x 4 B + 40
    1320
  """
  per_slot = cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_width
  itemsize = np.dtype(cfg.dtype).itemsize
  return 2 * batch * max_len * per_slot * itemsize + batch * max_len * 4


def draft_store_path(source: str | os.PathLike[str], quantize: Quantization | None) -> str:
  """Where `draft_from` keeps the draft of ``source`` by default: under the library's
  cache directory's ``drafts`` folder (`model_source.cached_store_path`)."""
  return cached_store_path(source, quantize, "drafts")


@dataclasses.dataclass(frozen=True, eq=False)
class Draft:
  """A placed draft and its config: pass it as `generate_llm`'s ``draft=`` (no
  ``draft_config`` needed). Calls run the placed model; close it when done (or use it
  as a context manager).

  Attributes:
    placed: the `FullyResident` placement (its ``metadata.memory`` lists the weights
      and the `KV_CACHE_ITEM`).
    config: the draft's :class:`LlamaConfig`.
    store: the store the draft was placed from.
  """

  placed: Any
  config: LlamaConfig
  store: str

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.placed(*args, **kwargs)

  @property
  def metadata(self) -> Any:
    return self.placed.metadata

  def report(self) -> Any:
    return self.placed.report()

  def close(self) -> None:
    self.placed.close()

  def __enter__(self) -> Draft:
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()


def draft_from(
  source: str | os.PathLike[str],
  *,
  quantize: str | Mapping[str, Any] | None = None,
  store: str | os.PathLike[str] | None = None,
  target: Any = None,
  device_budget_bytes: int | str | None = None,
  max_len: int = 2048,
  batch: int = 1,
  activations: str = "exact",
  progress: bool | None = None,
) -> Draft:
  """A draft for `generate_llm`'s ``draft=``: ``source`` quantized and placed
  `FullyResident`, its weights and KV cache counted against the device memory left.

  Args:
    source: a Hugging Face checkpoint directory (quantized ``quantize``, default int4),
      a ``.gguf`` file (kept in its GGML types), or a store written by ``convert``
      (used as it is; with ``quantize``, the checkpoint or file it records as its
      source is quantized instead).
    quantize: the draft's quantization (``"int4"``, ``"int8"``, ``{"scheme": "int4",
      "group_size": 64}``); None: int4 for a checkpoint, as stored otherwise.
    store: where to write the draft (default: under the library's cache directory,
      `draft_store_path`); a draft already written there is reused.
    target: the placed target: the draft must fit in the device memory its policy's
      device budget leaves beside its plan (``metadata.planned_device_bytes``).
    device_budget_bytes: the device bytes the draft may hold (in place of ``target``'s;
      an int or a size such as ``"2GiB"``).
    max_len: the cache slots a generation allocates for the draft (the prompt, the new
      tokens and twice the widest round: `speculate`), planned as its KV cache.
    batch: rows of a generation, planned in the KV cache.
    activations: the draft's products (``"int8"``: integer products on CPU,
      docs/quantization.md).
    progress: a progress bar while the draft is written (None: when stderr is a terminal).

  Returns:
    The `Draft` (its ``metadata.memory`` lists its weights and a `KV_CACHE_ITEM` item).

  Raises:
    FileNotFoundError: ``source`` is none of the three, or a store's recorded source is
      gone.
    QuantizationError: ``quantize`` given for a GGUF file.
    DeviceBudgetTooSmallError: the draft's weights and KV cache exceed the device bytes
      left, with the arithmetic; raised before the draft is placed.
    ValueError: ``max_len`` or ``batch`` is not a positive int.
  """
  for name, value in (("max_len", max_len), ("batch", batch)):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(
        f"draft_from(..., {name}={value!r}): pass a positive int (max_len: the prompt, the "
        "new tokens and twice the widest round; batch: the rows of a generation)"
      )
  wanted = None if quantize is None else Quantization.of(quantize)
  if wanted is None and is_checkpoint_dir(source):
    wanted = Quantization.of(DEFAULT_DRAFT_QUANTIZATION)
  path = converted_store(
    source,
    quantize=wanted,
    store=None if store is None else os.fspath(store),
    progress=progress,
    folder="drafts",
    caller="draft_from",
  )
  model = load(path)
  cfg: LlamaConfig = model.config
  kv = kv_cache_bytes(cfg, batch, max_len)
  left, where = _device_left(target, device_budget_bytes)

  def too_small(weights: int | None) -> DeviceBudgetTooSmallError:
    what = "its weights" if weights is None else f"{format_bytes(weights)} of weights"
    return DeviceBudgetTooSmallError(
      f"the draft {path} needs {what} + {format_bytes(kv)} of KV cache "
      f"({batch} row(s) x {max_len} slots x {cfg.num_hidden_layers} layers) on the device, "
      f"over the {format_bytes(left or 0)} {where}: use a smaller draft (quantize='int4'), "
      "a shorter max_len, or a larger device budget",
      required=kv + (weights or 0),
      budget=left,
    )

  if left is not None and kv >= left:
    raise too_small(None)
  policy = FullyResident() if left is None else FullyResident(device_budget_bytes=left - kv)
  try:
    placed = place(model, policy, store=path, activations=activations)
  except DeviceBudgetTooSmallError as e:
    raise too_small(int(e.required or 0)) from e
  item = MemoryItem(
    name=KV_CACHE_ITEM,
    memory="device",
    nbytes=kv,
    counted_in=DEVICE_BUDGET,
    note=f"{batch} row(s) x {max_len} slots of keys and values (draft_from's max_len)",
  )
  plan_beside(placed, item)
  return Draft(placed=placed, config=cfg, store=path)


def _device_left(target: Any, budget: int | str | None) -> tuple[int | None, str]:
  """The device bytes the draft may hold, and how that figure comes about."""
  if budget is not None:
    return parse_bytes(budget, name="device_budget_bytes"), "of device_budget_bytes"
  if target is None:
    return None, ""
  own = target.policy.offload().device_budget_bytes
  if own is None:
    return None, ""
  planned = target.metadata.planned_device_bytes
  return (
    int(own) - planned,
    f"the target leaves (its device budget {format_bytes(own)} - its plan {format_bytes(planned)})",
  )
