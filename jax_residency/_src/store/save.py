"""``save``: write a model's parameters as a streamable unit store."""

from __future__ import annotations

import os
import reprlib
from typing import Any

from jax_residency._src.placement.arguments import check_store_path, check_units
from jax_residency._src.placement.split import split_model
from jax_residency._src.policy.errors import StoreError
from jax_residency._src.store.info import StoreInfo
from jax_residency._src.store.writer import save_store


def save(
  model: Any,
  path: str | os.PathLike[str],
  *,
  params: Any = None,
  units: str | tuple[str, ...] | None = None,
  progress: bool | None = None,
  overwrite: bool = False,
) -> StoreInfo:
  """Writes a model's parameters to ``path`` as an Orbax-compatible unit store.

  The stacked layer parameters are written one chunk per unit, uncompressed,
  so :class:`DenseDiskStream` can read any unit at disk speed; static
  parameters are written whole, every chunk with a CRC-32C that reads check.
  The store is written to a temporary location and put in place only once
  complete; over an existing store (``overwrite=True``), the path holds the
  old store or the new one at every moment, even if the process is killed.

  Args:
    model: an ``nnx.Module``, or a Linen module with ``params``.
    path: a directory (a ``str`` or ``os.PathLike``), or a TensorStore kvstore
      URL (``memory://...``, ``gs://...``).
    params: a Linen model's variables.
    units: path of the stacked layer module (as for :func:`place`).
    progress: show a progress bar: True, False, or None (the default: when
      stderr is a terminal).
    overwrite: replace an existing store at ``path`` (True or False).

  Returns:
    A description of what was written.

  Raises:
    StoreError: ``path`` is not a path, ``progress`` or ``overwrite`` is not a
      bool (``overwrite="no"`` is refused, not taken as true), a store
      already exists at ``path`` and ``overwrite`` is False, a file lies where
      a directory of ``path`` should be, or the disk has (or runs out of) less
      space than the store needs; nothing is left written, and an old store at
      ``path`` is kept.
    UnitSelectionError: ``units`` is not a path, or names no layer stack.

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
  check_store_path(path, name="path", where="save")
  check_units(units, where="save")
  for name, flag, accepted in (
    ("progress", progress, "True, False or None (the default: when stderr is a terminal)"),
    ("overwrite", overwrite, "True or False (the default)"),
  ):
    if not isinstance(flag, bool) and not (flag is None and name == "progress"):
      raise StoreError(
        f"save: {name}={reprlib.repr(flag)} ({type(flag).__name__}) is not a bool; "
        f"nothing was written. Pass {accepted}."
      )
  split = split_model(model, params=params, units=units)
  return save_store(
    os.fspath(path),
    static={split.leaves[i].path: split.values[i] for i in split.static_index},
    units={split.unit_rel_path(split.leaves[i]): split.values[i] for i in split.unit_index},
    unit_prefix=split.unit_path_prefix,
    progress=progress,
    overwrite=overwrite,
  )
