"""``jax-residency plan``: which policies, and which depths, fit given byte budgets.

For one store's sizes (one device), every policy is judged the way ``place()``
judges it before anything moves (:func:`jax_residency._src.plan.budget.check_budgets`),
and each tier's arithmetic, static + window = required against its budget, is
shown beside the verdict. ``FullyResident`` has no budget of its own, so its
verdict is that arithmetic: would every unit fit next to the static parameters.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

from jax_residency._src.cli.console import PROG, fmt_bytes, table
from jax_residency._src.errors import BudgetTooSmallError
from jax_residency._src.plan.budget import ModelMetadata, check_budgets, largest_window
from jax_residency._src.plan.memory import staging_bytes
from jax_residency._src.policy.options import (
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
)
from jax_residency._src.policy.types import DenseDiskStream, LayerWeightResidency, LayerwiseHost


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanTier:
  """One tier of one plan: static + window (``units`` of ``unit_bytes``) against a budget.

  Attributes:
    tier: ``device`` or ``host``.
    static: bytes held besides the window: the static parameters on the device, a
      dense stream's staging unit on the host.
    units: units in the window.
    unit_bytes: bytes of the largest unit.
    window: bytes of the largest window of ``units`` consecutive units.
    budget: the tier's budget in bytes; ``None`` means unbounded.
    note: what to change when the tier does not fit (empty: nothing to say).
  """

  tier: str
  static: int
  units: int
  unit_bytes: int
  window: int
  budget: int | None
  note: str = ""

  @property
  def required(self) -> int:
    return self.static + self.window

  @property
  def fits(self) -> bool:
    return self.budget is None or self.required <= self.budget

  def arithmetic(self) -> str:
    window = f"{self.units} x {fmt_bytes(self.unit_bytes)}"
    if self.window != self.units * self.unit_bytes:  # units of several sizes (stacks)
      window = f"{self.units} units ({fmt_bytes(self.window)})"
    if self.tier == "device":
      text = f"{fmt_bytes(self.static)} + {window}"
    elif self.static:  # a dense stream's staging unit on an accelerator
      text = f"{window} + staging {fmt_bytes(self.static)}"
    else:
      text = window
    return f"{text} = {fmt_bytes(self.required)}"

  def to_dict(self) -> dict[str, Any]:
    return {
      "tier": self.tier,
      "static_bytes": self.static,
      "window_units": self.units,
      "window_bytes": self.window,
      "required_bytes": self.required,
      "budget_bytes": self.budget,
      "fits": self.fits,
      "note": self.note,
    }


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanRow:
  """One policy against the budgets: a group of rows in the table, one of ``plans`` in JSON.

  Attributes:
    policy: ``fully_resident``, ``layerwise_host`` or ``dense_disk_stream``.
    setting: the depth planned, e.g. ``prefetch_depth 2``; empty for ``fully_resident``.
    tiers: the device tier, then (for the streaming policies) the host tier.
    fits: whether ``place()`` would accept the policy with this setting.
    metadata: every item the placement would hold (see ``ModelMetadata.memory``);
      ``None`` where the policy does not fit, and for ``fully_resident``.
    depths: ``layerwise_host`` only: the smallest and largest ``prefetch_depth``
      that fit; ``None`` when none does.
    lookahead_max: ``dense_disk_stream`` only: the largest ``host_lookahead`` that
      fits; ``None`` when none does or the stream goes direct disk-to-device.
    note: why the policy cannot run whatever the budgets (empty: nothing to say).
  """

  policy: str
  setting: str
  tiers: tuple[PlanTier, ...]
  fits: bool
  metadata: ModelMetadata | None = None
  depths: tuple[int, int] | None = None
  lookahead_max: int | None = None
  note: str = ""

  def to_dict(self) -> dict[str, Any]:
    """The JSON form: ``depths`` only for ``layerwise_host``, ``lookahead_max`` only
    for ``dense_disk_stream``, ``note`` only when set, and ``memory`` (the metadata's
    items) last."""
    data: dict[str, Any] = {"policy": self.policy, "setting": self.setting}
    if self.policy == "layerwise_host":
      data["depths"] = None if self.depths is None else list(self.depths)
    if self.policy == "dense_disk_stream":
      data["lookahead_max"] = self.lookahead_max
    data["tiers"] = [t.to_dict() for t in self.tiers]
    data["fits"] = self.fits
    if self.note:
      data["note"] = self.note
    data["memory"] = None if self.metadata is None else [m.to_dict() for m in self.metadata.memory]
    return data

  def fit_text(self) -> str:
    """The policy and the settings that fit, for the summary line."""
    if self.policy == "layerwise_host" and self.depths:
      lo, hi = self.depths
      return f"layerwise_host (prefetch_depth {lo}" + (f"..{hi})" if hi > lo else ")")
    if self.policy == "dense_disk_stream":
      extra = "" if self.lookahead_max is None else f", up to {self.lookahead_max}"
      return f"dense_disk_stream ({self.setting}{extra})"
    return self.policy

  def misfit_text(self) -> str:
    """The policy and why it does not fit, for the summary line."""
    bad = [t for t in self.tiers if not t.fits]
    why = "; ".join(f"{t.tier} needs {fmt_bytes(t.required)} > {fmt_bytes(t.budget)}" for t in bad)
    return f"{self.policy}: {why or self.note}"

  def table_rows(self) -> list[list[str]]:
    """This policy's rows of the table: one per tier, then its note."""
    label = f"{self.policy} {self.setting}".strip()
    rows = []
    for k, t in enumerate(self.tiers):
      verdict = "yes" if t.fits else "NO"
      rows.append(
        [
          label if k == 0 else "",
          t.tier,
          t.arithmetic() if t.units or t.tier == "device" else "-",
          fmt_bytes(t.budget),
          verdict + (f" ({t.note})" if t.note and not t.fits else ""),
        ]
      )
    if self.note:
      rows.append(["", "", self.note, "", "NO"])
    return rows


