"""What a store must hold: a unit layout it can stream (`check_layout`, when it
opens) and the tensors a model expects of it (`check_against`).

Both raise the library's `StoreError` family with messages that name every
offending tensor and how to fix it.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jax_residency._src import errors
from jax_residency._src.plan.quantized import QuantPlan
from jax_residency._src.store.discovery import FORMAT_VERSION, SIDECAR_KEY, Discovered, as_path
from jax_residency._src.typing import ParamPath, TensorSpec, path_str

if TYPE_CHECKING:
  from jax.typing import DTypeLike


def recorded_stacks(found: Discovered) -> list[ParamPath]:
  """The layer stacks a store's sidecar records, in order (none for a plain checkpoint)."""
  sidecar = found.sidecar or {}
  if sidecar.get("stacks"):
    return [as_path(tuple(e["prefix"])) for e in sidecar["stacks"]]
  if sidecar.get("unit_prefix"):
    return [as_path(tuple(sidecar["unit_prefix"]))]
  return []


def recorded_quantization(found: Discovered, path: str) -> QuantPlan | None:
  """The tensors a store's sidecar records as quantized (None for a float store).

  Raises:
    StoreLayoutError: the record names a scheme or encoding this version does not
      know (the sidecar's fields have been type-checked by `discovery.discover`).
  """
  record = (found.sidecar or {}).get("quantization")
  if record is None:
    return None
  try:
    return QuantPlan.from_dict(record)
  except errors.ResidencyError as e:
    raise errors.StoreLayoutError(
      f"{path}/{SIDECAR_KEY}: its quantization record is not one this version reads ({e}); "
      "write the store again, or upgrade jax_residency."
    ) from e


def check_layout(
  path: str,
  found: Discovered,
  unit_prefix: ParamPath | None,
  *,
  require_unit_chunks: bool,
  stacks: Sequence[ParamPath] | None = None,
  require_recorded: bool | None = None,
) -> list[tuple[ParamPath, int]]:
  """Checks that a discovered store holds stacked units; returns each stack's
  (prefix, unit count), in order.

  Args:
    path: The store's path, for messages.
    found: What `discovery.discover` found there.
    unit_prefix: Path of the stacked unit subtree; None takes the sidecar's.
    require_unit_chunks: Also reject unit arrays chunked over several units.
    stacks: Several stack prefixes (instead of ``unit_prefix``).
    require_recorded: Reject stacks the store's sidecar does not record (default:
      as ``require_unit_chunks``).

  Raises:
    StoreError: A newer format, no known unit prefix, nothing under one, or
      stacks the store was not written with.
    StoreLayoutError: Units disagree on their count, or (with
      `require_unit_chunks`) a unit array is not chunked one unit per chunk.
  """
  sidecar, arrays, paths = found.sidecar, found.arrays, list(found.arrays)
  if sidecar is not None and sidecar.get("format_version", 0) > FORMAT_VERSION:
    raise errors.StoreError(
      f"{path} was written by a newer jax_residency (format_version="
      f"{sidecar.get('format_version')}; this one reads <= {FORMAT_VERSION}). Upgrade."
    )
  recorded = recorded_stacks(found)
  if stacks is None and unit_prefix is not None:
    stacks = [unit_prefix]
  if stacks is None:
    if not recorded:
      tops = sorted({path_str(p[:2]) for p in paths if len(p) > 2})
      raise errors.StoreError(
        f"{path} has no {SIDECAR_KEY} (a plain Orbax checkpoint), so the unit prefix is "
        f"unknown. Pass unit_prefix=(...) naming the stacked layer subtree; candidates:\n"
        f"{errors.format_paths(tops)}"
      )
    stacks = recorded
  chosen = [as_path(p) for p in stacks]
  held = [p for p in chosen if any(a[: len(p)] == p and len(a) > len(p) for a in arrays)]
  if require_recorded is None:
    require_recorded = require_unit_chunks
  if recorded and require_recorded and any(p not in recorded for p in held):
    raise errors.StoreError(
      f"{path} holds the layer stack(s) {', '.join(repr(path_str(p)) for p in recorded)}, "
      f"but {', '.join(repr(path_str(p)) for p in chosen)} were chosen. Place with "
      "units= naming stacks the store holds (or leave units= out to take the store's), or "
      "save the model again with units= naming every stack to stream."
    )
  counts = {tuple(e["prefix"]): e["count"] for e in (sidecar or {}).get("stacks") or ()}
  if sidecar is not None and sidecar.get("unit_prefix") and "unit_count" in sidecar:
    counts.setdefault(tuple(sidecar["unit_prefix"]), sidecar["unit_count"])
  return [
    _check_stack(path, arrays, p, counts.get(p), require_unit_chunks=require_unit_chunks)
    for p in chosen
  ]


