"""Memory kinds and shardings: where each parameter leaf lives.

Placement is derived from the parameter tree and the policy, never by mutating
modules: each leaf's :class:`~jax.sharding.PartitionSpec` comes from the
model's partitioning metadata (NNX ``with_partitioning`` / Linen
``with_logical_partitioning``), logical names are mapped to mesh axes through
``rules``, and the memory kind comes from the policy (static leaves and
fully-resident units on ``device``; layerwise units on ``pinned_host``).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_residency._src.errors import PlacementError, format_paths
from jax_residency._src.plan.split import Leaf, SplitModel
from jax_residency._src.typing import path_str, tensor_nbytes

DEVICE = "device"
PINNED_HOST = "pinned_host"

Rules = Sequence[tuple[str, str | tuple[str, ...] | None]]


def default_mesh(values: Sequence[Any] = ()) -> Mesh:
  """The mesh a placement uses when it is given none.

  In order: the mesh set with ``jax.set_mesh``; the mesh the model's arrays
  (``values``) are already sharded over, or the one device they all sit on;
  else the default device alone (``jax_default_device``, or the first local
  device), which is where the plain model runs. Replicating over every local
  device instead would keep a copy of each unit per device and move each unit
  once per device, for nothing at batch sizes one device handles: pass a mesh
  to shard or replicate.
  """
  ambient = jax.sharding.get_mesh()
  if not ambient.empty:
    return ambient
  shardings = {v.sharding for v in values if isinstance(v, jax.Array)}
  meshes = {s.mesh for s in shardings if isinstance(s, NamedSharding)}
  devices = {d for s in shardings for d in s.device_set}
  if len(meshes) == 1 and all(isinstance(s, NamedSharding) for s in shardings):
    (mesh,) = meshes
    if isinstance(mesh, Mesh):  # its axis names are the ones the model's metadata uses
      return mesh
  if len(devices) == 1:
    return Mesh(np.array(list(devices)), ("devices",))
  return Mesh(np.array([default_device()]), ("devices",))


def default_device() -> jax.Device:
  """Where JAX puts an array given no device: ``jax_default_device``, else the first local one."""
  chosen: Any = getattr(jax.config, "jax_default_device", None)
  if isinstance(chosen, jax.Device):
    return chosen
  if isinstance(chosen, str):
    return jax.local_devices(backend=chosen)[0]
  return jax.local_devices()[0]


def memory_kinds(mesh: Mesh) -> set[str]:
  """Memory kinds every device of ``mesh`` can address."""
  kinds: set[str] | None = None
  for d in mesh.devices.flat:
    mine = {m.kind for m in d.addressable_memories()}
    kinds = mine if kinds is None else kinds & mine
  return kinds or set()


def require_memory_kind(mesh: Mesh, kind: str) -> None:
  if kind not in memory_kinds(mesh):
    raise PlacementError(
      f"the devices of this mesh ({mesh.devices.flat[0].platform}) have no {kind!r} memory "
      f"(they have {sorted(memory_kinds(mesh))}); choose FullyResident or DenseDiskStream, "
      "or upgrade jax/jaxlib to a version with memory kinds for this backend"
    )


def resolve_specs(leaves: Sequence[Leaf], mesh: Mesh, rules: Rules | None) -> list[PartitionSpec]:
  """Maps each leaf's (possibly logical) spec onto ``mesh`` axes.

  Raises one :class:`PlacementError` listing every leaf whose axis names are
  neither mesh axes nor mapped by ``rules``.
  """
  table: Mapping[str, Any] = dict(rules or ())
  axes = set(mesh.axis_names)
  bad: list[str] = []
  out: list[PartitionSpec] = []

  def resolve(name: Any) -> Any:
    if name is None:
      return None
    if isinstance(name, tuple):
      mapped = tuple(resolve(n) for n in name)
      kept = tuple(m for m in mapped if m is not None)
      return kept or None
    if name in axes:
      return name
    if name in table:
      return table[name]
    raise KeyError(name)

  for leaf in leaves:
    try:
      spec = PartitionSpec(*(resolve(n) for n in leaf.spec))
    except KeyError as e:
      bad.append(f"{path_str(leaf.path)}: axis {e.args[0]!r} in {leaf.spec}")
      continue
    if len(spec) > len(leaf.shape):
      bad.append(f"{path_str(leaf.path)}: spec {spec} has more axes than shape {leaf.shape}")
      continue
    out.append(spec)
  if bad:
    raise PlacementError(
      f"partitioning names that are not axes of the mesh {tuple(mesh.axis_names)}; pass "
      "rules=[(logical_name, mesh_axis), ...] or a mesh with these axes:\n" + format_paths(bad)
    )
  return out


def unit_slice_spec(leaf: Leaf, spec: PartitionSpec) -> PartitionSpec:
  """The spec of one unit of a stacked leaf (the layer axis removed)."""
  if len(spec) and spec[0] is not None:
    raise PlacementError(
      f"{path_str(leaf.path)} is sharded over its layer axis ({spec}); units are moved one "
      "layer at a time, so the layer axis must be unsharded (use "
      "transform_metadata={nnx.PARTITION_NAME: None} in nnx.vmap, or shard another axis)"
    )
  return PartitionSpec(*spec[1:])


def sharding(mesh: Mesh, spec: PartitionSpec, kind: str) -> NamedSharding:
  return NamedSharding(mesh, spec, memory_kind=kind)


@dataclasses.dataclass(frozen=True)
class Layout:
  """Where each leaf of a split model goes.

  Attributes:
    static: the static leaves, in ``device`` memory.
    units: the stacked unit leaves, in the policy's unit memory kind.
    unit_slices: one unit of each stacked leaf, in ``device`` memory (where a
      unit is moved to when it runs).
  """

  static: list[NamedSharding]
  units: list[NamedSharding]
  unit_slices: list[NamedSharding]


def layout(split: SplitModel, mesh: Mesh, rules: Rules | None, *, unit_kind: str) -> Layout:
  """Derives every leaf's sharding from its partitioning metadata and the policy."""
  specs = resolve_specs(split.leaves, mesh, rules)
  return Layout(
    static=[sharding(mesh, specs[i], DEVICE) for i in split.static_index],
    units=[sharding(mesh, specs[i], unit_kind) for i in split.unit_index],
    unit_slices=[
      sharding(mesh, unit_slice_spec(split.leaves[i], specs[i]), DEVICE) for i in split.unit_index
    ],
  )


