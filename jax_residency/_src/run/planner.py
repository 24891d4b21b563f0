"""Choosing a placement: every one the budgets admit, ranked by predicted time
(docs/design.md, 4.8).

`plan(store, measurement, device_budget_bytes=..., host_budget_bytes=...)` enumerates
the placements that fit (the same `check_budgets` arithmetic `place` applies):
`FullyResident`; `LayerwiseHost` with a prefetch depth of 1 or 2 and 0 to all units of
each stack kept on the device; `DenseDiskStream` direct (host budget 0) and with the
host budget, with 0 to all units kept on the device and, with a host budget, 0 to the
rest kept in host memory. For each it predicts a prefill pass and a decode step from a
`Measurement` (`measure.py`) with a cost model (`predict`):

* a unit's compute ``c`` is the measured unit step of its stack, for the workload's
  decode and prompt inputs;
* a unit's transfer ``t`` is what it moves each pass: nothing if kept on the device
  (or under `FullyResident`); its bytes at the host-to-device bandwidth if it is in host
  memory (`LayerwiseHost`, a dense stream's host-resident units), which is 0 where device
  memory is host memory (CPU: XLA drops the copy, the dense stream aliases); its bytes at
  the store's read bandwidth (disk: the read path with the pages dropped; page cache:
  the read path from the page cache) if it streams from the store and the host cache
  cannot keep every streamed unit (the cache is least recently used, and a pass reads
  the units in order: a cache smaller than them all keeps none for the next pass; the
  prompt's pass, the placement's first, finds the cache empty);
* the engine overlaps a unit's move with the step before it, so a unit costs
  ``max(c, t)``; `LayerwiseHost` with a prefetch depth of 1 moves a unit and then runs
  it: ``c + t``. Where the measurement timed streamed units in the engine (direct or
  through a host cache, in the regime), a streamed unit costs that instead;
* a pass is the sum over its units, plus what the measured passes took beyond their
  units: for a placement that reads units from the store, the measured pass's time
  beyond them (static layers, the first streamed unit's read); else the static
  layers' time.

Ranked by the workload's time: one prefill pass and ``decode_steps`` decode steps.

`default_placement` chooses without a measurement, by the budgets alone: what
``jax-residency generate`` and ``chat`` place when no policy is named.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

from jax_residency._src.errors import BudgetTooSmallError, PlacementError
from jax_residency._src.plan.budget import ModelMetadata, check_budgets
from jax_residency._src.policy.options import format_budget
from jax_residency._src.policy.sizes import format_bytes, parse_bytes
from jax_residency._src.policy.types import (
  DenseDiskStream,
  FullyResident,
  LayerWeightResidency,
  LayerwiseHost,
)
from jax_residency._src.run.measure import Measurement
from jax_residency._src.run.model_sizes import ModelSizes, config_path, sizes_of

#: Where a dense stream's streamed units come from, each pass.
REGIMES = ("disk", "page cache")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """What the placement runs: a prompt of ``prompt_len`` tokens, then ``decode_steps``
  one-token steps, for ``batch`` sequences. ``decode_input`` and ``prefill_input`` name
  the two calls' inputs as `jax_residency.measure` keys its step times (`signature`);
  left out, they are token ids alone: ``int32[batch,1]`` and ``int32[batch,prompt_len]``
  (a model that also takes a cache, as a decoder's steps do, names its own).

  Example:
    >>> Workload(prompt_len=64).prefill_signature, Workload().decode_signature
    ('int32[1,64]', 'int32[1,1]')
  """

  prompt_len: int = 128
  decode_steps: int = 32
  batch: int = 1
  decode_input: str | None = None
  prefill_input: str | None = None

  @property
  def decode_signature(self) -> str:
    return self.decode_input or f"int32[{self.batch},1]"

  @property
  def prefill_signature(self) -> str:
    return self.prefill_input or f"int32[{self.batch},{self.prompt_len}]"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One feasible placement and its prediction.

  Attributes:
    policy: the policy to place with.
    prefill_seconds: a prompt's pass, predicted.
    decode_seconds: one decode step, predicted.
    total_seconds: the workload: ``prefill_seconds + decode_steps * decode_seconds``.
    bytes_per_token: bytes a decode step moves (store reads and host-to-device
      moves), per sequence of the batch.
    metadata: the plan `place` would make (`ModelMetadata`, its memory items).
    regime: where the prediction took streamed units from (``"disk"`` or
      ``"page cache"``).
    workload: the `Workload` predicted for.
    measured: the date of the measurement the prediction comes from.

  ``candidate.place(model, store=...)`` places the model with this policy and records
  the prediction in ``placed.metadata.prediction``.

  Example:
    >>> import jax_residency as jr
    >>> jr.Candidate.__dataclass_fields__.keys() >= {"policy", "decode_seconds"}
    True
  """

  policy: LayerWeightResidency
  prefill_seconds: float
  decode_seconds: float
  total_seconds: float
  bytes_per_token: float
  metadata: ModelMetadata
  regime: str = "disk"
  workload: Workload = Workload()  # noqa: RUF009 - frozen
  measured: str = ""

  @property
  def placement(self) -> str:
    """The policy in short: its type and the fields the planner chose."""
    return describe(self.policy)

  def place(self, model: Any, *, store: str, **kwargs: Any) -> Any:
    """``jax_residency.place(model, self.policy, store=store, **kwargs)``, with this
    candidate's prediction in ``placed.metadata.prediction``."""
    from jax_residency._src.run.place import place  # noqa: PLC0415 - place imports run

    placed = place(model, self.policy, store=store, **kwargs)
    executor = placed._placed()  # noqa: SLF001 - the executor owns the metadata
    executor.metadata = dataclasses.replace(
      executor.metadata,
      prediction={
        "prefill_seconds": self.prefill_seconds,
        "decode_seconds": self.decode_seconds,
        "bytes_per_token": self.bytes_per_token,
        "regime": self.regime,
        "workload": dataclasses.asdict(self.workload),
        "measured": self.measured,
      },
    )
    return placed


def plan(
  store: str,
  measurement: Measurement,
  *,
  device_budget_bytes: int | None,
  host_budget_bytes: int | None,
  workload: Workload = Workload(),  # noqa: B008 - frozen
  regime: str = "disk",
  dtype: Any = None,
  quantize: Any = None,
  draft_device_bytes: int = 0,
) -> list[Candidate]:
  """Every placement of ``store`` the budgets admit, fastest first (module docstring).

  ``draft_device_bytes``: device memory held beside the target, such as a speculative
  draft's weights and KV cache (``models.draft_from(...).metadata.planned_device_bytes``):
  the candidates fit ``device_budget_bytes`` less it, and carry that as their device
  budget (place the draft with ``models.draft_from(..., device_budget_bytes=...)``).

  ``store`` is a store, or a Hugging Face ``config.json`` (or a directory with one)
  planned as ``convert hf`` would store it, in ``dtype`` (default: its ``torch_dtype``)
  and quantized as ``quantize`` asks; a config.json is planned with figures given as
  numbers (``jr.Accelerator(...).measurement(config, workload)``), not measured ones.

  Raises:
    MeasurementMismatchError: ``measurement`` is of another store or backend.
    PlacementError: the measurement has no step time for the workload's inputs (the
      message says how to measure them), no placement fits (the message gives the
      smallest budgets one fits), a draft that leaves the target no device memory, or
      ``store`` is a config.json and ``measurement`` was measured, not given.

  Example:
    >>> import os, tempfile, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> os.environ["JAX_RESIDENCY_CACHE_DIR"] = tempfile.mkdtemp()
    >>> model = ToyTransformer(ToyConfig(n_layers=4), rngs=nnx.Rngs(0))
    >>> store = jr.save(model, os.path.join(tempfile.mkdtemp(), "toy"), progress=False).path
    >>> work = jr.Workload(prompt_len=8, decode_steps=4)
    >>> tokens = [(jnp.zeros((1, 1), jnp.int32),), (jnp.zeros((1, 8), jnp.int32),)]
    >>> found = jr.measure(store, model, inputs=tokens)
    >>> ranked = jr.plan(store, found, device_budget_bytes=None, host_budget_bytes=0,
    ...                  workload=work)
    >>> sorted({type(c.policy).__name__ for c in ranked})
    ['DenseDiskStream', 'FullyResident', 'LayerwiseHost']
    >>> times = [c.total_seconds for c in ranked]  # fastest first (on a toy, close together)
    >>> times == sorted(times) and ranked[0].decode_seconds > 0
    True
    >>> del os.environ["JAX_RESIDENCY_CACHE_DIR"]
  """
  if regime not in REGIMES:
    raise PlacementError(f"regime={regime!r}: pass one of {', '.join(map(repr, REGIMES))}")
  if config_path(store) is not None and not measurement.given:
    raise PlacementError(
      f"{store} is a config.json: its model has no store to measure, so plan it with an "
      "accelerator's figures given as numbers: jr.plan(config, jr.Accelerator(...)"
      ".measurement(config, workload), ...)"
    )
  device_budget_bytes = _beside_draft(device_budget_bytes, draft_device_bytes)
  measurement.check(store)
  steps = [
    _steps(measurement, sig) for sig in (workload.prefill_signature, workload.decode_signature)
  ]
  sizes = sizes_of(store, dtype=dtype, quantize=quantize)
  on_cpu = measurement.backend.startswith("cpu:")
  found = []
  for policy in _policies(sizes, device_budget_bytes, host_budget_bytes):
    try:
      meta = _check(policy, sizes, device_is_host=on_cpu)
    except (BudgetTooSmallError, PlacementError):
      continue
    # The prompt's pass is the first: a host cache holds nothing yet.
    prefill, _ = predict(
      policy,
      meta,
      sizes,
      measurement,
      steps[0],
      regime=regime,
      on_cpu=on_cpu,
      first=True,
      signature=workload.prefill_signature,
    )
    decode, moved = predict(
      policy,
      meta,
      sizes,
      measurement,
      steps[1],
      regime=regime,
      on_cpu=on_cpu,
      signature=workload.decode_signature,
    )
    found.append(
      Candidate(
        policy=policy,
        prefill_seconds=prefill,
        decode_seconds=decode,
        total_seconds=prefill + workload.decode_steps * decode,
        bytes_per_token=moved / workload.batch,
        metadata=meta,
        regime=regime,
        workload=workload,
        measured=measurement.date,
      )
    )
  if not found:
    why = _nothing_fits(sizes, device_budget_bytes, host_budget_bytes)
    if draft_device_bytes:
      why += (
        f" The device budget is what a draft of {draft_device_bytes} "
        f"({format_bytes(draft_device_bytes)}) leaves: a smaller draft leaves more."
      )
    raise PlacementError(why)
  return sorted(found, key=lambda c: (c.total_seconds, c.decode_seconds))


def default_placement(
  store: str,
  *,
  device_budget_bytes: int | None,
  host_budget_bytes: int | None,
  device_is_host: bool,
) -> LayerWeightResidency:
  """The placement of ``store`` chosen by the budgets alone, without a measurement to rank
  by (measuring reads the store with its pages dropped and times each stack's step):

  1. `FullyResident`, where the device budget holds the whole model;
  2. else `DenseDiskStream` through the host budget, keeping on the device the most units
     of each stack the device budget has room for, then in host memory the most the host
     budget has room for;
  3. else `DenseDiskStream` straight from disk (``host_budget_bytes=0``), keeping on the
     device the most units the device budget has room for.

  Units kept on the device or in host memory are never slower than units read each pass,
  so among the placements that fit, these move the fewest bytes a pass. `plan` ranks
  every placement with a measurement instead.

  Raises:
    PlacementError: no placement fits (the message gives the smallest device budget one
      fits).

  Example:
    >>> import os, tempfile
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=4), rngs=nnx.Rngs(0))
    >>> store = jr.save(model, os.path.join(tempfile.mkdtemp(), "toy"), progress=False).path
    >>> for device in (None, 600_000):  # the whole model is 668 KB
    ...   policy = default_placement(store, device_budget_bytes=device, host_budget_bytes=0,
    ...                              device_is_host=True)
    ...   print(describe(policy))
    FullyResident()
    DenseDiskStream(host_budget_bytes=0 B, device_resident_units=1, host_resident_units=0)
  """
  sizes = sizes_of(store)
  device, host = device_budget_bytes, host_budget_bytes
  shortest = min(n for _, n, _ in sizes.stacks)

  def fits(policy: LayerWeightResidency) -> bool:
    try:
      _check(policy, sizes, device_is_host=device_is_host)
    except (BudgetTooSmallError, PlacementError):
      return False
    return True

  if fits(whole := FullyResident(device_budget_bytes=device)):
    return whole
  for cache in dict.fromkeys((host, 0)):
    for kept in range(shortest, -1, -1):
      for held in range(0 if cache == 0 else shortest - kept, -1, -1):
        chosen = DenseDiskStream(
          host_budget_bytes=cache,
          device_budget_bytes=device,
          device_resident_units=kept,
          host_resident_units=held,
        )
        if fits(chosen):
          return chosen
  raise PlacementError(_nothing_fits(sizes, device, host))


def _beside_draft(budget: int | str | None, draft: int) -> int | None:
  """The target's device budget (given as an int or a size such as ``"8GiB"``) beside
  ``draft`` bytes of a draft, in bytes.

  Raises:
    PlacementError: ``draft`` is not a non-negative int, or leaves no device memory.
  """
  if isinstance(draft, bool) or not isinstance(draft, int) or draft < 0:
    raise PlacementError(
      f"draft_device_bytes={draft!r}: pass the draft's device bytes as an int >= 0 "
      "(models.draft_from(...).metadata.planned_device_bytes)"
    )
  device = parse_bytes(budget, name="device_budget_bytes")
  if device is None or not draft:
    return device
  if draft >= device:
    raise PlacementError(
      f"a draft of {draft} ({format_bytes(draft)}) on the device leaves nothing of "
      f"device_budget_bytes={device} ({format_bytes(device)}) for the target: use a smaller "
      "draft (quantize='int4', a shorter max_len) or a larger device budget"
    )
  return device - draft


def _steps(measurement: Measurement, signature: str) -> dict[str, float]:
  found = measurement.step_seconds.get(signature)
  if not found:
    raise PlacementError(
      f"the measurement of {measurement.store} has no unit step time for the input "
      f"{signature} (it has {sorted(measurement.step_seconds) or 'none'}); measure with "
      "the model and that input: jr.measure(store, model, inputs=[...]), or "
      "`jax-residency measure STORE --prompt-len N` for a stored toy model."
    )
  return dict(found)


def _check(
  policy: LayerWeightResidency, sizes: ModelSizes, *, device_is_host: bool
) -> ModelMetadata:
  units = sizes.unit_bytes()
  return check_budgets(
    policy,
    static_device_bytes=sizes.static,
    unit_bytes=units,
    device_unit_bytes=units,
    host_unit_bytes=units if not isinstance(policy, FullyResident) else [0] * len(units),
    device_is_host=device_is_host,
    stacks=[(path, n) for path, n, _ in sizes.stacks],
    decoded_bytes=sizes.decoded,
  )


def _policies(
  sizes: ModelSizes, device: int | None, host: int | None
) -> Iterator[LayerWeightResidency]:
  """Every candidate policy with these budgets (the budgets check each one)."""
  shortest = min(n for _, n, _ in sizes.stacks)
  yield FullyResident(device_budget_bytes=device)
  for depth, kept in itertools.product((1, 2), range(shortest + 1)):
    yield LayerwiseHost(
      prefetch_depth=depth,
      device_resident_units=kept,
      device_budget_bytes=device,
      host_budget_bytes=host,
    )
  for kept in range(shortest + 1):
    yield DenseDiskStream(
      host_budget_bytes=0, device_budget_bytes=device, device_resident_units=kept
    )
  if host != 0:
    for kept in range(shortest + 1):
      for held in range(shortest - kept + 1):
        yield DenseDiskStream(
          host_budget_bytes=host,
          device_budget_bytes=device,
          device_resident_units=kept,
          host_resident_units=held,
        )


def predict(
  policy: LayerWeightResidency,
  meta: ModelMetadata,
  sizes: ModelSizes,
  measurement: Measurement,
  step_seconds: dict[str, float],
  *,
  regime: str,
  on_cpu: bool,
  first: bool = False,
  signature: str = "",
) -> tuple[float, int]:
  """A pass's predicted seconds and the bytes it moves (module docstring); ``first``: the
  placement's first pass, before a host cache holds anything."""
  kept_device, kept_host = set(meta.resident.device), set(meta.resident.host)
  h2d = 0.0 if on_cpu else 1.0 / measurement.host_to_device_bytes_per_s
  read_rate = (
    measurement.read_path_bytes_per_s if regime == "disk" else measurement.page_cache_bytes_per_s
  )
  dense = policy.dense
  cached_all = False
  if dense is not None and dense.host_budget_bytes != 0 and not first:
    streamed = sum(b for i, b in enumerate(sizes.unit_bytes()) if i not in kept_device | kept_host)
    cached_all = meta.item_bytes("host cache") >= streamed
  how = f"{'cached' if dense is not None and dense.host_budget_bytes else 'direct'}, {regime}"
  engine = measurement.streamed_seconds.get(how, {}).get(signature, {})
  serial = isinstance(policy, LayerwiseHost) and policy.options.offload.prefetch_depth == 1
  seconds, moved, unit, streams = 0.0, 0, 0, False
  for path, count, nbytes in sizes.stacks:
    c = step_seconds.get(path, max(step_seconds.values()))
    for _ in range(count):
      if isinstance(policy, FullyResident) or unit in kept_device:
        cost, m = c, 0
      elif isinstance(policy, LayerwiseHost) or unit in kept_host or cached_all:
        cost, m = (c + nbytes * h2d) if serial else max(c, nbytes * h2d), nbytes
      elif path in engine:  # a streamed unit as the engine streamed it when measured
        cost, m, streams = engine[path], nbytes, True
      else:
        extra = nbytes * h2d if dense is not None and dense.host_budget_bytes else 0.0
        cost, m, streams = max(c, nbytes / read_rate + extra), nbytes, True
      seconds += cost
      moved += m
      unit += 1
  # The pass beyond its units: with units read from the store, what the measured pass
  # took beyond them (the static layers, the first streamed unit's read); else the
  # static layers' time.
  if streams:
    seconds += measurement.overhead_seconds.get(how, {}).get(signature, 0.0)
  else:
    seconds += measurement.static_seconds.get(signature, 0.0)
  return seconds, moved


def _nothing_fits(sizes: ModelSizes, device: int | None, host: int | None) -> str:
  largest = max(b for _, _, b in sizes.stacks)
  decoded = sum(sizes.decoded)
  need = sizes.static + 2 * largest + decoded
  floats = f" + decoded floats {format_bytes(decoded)}" if decoded else ""
  return (
    f"no placement fits device_budget_bytes={device} and host_budget_bytes={host}: the "
    f"smallest device budget any placement fits is {need} ({format_bytes(need)}: static "
    f"{format_bytes(sizes.static)} + a window of 2 units of {format_bytes(largest)}{floats}, "
    "DenseDiskStream(host_budget_bytes=0)), with no host budget."
  )


def ranking_table(candidates: Sequence[Candidate], *, top: int = 10) -> str:
  """The first ``top`` candidates as a table: rank, policy, predicted times, bytes/token."""
  rows = [("#", "placement", "prefill", "decode step", "moved/token")]
  for k, c in enumerate(candidates[:top], 1):
    rows.append(
      (
        str(k),
        describe(c.policy),
        f"{c.prefill_seconds * 1e3:.2f} ms",
        f"{c.decode_seconds * 1e3:.2f} ms",
        format_bytes(int(c.bytes_per_token)),
      )
    )
  widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
  return "\n".join(
    "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows
  )


def describe(policy: LayerWeightResidency) -> str:
  """A short description of a candidate policy (its non-default fields)."""
  if isinstance(policy, FullyResident):
    return "FullyResident()"
  if isinstance(policy, LayerwiseHost):
    o = policy.options
    return (
      f"LayerwiseHost(prefetch_depth={o.offload.prefetch_depth}, "
      f"device_resident_units={o.device_resident_units})"
    )
  dense: Any = policy.dense
  host = format_budget(dense.host_budget_bytes)
  return (
    f"DenseDiskStream(host_budget_bytes={host}, device_resident_units="
    f"{dense.device_resident_units}, host_resident_units={dense.host_resident_units})"
  )
