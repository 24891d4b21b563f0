"""Errors while a placed model runs: admission, background reads, use after close."""

from __future__ import annotations

from jax_residency._src.errors.base import ResidencyError


class ResidencyRuntimeError(ResidencyError, RuntimeError):
  """A failure while running a placed model.

  Raised by a placed model, or a dense stream's caches and worker, as it runs.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> placed = jr.place(net, units="layers")
    >>> placed.close()
    >>> try:
    ...   placed.arrays()
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, isinstance(e, RuntimeError))
    ClosedError True
  """


class AdmissionError(ResidencyRuntimeError):
  """A cache reservation could not be satisfied; nothing was changed.

  Raised by a dense stream's cache ledger when a unit does not fit a tier even
  after evicting every unprotected unit. The stream handles it (reading the unit
  uncached) and `place` checks the device window fits, so callers do not see it.

  Example:
    >>> import jax_residency as jr
    >>> try:
    ...   raise jr.errors.AdmissionError("unit 3 does not fit the host tier")
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, isinstance(e, RuntimeError))
    AdmissionError True
  """


class PrefetchError(ResidencyRuntimeError):
  """The background prefetch worker failed to load a unit, not because of the store.

  Raised in a `DenseDiskStream` pass that waits for a unit its worker thread
  failed to load, with the worker's error as ``__cause__``. A store that cannot
  be read, or is corrupt, raises its `StoreError` instead, whichever thread read
  the unit, so ``except jr.StoreError`` catches every store failure. The
  example builds one as the worker does (a failing load is timing-dependent).

  Example:
    >>> import jax_residency as jr
    >>> failure = MemoryError("out of host memory")
    >>> try:
    ...   raise jr.errors.PrefetchError("prefetch of unit 1 failed") from failure
    ... except jr.errors.ResidencyRuntimeError as e:
    ...   print(type(e).__name__, type(e.__cause__).__name__)
    PrefetchError MemoryError
  """


class ClosedError(ResidencyRuntimeError):
  """A placed model, cache or worker was used after `close()`.

  Raised by a `PlacedModel` called, lowered or asked for its arrays after
  ``close()`` (or its ``with`` block), and by a closed store, ledger or worker.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> with jr.place(net, units="layers") as placed:
    ...   pass
    >>> try:
    ...   placed(jnp.ones((1, 4)))
    ... except jr.ClosedError as e:
    ...   print(e)
    this placed model was closed; place the model again to run it
  """
