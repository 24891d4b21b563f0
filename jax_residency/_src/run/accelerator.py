"""An accelerator's figures given as numbers, for planning on a machine this process is
not on (docs/design.md, 4.8).

`Accelerator(...)` holds a datasheet's (or another machine's measured) figures;
``accelerator.measurement(path, workload)`` turns them into a `Measurement` the planner
takes, with each unit step's time from a roofline: a step reads the unit's bytes from
device memory once and multiplies by each of its parameters once per token, so it takes
``max(unit bytes / memory bandwidth, 2 * parameters * tokens / matmul FLOP/s)``.
Attention over the sequence, the static layers and every kernel's launch are left out:
a datasheet's peaks are not reached, so what it predicts is a lower bound, and the
ranking, not the seconds, is what to take from it. A measurement made this way is
marked given (its backend reads ``"given: <name>"``) and applies to any store.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
from collections.abc import Mapping
from typing import Any

from jax_residency._src.errors import PlacementError
from jax_residency._src.run.measure import GIVEN, Measurement
from jax_residency._src.run.model_sizes import sizes_of


@dataclasses.dataclass(frozen=True, kw_only=True)
class Accelerator:
  """An accelerator and its host, as numbers (bytes and FLOPs per second).

  Attributes:
    name: what it is (e.g. ``"NVIDIA T4"``).
    memory_bytes_per_s: device memory bandwidth.
    matmul_flops_per_s: matrix multiply peak at the weights' dtype.
    host_to_device_bytes_per_s: host-to-device copies from pinned memory.
    disk_bytes_per_s: the host's disk, reading the store.
    page_cache_bytes_per_s: the host, reading the store from its page cache.
    source: where the numbers come from (shown with every plan made from them).

  Example:
    >>> import jax_residency as jr
    >>> t4 = jr.Accelerator(name="T4", memory_bytes_per_s=320e9, matmul_flops_per_s=65e12,
    ...   host_to_device_bytes_per_s=12e9, disk_bytes_per_s=2e9, page_cache_bytes_per_s=8e9,
    ...   source="datasheet")
    >>> jr.Accelerator.from_dict(t4.to_dict()) == t4
    True
    >>> try:
    ...   jr.Accelerator(**{**t4.to_dict(), "memory_bytes_per_s": 0})
    ... except jr.PlacementError as e:
    ...   print(e)
    Accelerator(memory_bytes_per_s=0): pass a positive number of bytes (or FLOPs) per second
  """

  name: str
  memory_bytes_per_s: float
  matmul_flops_per_s: float
  host_to_device_bytes_per_s: float
  disk_bytes_per_s: float
  page_cache_bytes_per_s: float
  source: str = ""

  def __post_init__(self) -> None:
    if not isinstance(self.name, str) or not self.name:
      raise PlacementError(f"Accelerator(name={self.name!r}): pass a non-empty string")
    if not isinstance(self.source, str):
      raise PlacementError(f"Accelerator(source={self.source!r}): pass a string (or leave it out)")
    for f in dataclasses.fields(self):
      value = getattr(self, f.name)
      if f.type == "float" and (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
      ):
        raise PlacementError(
          f"Accelerator({f.name}={value!r}): pass a positive number of bytes (or FLOPs) per second"
        )

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, data: Mapping[str, Any]) -> Accelerator:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - fields)
    missing = sorted(
      f.name for f in dataclasses.fields(cls) if f.name not in data and f.name != "source"
    )
    if unknown or missing:
      raise PlacementError(
        f"Accelerator: {'unknown fields ' + str(unknown) if unknown else ''}"
        f"{'; ' if unknown and missing else ''}"
        f"{'missing fields ' + str(missing) if missing else ''}; give each of "
        f"{sorted(fields - {'source'})} (and optionally 'source')"
      )
    return cls(**data)

  def step_seconds(self, unit_bytes: int, unit_params: int, tokens: int) -> float:
    """One unit step over ``tokens`` tokens (batch times sequence), by the roofline."""
    return max(
      unit_bytes / self.memory_bytes_per_s, 2 * unit_params * tokens / self.matmul_flops_per_s
    )

  def measurement(
    self,
    path: str | os.PathLike[str],
    workload: Any = None,
    *,
    dtype: Any = None,
    quantize: Any = None,
  ) -> Measurement:
    """These figures as a `Measurement` of the store or config.json at ``path`` (sized as
    `jax_residency.plan` sizes it, with ``dtype`` and ``quantize`` for a config.json),
    with unit step times for ``workload``'s decode and prefill inputs (default
    ``Workload()``)."""
    from jax_residency._src.run.planner import Workload  # noqa: PLC0415 - planner imports this

    work = Workload() if workload is None else workload
    sizes = sizes_of(path, dtype=dtype, quantize=quantize)
    steps: dict[str, dict[str, float]] = {}
    for sig, tokens in (
      (work.decode_signature, work.batch),
      (work.prefill_signature, work.batch * work.prompt_len),
    ):
      steps[sig] = {
        name: self.step_seconds(nbytes, params, tokens)
        for (name, _, nbytes), params in zip(sizes.stacks, sizes.unit_params, strict=True)
      }
    return Measurement(
      store=os.fspath(path),
      store_key=GIVEN,
      backend=f"{GIVEN}: {self.name}",
      unit_bytes=sizes.stacks[0][2],
      units_read=0,
      disk_bytes_per_s=self.disk_bytes_per_s,
      read_path_bytes_per_s=self.disk_bytes_per_s,
      page_cache_bytes_per_s=self.page_cache_bytes_per_s,
      host_to_device_bytes_per_s=self.host_to_device_bytes_per_s,
      pinned_host=True,
      step_seconds=steps,
      date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )
