"""The arguments of :func:`jax_residency.place` (and the ``units`` and path that
:func:`jax_residency.save` shares with it), checked before anything is read or placed.

Each check raises a typed error that names the argument, the value (abbreviated)
and its type, and what to pass instead: `UnitSelectionError` for ``units`` and
``params``, `PlacementError` for ``mesh``, ``rules`` and ``sequence_axis``,
`StoreError` for a store path.
"""

from __future__ import annotations

import os
import reprlib
from collections.abc import Mapping
from typing import Any

from jax.sharding import Mesh

from jax_residency._src.errors import (
  PlacementError,
  StoreError,
  UnitSelectionError,
  format_paths,
)


def _given(name: str, value: Any) -> str:
  return f"{name}={reprlib.repr(value)} ({type(value).__name__})"


def check_units(units: Any, *, where: str) -> None:
  """``units`` must be None, a dotted path (``"decoder.layers"``), or a tuple (or list)
  of path components (``("decoder", "layers")``), none of them empty.

  Raises:
    UnitSelectionError: anything else; ``where`` (``"place"``, ``"save"``) starts the message.
  """
  if units is None:
    return
  if isinstance(units, str):
    parts: list[Any] = units.split(".")
  elif isinstance(units, tuple | list):
    parts = list(units)
  else:
    parts = []
  if parts and all(isinstance(p, str) and p for p in parts):
    return
  raise UnitSelectionError(
    f"{where}: {_given('units', units)} is not a path of the stacked layer module. Pass a "
    "str such as 'layers' or 'decoder.layers', a tuple of str such as ('decoder', 'layers'), "
    "or None to find the stack by its name."
  )


def check_store_path(path: Any, *, name: str, where: str, optional: bool = False) -> None:
  """``path`` must be a non-empty str or ``os.PathLike`` of a str (or, if ``optional``, None).

  Raises:
    StoreError: anything else, named ``name`` in the message.
  """
  if path is None and optional:
    return
  text = os.fspath(path) if isinstance(path, os.PathLike) else path
  if isinstance(text, str) and text:
    return
  none = ", or None" if optional else ""
  raise StoreError(
    f"{where}: {_given(name, path)} is not a store path. Pass a directory (a str or "
    f"pathlib.Path) or a TensorStore kvstore URL such as 'memory://name'{none}."
  )


def _bad_rules(rules: Any) -> list[str] | None:
  """The entries of ``rules`` that are not (logical name, mesh axes) pairs; None if
  ``rules`` itself is neither a mapping nor a list or tuple of pairs."""
  if isinstance(rules, Mapping):
    pairs = list(rules.items())
  elif isinstance(rules, tuple | list):
    pairs = list(rules)
  else:
    return None
  bad = []
  for i, pair in enumerate(pairs):
    ok = isinstance(pair, tuple | list) and len(pair) == 2 and isinstance(pair[0], str)
    if ok:
      axes = pair[1]
      ok = axes is None or isinstance(axes, str)
      ok = ok or (isinstance(axes, tuple | list) and all(isinstance(a, str) for a in axes))
    if not ok:
      bad.append(f"rules[{i}] = {reprlib.repr(pair)}")
  return bad


def check_place_arguments(
  *, params: Any, mesh: Any, units: Any, rules: Any, store: Any, sequence_axis: Any
) -> None:
  """Checks the types of :func:`jax_residency.place`'s keyword arguments.

  Raises:
    UnitSelectionError: ``units`` is not a path, or ``params`` not a mapping of
      Linen variables.
    PlacementError: ``mesh`` is not a ``jax.sharding.Mesh``, ``rules`` not
      (logical name, mesh axes) pairs, or ``sequence_axis`` not an int.
    StoreError: ``store`` is not a path.

  Example:
    >>> from jax_residency._src.errors import PlacementError
    >>> check_place_arguments(
    ...   params=None, mesh=None, units="layers", rules=None, store=None, sequence_axis=1)
    >>> try:
    ...   check_place_arguments(
    ...     params=None, mesh="x", units=None, rules=None, store=None, sequence_axis=1)
    ... except PlacementError as e:
    ...   print(str(e).split(". ")[0])
    place: mesh='x' (str) is not a jax.sharding.Mesh
  """
  check_units(units, where="place")
  if params is not None and not isinstance(params, Mapping):
    raise UnitSelectionError(
      f"place: {_given('params', params)} is not a Linen model's variables. Pass the "
      "mapping model.init(...) returns (its 'params' collection holds the weights), or "
      "None for an NNX module."
    )
  if mesh is not None and not isinstance(mesh, Mesh):
    raise PlacementError(
      f"place: {_given('mesh', mesh)} is not a jax.sharding.Mesh. Pass a Mesh, e.g. "
      "jax.make_mesh((n,), ('model',)), or None for the default (the ambient mesh, else "
      "the devices the model is on)."
    )
  if rules is not None:
    bad = _bad_rules(rules)
    if bad is None:
      raise PlacementError(
        f"place: {_given('rules', rules)} is not logical axis rules. Pass a list of "
        "(logical_name, mesh_axes) pairs, e.g. [('embed', None), ('mlp', 'model')], or None."
      )
    if bad:
      raise PlacementError(
        f"place: rules must be (logical_name, mesh_axes) pairs: a str, then a mesh axis "
        f"name, a tuple of them or None; these entries are not:\n{format_paths(bad)}"
      )
  check_store_path(store, name="store", where="place", optional=True)
  if isinstance(sequence_axis, bool) or not isinstance(sequence_axis, int):
    raise PlacementError(
      f"place: {_given('sequence_axis', sequence_axis)} is not an int. Pass the axis of the "
      "first array argument that counts tokens, e.g. sequence_axis=1 (the default)."
    )
