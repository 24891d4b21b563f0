"""`StoreInfo`: what a save or a conversion wrote (returned by `jr.save`)."""

from __future__ import annotations

import dataclasses

from jax_residency._src.store.discovery import FORMAT_VERSION
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True, kw_only=True)
class StoreInfo:
  """What `save_store` / `rechunk_store` wrote.

  Attributes:
    path: The store's path as given.
    unit_prefix: Path of the stacked unit subtree (e.g. `("params", "layers")`).
    unit_count: Number of units (the leading dimension of every unit array).
    unit_nbytes: Bytes of one unit (all unit tensors of one index).
    static_nbytes: Bytes of all static (non-unit) tensors.
    format_version: Version of the sidecar format.

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
  format_version: int = FORMAT_VERSION

  @property
  def total_unit_bytes(self) -> int:
    return self.unit_nbytes * self.unit_count
