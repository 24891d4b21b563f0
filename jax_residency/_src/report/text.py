"""The text form of a telemetry report (``str(placed.report())``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from jax_residency._src.policy.sizes import format_bytes

if TYPE_CHECKING:
  from jax_residency._src.report.records import Report
  from jax_residency._src.report.stream_metrics import TierMetrics


def render(report: Report) -> str:
  """The report as a short table: totals per phase, peaks, the last backend sample."""
  cols = ("", "passes", "seconds", "compile", "read", "host→dev", "stalls", "dev hit", "host hit")
  rows = []
  for name, t in (("prefill", report.prefill), ("decode", report.decode), ("total", report.total)):
    rows.append(
      (
        name,
        str(t.passes),
        f"{t.seconds:.3f}",
        f"{t.compile_seconds:.3f}",
        format_bytes(t.bytes_read),
        format_bytes(t.host_to_device_bytes),
        str(t.stalls),
        _rate(t.device),
        _rate(t.host),
      )
    )
  widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
  lines = [f"policy: {report.policy.get('kind')}"]
  lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip())
  lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows]
  t = report.total
  lines.append(
    f"peak device: {t.peak_device_units} units, {format_bytes(t.peak_device_bytes)}; "
    f"peak host: {t.peak_host_units} units, {format_bytes(t.peak_host_bytes)}"
  )
  if t.peak_rss_bytes is not None:
    lines.append(
      f"peak RSS: {format_bytes(t.peak_rss_bytes)}; page faults: "
      f"{t.minor_faults} minor, {t.major_faults} major"
    )
  last = report.last
  if last is not None and last.backend is not None:
    lines.append(f"backend memory: {_backend_line(last.backend)}")
  if report.speculation is not None:
    lines.append(report.speculation.summary())
  return "\n".join(lines)


def _backend_line(backend: Mapping[str, Any]) -> str:
  if backend.get("source") == "memory_stats":
    parts = []
    for name, stats in backend.get("devices", {}).items():
      in_use = stats.get("bytes_in_use")
      peak = stats.get("peak_bytes_in_use")
      text = f"{name} {format_bytes(in_use) if isinstance(in_use, int) else '?'} in use"
      if isinstance(peak, int):
        text += f" (peak {format_bytes(peak)})"
      parts.append(text)
    return "; ".join(parts)
  kinds = backend.get("bytes_by_memory_kind", {})
  return "live arrays " + (
    ", ".join(f"{kind} {format_bytes(n)}" for kind, n in kinds.items()) or "none"
  )


def _rate(m: TierMetrics | None) -> str:
  if m is None or m.hit_rate is None:
    return "-"
  return f"{100 * m.hit_rate:.0f}%"
