"""Reading lowered StableHLO text in tests.

``placed.lower(x, platforms=(...)).as_text()`` is MLIR text. :class:`Mlir` maps
each ``func.func`` name to its body, splits a body at its ``stablehlo.while``
loops, reads ``@main``'s arguments (tensor type, memory kind, sharded mesh axes)
and counts host-to-device placements (``annotate_device_placement`` custom calls
to ``"device"``) reachable from a region through calls.

The tests reach it through the ``mlir`` fixture of ``tests/conftest.py``, or
``from hlo import Mlir`` (conftest puts ``tests/`` on ``sys.path``). It is a
text scanner for the programs this suite lowers, not a general MLIR parser.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Any

_ANNOTATE = "@annotate_device_placement("
_TO_DEVICE = '_xla_buffer_placement = "device"'


@dataclasses.dataclass(frozen=True)
class MainArg:
  """One argument of ``@main``: its tensor type, memory kind and sharded mesh axes per dim."""

  type: str
  memory_kind: str
  spec: tuple[Any, ...]  # like PartitionSpec entries, trailing unsharded dims dropped


@dataclasses.dataclass(frozen=True)
class WhileLoop:
  operands: list[str]  # SSA values fed to the loop (its initial carried tuple)
  types: list[str]
  body: str  # the ``do { ... }`` region


def _matching(text: str, start: int, open_: str = "{", close: str = "}") -> int:
  """Index of the bracket closing the one at ``start`` (string literals skipped)."""
  depth, i, in_str = 0, start, False
  while i < len(text):
    c = text[i]
    if in_str:
      if c == "\\":
        i += 1
      elif c == '"':
        in_str = False
    elif c == '"':
      in_str = True
    elif c == open_:
      depth += 1
    elif c == close:
      depth -= 1
      if depth == 0:
        return i
    i += 1
  raise ValueError(f"unbalanced {open_!r} at {start}")


class Mlir:
  """A parsed module: ``funcs`` maps each ``func.func`` name to its body text."""

  _FUNC = re.compile(r"^\s*func\.func\s+(?:public\s+|private\s+)?@([\w$.\-]+)\(", re.M)
  _CALL = re.compile(r"(?<![\w.])(?:func\.)?call @([\w$.\-]+)\(")
  _DEF = re.compile(r"^\s*(%[\w#:]+) = stablehlo\.custom_call @annotate_device_placement\(", re.M)

  def __init__(self, text: str) -> None:
    self.text = text
    self.funcs: dict[str, str] = {}
    self.headers: dict[str, str] = {}
    for m in self._FUNC.finditer(text):
      line_end = text.index("\n", m.end())
      brace = text.rindex("{", m.end(), line_end + 1)
      end = _matching(text, brace)
      self.headers[m.group(1)] = text[m.start() : brace]
      self.funcs[m.group(1)] = text[brace + 1 : end]

  # -- @main's signature --

  def main_args(self) -> list[MainArg]:
    header = self.headers["main"]
    open_ = header.index("@main(") + len("@main")
    sig = header[open_ + 1 : _matching(header, open_, "(", ")")]
    starts = [m.start() for m in re.finditer(r"%arg\d+: ", sig)] + [len(sig)]
    out = []
    for a, b in itertools.pairwise(starts):
      chunk = sig[a:b]
      kind = re.search(r'mhlo\.memory_kind = "(\w+)"', chunk)
      dims = re.search(r"#sdy\.sharding<@\w+, \[(.*?)\]>", chunk)
      spec: list[Any] = []
      for axes in re.findall(r"\{([^}]*)\}", dims.group(1)) if dims else []:
        names = re.findall(r'"(\w+)"', axes)
        spec.append(None if not names else names[0] if len(names) == 1 else tuple(names))
      while spec and spec[-1] is None:
        spec.pop()
      tensor = re.search(r"tensor<[^>]*>", chunk)
      # No memory_kind attribute means the default memory: device.
      kind_name = kind.group(1) if kind else "device"
      out.append(MainArg(tensor.group(0) if tensor else "", kind_name, tuple(spec)))
    return out

  # -- loops and placements --

  @staticmethod
  def split_loops(body: str) -> tuple[str, list[WhileLoop]]:
    """``body`` without its top-level while loops, and those loops."""
    outside, loops, pos = [], [], 0
    pattern = re.compile(r"stablehlo\.while\(")
    while (m := pattern.search(body, pos)) is not None:
      close = _matching(body, m.end() - 1, "(", ")")
      pairs = re.findall(r"%[\w#]+ = (%[\w#:]+)", body[m.end() : close])
      line_end = body.index("\n", close)
      types = re.findall(r"tensor<[^>]*>", body[close:line_end])
      cond = body.index("cond {", close)
      cond_end = _matching(body, cond + len("cond "))
      do = body.index("do {", cond_end)
      do_end = _matching(body, do + len("do "))
      loops.append(WhileLoop(pairs, types, body[do + len("do {") : do_end]))
      outside.append(body[pos : m.start()])
      pos = do_end + 1
    outside.append(body[pos:])
    return "".join(outside), loops

  @staticmethod
  def _direct(text: str) -> int:
    return sum(1 for line in text.splitlines() if _ANNOTATE in line and _TO_DEVICE in line)

  def placements_all(self, text: str) -> int:
    """Placements to device executed by ``text``, following calls."""
    return self._direct(text) + sum(
      self.placements_all(self.funcs[c]) for c in self._CALL.findall(text)
    )

  def placements(self, func: str = "main") -> tuple[int, int]:
    """(placements outside every while loop, placements inside loop bodies) of ``func``."""
    outside, loops = self.split_loops(self.funcs[func])
    out = self._direct(outside)
    inside = sum(self.placements_all(loop.body) for loop in loops)
    for callee in self._CALL.findall(outside):
      o, i = self.placements(callee)
      out, inside = out + o, inside + i
    return out, inside

  def loops(self, func: str = "main") -> list[WhileLoop]:
    return self.split_loops(self.funcs[func])[1]

  def annotated_values(self, func: str = "main") -> set[str]:
    """SSA names in ``func`` that are results of a placement to device."""
    body = self.funcs[func]
    return {
      m.group(1)
      for m in self._DEF.finditer(body)
      if _TO_DEVICE in body[m.start() :].split("\n", 1)[0]
    }
