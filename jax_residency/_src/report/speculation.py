"""What speculative decoding did, as a placed target's report carries it
(`Report.speculation`; docs/speculative.md, "Reports").

`models.speculate` counts a generation's rounds in its `SpeculationReport`; where the
target is a placed model (a `RecordsSpeculation`), it adds that generation's
`SpeculationTotals` to the placement's report, which sums every generation the
placement was the target of.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, runtime_checkable


@dataclasses.dataclass(frozen=True)
class SpeculationTotals:
  """Counts and times of speculative generations, summed.

  Attributes:
    generations: speculative generations.
    rounds: draft-and-verify rounds.
    proposed: draft tokens proposed (a tree's nodes but its root), over rows.
    accepted: proposals the target kept.
    target_passes: the target's passes (each generation's prefill and one a round).
    row_passes: target passes times the rows each ran for (what tokens a pass divides by).
    draft_steps: the draft's calls, prefills not counted.
    generated: tokens returned, over rows.
    draft_s: seconds in the draft's prefills and calls.
    target_s: seconds in the target's prefills and passes.

  Example:
    >>> one = SpeculationTotals(1, 4, 16, 12, 5, 5, 20, 17, 0.1, 2.0)
    >>> two = one + one
    >>> two.generations, two.acceptance_rate, two.tokens_per_pass
    (2, 0.75, 3.4)
  """

  generations: int = 0
  rounds: int = 0
  proposed: int = 0
  accepted: int = 0
  target_passes: int = 0
  row_passes: int = 0
  draft_steps: int = 0
  generated: int = 0
  draft_s: float = 0.0
  target_s: float = 0.0

  @property
  def acceptance_rate(self) -> float:
    """The share of proposals kept (0 when none were made)."""
    return self.accepted / self.proposed if self.proposed else 0.0

  @property
  def tokens_per_pass(self) -> float:
    """Tokens returned per row and target pass (one without a draft)."""
    return self.generated / self.row_passes if self.row_passes else 0.0

  def __add__(self, other: SpeculationTotals) -> SpeculationTotals:
    return SpeculationTotals(
      *(getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self))
    )

  def to_dict(self) -> dict[str, Any]:
    """A JSON-serialisable dictionary, with the rate and tokens a pass."""
    out = dataclasses.asdict(self)
    out.update(acceptance_rate=self.acceptance_rate, tokens_per_pass=self.tokens_per_pass)
    return out

  def summary(self) -> str:
    """One line: rounds, proposals, acceptance, tokens a pass, time in each model."""
    return (
      f"speculation: {self.rounds} rounds, {self.accepted} of {self.proposed} proposals "
      f"accepted ({self.acceptance_rate:.0%}), {self.tokens_per_pass:.2f} tokens per target "
      f"pass; draft {self.draft_s:.2f} s, target {self.target_s:.2f} s"
    )


@runtime_checkable
class RecordsSpeculation(Protocol):
  """A target whose report sums what speculation did with it (a placed model)."""

  def note_speculation(self, totals: SpeculationTotals) -> None:
    """Adds one speculative generation's totals to the target's report."""
    ...
