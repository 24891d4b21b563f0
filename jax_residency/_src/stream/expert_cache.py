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
* hands the step each expert tensor of the unit whole, the picked experts' rows filled
  (`expert_rows`): on CPU with one device the unit's tensors themselves, kept between
  passes, whose filled rows are the cached experts; else a tensor built for the step,
  the unpicked rows zero. The layer weighs an unpicked expert 0, and a step with few
  tokens reads only its picks' rows (`models.llama.Experts`).

Both caches are `ResidencyLedger` tiers keyed by ``unit * width + expert`` (``width``:
the most experts a unit of any stack holds); eviction is the policy's. `predict` reads
ahead what a speculative probe expects the next unit to pick, on one background
thread, into the device cache.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_residency._src.errors import AdmissionError, PlacementError, StoreLayoutError
from jax_residency._src.policy.experts import ExpertResidency
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.report.metrics import Tally
from jax_residency._src.report.stream_metrics import ExpertMetrics, Tier
from jax_residency._src.store.unit_reader import UnitReader
from jax_residency._src.stream.expert_plan import StackExperts
from jax_residency._src.stream.expert_rows import ExpertRows, RowBuffers, put_rows
from jax_residency._src.stream.ledger import Eviction, ResidencyLedger
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency._src.typing import ParamPath


