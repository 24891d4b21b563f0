"""``DenseDiskStream``: a placement that streams its units from a store.

`DenseExecutor` opens the store, places the static weights (one tensor at a
time), and runs passes through a `DenseStreamEngine` (``stream/engine.py``),
which feeds the staged forward's unit loop from the store through byte-bounded
host and device tiers. It implements ``run/executor.py``'s `Executor`.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
from jax.sharding import Mesh

from jax_residency._src.errors import PlacementError
from jax_residency._src.plan import shardings as pl
from jax_residency._src.plan.budget import ModelMetadata, metadata_for
from jax_residency._src.plan.memory import OVERHEAD, MemoryItem
from jax_residency._src.plan.split import SplitModel
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.policy.types import DenseDiskStream
from jax_residency._src.report.telemetry import Telemetry
from jax_residency._src.run.executor import note_unplaced
from jax_residency._src.store.loading import StoreSource, open_for
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.stream.engine import DenseStreamEngine
from jax_residency._src.stream.expert_plan import with_expert_caches
from jax_residency._src.typing import path_str


class DenseExecutor:
  """Runs ``DenseDiskStream`` placements (see `executor.Executor`)."""

  def __init__(
    self,
    split: SplitModel,
    policy: DenseDiskStream,
    *,
    mesh: Mesh,
    rules: pl.Rules | None,
    store: StoreSource,
    sequence_axis: int = 1,
  ) -> None:
    placed_at = pl.layout(split, mesh, rules, unit_kind=pl.DEVICE)
    self.metadata: ModelMetadata = with_expert_caches(
      metadata_for(split, policy, placed_at.static, placed_at.unit_slices),
      policy.options.experts,
    )
    split.values = []  # weights come from the store; never keep the caller's arrays
    self._store = open_for(
      split, store, strict=policy.strict_loading, max_cached_shards=policy.max_cached_shards
    )
    try:
      self.metadata = _with_chunk_layout(self.metadata, self._store)
      # One tensor at a time: host memory holds the placed static weights plus one
      # tensor in transit, never a second copy of all of them.
      self._static = [
        pl.put([self._store.read_static_tensor(leaf.path)], [sharding])[0]
        for leaf, sharding in zip(split.static_leaves(), placed_at.static, strict=True)
      ]
      self.telemetry = Telemetry.for_policy(
        policy=policy, metadata=self.metadata, sequence_axis=sequence_axis
      )
      opened = self._store
      self.telemetry.fetched = lambda: store.fetched.total() + opened.own_read_bytes
      self._engine = DenseStreamEngine(
        split=split,
        policy=policy,
        source=self._store,
        static=self._static,
        unit_shardings=placed_at.unit_slices,
        metadata=self.metadata,
        telemetry=self.telemetry,
        on_trace=lambda ctx: note_unplaced(self, ctx),
      )
    except BaseException:
      self._store.close()
      raise
    self._split = split
    self._policy_name = policy.name

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((args, kwargs))):
      raise PlacementError(
        f"{self._policy_name} drives its layer loop from the host, one compiled step per "
        "unit, so it cannot run under a JAX transformation (jax.grad, jax.jit, jax.vmap, "
        "jax.make_jaxpr). Call it with concrete arrays, or place the model with "
        "FullyResident or LayerwiseHost, which support input gradients."
      )
    return self._engine.run(*args, **kwargs)

  def clear_caches(self) -> None:
    self._engine.clear_caches()

  def lower(self, *args: Any, platforms: tuple[str, ...] | None = None, **kwargs: Any) -> Any:
    raise PlacementError(
      f"{self._policy_name} does not run as one jitted program; there is nothing to lower"
    )

  def arrays(self) -> dict[str, jax.Array]:
    """The static arrays: a dense stream holds no units between passes."""
    leaves = self._split.static_leaves()
    return {path_str(leaf.path): a for leaf, a in zip(leaves, self._static, strict=True)}

  def close(self) -> None:
    try:
      self._engine.close()
    finally:
      self._store.close()


def _with_chunk_layout(meta: ModelMetadata, store: UnitStore) -> ModelMetadata:
  """``meta`` with what a store whose chunks span several units costs: its bytes read
  per byte used, and the memory a chunk's decode takes (a warning says how to fix it)."""
  ratio = store.bytes_read_per_byte_used
  if ratio <= 1.0:
    return meta
  chunk = store.largest_shared_chunk
  warnings.warn(
    f"The checkpoint at {store.path} stores several units per chunk (Orbax's default "
    f"chunking), so streaming it decodes {ratio:.1f} bytes for each byte it uses, each "
    f"chunk once per unit in it (the largest chunk is {format_bytes(chunk)}). Rewrite it "
    f"once with one unit per chunk: `jax-residency rechunk {store.path} DST --units "
    f"{','.join('.'.join(s.prefix) for s in store.stacks)}`, then place from DST.",
    UserWarning,
    stacklevel=4,
  )
  decode = MemoryItem(
    name="chunk decode",
    memory="host",
    nbytes=2 * chunk,
    counted_in=OVERHEAD,
    note="one chunk of several units read and decoded whole (stored and decoded bytes), "
    "one at a time",
  )
  return dataclasses.replace(meta, memory=(*meta.memory, decode), bytes_read_per_byte_used=ratio)
