"""Token trees for speculative decoding (docs/speculative.md, "Token trees").

A tree's shape is its branches per depth, ``(b1, b2, ...)``: the last kept token (the
root, depth 0) gets ``b1`` children from the draft, each of them ``b2``, and so on; a
chain of ``k`` proposals is the tree ``(1,) * k``. Nodes are numbered breadth first, so
that a node's ancestors come before it and each depth is one run of numbers: the draft
expands one depth a call, and the target checks every node in one pass, each node
attending to the committed cache and to its own ancestors only (`DraftTree.ancestors`).

The target keeps the longest path from the root whose every node it accepts:

* greedy: a child is accepted where its token is the target's argmax at its parent;
* sampling: the children of a node are drawn independently from the draft's ``q`` there,
  and tried in turn against the target's ``p``: child ``d`` is accepted with probability
  ``min(1, p(d) / q(d))``; after a rejection ``p`` becomes ``max(0, p - q)`` normalized
  for the next child; where none is accepted the token is drawn from the last ``p``.
  Each try is a speculative-sampling step towards the current ``p``, so the token kept
  at each depth is distributed as the target's (Miao et al., 2024, SpecInfer).

`choose` picks a shape from measured costs: the draft's call time and the target's pass
time by tokens, and the chance that the target's token is among a node's ``b`` children.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from jax_residency._src.errors import SpeculationError

#: The most nodes (the root included) a tree may have: one target pass checks them all.
MAX_TREE_NODES = 256
#: The most children of one node that ``"auto"`` considers (and whose ranks it counts).
MAX_AUTO_BRANCHES = 4
#: The deepest tree ``"auto"`` considers.
MAX_AUTO_DEPTH = 8


@dataclasses.dataclass(frozen=True)
class DraftTree:
  """A token tree's shape and its node tables.

  Example:
    >>> tree = DraftTree((2, 1))
    >>> tree.size, tree.levels, tree.parent.tolist(), tree.depth.tolist()
    (5, (1, 2, 2), [-1, 0, 0, 1, 2], [0, 1, 1, 2, 2])
    >>> tree.ancestors[3].tolist()  # node 3 sees the root, node 1 and itself
    [True, True, False, True, False]
    >>> [list(tree.children(n)) for n in range(tree.size)]
    [[1, 2], [3], [4], [], []]
  """

  branches: tuple[int, ...]

  @functools.cached_property
  def levels(self) -> tuple[int, ...]:
    """Nodes at each depth, the root's first."""
    return tuple(itertools.accumulate((1, *self.branches), lambda a, b: a * b))

  @functools.cached_property
  def starts(self) -> tuple[int, ...]:
    """The first node of each depth."""
    return tuple(itertools.accumulate((0, *self.levels[:-1])))

  @property
  def size(self) -> int:
    """Nodes, the root included: the tokens of the target's pass."""
    return self.starts[-1] + self.levels[-1]

  @property
  def proposals(self) -> int:
    """The draft's tokens: every node but the root."""
    return self.size - 1

  @property
  def is_chain(self) -> bool:
    return all(b == 1 for b in self.branches)

  @functools.cached_property
  def parent(self) -> np.ndarray:
    """Each node's parent (-1 for the root)."""
    out = [-1]
    for d, b in enumerate(self.branches):
      out += [self.starts[d] + i // b for i in range(self.levels[d + 1])]
    return np.asarray(out, np.int32)

  @functools.cached_property
  def depth(self) -> np.ndarray:
    return np.repeat(np.arange(len(self.levels), dtype=np.int32), self.levels)

  @functools.cached_property
  def ancestors(self) -> np.ndarray:
    """``(size, size)`` bool: ``[i, j]`` where node ``j`` is node ``i`` or its ancestor."""
    out = np.eye(self.size, dtype=bool)
    for node in range(1, self.size):
      out[node] |= out[self.parent[node]]
    return out

  def children(self, node: int) -> range:
    d = int(self.depth[node])
    if d == len(self.branches):
      return range(0)
    b = self.branches[d]
    first = self.starts[d + 1] + (node - self.starts[d]) * b
    return range(first, first + b)


def check_draft_tree(value: Any) -> DraftTree:
  """``draft_tree``: a non-empty sequence of positive ints (branches per depth).

  Raises:
    SpeculationError: anything else, or a tree of more than `MAX_TREE_NODES` nodes,
      naming the value.
  """
  fix = "pass branches per depth, e.g. draft_tree=(4, 2, 1, 1) (a chain of k is (1,) * k)"
  if isinstance(value, str | bytes) or not isinstance(value, Sequence) or not value:
    raise SpeculationError(f"draft_tree={value!r}: {fix}")
  for b in value:
    if isinstance(b, bool) or not isinstance(b, int | np.integer) or b < 1:
      raise SpeculationError(f"draft_tree={value!r}: every depth needs at least 1 branch; {fix}")
  tree = DraftTree(tuple(int(b) for b in value))
  if tree.size > MAX_TREE_NODES:
    raise SpeculationError(
      f"draft_tree={value!r} has {tree.size} nodes, over the {MAX_TREE_NODES} one target pass "
      "checks: use fewer branches or depths"
    )
  return tree


def expected_tokens(branches: Sequence[int], hit: Callable[[int], float]) -> float:
  """A round's expected tokens: the kept path's proposals plus the target's own token.

  ``hit(b)``: the chance that the target's token is among a node's ``b`` children,
  taken as the same at every depth and independent of the depths before.

  Example:
    >>> round(expected_tokens((1, 1), lambda b: 0.5), 4)  # 1 + 0.5 + 0.25
    1.75
  """
  total, reach = 1.0, 1.0
  for b in branches:
    reach *= hit(b)
    total += reach
  return total


def shapes(max_depth: int = MAX_AUTO_DEPTH) -> list[tuple[int, ...]]:
  """The shapes ``"auto"`` weighs: chains, and trees that branch at their first two
  depths (where a path is most likely to still be alive) into 2 or `MAX_AUTO_BRANCHES`
  children, few so that few pass shapes compile."""
  out: list[tuple[int, ...]] = []
  widths = (1, 2, MAX_AUTO_BRANCHES)
  for depth in range(1, max_depth + 1):
    for b1 in widths:
      for b2 in widths[:2] if depth > 1 else (1,):
        shape = ((b1, b2) + (1,) * (depth - 2))[:depth]
        if shape not in out and DraftTree(shape).size <= MAX_TREE_NODES:
          out.append(shape)
  return out


def rate(
  shape: tuple[int, ...],
  hit: Callable[[int], float],
  draft_call_s: Callable[[int], float],
  pass_s: Callable[[int], float],
) -> float:
  """Predicted tokens per second of rounds of ``shape`` (``()``: no draft, one target
  pass a token).

  A round of shape ``s`` costs one draft call per depth (``draft_call_s(nodes)``, the
  deepest too: it fills the draft's cache) and one target pass over its nodes, and
  yields `expected_tokens` ``(s, hit)``.

  Example:
    >>> rate((1,), lambda b: 0.5, lambda n: 0.1, lambda t: 1.0)  # 1.5 tokens in 1.2 s
    1.25
  """
  if not shape:
    return 1.0 / max(pass_s(1), 1e-12)
  tree = DraftTree(shape)
  cost = sum(draft_call_s(n) for n in tree.levels) + pass_s(tree.size)
  return expected_tokens(shape, hit) / max(cost, 1e-12)


def choose(
  hit: Callable[[int], float],
  draft_call_s: Callable[[int], float],
  pass_s: Callable[[int], float],
  candidates: Iterable[tuple[int, ...]] | None = None,
) -> tuple[int, ...]:
  """The candidate shape (default: `shapes`) with the most predicted tokens per second
  (`rate`), or ``()`` (no draft: one target pass a token) where none is predicted
  faster (``models.choose_draft_tree``).

  Example:
    >>> streamed = choose(lambda b: 0.7, lambda n: 0.001, lambda t: 0.5, shapes())
    >>> len(streamed) > 4  # a streamed pass: speculate deep
    True
    >>> choose(lambda b: 0.7, lambda n: 0.01, lambda t: 0.002 * t, shapes())  # no gain
    ()
  """
  best: tuple[int, ...] = ()
  best_rate = rate((), hit, draft_call_s, pass_s)
  for shape in shapes() if candidates is None else candidates:
    r = rate(shape, hit, draft_call_s, pass_s)
    if r > best_rate:
      best, best_rate = shape, r
  return best


def walk_greedy(tree: DraftTree, tokens: np.ndarray, pred: np.ndarray) -> tuple[list[int], int]:
  """The kept path (node numbers from the root) and the target's token after it, for
  one row: ``tokens`` ``(size,)`` the nodes' tokens, ``pred`` the target's argmax at each."""
  path, node = [0], 0
  while True:
    nxt = [c for c in tree.children(node) if tokens[c] == pred[node]]
    if not nxt:
      return path, int(pred[node])
    node = nxt[0]
    path.append(node)


def walk_sampled(
  tree: DraftTree,
  tokens: np.ndarray,
  p_at: Callable[[int], np.ndarray],
  q_at: Callable[[int], np.ndarray],
  rng: np.random.Generator,
) -> tuple[list[int], int, list[bool]]:
  """As `walk_greedy` for sampling (the module's rule), with ``p_at(node)`` the target's
  and ``q_at(node)`` the draft's distribution there; also whether each tried node's
  first child was accepted (what ``"auto"`` estimates its chances from)."""
  path, node, first = [0], 0, []
  while True:
    p = np.asarray(p_at(node), np.float64)
    kids = tree.children(node)
    moved = False
    if len(kids):
      q = np.asarray(q_at(node), np.float64)
      for i, child in enumerate(kids):
        d = int(tokens[child])
        ok = rng.random() * q[d] < p[d]
        if i == 0:
          first.append(bool(ok))
        if ok:
          node, moved = child, True
          path.append(child)
          break
        residual = np.maximum(p - q, 0.0)
        if residual.sum() > 0:
          p = residual / residual.sum()
    if not moved:
      return path, int(rng.choice(p.shape[0], p=p / p.sum())), first


@dataclasses.dataclass
class Chances:
  """Counts behind ``hit(b)``: how often the target's token was among a node's top ``b``.

  Greedy: ``ranks[r]`` counts checked nodes where the target's token was the draft's
  ``r``-th choice (``r < MAX_AUTO_BRANCHES``); sampling: ``first`` counts nodes whose
  first child was accepted, and ``hit(b) = 1 - (1 - first / checked) ** b``.
  """

  checked: int = 0
  first: int = 0
  ranks: list[int] = dataclasses.field(default_factory=lambda: [0] * MAX_AUTO_BRANCHES)

  def add_rank(self, rank: int | None) -> None:
    self.checked += 1
    if rank is not None and rank < MAX_AUTO_BRANCHES:
      self.ranks[rank] += 1
      self.first += rank == 0

  def add_first(self, accepted: bool) -> None:
    self.checked += 1
    self.first += accepted

  def hit(self, b: int, greedy: bool) -> float:
    """The estimated chance for ``b`` children (Laplace-smoothed: no count is certain)."""
    n = self.checked + 2
    if greedy:
      return (sum(self.ranks[:b]) + 1) / n
    return 1 - (1 - (self.first + 1) / n) ** b
