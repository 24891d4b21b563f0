"""Counters that merge: one base for the ledger's, the worker's and telemetry's metrics.

A metrics class is a frozen dataclass deriving from :class:`Metrics`; each field
says how two values combine in ``dataclasses.field(metadata={"merge": rule})``
(:func:`total` and :func:`peak` write that). ``a + b`` applies the rules field
by field, so adding a field is one line. Every rule skips ``None``: an optional
field (a nested metrics object, a sample some passes lack) is the other side's
value when one side has none.

A component counts a pass in a :class:`Tally` of its metrics class and hands
out :meth:`Tally.snapshot` when the pass ends.
"""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Callable, Mapping
from typing import Any, Generic, Self, TypeVar

import numpy as np

#: How two values of a field combine: counts add up (nested metrics merge), peaks are maxed.
RULES: dict[str, Callable[[Any, Any], Any]] = {"sum": operator.add, "max": max}


def total(default: Any = 0) -> Any:
  """A field summed over passes (a nested :class:`Metrics` is merged)."""
  return dataclasses.field(default=default, metadata={"merge": "sum"})


def peak(default: Any = 0) -> Any:
  """A field maxed over passes."""
  return dataclasses.field(default=default, metadata={"merge": "max"})


class Metrics:
  """Base of frozen metrics dataclasses: ``a + b`` merges them field by field."""

  def __add__(self, other: Self) -> Self:
    values = {}
    for f in dataclasses.fields(self):  # type: ignore[arg-type]
      a, b = getattr(self, f.name), getattr(other, f.name)
      values[f.name] = a if b is None else b if a is None else RULES[f.metadata["merge"]](a, b)
    return type(self)(**values)


M = TypeVar("M", bound=Metrics)


class Tally(Generic[M]):
  """The mutable counters of one pass of a :class:`Metrics` class (not thread-safe).

  Example:
    >>> @dataclasses.dataclass(frozen=True, kw_only=True)
    ... class Hits(Metrics):
    ...   hits: int = total()
    ...   peak_units: int = peak()
    >>> tally = Tally(Hits)
    >>> tally.add(hits=2)
    >>> tally.raise_to(peak_units=3)
    >>> tally.snapshot() + Hits(hits=1, peak_units=1)
    Hits(hits=3, peak_units=3)
  """

  __slots__ = ("_cls", "_values")

  def __init__(self, cls: type[M]) -> None:
    self._cls = cls
    self._values: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(cls)}  # type: ignore[arg-type]

  def add(self, **amounts: float) -> None:
    """Adds each amount to its counter."""
    for name, amount in amounts.items():
      self._values[name] += amount

  def raise_to(self, **values: float) -> None:
    """Raises each peak to the value if it is higher."""
    for name, value in values.items():
      self._values[name] = max(self._values[name], value)

  def snapshot(self) -> M:
    """The counters so far, as an immutable metrics object."""
    return self._cls(**self._values)


@dataclasses.dataclass(frozen=True, kw_only=True)
class StackPass(Metrics):
  """One layer stack's share of a pass (``PassReport.stacks[path]``).

  Attributes:
    units_run: its units the pass ran (0 for a stack the call did not run,
      e.g. the encoder during a decoder step).
    bytes_moved: bytes of its units moved to a device (from host memory or
      the store) in the pass; 0 where its units stay on the device.

  Example:
    >>> import jax.numpy as jnp, jax_residency as jr
    >>> from flax import nnx
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> with jr.place(model, jr.LayerwiseHost(), units="layers") as placed:
    ...   _ = placed(jnp.zeros((1, 4), jnp.int32))
    ...   layers = placed.report().last.stacks["layers"]
    >>> layers.units_run, layers.bytes_moved == placed.metadata.total_unit_bytes
    (2, True)
  """

  units_run: int = total()
  bytes_moved: int = total()


def freeze(x: Any) -> Any:
  """A read-only copy: mappings become ``MappingProxyType``, lists tuples."""
  if isinstance(x, Mapping):
    return types.MappingProxyType({k: freeze(v) for k, v in x.items()})
  if isinstance(x, list | tuple):
    return tuple(freeze(v) for v in x)
  return x


def plain(x: Any) -> Any:
  """Dataclasses, mappings, sequences and numpy scalars as JSON-ready Python values."""
  if dataclasses.is_dataclass(x) and not isinstance(x, type):
    return {f.name: plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
  if isinstance(x, Mapping):
    return {str(k): plain(v) for k, v in x.items()}
  if isinstance(x, list | tuple):
    return [plain(v) for v in x]
  if isinstance(x, np.integer):
    return int(x)
  if isinstance(x, np.floating):
    return float(x)
  if isinstance(x, np.bool_):
    return bool(x)
  return x