@dataclasses.dataclass(frozen=True, kw_only=True)
class PlanInputs:
  """What every policy of a plan is judged with: one store's sizes and the two budgets.

  Attributes:
    units: number of units.
    unit_bytes: bytes of one unit (the largest, with several stacks).
    static_bytes: bytes of the static parameters.
    device_budget_bytes: the device budget; ``None`` means unbounded.
    host_budget_bytes: the host budget; ``None`` means unbounded, ``0`` means
      direct disk-to-device streaming for ``DenseDiskStream``.
    device_is_host: planned for CPU devices, whose memory is host memory.
    decoded_bytes: for a quantized store, the float bytes of its largest static tensor
      and of a unit's largest while they are used (one at a time), which the device
      budget pays for too.
    quantization: for a quantized store, its scheme and bytes (as ``inspect`` shows).
  """

  units: int
  unit_bytes: int
  static_bytes: int
  device_budget_bytes: int | None
  host_budget_bytes: int | None
  device_is_host: bool = True
  decoded_bytes: tuple[int, int] = (0, 0)
  quantization: dict[str, Any] | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class BudgetPlan:
  """Every policy against a device and a host budget, for one store.

  Attributes:
    path: the store.
    inputs: the store's sizes and the budgets.
    plans: one row per policy, in the order of the table.
  """

  path: str
  inputs: PlanInputs
  plans: tuple[PlanRow, ...]

  @property
  def fitting(self) -> list[str]:
    """Names of the policies that fit."""
    return [p.policy for p in self.plans if p.fits]

  def summary(self) -> str:
    """One line: what fits (with its depths), or why nothing does."""
    fits = [p.fit_text() for p in self.plans if p.fits]
    if fits:
      return "fits: " + ", ".join(fits)
    return "nothing fits. " + ". ".join(p.misfit_text() for p in self.plans)

  def to_dict(self) -> dict[str, Any]:
    """The JSON form: the path, the inputs' fields, the plans, what fits and the summary."""
    return {
      "path": self.path,
      **dataclasses.asdict(self.inputs),
      "plans": [p.to_dict() for p in self.plans],
      "fits": self.fitting,
      "summary": self.summary(),
    }

  def __str__(self) -> str:
    i = self.inputs
    n, unit, static = i.units, i.unit_bytes, i.static_bytes
    lines = [
      f"store: {self.path} ({n} units x {fmt_bytes(unit)} = {fmt_bytes(n * unit)}, "
      f"static {fmt_bytes(static)})",
      f"budgets: device {fmt_bytes(i.device_budget_bytes)}, host "
      f"{fmt_bytes(i.host_budget_bytes)} (bytes per device; one device)",
      "",
    ]
    if i.quantization is not None:
      q = i.quantization
      lines[1:1] = [
        f"quantized: {q['scheme']}, {q['tensors']} matrices {fmt_bytes(q['float_bytes'])} "
        f"as floats -> {fmt_bytes(q['stored_bytes'])} stored; decoded while used, one at a "
        f"time: static {fmt_bytes(i.decoded_bytes[0])}, in a unit "
        f"{fmt_bytes(i.decoded_bytes[1])}"
      ]
    rows = [row for p in self.plans for row in p.table_rows()]
    lines += table(("policy", "tier", "static + window = required", "budget", "fits"), rows)
    where = "CPU: device memory is host memory" if i.device_is_host else "accelerator"
    for p in self.plans:
      if p.metadata is not None and p.policy != "fully_resident":
        lines += ["", f"{p.policy} {p.setting}: where the bytes go ({where})"]
        lines += ["  " + line for line in p.metadata.memory_table().splitlines()]
    lines += ["", self.summary()]
    return "\n".join(lines)


