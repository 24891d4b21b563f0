"""What a placement's speed depends on, measured on this process's backend (docs/design.md, 4.7).

`measure(store, model, inputs=...)` returns a `Measurement`:

* the store's disk bandwidth: its files read raw by one thread after their pages were
  dropped from the page cache, and its units read by the library's read path (its read
  threads) after the pages were dropped again;
* the same read path from the page cache (the units read a second time);
* host-to-device bandwidth: one unit's bytes moved from ``pinned_host`` memory (where
  the backend has it) to device memory;
* with a model and its inputs, one unit step's time for each input: a dense stream
  whose first units of each stack are kept on the device runs passes (after one that
  compiles and `WARM_PASSES` more), and the step time is the median time between the
  forward's asks for two kept units (the engine waits for each step before it asks for
  the one after next, so in steady state that is one step); the same passes time a
  streamed unit (the mean per unit over the streamed ones), the pass's time beyond its
  units, and its static layers', direct and through a two-unit host cache, from the
  page cache and with the pages dropped before each pass.

A measurement is cached next to the compilation cache, under the library's cache
directory, keyed by the store (its path and its newest version) and the backend;
``refresh=True`` measures again. `Measurement.check` refuses a measurement taken for
another store or backend.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jax_residency._src.cache_dir import library_cache_dir
from jax_residency._src.errors import MeasurementMismatchError
from jax_residency._src.plan import shardings as pl
from jax_residency._src.policy.sizes import format_bytes
from jax_residency._src.policy.types import DenseDiskStream
from jax_residency._src.store import files
from jax_residency._src.store.generation import fingerprint
from jax_residency._src.store.locations import locate
from jax_residency._src.store.unit_store import UnitStore

#: Subdirectory of the library cache directory that holds measurements.
SUBDIR = "measurements"
#: Bytes of units the bandwidth measurements read (at least two units, at most all).
READ_BYTES = 512 << 20
#: Units of each stack kept on the device to time a unit step (at most; three or more of
#: each stack stream, to time a streamed unit after the first).
STEP_UNITS = 5
#: Passes timed for each input and regime, after `WARM_PASSES` untimed ones (and one
#: that compiles): the first passes after compiling run slower (measured on the planner
#: benchmark's 192 MiB units: a kept unit's step 13.5 ms over two passes right after
#: compiling, 8.2 ms in steady state).
STEP_PASSES = 4
WARM_PASSES = 2
#: The store key of figures given as numbers (`Accelerator.measurement`), and the start
#: of their backend's name.
GIVEN = "given"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Measurement:
  """One store's and one backend's figures (see the module docstring).

  Attributes:
    store: the store's path, as given.
    store_key: the store's identity: its absolute path and its newest version's
      marker file (a store written again is another store), or its URL.
    backend: the backend: platform, device kind and device count.
    unit_bytes: bytes of one unit read (the first stack's).
    units_read: units each bandwidth measurement read.
    disk_bytes_per_s: the store's files read raw, one thread, pages dropped first;
      None for a store that is not local.
    read_path_bytes_per_s: units read by the library (its read threads), pages
      dropped first (for a remote store: fetched from its server).
    page_cache_bytes_per_s: the same units read again, from the page cache.
    host_to_device_bytes_per_s: one unit's bytes moved from host to device memory.
    pinned_host: whether the host side of that move was ``pinned_host`` memory.
    step_seconds: one unit step's time per input signature (``"int32[1,1]"``), per
      stack (``{signature: {stack: seconds}}``), for a unit on the device; empty
      without a model.
    streamed_seconds: one streamed unit's time, read ahead and moved as the engine
      does, by how it streamed (``"direct, page cache"``, ``"direct, disk"``: host budget
      0; ``"cached, page cache"``, ``"cached, disk"``: through a host cache of two
      units), then by signature and stack: the mean time per unit from the first
      streamed unit's ask to the stack's last; empty without a model.
    overhead_seconds: what such a pass took beyond its units' steps, by how it streamed
      and signature: the static layers, the first streamed unit's read (it waits
      while the kept units run) and the pass's own work.
    static_seconds: a pass's time outside its units, by signature (the direct page
      cache passes: before the first unit's ask, and after the last unit's step).
    date: when it was measured (UTC, ISO 8601).

  A measurement made from numbers (`Accelerator.measurement`) is not of this process:
  its store key is ``"given"``, its backend ``"given: <name>"``, and `check` takes it
  for any store and backend (`given`).

  Example:
    >>> m = Measurement(store="s", store_key="/s#1", backend="cpu:cpu x1", unit_bytes=1 << 20,
    ...   units_read=4, disk_bytes_per_s=2e9, read_path_bytes_per_s=1.5e9,
    ...   page_cache_bytes_per_s=8e9, host_to_device_bytes_per_s=1e10, pinned_host=True,
    ...   step_seconds={"int32[1,1]": {"layers": 0.002}}, date="2026-12-05T12:00:00+00:00")
    >>> m.key
    '/s#1 on cpu:cpu x1'
    >>> Measurement.from_dict(m.to_dict()) == m
    True
  """

  store: str
  store_key: str
  backend: str
  unit_bytes: int
  units_read: int
  disk_bytes_per_s: float | None
  read_path_bytes_per_s: float
  page_cache_bytes_per_s: float
  host_to_device_bytes_per_s: float
  pinned_host: bool
  step_seconds: Mapping[str, Mapping[str, float]]
  date: str
  streamed_seconds: Mapping[str, Mapping[str, Mapping[str, float]]] = dataclasses.field(
    default_factory=dict
  )
  overhead_seconds: Mapping[str, Mapping[str, float]] = dataclasses.field(default_factory=dict)
  static_seconds: Mapping[str, float] = dataclasses.field(default_factory=dict)

  @property
  def given(self) -> bool:
    """Whether the figures were given as numbers (`Accelerator`), not measured here."""
    return self.store_key == GIVEN

  @property
  def key(self) -> str:
    """What the figures hold for: ``"<store_key> on <backend>"``."""
    return f"{self.store_key} on {self.backend}"

  def check(self, store: str, devices: Sequence[jax.Device] | None = None) -> None:
    """Raises `MeasurementMismatchError` unless this measurement is of ``store`` (as it
    is now) on this process's backend (or ``devices``); figures `given` as numbers
    are taken for any."""
    if self.given:
      return
    want = f"{store_key(store)} on {backend_key(devices)}"
    if want != self.key:
      raise MeasurementMismatchError(
        f"this measurement is of {self.key!r}, not of {want!r}: its figures hold for "
        f"another store (or an older version of it) or another backend. Measure again: "
        f"jr.measure({store!r}, ...)."
      )

  def to_dict(self) -> dict[str, Any]:
    out = dataclasses.asdict(self)
    out["step_seconds"] = {k: dict(v) for k, v in self.step_seconds.items()}
    out["streamed_seconds"] = {
      how: {sig: dict(v) for sig, v in per.items()} for how, per in self.streamed_seconds.items()
    }
    out["overhead_seconds"] = {how: dict(v) for how, v in self.overhead_seconds.items()}
    out["static_seconds"] = dict(self.static_seconds)
    return out

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Measurement:
    return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls)})

  def __str__(self) -> str:
    def rate(v: float | None) -> str:
      return "n/a" if v is None else f"{format_bytes(int(v))}/s"

    rows = [
      ("store", self.store),
      ("backend", self.backend),
      ("unit", f"{format_bytes(self.unit_bytes)} ({self.units_read} read)"),
      ("disk, raw, 1 thread", rate(self.disk_bytes_per_s)),
      ("disk, read path", rate(self.read_path_bytes_per_s)),
      ("page cache, read path", rate(self.page_cache_bytes_per_s)),
      (
        "host to device" + (" (pinned)" if self.pinned_host else ""),
        rate(self.host_to_device_bytes_per_s),
      ),
      *(
        (f"unit step, {sig}, {stack}", f"{seconds * 1e3:.3f} ms")
        for sig, per_stack in self.step_seconds.items()
        for stack, seconds in per_stack.items()
      ),
      *(
        (f"streamed unit ({how}), {sig}, {stack}", f"{seconds * 1e3:.3f} ms")
        for how, per in self.streamed_seconds.items()
        for sig, per_stack in per.items()
        for stack, seconds in per_stack.items()
      ),
      *(
        (f"pass beyond its units ({how}), {sig}", f"{seconds * 1e3:.3f} ms")
        for how, per in self.overhead_seconds.items()
        for sig, seconds in per.items()
      ),
      *(
        (f"static layers, {sig}", f"{seconds * 1e3:.3f} ms")
        for sig, seconds in self.static_seconds.items()
      ),
      ("measured", self.date),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def backend_key(devices: Sequence[jax.Device] | None = None) -> str:
  """``"<platform>:<device kind> x<count>"`` of ``devices`` (default: every device)."""
  devices = list(jax.devices() if devices is None else devices)
  return f"{devices[0].platform}:{devices[0].device_kind} x{len(devices)}"


def store_key(store: str | os.PathLike[str]) -> str:
  """The identity of the store at ``store``: for a local store its absolute path and
  the identity of its newest version's marker file; otherwise its URL."""
  loc = locate(store)
  if loc.local is None:
    return loc.path
  found = fingerprint(loc.local)
  version = "-".join(map(str, found)) if found is not None else "absent"
  return f"{loc.local}#{hashlib.sha256(version.encode()).hexdigest()[:12]}"


