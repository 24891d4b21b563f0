"""How reads from a store retry and time out (`ReadOptions`).

Pure Python, no JAX and no TensorStore: `store/handles.py` turns the retry
fields into TensorStore's ``http_request_retries`` / ``gcs_request_retries`` /
``s3_request_retries`` context resources, and the store applies ``timeout_s``
to every read it waits for (metadata, static tensors and units).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any

from jax_residency._src.errors import InvalidPolicyValueError

#: Default `ReadOptions.retries`: a request is tried once and retried this many times.
DEFAULT_READ_RETRIES = 4
#: Default `ReadOptions.timeout_s`: the longest one read (a unit, a tensor, a metadata
#: file, its retries included) may take.
DEFAULT_READ_TIMEOUT_S = 120.0


def _seconds(owner: str, field: str, value: object, *, none_ok: bool = False) -> float | None:
  if value is None and none_ok:
    return None
  ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
  if not ok or not math.isfinite(float(value)) or float(value) < 0:  # type: ignore[arg-type]
    allowed = "a number of seconds >= 0" + (", or None for no limit" if none_ok else "")
    raise InvalidPolicyValueError(f"{owner}: {field}={value!r} must be {allowed}.")
  return float(value)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReadOptions:
  """How a placement's reads from its store retry and time out.

  They matter most for remote stores (``http(s)://``, ``gs://``, ``s3://``),
  where a request can fail or stall; local reads rarely need them. Pass them as
  ``jr.place(..., read_options=jr.ReadOptions(...))``.

  Attributes:
    retries: how many times a failed HTTP / GCS / S3 request is tried again
      (TensorStore retries it, with exponential back-off), ``0`` for none.
      When every try fails, the read raises ``jr.errors.StoreUnavailableError``.
    retry_delay_s: the back-off before the first retry; it doubles per retry.
    max_retry_delay_s: the longest back-off between two tries.
    timeout_s: the longest one read may take, its retries included: a unit
      (all its tensors), a static tensor, or a metadata file. A read still
      running then is cancelled and raises ``jr.errors.StoreTimeoutError``.
      ``None``: no limit.

  Example:
    >>> import jax_residency as jr
    >>> jr.ReadOptions(retries=2, timeout_s=30).attempts
    3
  """

  retries: int = DEFAULT_READ_RETRIES
  retry_delay_s: float = 0.1
  max_retry_delay_s: float = 2.0
  timeout_s: float | None = DEFAULT_READ_TIMEOUT_S

  def __post_init__(self) -> None:
    owner = type(self).__name__
    r = self.retries
    if isinstance(r, bool) or not isinstance(r, numbers.Integral) or r < 0:
      raise InvalidPolicyValueError(
        f"{owner}: retries={r!r} must be an int >= 0 (tries after the first), e.g. retries=4."
      )
    object.__setattr__(self, "retries", int(r))
    for name in ("retry_delay_s", "max_retry_delay_s"):
      object.__setattr__(self, name, _seconds(owner, name, getattr(self, name)))
    timeout = _seconds(owner, "timeout_s", self.timeout_s, none_ok=True)
    if timeout == 0:
      raise InvalidPolicyValueError(
        f"{owner}: timeout_s=0 would fail every read; pass seconds > 0, or None for no limit."
      )
    object.__setattr__(self, "timeout_s", timeout)

  @property
  def attempts(self) -> int:
    """Tries of one request in all: the first and its retries."""
    return self.retries + 1

  def context_spec(self) -> dict[str, Any]:
    """The TensorStore context resources that make its remote drivers retry as asked."""
    retries = {  # TensorStore's max_retries counts the tries after the first
      "max_retries": self.retries,
      "initial_delay": f"{self.retry_delay_s * 1e3:.0f}ms",
      "max_delay": f"{self.max_retry_delay_s * 1e3:.0f}ms",
    }
    return {f"{kind}_request_retries": dict(retries) for kind in ("http", "gcs", "s3")}
