"""Expert residency: experts read only when a router picks them (docs/design.md, 4.9).

A dense stream with `ExpertResidency` reads each unit without its experts
(`UnitStore.read_unit_async(skip=...)`) and gives the unit loop these hooks
(`expert_steps.ExpertHooks`). For a step's picks (the distinct ids its probe
returned) `ExpertStream.experts`:

* takes each picked expert from the **device expert cache** (a hit), else from the
  **host expert cache**, else reads it from the store (its own chunks only,
  `UnitStore.read_experts_async`), all misses of the step in one read;
* moves the new ones to the device and caches them there, within the cache's budget
  (a step that picks more than fits, a prefill, moves the rest through uncached);
* assembles each expert tensor of the unit, the picked experts' rows filled and the
  others zero: the layer weighs an unpicked expert 0, and a step with few tokens
  reads only its picks' rows (`models.llama.Experts`).

Both caches are `ResidencyLedger` tiers keyed by ``unit * experts + expert``;
eviction is the policy's. `predict` reads ahead what a speculative probe expects
the next unit to pick, on one background thread, into the device cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import math
import mmap
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import (
  AdmissionError,
  DeviceBudgetTooSmallError,
  PlacementError,
  StoreLayoutError,
)
from jax_residency._src.plan.budget import ModelMetadata
from jax_residency._src.plan.memory import MemoryItem
from jax_residency._src.policy.experts import ExpertResidency
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.report.metrics import Tally
from jax_residency._src.report.stream_metrics import ExpertMetrics, Tier
from jax_residency._src.store.stored_stack import per_expert
from jax_residency._src.stream.ledger import ResidencyLedger
from jax_residency._src.stream.stack_units import StackUnits
from jax_residency._src.typing import ParamPath


@dataclasses.dataclass(frozen=True)
class StackExperts:
  """One stack's expert tensors.

  Attributes:
    leaves: their positions among the stack's leaves.
    rel_paths: their paths relative to the stack, in leaf order.
    count: experts per unit.
    shardings: where each whole tensor (``(experts, ...)`` per unit) goes.
    parts: where one expert's part of each goes (the expert axis dropped).
    expert_bytes: bytes of one expert (its part of every expert tensor).
  """

  leaves: tuple[int, ...]
  rel_paths: tuple[ParamPath, ...]
  count: int
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[np.dtype, ...]
  shardings: tuple[jax.sharding.Sharding, ...]
  parts: tuple[jax.sharding.Sharding, ...]
  expert_bytes: int

  @classmethod
  def of(cls, st: StackUnits, stored: Any) -> StackExperts | None:
    found = [
      (k, rel) for k, rel in enumerate(st.rel_paths) if per_expert(stored.arrays[tuple(rel)])
    ]
    if not found:
      return None
    leaves = tuple(k for k, _ in found)
    shapes = tuple(st.shapes[k] for k in leaves)
    dtypes = tuple(np.dtype(stored.arrays[tuple(rel)].dtype) for _, rel in found)
    return cls(
      leaves=leaves,
      rel_paths=tuple(tuple(rel) for _, rel in found),
      count=stored.experts,
      shapes=shapes,
      dtypes=dtypes,
      shardings=tuple(st.shardings[k] for k in leaves),
      parts=tuple(_part_sharding(st.shardings[k]) for k in leaves),
      expert_bytes=sum(math.prod(s[1:]) * d.itemsize for s, d in zip(shapes, dtypes, strict=True)),
    )


def _part_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
  """The sharding of one expert's part of a tensor sharded as ``s`` (its first axis gone)."""
  if isinstance(s, jax.sharding.NamedSharding):
    return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*s.spec[1:]))
  return s


