"""How ``draft_tokens="auto"`` picks each round's shape (docs/speculative.md, "When it
pays: the cost model behind "auto""): what it measured for a target and draft
(`AutoTuning`, kept per pair and pooled over their generations), the lines it fits to
pass and draft-call times, and the choice with its hysteresis (`next_shape`).
"""

from __future__ import annotations

import collections
import dataclasses
import statistics
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from jax_residency._src.models.draft_tree import Chances, DraftTree, choose, rate, shapes

#: ``"auto"``'s first rounds for a target and draft: the shapes whose pass and draft
#: times it measures first (a chain of 1 and of 4, and a tree, so that both fitted lines
#: have spread), each twice (a shape's first pass may compile: `TimesBySize`).
AUTO_PROBES = ((1,), (1, 1, 1, 1), (4, 2, 1, 1))
#: ``"auto"`` moves from the shape it runs to another one only where that one is
#: predicted this much faster (each new shape compiles, and the estimates are noisy).
AUTO_SWITCH_GAIN = 1.05
#: Times ``"auto"`` keeps of each size (the most recent ones).
AUTO_TIMES_KEPT = 16


class TimesBySize:
  """Seconds measured per size (a pass's tokens, or a draft call's nodes): each size's
  first time apart, since a size's first call may compile, and its `AUTO_TIMES_KEPT`
  latest times after that."""

  def __init__(self) -> None:
    self._first: dict[int, float] = {}
    self._later: dict[int, collections.deque[float]] = {}

  def add(self, size: int, seconds: float) -> None:
    if size not in self._first:
      self._first[size] = seconds
    else:
      self._later.setdefault(size, collections.deque(maxlen=AUTO_TIMES_KEPT)).append(seconds)

  def typical(self) -> dict[int, float]:
    """Each size's median time after its first; where no size has run twice yet, the
    first times (compiles and all: the best there is)."""
    if self._later:
      return {n: statistics.median(t) for n, t in self._later.items()}
    return dict(self._first)


@dataclasses.dataclass
class AutoTuning:
  """What ``draft_tokens="auto"`` has measured for one target and draft (at one batch
  size and sampling setting), pooled over the generations that share it.

  Attributes:
    pass_times: the target's pass times by tokens.
    draft_times: the draft's call times by nodes.
    chances: how often the target's token was among the draft's top choices.
    rounds: rounds measured.
    shape: the shape ``"auto"`` last chose.
  """

  pass_times: TimesBySize = dataclasses.field(default_factory=TimesBySize)
  draft_times: TimesBySize = dataclasses.field(default_factory=TimesBySize)
  chances: Chances = dataclasses.field(default_factory=Chances)
  rounds: int = 0
  shape: tuple[int, ...] | None = None


_TUNINGS: weakref.WeakKeyDictionary[Any, weakref.WeakKeyDictionary[Any, dict[Hashable, AutoTuning]]]
_TUNINGS = weakref.WeakKeyDictionary()


def auto_tuning(target: Any, draft: Any, setting: Hashable) -> AutoTuning:
  """The `AutoTuning` of ``target`` and ``draft`` (the objects given to `generate_llm`)
  at ``setting`` (batch size and sampling), kept while both live; a fresh one where
  either cannot be weakly referenced."""
  try:
    drafts = _TUNINGS.setdefault(target, weakref.WeakKeyDictionary())
    return drafts.setdefault(draft, {}).setdefault(setting, AutoTuning())
  except TypeError:
    return AutoTuning()


def fit_line(times: TimesBySize) -> Callable[[int], float]:
  """A line through each size's typical time (`TimesBySize.typical`), by size; flat
  through one size, and never falling."""
  typical = times.typical()
  sizes = sorted(typical)
  best = [typical[t] for t in sizes]
  if len(sizes) > 1:
    slope, intercept = np.polyfit(sizes, best, 1)
  else:
    slope, intercept = 0.0, best[0]
  slope, intercept = max(float(slope), 0.0), float(intercept)
  return lambda size: max(intercept + slope * size, min(best))


def next_shape(tuning: AutoTuning, greedy: bool) -> DraftTree:
  """``"auto"``'s shape for the next round: the probes first (each twice), then
  `draft_tree.choose` on lines fitted to the pass and draft-call times and on the
  counted chances, moving from the last choice only for a predicted gain of
  `AUTO_SWITCH_GAIN`; the empty tree (the target's one token a pass, the draft's one
  call keeping its cache) where no speculation is predicted faster."""
  if tuning.rounds < 2 * len(AUTO_PROBES):
    return DraftTree(AUTO_PROBES[tuning.rounds // 2])

  def hit(b: int) -> float:
    return tuning.chances.hit(b, greedy)

  draft_s, pass_s = fit_line(tuning.draft_times), fit_line(tuning.pass_times)
  shape = choose(hit, draft_s, pass_s, shapes())
  if tuning.shape is not None and shape != tuning.shape:
    now, new = (rate(s, hit, draft_s, pass_s) for s in (tuning.shape, shape))
    if new < AUTO_SWITCH_GAIN * now:
      shape = tuning.shape
  tuning.shape = shape
  return DraftTree(shape)
