"""The errors of unit stores: missing, unreadable, damaged, or not what the model needs.

Part of the hierarchy in `errors.py`, which re-exports every class here.
"""

from __future__ import annotations

from jax_residency._src.errors.base import ResidencyError


class StoreError(ResidencyError, ValueError):
  """A unit store is missing, unreadable, or not laid out as needed.

  Raised by `save` (e.g. a store already there without ``overwrite=True``), by
  `place` with ``store=``, and by a dense stream whose store read fails.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> try:
    ...   jr.place(net, store=tempfile.mkdtemp() + "/missing", units="layers")
    ... except jr.StoreError as e:
    ...   print(type(e).__name__, isinstance(e, ValueError))
    StoreNotFoundError True
  """


class StoreNotFoundError(StoreError, FileNotFoundError):
  """No unit store exists at the given path.

  Raised by `place` with ``store=`` when the path is not a directory or holds no
  checkpoint; it is a `FileNotFoundError` too.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> try:  # an empty directory
    ...   jr.place(net, jr.DenseDiskStream(), store=tempfile.mkdtemp(), units="layers")
    ... except FileNotFoundError as e:
    ...   print(type(e).__name__, "found neither Orbax's _METADATA" in str(e))
    StoreNotFoundError True
  """


class StoreLayoutError(StoreError):
  """A store exists but its arrays are not laid out as a layer stack.

  Raised by `place` with ``store=`` when the arrays under a stack disagree on
  their unit count (the stack's path names more than the stacked layers), and
  by ``UnitStore.open(require_unit_chunks=True)`` for a unit array chunked over
  several units (placing such a checkpoint works, with a warning; ``jax-residency
  rechunk`` rewrites it).

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, orbax.checkpoint as ocp
    >>> import jax_residency as jr
    >>> state = {"layers": {"w": jnp.zeros((2, 4, 4)), "b": jnp.zeros((3, 4))}}
    >>> path = tempfile.mkdtemp() + "/ckpt"
    >>> with ocp.StandardCheckpointer() as ckptr:  # 2 units of w, but 3 of b
    ...   ckptr.save(path, state)
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4))),
    ...                                b=nnx.Param(jnp.zeros((2, 4)))))
    >>> try:
    ...   jr.place(net, store=path, units="layers")
    ... except jr.errors.StoreLayoutError as e:
    ...   print(type(e).__name__, "layers.b: leading dim 3" in str(e))
    StoreLayoutError True
  """


class StoreCorruptionError(StoreError):
  """A chunk of a store holds data that does not match its checksum.

  Stores written by `save` keep a CRC-32C after each chunk, checked when a chunk's
  bytes come from disk (docs/memory.md, "Checksums on the read path"): by the
  placement, the dense stream (mapped or copied reads) and ``jax-residency verify``,
  which checks every chunk and lists every damaged tensor. Carries ``store``,
  ``tensor`` (the dot-separated path) and ``unit`` (None for a static tensor).
  Also raised when a store opens and its OCDBT manifest (or an index node) fails
  its own checksum; ``tensor`` and ``unit`` are then None.

  Example:
    >>> import glob, os, tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.ones((2, 32, 32)))))
    >>> path = tempfile.mkdtemp() + "/net"
    >>> _ = jr.save(net, path, units="layers", progress=False)
    >>> data = max(glob.glob(path + "/d/*"), key=os.path.getsize)  # starts with a unit's chunk
    >>> with open(data, "r+b") as f:  # damage the chunk's first byte
    ...   _ = f.write(b"\\x01")
    >>> try:
    ...   jr.place(net, store=path, units="layers")
    ... except jr.errors.StoreCorruptionError as e:
    ...   print(e.tensor, e.unit in (0, 1))
    layers.w True
  """

  def __init__(
    self,
    message: str,
    *,
    store: str | None = None,
    tensor: str | None = None,
    unit: int | None = None,
  ):
    super().__init__(message)
    self.store = store
    self.tensor = tensor
    self.unit = unit


class StoreReplacedError(StoreError):
  """The store a placement streams from was replaced or rewritten on disk.

  A placement serves the store it opened. When the store at its path is
  replaced (``jr.save(..., overwrite=True)``) or rewritten (a new Orbax commit),
  the next read from disk raises this instead of mixing two versions' weights;
  place the model again to use the new store. Units still cached (a device
  window holding every unit, a host cache) keep serving the old weights until
  a read is needed. Carries ``store``.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=4), rngs=nnx.Rngs(0))
    >>> path, tokens = tempfile.mkdtemp() + "/toy", jnp.zeros((1, 4), jnp.int32)
    >>> _ = jr.save(model, path, progress=False)
    >>> placed = jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=path)
    >>> _ = placed(tokens)
    >>> _ = jr.save(model, path, progress=False, overwrite=True)  # a new store there
    >>> try:
    ...   placed(tokens)
    ... except jr.errors.StoreReplacedError as e:
    ...   print(e.store == path)
    True
    >>> placed.close()
  """

  def __init__(self, message: str, *, store: str | None = None):
    super().__init__(message)
    self.store = store


