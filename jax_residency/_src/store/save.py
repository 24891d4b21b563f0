"""``save``: write a model's parameters as a streamable unit store."""

from __future__ import annotations

from typing import Any

from jax_residency._src.placement.split import split_model
from jax_residency._src.store.unit_store import StoreInfo
from jax_residency._src.store.writer import save_store


def save(
  model: Any,
  path: str,
  *,
  params: Any = None,
  units: str | tuple[str, ...] | None = None,
  progress: bool | None = None,
  overwrite: bool = False,
) -> StoreInfo:
  """Writes a model's parameters to ``path`` as an Orbax-compatible unit store.

  The stacked layer parameters are written one chunk per unit, uncompressed,
  so :class:`DenseDiskStream` can read any unit at disk speed; static
  parameters are written whole. The store is written to a temporary location
  and renamed into place only once complete.

  Args:
    model: an ``nnx.Module``, or a Linen module with ``params``.
    path: a directory, or a TensorStore kvstore URL (``memory://...``, ``gs://...``).
    params: a Linen model's variables.
    units: path of the stacked layer module (as for :func:`place`).
    progress: show a progress bar (default: when stderr is a terminal).
    overwrite: replace an existing store at ``path``.

  Returns:
    A description of what was written.

  Example:
    >>> import tempfile, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> path = tempfile.mkdtemp() + "/toy"
    >>> info = jr.save(model, path, progress=False)
    >>> options = jr.DenseDiskStreamLoadOptions(host_budget_bytes="1MiB")
    >>> with jr.place(model, jr.DenseDiskStream(options), store=path) as placed:
    ...   tokens = jnp.zeros((1, 4), jnp.int32)
    ...   bool((placed(tokens) == model(tokens)).all())
    True
  """
  split = split_model(model, params=params, units=units)
  return save_store(
    path,
    static={split.leaves[i].path: split.values[i] for i in split.static_index},
    units={split.unit_rel_path(split.leaves[i]): split.values[i] for i in split.unit_index},
    unit_prefix=split.unit_path_prefix,
    progress=progress,
    overwrite=overwrite,
  )