def per_device_bytes(shape: tuple[int, ...], dtype: np.dtype, s: jax.sharding.Sharding) -> int:
  """Bytes one device holds of an array of ``shape`` under ``s``."""
  return tensor_nbytes(s.shard_shape(shape), dtype)


def per_process_bytes(shape: tuple[int, ...], dtype: np.dtype, s: jax.sharding.Sharding) -> int:
  """Bytes this process holds of such an array: one copy per addressable device."""
  return per_device_bytes(shape, dtype, s) * len(s.addressable_devices)


def put(values: Sequence[Any], shardings: Sequence[jax.sharding.Sharding]) -> list[jax.Array]:
  """Places host or device values with the given shardings (one transfer per leaf).

  A ``jax.Array`` already laid out as asked (same devices, partitioning and
  memory kind) is used as it is, not copied: placing a model that is already
  on its device costs no memory.
  """
  out: list[Any] = list(values)
  todo = [
    i
    for i, (v, s) in enumerate(zip(values, shardings, strict=True))
    if not (
      isinstance(v, jax.Array)
      and v.sharding.memory_kind == s.memory_kind
      and v.sharding.is_equivalent_to(s, v.ndim)
    )
  ]
  moved = jax.device_put([values[i] for i in todo], [shardings[i] for i in todo])
  for i, v in zip(todo, moved, strict=True):
    out[i] = v
  return out


def held_units(
  units: Sequence[Any], stacks: Sequence[tuple[slice, int]]
) -> dict[str, tuple[int, int]]:
  """``{memory kind: (units, bytes)}`` of the unit arrays in ``units`` that are alive:
  for each kind, the most bytes any one device holds in it, and the units of the
  stacks (``(leaf slice, unit count)``) with a live leaf there. A kind holding nothing
  answers ``(0, 0)``.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> a, b = jnp.zeros((3, 4)), jnp.zeros((3, 2), jnp.int8)  # one stack of 3 units
    >>> held_units([a, b], [(slice(0, 2), 3)])["device"], held_units([a], [])["pinned_host"]
    ((3, 54), (0, 0))
    >>> b.delete()
    >>> held_units([a, b], [(slice(0, 2), 3)])["device"]
    (3, 48)
  """
  per_device: dict[tuple[str, Any], int] = collections.defaultdict(int)
  kinds_of: list[set[str]] = [set() for _ in units]
  for i, a in enumerate(units):
    if not isinstance(a, jax.Array) or a.is_deleted():
      continue
    kind = a.sharding.memory_kind or DEVICE
    shard = math.prod(a.sharding.shard_shape(a.shape)) * a.dtype.itemsize
    for device in a.sharding.addressable_devices:
      per_device[(kind, device)] += shard
    kinds_of[i].add(kind)
  out: dict[str, tuple[int, int]] = collections.defaultdict(lambda: (0, 0))
  for kind in {k for k, _ in per_device}:
    count = sum(n for leaves, n in stacks if any(kind in ks for ks in kinds_of[leaves]))
    out[kind] = (count, max(v for (k, _), v in per_device.items() if k == kind))
  return out
