"""Reads that may fail or stall, and what a store fetched.

* `wait`: the result of one TensorStore future within the store's
  ``ReadOptions.timeout_s``; past it, the read is cancelled and raises
  `StoreTimeoutError`, and a request that failed on every try raises
  `StoreUnavailableError` (TensorStore retries HTTP / GCS / S3 requests itself,
  as the context from `handles.store_context` tells it).
* `FetchCounter`: bytes fetched from a store's storage, from TensorStore's
  per-driver ``/tensorstore/kvstore/<driver>/bytes_read`` counters, which
  count every byte a key-value read returned (chunks, index nodes, metadata).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store.read_options import ReadOptions

#: TensorStore's key-value driver (the name in its metrics) per URL scheme.
_DRIVERS = {"http": "http", "https": "http", "gs": "gcs", "s3": "s3", "file": "file"}
_ATTEMPTS = re.compile(r"All (\d+) retry attempts failed")
_UNAVAILABLE = ("retry attempts failed", "UNAVAILABLE", "CURL error", "Could not connect")


def driver_of(path: str, *, local: bool) -> str | None:
  """The TensorStore key-value driver whose byte counter counts a store's fetches
  (None: a local store, which counts its reads itself, or one with no counter,
  such as ``memory://``)."""
  if local:
    return None
  return _DRIVERS.get(path.split("://", 1)[0].lower()) if "://" in path else None


def unavailable(
  error: BaseException, where: str, what: str, attempts: int | None = None
) -> errors.StoreError | None:
  """`StoreUnavailableError` if TensorStore's ``error`` says the store's server could
  not be reached or kept failing, after ``attempts`` tries (None: some other failure)."""
  text = str(error)
  if not any(marker in text for marker in _UNAVAILABLE):
    return None
  if attempts is None:  # "All N retry attempts failed": N retries after the first try
    match = _ATTEMPTS.search(text)
    attempts = int(match.group(1)) + 1 if match else None
  tries = f" on all {attempts} tries" if attempts else ""
  return errors.StoreUnavailableError(
    f"Reading {what} from {where} failed{tries}: {text}. The server is down or keeps "
    "failing. Check the URL and the server; for a flaky link pass "
    "read_options=jr.ReadOptions(retries=...) with more retries.",
    store=where,
    attempts=attempts,
  )


def timed_out(where: str, what: str, timeout_s: float) -> errors.StoreTimeoutError:
  """The error for a read of ``what`` from ``where`` still running after ``timeout_s``."""
  return errors.StoreTimeoutError(
    f"Reading {what} from {where} took more than {timeout_s:g} s "
    "(ReadOptions.timeout_s) and was cancelled. For a slow link pass "
    "read_options=jr.ReadOptions(timeout_s=...) with more seconds, or check the server.",
    store=where,
    timeout_s=timeout_s,
    what=what,
  )


def wait(
  future: Any,
  reads: ReadOptions,
  where: str,
  what: str,
  *,
  other: Callable[[BaseException], BaseException] | None = None,
  on_timeout: Callable[[], None] | None = None,
) -> Any:
  """``future.result()`` within ``reads.timeout_s``.

  Raises:
    StoreTimeoutError: still running then (the future is cancelled, and
      ``on_timeout()`` called).
    StoreUnavailableError: the server could not be reached or kept failing.
    whatever ``other(error)`` returns for any other failure (default: the error).
  """
  try:
    return future.result(timeout=reads.timeout_s)
  except TimeoutError:
    future.cancel()
    if on_timeout is not None:
      on_timeout()
    raise timed_out(where, what, reads.timeout_s or 0.0) from None
  except errors.StoreError:
    raise
  except Exception as e:  # TensorStore reports failures as ValueError
    typed = unavailable(e, where, what, reads.attempts) or (other(e) if other else None)
    if typed is None:
      raise
    raise typed from e


def _kvstore_bytes_read(driver: str) -> int:
  metrics = ts.experimental_collect_matching_metrics(f"/tensorstore/kvstore/{driver}/bytes_read")
  return sum(int(v.get("value", 0)) for m in metrics for v in m.get("values", ()))


class FetchCounter:
  """Bytes TensorStore fetched from a store's storage since the counter was made.

  TensorStore's counters are per driver and process-wide: reads of other stores
  of the same kind in this process during the same time count too. A local
  store counts its own reads (`UnitStore.own_read_bytes`): TensorStore's file
  counter misses memory-mapped reads, and mapped and direct reads bypass it.
  """

  def __init__(self, path: str, *, local: bool):
    self._driver = driver_of(path, local=local)
    self._start = self._now()

  def _now(self) -> int:
    return _kvstore_bytes_read(self._driver) if self._driver else 0

  def total(self) -> int:
    return self._now() - self._start
