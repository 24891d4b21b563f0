"""``jax-residency plan``: which policies, and which depths, fit given byte budgets.

For one store's sizes (one device), every policy is judged the way ``place()``
judges it before anything moves (:func:`jax_residency._src.plan.budget.check_budgets`),
and each tier's arithmetic, static + window = required against its budget, is
shown beside the verdict. ``FullyResident`` has no budget of its own, so its
verdict is that arithmetic: would every unit fit next to the static parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax_residency._src.cli.console import PROG, fmt_bytes, table
from jax_residency._src.errors import BudgetTooSmallError
from jax_residency._src.plan.budget import (
  ModelMetadata,
  check_budgets,
  largest_window,
  staging_bytes,
)
from jax_residency._src.policy.options import (
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
)
from jax_residency._src.policy.types import DenseDiskStream, LayerWeightResidency, LayerwiseHost


@dataclasses.dataclass
class _Tier:
  """One tier of one plan: static + window (``units`` of ``unit_bytes``) against a budget."""

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


@dataclasses.dataclass(kw_only=True)
class BudgetPlan:
  """Every policy against a device and a host budget, for one store.

  Attributes:
    path: the store.
    units: number of units.
    unit_bytes: bytes of one unit.
    static_bytes: bytes of the static parameters.
    device_budget: the device budget in bytes; ``None`` means unbounded.
    host_budget: the host budget in bytes; ``None`` means unbounded.
    plans: one dict per policy: ``policy``, ``setting``, ``tiers`` (device,
      then host), ``fits``, per policy the depths that fit, and ``memory``:
      every item the placement would hold (see ``ModelMetadata.memory``), where
      the policy fits.
    device_is_host: planned for CPU devices, whose memory is host memory.
  """

  path: str
  units: int
  unit_bytes: int
  static_bytes: int
  device_budget: int | None
  host_budget: int | None
  plans: list[dict[str, Any]]
  device_is_host: bool = True

  @property
  def fitting(self) -> list[str]:
    """Names of the policies that fit."""
    return [p["policy"] for p in self.plans if p["fits"]]

  def summary(self) -> str:
    """One line: what fits (with its depths), or why nothing does."""
    plans = self.plans
    fits = []
    for p in plans:
      if not p["fits"]:
        continue
      if p["policy"] == "layerwise_host" and p.get("depths"):
        lo, hi = p["depths"]
        fits.append(f"layerwise_host (prefetch_depth {lo}" + (f"..{hi})" if hi > lo else ")"))
      elif p["policy"] == "dense_disk_stream":
        extra = ""
        if p.get("lookahead_max") is not None:
          extra = f", up to {p['lookahead_max']}"
        fits.append(f"dense_disk_stream ({p['setting']}{extra})")
      else:
        fits.append(p["policy"])
    if fits:
      return "fits: " + ", ".join(fits)
    reasons = []
    for p in plans:
      bad = [t for t in p["tiers"] if not t.fits]
      why = "; ".join(
        f"{t.tier} needs {fmt_bytes(t.required)} > {fmt_bytes(t.budget)}" for t in bad
      ) or p.get("note", "")
      reasons.append(f"{p['policy']}: {why}")
    return "nothing fits. " + ". ".join(reasons)

  def to_dict(self) -> dict[str, Any]:
    return {
      "path": self.path,
      "units": self.units,
      "unit_bytes": self.unit_bytes,
      "static_bytes": self.static_bytes,
      "device_budget_bytes": self.device_budget,
      "host_budget_bytes": self.host_budget,
      "device_is_host": self.device_is_host,
      "plans": [
        {
          **{k: v for k, v in p.items() if k != "metadata"},
          "tiers": [t.to_dict() for t in p["tiers"]],
          "memory": [m.to_dict() for m in p["metadata"].memory] if p.get("metadata") else None,
        }
        for p in self.plans
      ],
      "fits": self.fitting,
      "summary": self.summary(),
    }

  def __str__(self) -> str:
    n, unit, static = self.units, self.unit_bytes, self.static_bytes
    lines = [
      f"store: {self.path} ({n} units x {fmt_bytes(unit)} = {fmt_bytes(n * unit)}, "
      f"static {fmt_bytes(static)})",
      f"budgets: device {fmt_bytes(self.device_budget)}, host {fmt_bytes(self.host_budget)} "
      "(bytes per device; one device)",
      "",
    ]
    rows = []
    for p in self.plans:
      label = f"{p['policy']} {p['setting']}".strip()
      for k, t in enumerate(p["tiers"]):
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
      if p.get("note"):
        rows.append(["", "", p["note"], "", "NO"])
    lines += table(("policy", "tier", "static + window = required", "budget", "fits"), rows)
    for p in self.plans:
      meta = p.get("metadata")
      if meta is not None and p["policy"] != "fully_resident":
        where = "CPU: device memory is host memory" if self.device_is_host else "accelerator"
        lines += ["", f"{p['policy']} {p['setting']}: where the bytes go ({where})"]
        lines += ["  " + line for line in meta.memory_table().splitlines()]
    lines += ["", self.summary()]
    return "\n".join(lines)


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
  """
  n, unit, static = units, unit_bytes, static_bytes
  device, host = device_budget, host_budget
  if not stacks:
    stacks = [("", n, unit)]
  sizes = [b for _, count, b in stacks for _ in range(count)]

  def tier(
    name: str, count: int, budget: int | None, fixed: int = 0, *, resident: bool = False
  ) -> _Tier:
    if name == "device" and not resident:  # the stacks run one after another
      window = max(largest_window([b] * c, min(count, c)) for _, c, b in stacks)
    else:
      window = largest_window(sizes, count)
    return _Tier(name, fixed, count, unit, window, budget)

  def metadata(policy: LayerWeightResidency) -> ModelMetadata | None:
    """What ``place()`` decides before anything moves (None: it refuses)."""
    try:
      return check_budgets(
        policy,
        static_device_bytes=static,
        unit_bytes=sizes,
        device_unit_bytes=sizes,
        host_unit_bytes=sizes,
        device_is_host=device_is_host,
        stacks=[(name, count) for name, count, _ in stacks],
      )
    except BudgetTooSmallError:
      return None

  def accepted(policy: LayerWeightResidency) -> bool:
    return metadata(policy) is not None

  def layerwise(depth: int) -> LayerwiseHost:
    offload = OffloadConfig(
      device_budget_bytes=device, host_budget_bytes=host, prefetch_depth=depth
    )
    return LayerwiseHost(LayerwiseLoadOptions(offload=offload))

  def dense(look: int) -> DenseDiskStream:
    return DenseDiskStream(
      DenseDiskStreamLoadOptions(
        device_budget_bytes=device,
        host_budget_bytes=host,
        host_lookahead=look,
        background_queue_capacity=2 if look else 0,
      )
    )

  full = [tier("device", n, device, static, resident=True)]
  plans: list[dict[str, Any]] = [
    {"policy": "fully_resident", "setting": "", "tiers": full, "fits": full[0].fits}
  ]

  # LayerwiseHost keeps every unit in host memory; check_budgets rejects every
  # depth when they do not fit the host budget, and the host row shows why.
  host_all = tier("host", n, host)
  host_all.note = "LayerwiseHost keeps every unit in host memory"
  depths = [d for d in range(1, n + 1) if accepted(layerwise(d))]
  depth = (min(2, n) if device is None else depths[-1]) if depths else 1
  plans.append(
    {
      "policy": "layerwise_host",
      "setting": f"prefetch_depth {depth}",
      "metadata": metadata(layerwise(depth)),
      "depths": [depths[0], depths[-1]] if depths else None,
      "tiers": [tier("device", depth, device, static), host_all],
      "fits": bool(depths),
    }
  )

  if host == 0:
    setting, look, look_max = "direct disk-to-device", 0, None
  else:
    look = min(lookahead, n)
    setting = f"host_lookahead {look}"
    look_max = max((k for k in range(1, n + 1) if accepted(dense(k))), default=None)
  stream = dense(look)
  staging = staging_bytes(stream, unit, device_is_host=device_is_host) if host != 0 else 0
  host_window = tier("host", look, host, staging)
  if not host_window.fits:
    host_window.note = (
      f"host_lookahead <= {look_max} fits"
      if look_max
      else "--host-budget 0 streams disk-to-device without a host cache"
    )
  plans.append(
    {
      "policy": "dense_disk_stream",
      "setting": setting,
      "metadata": metadata(stream),
      "lookahead_max": look_max,
      "tiers": [tier("device", stream.device_depth(n), device, static), host_window],
      "fits": accepted(stream),
    }
  )
  if not streamable:
    plans[-1]["fits"] = False
    plans[-1]["note"] = f"the store is not one chunk per unit; run `{PROG} rechunk` first"
  return BudgetPlan(
    path=path,
    units=n,
    unit_bytes=unit,
    static_bytes=static,
    device_budget=device,
    host_budget=host,
    plans=plans,
    device_is_host=device_is_host,
  )