def with_expert_caches(metadata: ModelMetadata, policy: ExpertResidency | None) -> ModelMetadata:
  """The plan with the expert caches in it, checked against the device budget: the
  device expert cache is paid from ``device_budget_bytes`` beside the static weights and
  the window (whose units are planned whole, so one unit's assembled experts fit)."""
  if policy is None:
    return metadata
  items = []
  if policy.device_budget_bytes is not None:
    items.append(
      MemoryItem(
        name="device expert cache",
        memory="device",
        nbytes=policy.device_budget_bytes,
        counted_in="device budget",
        note="ExpertResidency.device_budget_bytes",
      )
    )
  if policy.host_budget_bytes:
    items.append(
      MemoryItem(
        name="host expert cache",
        memory="host",
        nbytes=policy.host_budget_bytes,
        counted_in="host budget",
        note="ExpertResidency.host_budget_bytes",
      )
    )
  out = dataclasses.replace(metadata, memory=(*metadata.memory, *items))
  budget = metadata.policy.offload().device_budget_bytes
  cache = policy.device_budget_bytes
  if budget is not None and cache is None:
    raise DeviceBudgetTooSmallError(
      f"DenseDiskStream(device_budget_bytes={budget}) bounds the device, but "
      "ExpertResidency(device_budget_bytes=None) lets the expert cache grow without bound; "
      "give the expert cache a budget, or the policy device_budget_bytes=None.",
      budget=budget,
    )
  if budget is not None and out.planned_device_bytes > budget:
    before = metadata.planned_device_bytes
    raise DeviceBudgetTooSmallError(
      f"DenseDiskStream(device_budget_bytes={budget}) ({format_bytes(budget)}) cannot hold "
      f"the static weights and the unit window ({before} B) plus the device expert cache "
      f"({cache} B): {before} + {cache} = {out.planned_device_bytes} B "
      f"({format_bytes(out.planned_device_bytes)}). Raise device_budget_bytes to at least "
      f"that, or shrink ExpertResidency.device_budget_bytes to {max(0, budget - before)} B.",
      required=out.planned_device_bytes,
      budget=budget,
      window=metadata.device_window_bytes,
      static=metadata.static_device_bytes,
    )
  return out


