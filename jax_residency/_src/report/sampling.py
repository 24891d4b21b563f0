"""Memory sampling for telemetry: process RSS and page faults, backend memory.

:class:`ProcessMemorySampler` reads the resident set size and page-fault
counters from ``/proc/self`` (Linux only; elsewhere every sample is ``None``,
never zero) and keeps the peak RSS with a background thread that wakes at an
interval (an ``Event.wait``, never a busy loop). :func:`backend_memory` asks
the devices for ``memory_stats()`` and, where the backend has none (CPU), counts
the bytes of live JAX arrays per memory kind instead.

A placed model whose policy sets ``sample_process_memory`` /
``sample_backend_memory`` runs these as :class:`~.telemetry.Telemetry`
samplers; each pass report then carries their values.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterable
from typing import Any

import jax
import numpy as np

from jax_residency._src.typing import tensor_nbytes

#: How often the background thread samples RSS, in seconds.
DEFAULT_INTERVAL_SECONDS = 0.01

_STATM = "/proc/self/statm"
_STAT = "/proc/self/stat"


def process_memory_supported() -> bool:
  """Whether this platform exposes ``/proc/self`` memory counters (Linux)."""
  return sys.platform.startswith("linux") and os.path.exists(_STATM)


def read_rss_bytes() -> int:
  """The current resident set size, from ``/proc/self/statm`` (Linux only)."""
  with open(_STATM, "rb") as f:
    resident_pages = int(f.read().split()[1])
  return resident_pages * os.sysconf("SC_PAGE_SIZE")


def read_page_faults() -> tuple[int, int]:
  """``(minor, major)`` page faults of this process so far, from ``/proc/self/stat``."""
  with open(_STAT, "rb") as f:
    text = f.read()
  # Field 2 (the command) is in parentheses and may contain spaces; fields 10
  # (minflt) and 12 (majflt) are counted from field 3, the first after it.
  rest = text[text.rindex(b")") + 2 :].split()
  return int(rest[10 - 3]), int(rest[12 - 3])


class ProcessMemorySampler:
  """Samples this process's RSS and page faults; a thread tracks the peak RSS.

  Each :meth:`sample` describes the interval since the previous one (or since
  :meth:`start`): ``rss_bytes`` now, ``peak_rss_bytes`` the highest RSS seen in
  the interval, and the ``minor_faults`` / ``major_faults`` taken in it. Where
  ``/proc/self`` is unavailable (not Linux) nothing is started and every
  sample is ``None``.

  Calling the sampler is :meth:`sample`, so it can be passed as a
  :class:`~.telemetry.Telemetry` sampler. Use it as a context manager, or call
  :meth:`close`, to stop the thread.

  Args:
    interval: seconds between background RSS samples.

  Example:
    >>> with ProcessMemorySampler(interval=0.01) as sampler:
    ...   sample = sampler.sample()
    >>> sample is None or sample["peak_rss_bytes"] >= sample["rss_bytes"] > 0
    True
  """

  def __init__(self, *, interval: float = DEFAULT_INTERVAL_SECONDS) -> None:
    if not interval > 0:
      raise ValueError(f"interval={interval!r}: pass a positive number of seconds")
    self.interval = float(interval)
    self.supported = process_memory_supported()
    self._lock = threading.Lock()
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self._peak = 0
    self._faults = (0, 0)
    self._started = False

  @property
  def running(self) -> bool:
    """Whether the background thread is alive."""
    return self._thread is not None and self._thread.is_alive()

  def start(self) -> ProcessMemorySampler:
    """Starts the background thread (idempotent; a no-op where unsupported)."""
    with self._lock:
      if self._started or not self.supported:
        return self
      self._started = True
      self._peak = read_rss_bytes()
      self._faults = read_page_faults()
      self._stop.clear()
      self._thread = threading.Thread(
        target=self._loop, name="jax_residency-memory-sampler", daemon=True
      )
      self._thread.start()
    return self

  def _loop(self) -> None:
    while not self._stop.wait(self.interval):
      self._observe(read_rss_bytes())

  def _observe(self, rss: int) -> None:
    with self._lock:
      if rss > self._peak:
        self._peak = rss

  def sample(self) -> dict[str, int] | None:
    """RSS now, peak RSS and page faults since the previous sample; ``None`` if unsupported."""
    if not self.supported:
      return None
    rss = read_rss_bytes()
    minor, major = read_page_faults()
    with self._lock:
      if not self._started:
        # Sampled without a running thread: the interval is just this instant.
        self._peak, self._faults = rss, (minor, major)
      peak = max(self._peak, rss)
      last_minor, last_major = self._faults
      self._peak, self._faults = rss, (minor, major)
    return {
      "rss_bytes": rss,
      "peak_rss_bytes": peak,
      "minor_faults": minor - last_minor,
      "major_faults": major - last_major,
    }

  __call__ = sample

  def stop(self) -> None:
    """Stops and joins the background thread (idempotent)."""
    with self._lock:
      thread, self._thread = self._thread, None
      self._started = False
    self._stop.set()
    if thread is not None:
      thread.join()

  def close(self) -> None:
    """Same as :meth:`stop`."""
    self.stop()

  def __enter__(self) -> ProcessMemorySampler:
    return self.start()

  def __exit__(self, *exc: object) -> None:
    self.close()

  def __repr__(self) -> str:
    state = "running" if self.running else ("stopped" if self.supported else "unsupported")
    return f"ProcessMemorySampler(interval={self.interval}, {state})"


def backend_memory(devices: Iterable[jax.Device] | None = None) -> dict[str, Any]:
  """What the backend says about its memory, or live-array bytes per memory kind.

  Args:
    devices: the devices to ask; default all local devices.

  Returns:
    ``{"source": "memory_stats", "devices": {name: stats}}`` when every device
    reports ``memory_stats()``, else ``{"source": "live_arrays",
    "bytes_by_memory_kind": {kind: bytes}, "arrays": n}`` counted over
    ``jax.live_arrays()`` (bytes summed over the shards held by local devices).

  Example:
    >>> backend_memory()["source"] in ("memory_stats", "live_arrays")
    True
  """
  devices = list(jax.local_devices() if devices is None else devices)
  stats: dict[str, Any] = {}
  for d in devices:
    try:
      s = d.memory_stats()
    except Exception:  # noqa: BLE001 - backends without stats raise or return None
      s = None
    if not s:
      break
    stats[str(d)] = {k: int(v) if isinstance(v, int | np.integer) else v for k, v in s.items()}
  else:
    if stats:
      return {"source": "memory_stats", "devices": stats}
  return live_array_bytes()


def live_array_bytes() -> dict[str, Any]:
  """Bytes of live (not deleted) JAX arrays per memory kind, over local shards."""
  by_kind: dict[str, int] = {}
  count = 0
  for a in jax.live_arrays():
    try:
      if a.is_deleted():
        continue
      sharding = a.sharding
      kind = getattr(sharding, "memory_kind", None) or "device"
      shard_shape = sharding.shard_shape(a.shape)
      local = sum(1 for d in sharding.device_set if d.process_index == jax.process_index())
      nbytes = tensor_nbytes(shard_shape, a.dtype) * local
    except Exception:  # noqa: BLE001 - an array freed while we looked: skip it
      continue
    by_kind[kind] = by_kind.get(kind, 0) + nbytes
    count += 1
  return {
    "source": "live_arrays",
    "bytes_by_memory_kind": dict(sorted(by_kind.items())),
    "arrays": count,
  }