class StoreUnavailableError(StoreError):
  """A store's server failed a read every time it was tried.

  Raised for a remote store (``http(s)://``, ``gs://``, ``s3://``) when a
  request still fails after ``jr.ReadOptions.retries`` retries: the server is
  down, refuses the connection, or keeps answering with an error. Carries
  ``store`` and ``attempts`` (tries made; None where unknown). The store and
  the placement stay usable: a later call reads again.

  Example:
    >>> import jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> try:  # nothing listens on port 9 of this machine
    ...   jr.place(net, store="http://127.0.0.1:9/net", units="layers",
    ...            read_options=jr.ReadOptions(retries=1, retry_delay_s=0.01))
    ... except jr.errors.StoreUnavailableError as e:
    ...   print(e.store, e.attempts)
    http://127.0.0.1:9/net 2
  """

  def __init__(self, message: str, *, store: str | None = None, attempts: int | None = None):
    super().__init__(message)
    self.store = store
    self.attempts = attempts


class StoreTimeoutError(StoreUnavailableError):
  """A read from a store took longer than ``jr.ReadOptions.timeout_s``.

  The read (a unit, a static tensor or a metadata file, with its retries) is
  cancelled. Carries ``store``, ``timeout_s`` and ``what`` (the read, e.g.
  ``"unit 3"``). Raise ``timeout_s`` for a slow link, or check the server.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> from jax_residency.testing import serve_store
    >>> net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4)))))
    >>> path = tempfile.mkdtemp() + "/net"
    >>> _ = jr.save(net, path, units="layers", progress=False)
    >>> with serve_store(path, latency_s=0.5) as server:  # every answer takes 0.5 s
    ...   try:
    ...     jr.place(net, store=server.url, read_options=jr.ReadOptions(timeout_s=0.1))
    ...   except jr.errors.StoreTimeoutError as e:
    ...     print(e.timeout_s, e.what)
    0.1 metadata
  """

  def __init__(
    self, message: str, *, store: str | None = None, timeout_s: float = 0.0, what: str = ""
  ):
    super().__init__(message, store=store)
    self.timeout_s = timeout_s
    self.what = what


class CheckpointMismatchError(StoreError):
  """Base of the errors that compare a stored tree with the model's tree.

  Raised by `place` with ``store=`` before any weight is read, listing every path.

  Catch it to handle every such mismatch at once; each subclass's example raises it.

  Example:
    >>> import jax_residency as jr
    >>> for kind in sorted(c.__name__ for c in jr.errors.CheckpointMismatchError.__subclasses__()):
    ...   print(kind)
    CheckpointShapeMismatchError
    MissingCheckpointParametersError
    UnexpectedCheckpointParametersError
    >>> issubclass(jr.errors.CheckpointMismatchError, jr.StoreError)
    True
  """


class MissingCheckpointParametersError(CheckpointMismatchError):
  """The model has parameters the store does not hold.

  Raised by `place` with ``store=`` (and the `jax_residency.models` converters).

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> layers = lambda: nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4))))
    >>> path = tempfile.mkdtemp() + "/net"
    >>> _ = jr.save(nnx.Dict(layers=layers()), path, units="layers", progress=False)
    >>> try:
    ...   jr.place(nnx.Dict(layers=layers(), head=nnx.Param(jnp.zeros(4))), store=path)
    ... except jr.errors.MissingCheckpointParametersError as e:
    ...   print(type(e).__name__, "head: expected (4,) float32" in str(e))
    MissingCheckpointParametersError True
  """


class CheckpointShapeMismatchError(CheckpointMismatchError):
  """Stored tensors disagree with the model's shape or dtype.

  Raised by `place` with ``store=`` (and the `jax_residency.models` converters).

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> net = lambda width: nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, width, width)))))
    >>> path = tempfile.mkdtemp() + "/net"
    >>> _ = jr.save(net(4), path, units="layers", progress=False)
    >>> try:
    ...   jr.place(net(8), store=path)
    ... except jr.errors.CheckpointShapeMismatchError as e:
    ...   print("layers.w (per unit): expected (8, 8) float32, found (4, 4) float32" in str(e))
    True
  """


class UnexpectedCheckpointParametersError(CheckpointMismatchError):
  """With `strict_loading`, the store holds tensors the model does not claim.

  Raised by `place` with ``store=`` (and the `jax_residency.models` converters);
  ``strict_loading=False`` ignores such tensors.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> layers = lambda: nnx.Dict(w=nnx.Param(jnp.zeros((2, 4, 4))))
    >>> path = tempfile.mkdtemp() + "/net"
    >>> saved = nnx.Dict(layers=layers(), head=nnx.Param(jnp.zeros(4)))
    >>> _ = jr.save(saved, path, units="layers", progress=False)
    >>> try:
    ...   jr.place(nnx.Dict(layers=layers()), store=path)
    ... except jr.errors.UnexpectedCheckpointParametersError as e:
    ...   print(type(e).__name__, "head: (4,) float32" in str(e))
    UnexpectedCheckpointParametersError True
    >>> lenient = jr.LayerwiseHost(strict_loading=False)  # ignores the extra "head"
    >>> jr.place(nnx.Dict(layers=layers()), lenient, store=path).close()
  """
