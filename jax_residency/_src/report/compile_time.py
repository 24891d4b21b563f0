"""Time spent compiling, per thread, from JAX's monitoring events.

JAX reports how long it spent tracing a function to a jaxpr, lowering it to
MLIR and compiling it with XLA (or loading it from the persistent compilation
cache) through ``jax.monitoring``. :func:`install` registers one listener that
keeps, per thread, the time spans of those events; :func:`seconds_between`
answers how long the calling thread spent compiling within a window of
``time.perf_counter()`` times. Nested spans (a ``jit`` traced inside another)
count once.

A pass's telemetry reads the window the pass ran in, so compiles made before
the pass, or on other threads, are not charged to it. Beside it: what a compiled
program is specialised to (:func:`signature`, the key of the placed forwards'
program caches) and the temporaries it allocates (:func:`temp_bytes`).

The same listener returns the heap a compile leaves behind (:func:`release_heap`).
XLA's compiler allocates tens of MiB while it compiles and frees them at the end,
but glibc keeps freed memory in its arenas, where it counts as the process's
anonymous memory (docs/memory.md, "Process memory beside the plan", has the
memory sweep's figures before and after).
"""

from __future__ import annotations

import collections
import ctypes
import platform
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax import monitoring

#: The ``jax.monitoring`` duration events that count as compiling (jax 0.10).
EVENTS = frozenset(
  {
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
  }
)

#: The event after which a compile's heap is released (a real compile, not a cache load).
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"

#: Spans a thread keeps at most until :func:`forget_before` drops them.
MAX_SPANS = 4096

_local = threading.local()
_lock = threading.Lock()
_installed = False
_trim: Any = None  # glibc's malloc_trim, looked up once (False where there is none)


def install() -> None:
  """Registers the listener with ``jax.monitoring`` (once per process; idempotent)."""
  global _installed
  with _lock:
    if not _installed:
      monitoring.register_event_duration_secs_listener(_on_duration)
      _installed = True


def _spans() -> collections.deque[tuple[float, float]]:
  spans = getattr(_local, "spans", None)
  if spans is None:
    spans = _local.spans = collections.deque(maxlen=MAX_SPANS)
  return spans


def _on_duration(event: str, duration_secs: float, **_: str | int) -> None:
  # JAX calls listeners on the compiling thread right after the event ends.
  if event in EVENTS:
    end = time.perf_counter()
    _spans().append((end - duration_secs, end))
  if event == BACKEND_COMPILE_EVENT:
    release_heap()


def release_heap() -> bool:
  """Returns the free memory of the C heap to the system (glibc's ``malloc_trim``), as
  after each compile; False where the C library has no such call (macOS, musl).

  Example:
    >>> isinstance(release_heap(), bool)
    True
  """
  global _trim
  if _trim is None:
    _trim = False
    if sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc":
      try:
        _trim = ctypes.CDLL(None).malloc_trim
        _trim.argtypes, _trim.restype = [ctypes.c_size_t], ctypes.c_int
      except (OSError, AttributeError):
        _trim = False
  if _trim is False:
    return False
  _trim(0)
  return True


def seconds_between(start: float, end: float) -> float:
  """Seconds this thread spent compiling between ``perf_counter`` times ``start`` and ``end``.

  Only compiles since :func:`install` are seen.

  Example:
    >>> import time
    >>> import jax, jax.numpy as jnp
    >>> from jax_residency._src.report import compile_time
    >>> compile_time.install()
    >>> f = jax.jit(lambda x: jnp.sin(x) * 3)
    >>> start = time.perf_counter()
    >>> _ = f(jnp.ones(5)).block_until_ready()  # traced, lowered, compiled
    >>> middle = time.perf_counter()
    >>> _ = f(jnp.ones(5)).block_until_ready()  # already compiled
    >>> compile_time.seconds_between(start, middle) > 0
    True
    >>> compile_time.seconds_between(middle, time.perf_counter())
    0.0
  """
  total, reach = 0.0, start
  for s, e in sorted(_spans()):
    s, e = max(s, reach), min(e, end)
    if e > s:
      total += e - s
      reach = e
  return total


def forget_before(t: float) -> None:
  """Drops this thread's spans that ended before ``t`` (no later window can need them)."""
  spans = _spans()
  while spans and spans[0][1] < t:
    spans.popleft()


def temp_bytes(compiled: Any) -> int | None:
  """Bytes of temporaries a compiled XLA program allocates while it runs (its
  ``memory_analysis``); ``None`` where the backend does not say."""
  try:
    analysis = compiled.memory_analysis()
  except Exception:  # noqa: BLE001 - backends without a memory analysis
    return None
  temp = getattr(analysis, "temp_size_in_bytes", None)
  return int(temp) if temp is not None else None


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
  """What a compiled program is specialised to: the call's pytree structure and, per
  leaf, its shape, dtype, weak type and (for arrays) sharding."""
  leaves, tree = jax.tree.flatten((args, kwargs))

  def aval(x: Any) -> Any:
    weak = bool(getattr(x, "weak_type", isinstance(x, bool | int | float | complex)))
    return (np.shape(x), jax.dtypes.result_type(x), weak, _sharding_key(x))

  return tree, tuple(aval(x) for x in leaves)


def _sharding_key(x: Any) -> Any:
  """An array's sharding, with a `NamedSharding`'s spec written one way: ``P()`` and
  ``P(None, None)`` place an array alike, and a program's outputs may carry either (a
  prefill's cache one, a decode step's the other), which must not compile it twice."""
  sharding = x.sharding if isinstance(x, jax.Array) else None
  if isinstance(sharding, jax.sharding.NamedSharding):
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
      spec.pop()
    return ("named", sharding.mesh, tuple(spec), sharding.memory_kind)
  return sharding