def zeros(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
  """A zero array on pages of its own: untouched rows cost no memory, and its start is
  page-aligned (a CPU device array can then use it without a copy)."""
  nbytes = math.prod(shape) * dtype.itemsize
  if not nbytes:
    return np.zeros(shape, dtype)
  return np.frombuffer(mmap.mmap(-1, nbytes), dtype).reshape(shape)


class ExpertStream:
  """The expert caches of one dense stream, and the hooks its unit loop calls."""

  def __init__(
    self,
    *,
    policy: ExpertResidency,
    source: Any,
    stacks: Sequence[StackUnits],
    owner: Sequence[StackUnits],
    ordinary: Any,
    platform: str,
  ) -> None:
    stored = getattr(source, "stored_stacks", None)
    if stored is None:
      raise PlacementError(
        "expert residency needs a store (jax_residency.save) to read experts from"
      )
    self._stacks = {st.name: StackExperts.of(st, s) for st, s in zip(stacks, stored, strict=True)}
    if not any(self._stacks.values()):
      raise StoreLayoutError(
        f"{getattr(source, 'path', 'the store')}: no layer stack stores its experts a chunk "
        "per expert, so expert residency cannot read one expert without the others. Rewrite "
        "it with `jax-residency rechunk STORE NEW --experts mlp.experts` (the experts' path "
        "inside a layer), or place it without experts=."
      )
    self._policy = policy
    self._source = source
    self._owner = owner
    self._ordinary = ordinary  # unit -> its ordinary leaves on the device, or None
    self._on_cpu = platform == "cpu"
    self.ledger = ResidencyLedger(
      host_budget_bytes=policy.host_budget_bytes,
      device_budget_bytes=policy.device_budget_bytes,
      eviction_policy=policy.eviction_policy,
    )
    self._lock = threading.Lock()
    self._tally = Tally(ExpertMetrics)
    self._pending: dict[int, concurrent.futures.Future] = {}
    # Speculative reads the device cache had no room for (one layer's predictions).
    self._landed: dict[int, list[jax.Array]] = {}
    self._predicted: dict[int, frozenset[int]] = {}
    self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jr-experts")

  @classmethod
  def for_stacks(
    cls,
    policy: ExpertResidency,
    source: Any,
    stacks: Sequence[StackUnits],
    ordinary: Any,
    platform: str,
  ) -> tuple[ExpertStream, list[StackUnits]]:
    """The expert caches of a stream of ``stacks``, and the stacks as their units are
    then read and charged: without their experts."""
    if any(st.read_index is not None for st in stacks):
      raise PlacementError(
        "expert residency runs in one process (its devices may be many); on a "
        "multi-process mesh place the model without experts="
      )
    owner = [st for st in stacks for _ in range(st.count)]
    stream = cls(
      policy=policy,
      source=source,
      stacks=stacks,
      owner=owner,
      ordinary=ordinary,
      platform=platform,
    )
    out = []
    for st in stacks:
      ex = stream.stack(st.name)
      if ex is not None:
        left = st.host_bytes - ex.count * ex.expert_bytes
        device = st.device_bytes * left // max(1, st.host_bytes)
        st = dataclasses.replace(st, host_bytes=left, device_bytes=device)
      out.append(st)
    return stream, out

  # --- what the engine and the loop ask -----------------------------------------

  def of(self, unit: int) -> StackExperts | None:
    return self._stacks[self._owner[unit].name]

  def stack(self, name: str) -> StackExperts | None:
    return self._stacks[name]

  def skip(self, unit: int) -> tuple[ParamPath, ...]:
    """The tensors a read of ``unit`` leaves out (its experts)."""
    ex = self.of(unit)
    return () if ex is None else ex.rel_paths

  def expert_leaves(self, unit: int) -> frozenset[int]:
    ex = self.of(unit)
    return frozenset() if ex is None else frozenset(ex.leaves)

  def ordinary(self, unit: int) -> Sequence[jax.Array | None] | None:
    return self._ordinary(unit)

  def check_top_k(self, unit: int, top_k: int) -> None:
    """Raises if the device expert cache cannot hold one token's picks of a layer."""
    ex, budget = self.of(unit), self._policy.device_budget_bytes
    if ex is None or budget is None or budget >= top_k * ex.expert_bytes:
      return
    need = top_k * ex.expert_bytes
    raise PlacementError(
      f"ExpertResidency(device_budget_bytes={budget}) ({format_bytes(budget)}) is smaller than "
      f"the experts one token picks in a layer of {self._owner[unit].name!r}: top_k {top_k} x "
      f"{ex.expert_bytes} B an expert = {need} B ({format_bytes(need)}). Give the device "
      f"expert cache at least {format_bytes(need)}."
    )

  def experts(self, unit: int, ids: jax.Array) -> Mapping[int, jax.Array]:
    ex = self.of(unit)
    assert ex is not None
    picks = sorted({int(e) for e in np.asarray(ids).ravel()})
    keys = {e: unit * ex.count + e for e in picks}
    predicted = self._predicted.pop(unit, None)
    for e in picks:  # the speculative reads of this unit's picks land first
      future = self._pending.get(keys[e])
      if future is not None:
        future.result()
    self.ledger.protect(Tier.DEVICE, keys.values())
    parts: dict[int, list[jax.Array]] = {}
    missing = []
    for e in picks:
      found = self._landed.pop(keys[e], None)
      if found is None:
        found = self.ledger.get(Tier.DEVICE, keys[e])
      if found is None:
        missing.append(e)
      else:
        parts[e] = found
    hosted = self._from_host(unit, ex, missing)
    unread = [e for e in missing if e not in hosted]
    read = self._read(unit, ex, unread) if unread else {}
    for e in missing:
      parts[e] = self._to_device(keys[e], ex, hosted.get(e) or read[e], prefetched=False)
    with self._lock:
      self._tally.add(
        selected=len(picks),
        hits=len(picks) - len(missing),
        misses=len(missing),
        host_hits=len(hosted),
      )
      if predicted is not None:
        self._tally.add(predicted_used=len(predicted & set(picks)))
    whole = self._assemble(ex, parts)
    # The tensors hold their own copies now (or, on a device, are computed from them): a
    # later read may evict these experts.
    self.ledger.protect(Tier.DEVICE, ())
    self._landed.clear()  # predictions this step did not pick
    return dict(zip(ex.leaves, whole, strict=True))

  def predict(self, unit: int, ids: jax.Array) -> None:
    ex = self.of(unit)
    if ex is None or not self._policy.speculative_prefetch:
      return
    picks = frozenset(int(e) for e in np.asarray(ids).ravel())
    self._predicted[unit] = picks
    with self._lock:
      self._tally.add(predicted=len(picks))
    for e in sorted(picks):
      key = unit * ex.count + e
      if key in self._pending or self.ledger.contains(Tier.DEVICE, key):
        continue
      self._pending[key] = self._reader.submit(self._read_ahead, unit, ex, e, key)

  # --- moving experts -------------------------------------------------------------

  def _read_ahead(self, unit: int, ex: StackExperts, e: int, key: int) -> None:
    try:
      if self.ledger.contains(Tier.DEVICE, key):
        return
      host = self._from_host(unit, ex, [e], count=False).get(e)
      if host is None:
        host = self._read(unit, ex, [e])[e]
        with self._lock:
          self._tally.add(read_ahead=1)
      self._to_device(key, ex, host, prefetched=True)
    finally:
      self._pending.pop(key, None)

  def _from_host(
    self, unit: int, ex: StackExperts, experts: Sequence[int], *, count: bool = True
  ) -> dict[int, list[np.ndarray]]:
    if self._policy.host_budget_bytes == 0:
      return {}
    get = self.ledger.get if count else _peek(self.ledger)
    found = {e: get(Tier.HOST, unit * ex.count + e) for e in experts}
    return {e: v for e, v in found.items() if v is not None}

  def _read(
    self, unit: int, ex: StackExperts, experts: Sequence[int]
  ) -> dict[int, list[np.ndarray]]:
    """Reads experts ``experts`` of ``unit`` from the store (into the host cache too)."""
    data = self._source.read_experts_async(unit, experts, ex.rel_paths).result()
    out = {e: [data[(*rel, str(e))] for rel in ex.rel_paths] for e in experts}
    with self._lock:
      self._tally.add(bytes_read=len(experts) * ex.expert_bytes)
    if self._policy.host_budget_bytes != 0:
      for e, arrays in out.items():
        key = unit * ex.count + e
        try:
          with self.ledger.reserve(Tier.HOST, key, ex.expert_bytes) as r:
            r.commit([np.array(a) for a in arrays])  # its own copy: the read buffer is reused
        except AdmissionError:
          pass  # everything cached is pinned, or it is cached already
    return out

  def _to_device(
    self, key: int, ex: StackExperts, host: list[np.ndarray], *, prefetched: bool
  ) -> list[jax.Array]:
    arrays = [
      jax.device_put(np.array(a) if self._on_cpu else a, s)
      for a, s in zip(host, ex.parts, strict=True)
    ]
    with self._lock:
      self._tally.add(bytes_moved=ex.expert_bytes)
    try:
      with self.ledger.reserve(Tier.DEVICE, key, ex.expert_bytes) as r:
        r.commit(arrays, prefetched=prefetched)
    except AdmissionError:
      # More picks than the cache holds (a prefill): moved through, not kept. A
      # speculative read waits beside the cache for the next step.
      if prefetched:
        self._landed[key] = arrays
    return arrays

  def _assemble(self, ex: StackExperts, parts: Mapping[int, list[jax.Array]]) -> list[jax.Array]:
    """Each expert tensor of the unit: the picked experts' rows, the rest zero. On CPU the
    rows are copied into fresh zero pages (the unpicked rows are never touched); on an
    accelerator the tensor is built on the device, where the parts are."""
    if not self._on_cpu:
      ids = np.asarray(sorted(parts), np.int32)
      return [
        _put_rows(shape, dtype, s)(ids, [parts[e][k] for e in sorted(parts)])
        for k, (shape, dtype, s) in enumerate(zip(ex.shapes, ex.dtypes, ex.shardings, strict=True))
      ]
    out = []
    for k, (shape, dtype, sharding) in enumerate(
      zip(ex.shapes, ex.dtypes, ex.shardings, strict=True)
    ):
      whole = zeros(shape, dtype)
      for e, arrays in parts.items():
        whole[e] = np.asarray(arrays[k])
      out.append(jax.device_put(whole, sharding, may_alias=True))
    return out

  # --- passes -----------------------------------------------------------------------

  def begin_pass(self) -> None:
    self.ledger.begin_pass()
    with self._lock:
      self._tally = Tally(ExpertMetrics)

  def end_pass(self) -> ExpertMetrics:
    self.wait()
    self._predicted.clear()
    self._landed.clear()
    self.ledger.protect(Tier.DEVICE, ())
    tiers = self.ledger.end_pass()
    with self._lock:
      counted = self._tally.snapshot()
    host = tiers.host if self._policy.host_budget_bytes != 0 else None
    return dataclasses.replace(counted, device=tiers.device, host=host)

  def wait(self) -> None:
    """Waits out the speculative reads in flight (their errors are the next step's)."""
    for future in list(self._pending.values()):
      concurrent.futures.wait([future])

  def clear(self) -> None:
    self.wait()
    self.ledger.discard_all()

  def close(self) -> None:
    self.wait()
    self._reader.shutdown(wait=True)
    self.ledger.close()


@functools.lru_cache(maxsize=64)
def _put_rows(shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding) -> Any:
  """A program that writes rows (each an expert's part) at ids of a zero tensor."""

  def put(ids: jax.Array, rows: list[jax.Array]) -> jax.Array:
    return jnp.zeros(shape, dtype).at[ids].set(jnp.stack(rows))

  return jax.jit(put, out_shardings=sharding)


def _peek(ledger: ResidencyLedger) -> Any:
  def peek(tier: Tier, key: int) -> Any:
    return ledger.peek(tier, key)

  return peek
