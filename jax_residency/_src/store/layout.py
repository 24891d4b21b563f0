"""How `save_store` lays a model's arrays out: the static ones, each layer stack with its
unit count, and which of a stack's arrays are written one chunk per expert
(docs/design.md, 5.6)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_residency._src import errors
from jax_residency._src.store import checks
from jax_residency._src.store.discovery import as_path
from jax_residency._src.typing import ParamPath, path_str

if TYPE_CHECKING:
  from jax.typing import ArrayLike


def host(value: Any) -> Any:
  """Keeps array-likes with shape/dtype as they are (sliced lazily); else numpy."""
  if hasattr(value, "shape") and hasattr(value, "dtype") and hasattr(value, "__getitem__"):
    return value
  return np.asarray(value)


#: One layer stack to write: its prefix, its arrays by path inside it, its unit count.
LaidOut = tuple[ParamPath, dict[ParamPath, Any], int]


def stacks_argument(
  units: Mapping[tuple[str, ...], ArrayLike] | None,
  unit_prefix: tuple[str, ...] | None,
  stacks: Mapping[tuple[str, ...], Mapping[tuple[str, ...], ArrayLike]] | None,
) -> Mapping[tuple[str, ...], Mapping[tuple[str, ...], ArrayLike]]:
  """`save_store`'s stacks, given as ``stacks=`` or as ``units=`` with ``unit_prefix=``."""
  if stacks is None:
    if unit_prefix is None or units is None:
      raise errors.StoreError("save_store needs units= and unit_prefix=, or stacks=.")
    stacks = {tuple(unit_prefix): units}
  elif units is not None or unit_prefix is not None:
    raise errors.StoreError("save_store takes stacks= or units= with unit_prefix=, not both.")
  if not stacks:
    raise errors.StoreError("save_store needs at least one layer stack; got none.")
  return stacks


def lay_out(
  static: Mapping[tuple[str, ...], ArrayLike],
  stacks: Mapping[tuple[str, ...], Mapping[tuple[str, ...], ArrayLike]],
) -> tuple[dict[ParamPath, Any], list[LaidOut]]:
  """The static arrays by path, and each stack with its unit count (checked equal
  across the stack's arrays)."""
  static_arrays = {as_path(k): host(v) for k, v in static.items()}
  laid_out: list[LaidOut] = []
  for key, arrays in stacks.items():
    prefix = as_path(key)
    unit_arrays = {as_path(k): host(v) for k, v in arrays.items()}
    laid_out.append(
      (prefix, unit_arrays, checks.stack_unit_count(prefix, unit_arrays, static_arrays))
    )
  return static_arrays, laid_out


def expert_arrays(
  laid_out: Sequence[LaidOut], experts: Sequence[ParamPath], *, where: str = "save"
) -> tuple[dict[ParamPath, frozenset[ParamPath]], dict[ParamPath, int]]:
  """Each stack's arrays under an ``experts`` path (relative to a unit), and its expert
  count (the arrays' second axis, the same for all of a stack's).

  Raises:
    StoreError: an ``experts`` path names no array of any stack, or the arrays under
      them disagree on their expert count (or have no expert axis).
  """
  chosen: dict[ParamPath, frozenset[ParamPath]] = {}
  counts: dict[ParamPath, int] = {}
  used: set[ParamPath] = set()
  for prefix, arrays, _ in laid_out:
    picked = {p: a for p, a in arrays.items() for e in experts if p[: len(e)] == e}
    used.update(e for e in experts for p in picked if p[: len(e)] == e)
    if not picked:
      continue
    found = {path_str(p): tuple(a.shape) for p, a in picked.items()}
    sizes = {s[1] if len(s) >= 3 else 0 for s in found.values()}
    if len(sizes) != 1 or 0 in sizes:
      raise errors.StoreError(
        f"{where}: the arrays under experts={[path_str(e) for e in experts]} in stack "
        f"{path_str(prefix)!r} must each hold (units, experts, ...) with one expert count; "
        f"found:\n{errors.format_paths(f'{k}: {v}' for k, v in found.items())}\nPass the "
        "path of the module whose parameters are stacked per expert."
      )
    chosen[prefix], counts[prefix] = frozenset(picked), sizes.pop()
  unused = [path_str(e) for e in experts if e not in used]
  if unused:
    leaves = sorted({path_str(p[:-1]) for _, arrays, _ in laid_out for p in arrays if len(p) > 1})
    raise errors.StoreError(
      f"{where}: experts={unused} names no parameters of a unit; nothing was written. A path "
      f"is relative to a unit, e.g. 'mlp.experts'; a unit's modules:\n"
      f"{errors.format_paths(leaves)}"
    )
  return chosen, counts