def cache_path(key: str) -> str:
  """Where the measurement with ``key`` is kept."""
  name = hashlib.sha256(key.encode()).hexdigest()[:24] + ".json"
  return os.path.join(library_cache_dir(), SUBDIR, name)


def signature(args: Sequence[Any]) -> str:
  """``"int32[1,1]"``-style text of an input's arrays (how step times are keyed)."""
  leaves = jax.tree.leaves(args)
  return ", ".join(f"{np.dtype(a.dtype).name}[{','.join(map(str, a.shape))}]" for a in leaves)


def measure(
  store: str | os.PathLike[str],
  model: Any = None,
  *,
  inputs: Sequence[Sequence[Any]] = (),
  refresh: bool = False,
) -> Measurement:
  """Measures ``store`` and this process's backend (see the module docstring).

  Args:
    store: a store written by ``jr.save`` (local or remote).
    model: the model whose weights the store holds (abstract or not), to time a unit
      step; None leaves ``step_seconds`` empty.
    inputs: the call arguments to time a step with, each a tuple (e.g.
      ``[(decode_tokens,), (prompt_tokens,)]``).
    refresh: measure again even if a measurement of this store and backend is cached.

  Returns:
    The `Measurement`, also written to the cache (`cache_path`).

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> os.environ["JAX_RESIDENCY_CACHE_DIR"] = tempfile.mkdtemp()  # keep it out of yours
    >>> model = ToyTransformer(ToyConfig(n_layers=4), rngs=nnx.Rngs(0))
    >>> store = jr.save(model, os.path.join(tempfile.mkdtemp(), "toy"), progress=False).path
    >>> found = jr.measure(store, model, inputs=[(jnp.zeros((1, 1), jnp.int32),)])
    >>> found.read_path_bytes_per_s > 0, list(found.step_seconds["int32[1,1]"])
    (True, ['layers'])
    >>> jr.measure(store, model, inputs=[(jnp.zeros((1, 1), jnp.int32),)]) == found  # cached
    True
    >>> del os.environ["JAX_RESIDENCY_CACHE_DIR"]
  """
  path = os.fspath(store)
  identity, backend = store_key(path), backend_key()
  key = f"{identity} on {backend}"
  wanted = {signature(args) for args in inputs} if model is not None else set()
  cached = _load(key)
  if cached is not None and not refresh and wanted <= set(cached.step_seconds):
    return cached
  found = _bandwidths(path)
  engine: dict[str, Any] = {"step_seconds": {}}
  if model is not None and inputs:
    engine = _engine_seconds(path, model, inputs)
  result = Measurement(
    store=path,
    store_key=identity,
    backend=backend,
    date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    **engine,
    **found,
  )
  _save(key, result)
  return result