# --- the three policies against the budgets -----------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Checker:
  """The checks each policy's row uses: tiers, and what ``place()`` would decide.

  ``stacks`` is ``(path, units, unit_bytes)`` per layer stack in forward order.
  """

  inputs: PlanInputs
  stacks: tuple[tuple[str, int, int], ...]

  @functools.cached_property
  def sizes(self) -> list[int]:
    """Bytes of every unit, in forward order."""
    return [b for _, count, b in self.stacks for _ in range(count)]

  def device_tier(self, units: int, *, resident: bool = False) -> PlanTier:
    """The static parameters and a window of ``units`` units (of every stack at once
    if ``resident``, else of one stack at a time) against the device budget."""
    if resident:
      window = largest_window(self.sizes, units)
    else:  # the stacks run one after another
      window = max(largest_window([b] * c, min(units, c)) for _, c, b in self.stacks)
    i = self.inputs
    decoded = sum(i.decoded_bytes)
    note = f"static includes {fmt_bytes(decoded)} of decoded floats" if decoded else ""
    return self._tier(
      "device", units, window, i.static_bytes + decoded, i.device_budget_bytes, note
    )

  def host_tier(self, units: int, *, staging: int = 0, note: str = "") -> PlanTier:
    """A window of ``units`` units (and ``staging`` bytes) against the host budget."""
    window = largest_window(self.sizes, units)
    return self._tier("host", units, window, staging, self.inputs.host_budget_bytes, note)

  def _tier(
    self, tier: str, units: int, window: int, static: int, budget: int | None, note: str = ""
  ) -> PlanTier:
    return PlanTier(
      tier=tier,
      static=static,
      units=units,
      unit_bytes=self.inputs.unit_bytes,
      window=window,
      budget=budget,
      note=note,
    )

  def metadata(self, policy: LayerWeightResidency) -> ModelMetadata | None:
    """What ``place()`` decides before anything moves (None: it refuses)."""
    try:
      return check_budgets(
        policy,
        static_device_bytes=self.inputs.static_bytes,
        unit_bytes=self.sizes,
        device_unit_bytes=self.sizes,
        host_unit_bytes=self.sizes,
        device_is_host=self.inputs.device_is_host,
        stacks=[(name, count) for name, count, _ in self.stacks],
        decoded_bytes=self.inputs.decoded_bytes,
      )
    except BudgetTooSmallError:
      return None

  def accepts(self, policy: LayerWeightResidency) -> bool:
    return self.metadata(policy) is not None

  def layerwise(self, depth: int) -> LayerwiseHost:
    i = self.inputs
    offload = OffloadConfig(
      device_budget_bytes=i.device_budget_bytes,
      host_budget_bytes=i.host_budget_bytes,
      prefetch_depth=depth,
    )
    return LayerwiseHost(LayerwiseLoadOptions(offload=offload))

  def dense(self, lookahead: int) -> DenseDiskStream:
    return DenseDiskStream(
      DenseDiskStreamLoadOptions(
        device_budget_bytes=self.inputs.device_budget_bytes,
        host_budget_bytes=self.inputs.host_budget_bytes,
        host_lookahead=lookahead,
        background_queue_capacity=2 if lookahead else 0,
      )
    )


def _fully_resident(check: _Checker) -> PlanRow:
  """Every unit next to the static parameters: no budget of its own, only the arithmetic."""
  device = check.device_tier(check.inputs.units, resident=True)
  return PlanRow(policy="fully_resident", setting="", tiers=(device,), fits=device.fits)