def _check_stack(
  path: str,
  arrays: Mapping[ParamPath, Any],
  prefix: ParamPath,
  recorded_count: int | None,
  *,
  require_unit_chunks: bool,
) -> tuple[ParamPath, int]:
  """Checks one stack of a store; returns its (prefix, unit count)."""
  units = {p: a for p, a in arrays.items() if p[: len(prefix)] == prefix and len(p) > len(prefix)}
  if not units:
    parents = sorted({path_str(p[:-1]) for p in arrays if len(p) > 1})
    raise errors.StoreError(
      f"{path} holds no arrays under unit_prefix={prefix}. Pass the prefix of the "
      f"stacked layer subtree; array parents found:\n{errors.format_paths(parents)}"
    )
  counts = {path_str(p): a.shape[0] if a.shape else None for p, a in units.items()}
  unit_count = next(iter(counts.values()))
  if unit_count is None or any(c != unit_count for c in counts.values()):
    raise errors.StoreLayoutError(
      f"Unit arrays under {prefix} in {path} must share one leading (unit) dimension; "
      f"found:\n{errors.format_paths(f'{k}: leading dim {v}' for k, v in counts.items())}\n"
      "Fix unit_prefix so it names only the stacked layers."
    )
  if recorded_count is not None and recorded_count != unit_count:
    raise errors.StoreLayoutError(
      f"{path}: {SIDECAR_KEY} records {recorded_count} units under {path_str(prefix)!r} but "
      f"the arrays hold {unit_count}. The store is inconsistent; write it again."
    )
  bad = [
    f"{path_str(p)}: chunk shape {a.read_chunk}" for p, a in units.items() if a.read_chunk[0] > 1
  ]
  if bad and require_unit_chunks:
    raise errors.StoreLayoutError(
      f"{path} cannot be streamed one unit at a time: these unit arrays hold several "
      f"units per chunk (streaming needs chunk shape (1, ...)):\n{errors.format_paths(bad)}\n"
      f"Fix: run `jax-residency rechunk {path} DST --units {path_str(prefix)}` or call "
      f"rechunk_store({path!r}, dst, unit_prefix={prefix}), then open DST."
    )
  return prefix, unit_count


def check_against(
  path: str,
  stacks: Sequence[ParamPath],
  stored_units: Mapping[ParamPath, TensorSpec],
  stored_static: Mapping[ParamPath, TensorSpec],
  expected_units: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
  expected_static: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
  *,
  strict: bool,
) -> None:
  """Checks that a store holds exactly what a model expects.

  ``stored_units`` and ``expected_units`` (per-unit shapes) and the static ones
  are keyed by full path; ``stacks`` are the stacks' prefixes, for messages;
  ``strict`` also rejects stored tensors the model does not claim.

  Raises:
    MissingCheckpointParametersError: Expected tensors are absent (checked
      first; the message counts the other problems too).
    CheckpointShapeMismatchError: Shapes or dtypes differ.
    UnexpectedCheckpointParametersError: With `strict`, unclaimed tensors.
  """
  missing, mismatched = [], []
  for label, expected, stored in (
    ("per unit", expected_units, stored_units),
    ("", expected_static, stored_static),
  ):
    for key, (shape, dtype) in expected.items():
      name = path_str(tuple(key)) + (f" ({label})" if label else "")
      want = (tuple(int(d) for d in shape), np.dtype(dtype))
      found = stored.get(tuple(key))
      if found is None:
        missing.append(f"{name}: expected {_fmt(want)}")
      elif found != want:
        mismatched.append(f"{name}: expected {_fmt(want)}, found {_fmt(found)}")
  claimed = {tuple(p) for p in expected_units} | {tuple(p) for p in expected_static}
  unexpected = []
  if strict:
    for key, spec in stored_units.items():
      if key not in claimed:
        unexpected.append(f"{path_str(key)} (per unit): {_fmt(spec)}")
    for key, spec in stored_static.items():
      if key not in claimed:
        unexpected.append(f"{path_str(key)}: {_fmt(spec)}")
  names = ", ".join(repr(path_str(p)) for p in stacks)
  where = f"the store at {path} (layer stack{'s' if len(stacks) > 1 else ''} {names})"
  if missing:
    also = _also(mismatched=len(mismatched), unexpected=len(unexpected))
    raise errors.MissingCheckpointParametersError(
      f"The model has {len(missing)} parameter(s) that {where} does not hold:\n"
      f"{errors.format_paths(missing)}\n{also}Fix: save the store from this model "
      "(save_store), or check that the stacks are the model's layer stacks."
    )
  if mismatched:
    also = _also(unexpected=len(unexpected))
    raise errors.CheckpointShapeMismatchError(
      f"{len(mismatched)} tensor(s) in {where} disagree with the model:\n"
      f"{errors.format_paths(mismatched)}\n{also}Fix: the store was written for a "
      "different model configuration; save it again from this model."
    )
  if unexpected:
    raise errors.UnexpectedCheckpointParametersError(
      f"{where} holds {len(unexpected)} tensor(s) the model does not claim:\n"
      f"{errors.format_paths(unexpected)}\nFix: pass strict_loading=False to ignore "
      "them, or save a store from this model."
    )