def _load(key: str) -> Measurement | None:
  try:
    with open(cache_path(key), encoding="utf-8") as f:
      data = json.load(f)
    found = Measurement.from_dict(data)
  except (OSError, ValueError, KeyError, TypeError):
    return None  # absent, or written by another version: measure again
  return found if found.key == key else None


def _save(key: str, result: Measurement) -> None:
  where = cache_path(key)
  try:
    os.makedirs(os.path.dirname(where), exist_ok=True)
    tmp = f"{where}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
      json.dump(result.to_dict(), f, indent=1)
    os.replace(tmp, where)
  except OSError:
    pass  # an unwritable cache directory costs a measurement next time, nothing else


def _timed(fn: Any) -> float:
  start = time.perf_counter()
  fn()
  return time.perf_counter() - start


def _bandwidths(path: str) -> dict[str, Any]:
  """The read and host-to-device figures of the store at ``path``."""
  with UnitStore.open(path, require_unit_chunks=False) as store:
    info = store.info
    unit = info.stacks[0].unit_nbytes
    n = max(1, min(info.unit_count, max(2, READ_BYTES // max(unit, 1))))
    nbytes = n * unit
    local = locate(path).local

    def read_units() -> None:
      # Two units in flight, as the prefetch worker reads (one read issued while the
      # one before it completes).
      pending: list[Any] = []
      for i in range(n):
        pending.append(store.read_unit_async(i))
        if len(pending) == 2:
          pending.pop(0).result()
      for read in pending:
        read.result()

    disk = None
    if local is not None and files.drop_cached(local):
      start = time.perf_counter()
      raw = files.read_raw(local, nbytes)
      disk = raw / (time.perf_counter() - start)
      files.drop_cached(local)
    read_path = nbytes / _timed(read_units)
    page_cache = nbytes / _timed(read_units)
  h2d, pinned = _host_to_device(unit)
  return {
    "unit_bytes": unit,
    "units_read": n,
    "disk_bytes_per_s": disk,
    "read_path_bytes_per_s": read_path,
    "page_cache_bytes_per_s": page_cache,
    "host_to_device_bytes_per_s": h2d,
    "pinned_host": pinned,
  }


def _host_to_device(nbytes: int) -> tuple[float, bool]:
  """Bytes per second of one ``nbytes`` move from host to device memory (the median of
  three), and whether the host side was ``pinned_host`` memory."""
  device = jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  pinned = pl.PINNED_HOST in kinds
  host = jax.sharding.SingleDeviceSharding(device, memory_kind=pl.PINNED_HOST if pinned else None)
  target = jax.sharding.SingleDeviceSharding(device, memory_kind=pl.DEVICE if pinned else None)
  source = jax.device_put(np.ones(max(1, nbytes // 4), np.float32), host)
  jax.block_until_ready(source)
  times = []
  for _ in range(3):
    times.append(_timed(lambda: jax.block_until_ready(jax.device_put(source, target))))
  return nbytes / statistics.median(times), pinned


def _engine_seconds(path: str, model: Any, inputs: Sequence[Sequence[Any]]) -> dict[str, Any]:
  """One kept unit's step, one streamed unit's, the pass's time beyond them and the
  static layers' time, per input (and stack), in the engine (see the module
  docstring): `Measurement`'s ``step_seconds``, ``streamed_seconds``,
  ``overhead_seconds`` and ``static_seconds``."""
  from jax_residency._src.run.place import place  # noqa: PLC0415 - place imports this package

  with UnitStore.open(path, require_unit_chunks=False) as store:
    counts = [s.count for s in store.info.stacks]
    largest = max(s.unit_nbytes for s in store.info.stacks)
  shortest = min(counts)
  # Three or more units of each stack stream where the stacks are long enough to time a
  # streamed unit too; else every unit is kept, to time a kept one.
  kept = min(STEP_UNITS, shortest - 3) if shortest >= 6 else min(STEP_UNITS, shortest)
  found: dict[str, Any] = {"step_seconds": {}, "streamed_seconds": {}, "overhead_seconds": {}}
  found["static_seconds"] = {}
  if kept < 3:  # the first step's time is not a steady one: two more are needed
    return found
  local = locate(path).local
  # Through a host cache of two units: fewer than a pass streams, so (least recently
  # used, read in order) it keeps none for the next pass, as in a cached placement
  # whose cache cannot hold every streamed unit.
  modes = {"direct": 0, "cached": 2 * largest}
  streams = kept < shortest
  if not streams:  # every unit kept: nothing is read, so one way and one regime tell all
    modes = {"direct": 0}
  for mode, host in modes.items():
    policy = DenseDiskStream(
      host_budget_bytes=host, device_budget_bytes=None, device_resident_units=kept
    )
    with place(model, policy, store=path) as placed:
      firsts = placed.metadata.resident.device[::kept]  # each stack's first unit
      stacks = list(zip(placed.stacks, firsts, counts, strict=True))
      for args in inputs:
        sig = signature(args)
        jax.block_until_ready(placed(*args))  # compiles
        for regime in ("page cache", "disk"):
          if regime == "disk" and (not streams or local is None or not files.drop_cached(local)):
            continue
          for _ in range(WARM_PASSES + STEP_PASSES):
            if regime == "disk" and local is not None:
              files.drop_cached(local)
            jax.block_until_ready(placed(*args))
          passes = placed.report().passes[-STEP_PASSES:]
          _timed_passes(found, passes, f"{mode}, {regime}", sig, stacks, kept)
  return found


def _timed_passes(
  found: dict[str, Any],
  passes: Sequence[Any],
  how: str,
  sig: str,
  stacks: Sequence[tuple[str, int, int]],
  kept: int,
) -> None:
  """Adds what ``passes`` (of the measuring placement: ``STEP_UNITS`` kept units at the
  start of each stack) show to ``found``: for ``how``'s streamed units the mean time
  per unit from the first streamed unit's ask to the stack's last (reads that land in
  pairs make single gaps bimodal), and what the pass took beyond its units. ``kept``
  units of each stack are kept on the device; with every unit kept, only their step
  and the static layers' time are timed."""
  steps = found["step_seconds"].setdefault(sig, {})
  units, c, timed = 0.0, None, True
  for name, first, count in stacks:
    c = steps.get(name) or _gaps(passes, range(first + 1, first + kept - 1))
    if c is None:
      return
    if how == "direct, page cache":
      steps[name] = c
    spans = [
      (at[first + count - 1] - at[first + kept]) / (count - kept - 1)
      for at in ({t.unit: t.seconds for t in p.timeline} for p in passes)
      if count - kept > 1 and first + kept in at and first + count - 1 in at
    ]
    timed = timed and bool(spans)
    if spans:
      streamed = statistics.median(spans)
      found["streamed_seconds"].setdefault(how, {}).setdefault(sig, {})[name] = streamed
      units += kept * c + (count - kept) * streamed
  if timed:
    overhead = statistics.median(p.seconds for p in passes) - units
    found["overhead_seconds"].setdefault(how, {})[sig] = max(0.0, overhead)
  if how == "direct, page cache" and c is not None:  # the last stack's last unit's step
    outside = statistics.median(_outside_units(p) for p in passes) - c
    found["static_seconds"][sig] = max(0.0, outside)


def _outside_units(p: Any) -> float:
  """A pass's time before its first unit's ask and after its last one's."""
  asks = [t.seconds for t in p.timeline]
  return min(asks) + p.seconds - max(asks)


def _gaps(passes: Sequence[Any], units: range) -> float | None:
  """The median time between the forward's asks for unit ``u`` and ``u + 1``, over
  ``units`` and ``passes`` (None: none to time)."""
  gaps = []
  for p in passes:
    at = {t.unit: t.seconds for t in p.timeline}
    gaps += [at[u + 1] - at[u] for u in units if u in at and u + 1 in at]
  return statistics.median(gaps) if gaps else None
