"""The logit parity gates of the peer benchmarks: each run's logits against the plain JAX
model's (and the torch port's), within a fraction of the logit scale.

A parity result (`parity_of`) holds ``logit_scale`` (max |logit| of the plain model),
``max_abs_diff`` (``"RUN vs jax"`` / ``"RUN vs torch"`` -> the largest difference) and
``ok``; `merge` joins several runs' results, `by_run` groups the differences a gate
checks together.
"""

from __future__ import annotations

from collections.abc import Callable

PARITY_RTOL = 1e-3  # max |diff| / max |logit| allowed


def parity_of(ref, logits, torch=None) -> dict:
  """The parity gate: max |diff| of each run's logits against ``ref`` and against torch's.

  Args:
    ref: the plain JAX model's logits.
    logits: run name -> logits of the same shape.
    torch: the torch port's logits (run whole), or ``None`` without the peers;
      every run but one named ``"torch"`` is also compared with them.

  Returns:
    ``logit_scale`` (max |ref|), ``max_abs_diff`` ("NAME vs jax" / "NAME vs
    torch" -> float) and ``ok``: every difference is within ``PARITY_RTOL``
    of the logit scale.
  """
  import numpy as np

  scale = float(np.abs(ref).max())
  out: dict = {"logit_scale": scale, "max_abs_diff": {}}
  for name, value in logits.items():
    out["max_abs_diff"][f"{name} vs jax"] = float(np.abs(value - ref).max())
    if name != "torch" and torch is not None:
      out["max_abs_diff"][f"{name} vs torch"] = float(np.abs(value - torch).max())
  out["ok"] = all(d <= PARITY_RTOL * scale for d in out["max_abs_diff"].values())
  return out


def merge(pars: list[dict]) -> dict:
  """Several runs' parity results as one: each difference's max over the runs; ``ok``,
  each entry of ``tokens_match_jax`` and each ``*_tokens_match_torch``, all of them;
  ``steps_compared``, the least; any other field, the last run's."""
  out = dict(pars[-1])
  out["max_abs_diff"] = {
    k: max(p["max_abs_diff"][k] for p in pars) for k in pars[0]["max_abs_diff"]
  }
  if "tokens_match_jax" in out:
    out["tokens_match_jax"] = {
      k: all(p["tokens_match_jax"][k] for p in pars) for k in pars[0]["tokens_match_jax"]
    }
  for k in out:
    if k.endswith("_tokens_match_torch") or k == "ok":
      out[k] = all(p[k] for p in pars)
  if "steps_compared" in out:
    out["steps_compared"] = min(p["steps_compared"] for p in pars)
  return out


def by_run(diffs: dict[str, float], row: Callable[[str], str] = str) -> dict:
  """``diffs`` (``"RUN vs AGAINST"`` -> difference) as ``{row(RUN): {AGAINST: the largest
  difference}}``: the differences one gate checks together."""
  rows: dict[str, dict[str, float]] = {}
  for key, diff in diffs.items():
    run, _, against = key.rpartition(" vs ")
    worst = rows.setdefault(row(run), {})
    worst[against] = max(diff, worst.get(against, 0.0))
  return rows