def check_stacks(
  path: str,
  stored_stacks: Sequence[tuple[ParamPath, Mapping[ParamPath, TensorSpec]]],
  stored_static: Mapping[ParamPath, TensorSpec],
  expected_stacks: Sequence[Mapping[ParamPath, tuple[Sequence[int], DTypeLike]]],
  expected_static: Mapping[ParamPath, tuple[Sequence[int], DTypeLike]],
  strict: bool,
) -> None:
  """`check_against` for stacks given as (prefix, unit specs keyed relative to it)."""
  stored: dict[ParamPath, TensorSpec] = {}
  expected: dict[ParamPath, tuple[Sequence[int], DTypeLike]] = {}
  for (prefix, specs), want in zip(stored_stacks, expected_stacks, strict=False):
    stored.update({prefix + rel: spec for rel, spec in specs.items()})
    expected.update({prefix + tuple(rel): spec for rel, spec in want.items()})
  check_against(
    path,
    tuple(p for p, _ in stored_stacks),
    stored,
    stored_static,
    expected,
    expected_static,
    strict=strict,
  )


def _fmt(spec: tuple[Sequence[int], Any]) -> str:
  return f"{tuple(spec[0])} {np.dtype(spec[1]).name}"


def _also(*, mismatched: int = 0, unexpected: int = 0) -> str:
  parts = [f"{mismatched} shape/dtype mismatch(es)"] if mismatched else []
  parts += [f"{unexpected} unexpected tensor(s)"] if unexpected else []
  return f"(Also found: {', '.join(parts)}.)\n" if parts else ""


def check_save_paths(full: Mapping[ParamPath, Any], prefixes: Sequence[ParamPath]) -> None:
  """Checks that full parameter paths can be saved as one Orbax tree.

  Raises:
    StoreError: paths join to one name, contain '/', are empty or nest.
  """
  problems = []
  names = collections.Counter(path_str(p) for p in full)
  problems += [f"{n}: several paths join to this Orbax name" for n, c in names.items() if c > 1]
  problems += [
    f"{path_str(p)}: a path component contains '/'" for p in full if any("/" in k for k in p)
  ]
  problems += [f"{path_str(p)}: an empty path" for p in full if not p]
  keys = sorted(full)
  problems += [
    f"{path_str(a)}: is a prefix of {path_str(b)}"
    for a, b in zip(keys, keys[1:], strict=False)
    if b[: len(a)] == a
  ]
  if problems:
    raise errors.StoreError(
      f"Cannot save these parameter paths (unit_prefix={', '.join(map(str, prefixes))}) "
      "as one Orbax tree:\n"
      f"{errors.format_paths(problems)}\nRename the parameters or choose another unit_prefix."
    )


def stack_unit_count(
  prefix: ParamPath, unit_arrays: Mapping[ParamPath, Any], static_arrays: Mapping[ParamPath, Any]
) -> int:
  """The unit count of one stack's arrays, once they are a stack under ``prefix``."""
  if not prefix:
    raise errors.StoreError("unit_prefix must name the unit subtree, e.g. ('layers',); got ().")
  if not unit_arrays:
    raise errors.StoreError(f"save_store needs at least one unit array under {prefix}; got none.")
  clash = [path_str(p) for p in static_arrays if p[: len(prefix)] == prefix]
  if clash:
    raise errors.StoreError(
      f"Static paths lie under unit_prefix={prefix}, where only units belong:\n"
      f"{errors.format_paths(clash)}\nPass them in `units` (stacked) or change unit_prefix."
    )
  leading = {
    path_str(prefix + p): (a.shape[0] if a.shape else None) for p, a in unit_arrays.items()
  }
  if len(set(leading.values())) != 1 or None in leading.values():
    raise errors.StoreError(
      "Unit arrays must be stacked on axis 0 with one common unit count; found:\n"
      f"{errors.format_paths(f'{k}: leading dim {v}' for k, v in leading.items())}\n"
      "Stack each unit parameter over the same layers."
    )
  return int(next(iter(leading.values())) or 0)