def _layerwise_host(check: _Checker) -> PlanRow:
  """The depths that fit; the plan shows the largest (2 with no device budget)."""
  n = check.inputs.units
  # LayerwiseHost keeps every unit in host memory; check_budgets rejects every
  # depth when they do not fit the host budget, and the host row shows why.
  host_all = check.host_tier(n, note="LayerwiseHost keeps every unit in host memory")
  depths = [d for d in range(1, n + 1) if check.accepts(check.layerwise(d))]
  unbounded = check.inputs.device_budget_bytes is None
  depth = (min(2, n) if unbounded else depths[-1]) if depths else 1
  return PlanRow(
    policy="layerwise_host",
    setting=f"prefetch_depth {depth}",
    metadata=check.metadata(check.layerwise(depth)),
    depths=(depths[0], depths[-1]) if depths else None,
    tiers=(check.device_tier(depth), host_all),
    fits=bool(depths),
  )


def _dense_disk_stream(check: _Checker, *, lookahead: int, streamable: bool) -> PlanRow:
  """The lookahead asked for (none with a host budget of 0) and the largest that fits."""
  i = check.inputs
  if i.host_budget_bytes == 0:
    setting, look, look_max = "direct disk-to-device", 0, None
  else:
    look = min(lookahead, i.units)
    setting = f"host_lookahead {look}"
    fitting = (k for k in range(1, i.units + 1) if check.accepts(check.dense(k)))
    look_max = max(fitting, default=None)
  stream = check.dense(look)
  staging = 0
  if i.host_budget_bytes != 0:
    staging = staging_bytes(stream, i.unit_bytes, device_is_host=i.device_is_host)
  host_window = check.host_tier(look, staging=staging)
  if not host_window.fits:
    note = (
      f"host_lookahead <= {look_max} fits"
      if look_max
      else "--host-budget 0 streams disk-to-device without a host cache"
    )
    host_window = dataclasses.replace(host_window, note=note)
  metadata = check.metadata(stream)
  return PlanRow(
    policy="dense_disk_stream",
    setting=setting,
    metadata=metadata,
    lookahead_max=look_max,
    tiers=(check.device_tier(stream.device_depth(i.units)), host_window),
    fits=streamable and metadata is not None,
    note="" if streamable else f"the store is not one chunk per unit; run `{PROG} rechunk` first",
  )


def plan_budgets(
  path: str,
  *,
  units: int,
  unit_bytes: int,
  static_bytes: int,
  device_budget: int | None,
  host_budget: int | None,
  lookahead: int,
  streamable: bool,
  device_is_host: bool = True,
  stacks: Sequence[tuple[str, int, int]] = (),
  decoded_bytes: tuple[int, int] = (0, 0),
  quantization: dict[str, Any] | None = None,
) -> BudgetPlan:
  """Judges every policy against the budgets for a store of ``units`` equal units
  (or of ``stacks``).

  Args:
    path: the store, as the user named it.
    units: number of units.
    unit_bytes: bytes of one unit.
    static_bytes: bytes of the static parameters.
    device_budget: device budget in bytes; ``None`` means unbounded.
    host_budget: host budget in bytes; ``None`` means unbounded, ``0`` means
      direct disk-to-device streaming for ``DenseDiskStream``.
    lookahead: the ``host_lookahead`` to show for ``DenseDiskStream``.
    streamable: whether the store is one chunk per unit (else
      ``DenseDiskStream`` cannot stream it).
    device_is_host: plan for CPU devices (a dense stream's read buffers become
      device arrays); ``False`` plans for an accelerator, where the unit in
      transit is a staging buffer in host memory.
    stacks: the store's layer stacks as ``(path, units, unit_bytes)``, in
      forward order (then ``units`` and ``unit_bytes`` are their total and
      largest): a device window is the largest of any stack, a host window
      runs over the units in forward order.
    decoded_bytes: a quantized store's decoded floats, static and per unit.
    quantization: a quantized store's scheme and bytes, shown with the sizes.
  """
  inputs = PlanInputs(
    units=units,
    unit_bytes=unit_bytes,
    static_bytes=static_bytes,
    device_budget_bytes=device_budget,
    host_budget_bytes=host_budget,
    device_is_host=device_is_host,
    decoded_bytes=decoded_bytes,
    quantization=quantization,
  )
  check = _Checker(inputs=inputs, stacks=tuple(stacks) or (("", units, unit_bytes),))
  rows = (
    _fully_resident(check),
    _layerwise_host(check),
    _dense_disk_stream(check, lookahead=lookahead, streamable=streamable),
  )
  return BudgetPlan(path=path, inputs=inputs, plans=rows)
