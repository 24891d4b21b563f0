"""`StoreInfo`: what a save or a conversion wrote (returned by `jr.save`)."""

from __future__ import annotations

import dataclasses

from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.store.discovery import PLAIN_FORMAT_VERSION
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StackInfo:
  """One layer stack a store holds: its path, unit count and bytes per unit, and how
  many experts each unit holds as chunks of their own (``experts``, 0 for none:
  docs/design.md, 5.6).

  Example:
    >>> from jax_residency.models import T5Config, init_t5
    >>> import jax_residency as jr
    >>> cfg = T5Config(vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=2,
    ...                num_decoder_layers=3, num_heads=2, relative_attention_num_buckets=8)
    >>> info = jr.save(init_t5(cfg), "memory://stack_info/t5", progress=False)
    >>> [(s.prefix, s.count) for s in info.stacks]  # both stacks, in forward order
    [(('encoder_layers',), 2), (('decoder_layers',), 3)]
  """

  prefix: ParamPath
  count: int
  unit_nbytes: int
  experts: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreInfo:
  """What `save_store` / `rechunk_store` wrote.

  Attributes:
    path: The store's path as given.
    unit_prefix: Path of the (first) stacked unit subtree (e.g. `("layers",)`).
    unit_count: Number of units over all stacks.
    unit_nbytes: Bytes of one unit (all unit tensors of one index); with
      several stacks, of the largest.
    static_nbytes: Bytes of all static (non-unit) tensors.
    format_version: Version of the sidecar format.
    stacks: every layer stack the store holds, in the model's forward order
      (:class:`StackInfo`).
    quantization: the tensors it holds quantized and how (``None`` for a float
      store); byte counts above are of what is stored (codes, scales, offsets).

  Example:
    >>> import tempfile
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> cfg = ToyConfig(n_layers=2)
    >>> with tempfile.TemporaryDirectory() as tmp:
    ...   info = jr.save(ToyTransformer(cfg, rngs=nnx.Rngs(0)), tmp + "/toy", progress=False)
    >>> info.unit_prefix, info.unit_count, info.unit_nbytes == cfg.unit_bytes()
    (('layers',), 2, True)
    >>> info.total_unit_bytes == 2 * info.unit_nbytes
    True
  """

  path: str
  unit_prefix: ParamPath
  unit_count: int
  unit_nbytes: int
  static_nbytes: int
  format_version: int = PLAIN_FORMAT_VERSION
  stacks: tuple[StackInfo, ...] = ()
  quantization: QuantPlan | None = None

  @property
  def total_unit_bytes(self) -> int:
    if self.stacks:
      return sum(s.count * s.unit_nbytes for s in self.stacks)
    return self.unit_nbytes * self.unit_count