class ExpertStream:
  """The expert caches of one dense stream, and the hooks its unit loop calls."""

  def __init__(
    self,
    *,
    policy: ExpertResidency,
    source: UnitReader,
    stacks: Sequence[StreamedStack],
    owner: Sequence[StreamedStack],
    ordinary: Any,
    platform: str,
  ) -> None:
    stored = source.stored_stacks
    self._stacks = {st.name: StackExperts.of(st, s) for st, s in zip(stacks, stored, strict=True)}
    if not any(self._stacks.values()):
      raise StoreLayoutError(
        f"{source.path}: no layer stack stores its experts a chunk "
        "per expert, so expert residency cannot read one expert without the others. Rewrite "
        "it with `jax-residency rechunk STORE NEW --experts mlp.experts` (the experts' path "
        "inside a layer), or place it without experts=."
      )
    self._policy = policy
    self._source = source
    self._owner = owner
    self._ordinary = ordinary  # unit -> its ordinary leaves on the device, or None
    self._on_cpu = platform == "cpu"
    # Cache keys: unit * width + expert, one key per expert of every stack.
    self._width = max(ex.count for ex in self._stacks.values() if ex is not None)
    self.ledger = ResidencyLedger(
      host_budget_bytes=policy.host_budget_bytes,
      device_budget_bytes=policy.device_budget_bytes,
      eviction_policy=policy.eviction_policy,
      on_evict=self._on_evict,
    )
    self._lock = threading.Lock()
    self._tally = Tally(ExpertMetrics)
    self._pending: dict[int, concurrent.futures.Future] = {}
    # Speculative reads the device cache had no room for (one layer's predictions).
    self._landed: dict[int, list[jax.Array]] = {}
    self._rings: dict[int, list[RowBuffers]] = {}  # per stack, CPU with several devices
    self._rows: dict[int, ExpertRows] = {}  # per unit, CPU with one device
    self._transient: set[tuple[int, int]] = set()  # rows filled but not cached
    self._predicted: dict[int, frozenset[int]] = {}
    self._reader = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="jr-experts")

  @classmethod
  def for_stacks(
    cls,
    policy: ExpertResidency,
    source: UnitReader,
    stacks: Sequence[StreamedStack],
    ordinary: Any,
    platform: str,
  ) -> tuple[ExpertStream, list[StreamedStack]]:
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
    # Waiting for the ids waits for the step before (the probe's input is its output):
    # what that step protected, or used without caching, is free now.
    picks = sorted({int(e) for e in np.asarray(ids).ravel()})
    keys = {e: self._key(unit, e) for e in picks}
    predicted = self._predicted.pop(unit, None)
    for key in [k for k in list(self._pending) if k // self._width == unit]:
      future = self._pending.get(key)  # this unit's speculative reads land first
      if future is not None:
        future.result()
    self._release(keep={(unit, e) for e in picks})
    self.ledger.protect(Tier.DEVICE, keys.values())
    parts: dict[int, list[Any]] = {}
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
      parts[e] = self._to_device(unit, ex, e, hosted.get(e) or read[e], prefetched=False)
    with self._lock:
      self._tally.add(
        selected=len(picks),
        hits=len(picks) - len(missing),
        misses=len(missing),
        host_hits=len(hosted),
      )
      if predicted is not None:
        self._tally.add(predicted_used=len(predicted & set(picks)))
    self._landed.clear()  # predictions this step did not pick
    return dict(zip(ex.leaves, self._assemble(unit, ex, parts), strict=True))

  def predict(self, unit: int, ids: jax.Array) -> None:
    ex = self.of(unit)
    if ex is None or not self._policy.speculative_prefetch:
      return
    picks = frozenset(int(e) for e in np.asarray(ids).ravel())
    self._predicted[unit] = picks
    with self._lock:
      self._tally.add(predicted=len(picks))
    for e in sorted(picks):
      key = self._key(unit, e)
      if key in self._pending or self.ledger.contains(Tier.DEVICE, key):
        continue
      self._pending[key] = self._reader.submit(self._read_ahead, unit, ex, e)

  # --- moving experts -------------------------------------------------------------

  def _key(self, unit: int, e: int) -> int:
    return unit * self._width + e

  def _in_rows(self, ex: StackExperts) -> bool:
    """Whether the unit's expert tensors are kept whole (`ExpertRows`): on CPU, where
    each goes to one device (a step then uses them without a copy)."""
    return self._on_cpu and all(len(s.device_set) == 1 for s in ex.shardings)

  def _rows_of(self, unit: int, ex: StackExperts) -> ExpertRows:
    rows = self._rows.get(unit)
    if rows is None:
      rows = self._rows[unit] = ExpertRows(ex.shapes, ex.dtypes)
    return rows

  def _read_ahead(self, unit: int, ex: StackExperts, e: int) -> None:
    key = self._key(unit, e)
    try:
      if self.ledger.contains(Tier.DEVICE, key):
        return
      host = self._from_host(unit, ex, [e], count=False).get(e)
      if host is None:
        host = self._read(unit, ex, [e])[e]
        with self._lock:
          self._tally.add(read_ahead=1)
      self._to_device(unit, ex, e, host, prefetched=True)
    finally:
      self._pending.pop(key, None)

  def _from_host(
    self, unit: int, ex: StackExperts, experts: Sequence[int], *, count: bool = True
  ) -> dict[int, list[np.ndarray]]:
    if self._policy.host_budget_bytes == 0:
      return {}
    get = self.ledger.get if count else self.ledger.peek
    found = {e: get(Tier.HOST, self._key(unit, e)) for e in experts}
    return {e: v for e, v in found.items() if v is not None}

  def _read(
    self, unit: int, ex: StackExperts, experts: Sequence[int]
  ) -> dict[int, list[np.ndarray]]:
    """Reads experts ``experts`` of ``unit`` from the store (into the host cache too):
    straight into their rows where the unit's tensors are kept whole."""
    into = None
    if self._in_rows(ex):
      rows = self._rows_of(unit, ex)
      into = {
        (*rel, str(e)): part
        for e in experts
        for rel, part in zip(ex.rel_paths, rows.row(e), strict=True)
      }
    data = self._source.read_experts_async(unit, experts, ex.rel_paths, into=into).result()
    out = {e: [data[(*rel, str(e))] for rel in ex.rel_paths] for e in experts}
    with self._lock:
      self._tally.add(bytes_read=len(experts) * ex.expert_bytes)
    if self._policy.host_budget_bytes != 0:
      for e, arrays in out.items():
        try:
          with self.ledger.reserve(Tier.HOST, self._key(unit, e), ex.expert_bytes) as r:
            r.commit([np.array(a) for a in arrays])  # its own copy: the read buffer is reused
        except AdmissionError:
          pass  # everything cached is pinned, or it is cached already
    return out

  def _to_device(
    self, unit: int, ex: StackExperts, e: int, host: list[np.ndarray], *, prefetched: bool
  ) -> list[Any]:
    """Puts expert ``e`` of ``unit`` on the device (its rows, where kept whole) and caches
    it there if it fits; else it serves this step only."""
    if self._in_rows(ex):
      arrays: list[Any] = self._rows_of(unit, ex).row(e)
      for dst, src in zip(arrays, host, strict=True):
        if not np.shares_memory(dst, src):
          dst[...] = src
    else:
      arrays = [
        jax.device_put(np.array(a) if self._on_cpu else a, s)
        for a, s in zip(host, ex.parts, strict=True)
      ]
    with self._lock:
      self._tally.add(bytes_moved=ex.expert_bytes)
    key = self._key(unit, e)
    try:
      with self.ledger.reserve(Tier.DEVICE, key, ex.expert_bytes) as r:
        r.commit(arrays, prefetched=prefetched)
    except AdmissionError:
      # More picks than the cache holds (a prefill): moved through, not kept. A
      # speculative read waits beside the cache for its step.
      with self._lock:
        self._transient.add((unit, e))
      if prefetched:
        self._landed[key] = arrays
    return arrays

  def _release(self, keep: set[tuple[int, int]]) -> None:
    """Gives back the rows filled for a step that did not cache them (not ``keep``)."""
    with self._lock:
      done, self._transient = self._transient - keep, self._transient & keep
    for unit, e in sorted(done):
      if not self.ledger.contains(Tier.DEVICE, self._key(unit, e)) and unit in self._rows:
        self._rows[unit].clear(e)

  def _on_evict(self, eviction: Eviction) -> None:
    if eviction.tier is Tier.DEVICE:
      unit, e = divmod(eviction.unit, self._width)
      rows = self._rows.get(unit)
      if rows is not None:
        rows.clear(e)

  def _assemble(
    self, unit: int, ex: StackExperts, parts: Mapping[int, list[Any]]
  ) -> list[jax.Array]:
    """Each expert tensor of the unit, the picked experts' rows filled and the others
    zero (or, where kept whole, holding experts cached earlier: weighed 0 all the same).
    On an accelerator the tensor is built on the device, where the parts are."""
    if self._in_rows(ex):
      rows = self._rows_of(unit, ex)
      return [
        jax.device_put(b, s, may_alias=True)
        for b, s in zip(rows.buffers, ex.shardings, strict=True)
      ]
    if not self._on_cpu:
      ids = np.asarray(sorted(parts), np.int32)
      return [
        put_rows(shape, dtype, s)(ids, [parts[e][k] for e in sorted(parts)])
        for k, (shape, dtype, s) in enumerate(zip(ex.shapes, ex.dtypes, ex.shardings, strict=True))
      ]
    rings = self._rings.get(id(ex))
    if rings is None:
      rings = [RowBuffers(s, d) for s, d in zip(ex.shapes, ex.dtypes, strict=True)]
      self._rings[id(ex)] = rings
    out = []
    for k, (ring, sharding) in enumerate(zip(rings, ex.shardings, strict=True)):
      whole = ring.take(parts)
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
    self._release(keep=set())  # the pass's outputs are ready: its steps are done
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
    self._rows.clear()  # the cached experts' rows go with them
    self._transient.clear()
    self._landed.clear()

  def close(self) -> None:
    self.wait()
    self._reader.shutdown(wait=True)
    self.ledger.close()
