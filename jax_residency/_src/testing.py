"""Checks a user puts in their own test suite (``jax_residency.testing``).

`assert_policy_parity` runs the plain model and the model placed under each
policy and compares the outputs; `assert_memory_kinds` checks where a
placement's arrays live; `assert_within_budgets` checks a placement's reports
against its plan. Each raises ``AssertionError`` with a message that names what
differs, so a failing test says why.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from flax import nnx

from jax_residency._src.plan.shardings import DEVICE, PINNED_HOST
from jax_residency._src.policy.types import (
  DenseDiskStream,
  FullyResident,
  LayerWeightResidency,
  LayerwiseHost,
)
from jax_residency._src.run.place import PlacedModel, place
from jax_residency._src.store.save import save


def default_policies() -> dict[str, LayerWeightResidency]:
  """One placement of each kind: resident, a two-layer host window, a disk stream with
  a host cache and one without (direct disk to device)."""
  return {
    "fully_resident": FullyResident(),
    "layerwise_host": LayerwiseHost(prefetch_depth=2),
    "dense_disk_stream": DenseDiskStream(host_budget_bytes="256MiB"),
    "dense_direct": DenseDiskStream(host_budget_bytes=0),
  }


def _plain(
  model: Any, params: Any, args: tuple[Any, ...], kwargs: dict[str, Any], jit: bool
) -> Any:
  """The plain model's output: jitted (what FullyResident / LayerwiseHost run, one program)
  or eager (what a dense stream's per-unit steps run)."""
  if isinstance(model, nnx.Module):
    return (
      nnx.jit(lambda m, *a, **k: m(*a, **k))(model, *args, **kwargs)
      if jit
      else model(*args, **kwargs)
    )
  if isinstance(model, nn.Module):
    apply = jax.jit(model.apply) if jit else model.apply
    return apply(params, *args, **kwargs)
  raise TypeError(f"expected an nnx.Module or a linen Module, got {type(model).__name__}")


@contextlib.contextmanager
def _store_for(
  model: Any, params: Any, units: Any, store: str | None, args: tuple[Any, ...]
) -> Iterator[str]:
  if store is not None:
    yield store
    return
  with tempfile.TemporaryDirectory(prefix="jax_residency-parity-") as tmp:
    path = os.path.join(tmp, "store")
    save(model, path, params=params, units=units, example=None if units else args, progress=False)
    yield path


def _max_diff(name: str, got: Any, want: Any) -> float:
  diffs = []
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    if np.shape(a) != np.shape(b):  # never compared by broadcasting
      raise AssertionError(
        f"under {name} an output has shape {np.shape(a)}, the plain model's {np.shape(b)}"
      )
    diffs.append(
      float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
    )
  return max(diffs, default=0.0)


def assert_policy_parity(
  model: Any,
  *args: Any,
  policies: dict[str, LayerWeightResidency] | Sequence[LayerWeightResidency] | None = None,
  atol: float = 0.0,
  params: Any = None,
  units: Any = None,
  store: str | None = None,
  mesh: jax.sharding.Mesh | None = None,
  **kwargs: Any,
) -> dict[str, float]:
  """Asserts that ``model`` placed under each policy gives the plain model's outputs.

  ``DenseDiskStream`` (which runs one compiled step per layer, as eager execution
  does) is compared with the plain model run eagerly; ``FullyResident`` and
  ``LayerwiseHost`` (one program) with the plain model under ``jax.jit``. On CPU, on
  one device, each is bit-identical: the default ``atol=0``; on accelerators pass a
  tolerance. A dense
  stream reads a store written for the test in a temporary
  directory, unless ``store`` is given.

  Args:
    model: an ``nnx.Module``, or a Linen module (then pass ``params``).
    *args: the call's arguments (and ``**kwargs``).
    policies: the policies, by name (a dict) or as a list; default
      `default_policies`.
    atol: the largest absolute difference allowed.
    params, units, mesh: as for :func:`jax_residency.place`.
    store: a store of the model to stream from.

  Returns:
    The largest absolute difference under each policy, by name.

  Raises:
    AssertionError: some policy's outputs differ by more than ``atol`` (the
      message lists every policy with its difference), or an output's shape
      differs from the plain model's.

  Example:
    >>> import jax, jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.testing import assert_policy_parity
    >>> class Net(nnx.Module):
    ...   def __init__(self, rngs):
    ...     self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(
    ...         jax.random.split(rngs.params(), 3))
    ...   def __call__(self, x):
    ...     return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)
    >>> assert_policy_parity(Net(nnx.Rngs(0)), jnp.ones((2, 8)))
    {'fully_resident': 0.0, 'layerwise_host': 0.0, 'dense_disk_stream': 0.0, 'dense_direct': 0.0}
  """
  if policies is None:
    chosen = default_policies()
  elif isinstance(policies, dict):
    chosen = dict(policies)
  else:
    chosen = {f"{p.name}[{k}]": p for k, p in enumerate(policies)}
  reference = {
    jit: _plain(model, params, args, kwargs, jit)
    for jit in {_jitted_reference(p) for p in chosen.values()}
  }
  diffs: dict[str, float] = {}
  with _store_for(model, params, units, store, args) as path:
    for name, policy in chosen.items():
      dense = isinstance(policy, DenseDiskStream)
      with place(
        model, policy, params=params, units=units, mesh=mesh, store=path if dense else None
      ) as placed:
        got = placed(*args, **kwargs)
      diffs[name] = _max_diff(name, got, reference[_jitted_reference(policy)])
  bad = {k: v for k, v in diffs.items() if not v <= atol}
  if bad:
    lines = "\n".join(
      f"  {k}: max |difference| {v:.3g}{'  > atol' if k in bad else ''}" for k, v in diffs.items()
    )
    raise AssertionError(
      f"outputs differ from the plain model's by more than atol={atol} under "
      f"{', '.join(bad)}:\n{lines}\n(DenseDiskStream is compared with the eager plain "
      "model, FullyResident and LayerwiseHost with the plain model under jax.jit)"
    )
  return diffs


def _jitted_reference(policy: LayerWeightResidency) -> bool:
  """Whether ``policy``'s outputs are compared with the jitted plain model (else eager):
  the same on every backend and mesh."""
  return not isinstance(policy, DenseDiskStream)


def assert_memory_kinds(placed: PlacedModel) -> dict[str, int]:
  """Asserts that every array of ``placed`` lives in the memory its policy says.

  Static parameters in ``device`` memory; stacked units in ``device`` memory
  under ``FullyResident`` and in ``pinned_host`` memory under
  ``LayerwiseHost`` (but for its device-resident units, the arrays
  ``placed.arrays()`` names ``PATH[:d]``, in ``device`` memory); a dense stream
  holds no units between passes.

  Returns:
    How many arrays live in each memory kind.

  Example:
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.testing import assert_memory_kinds
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> with jr.place(model, jr.LayerwiseHost()) as placed:
    ...   kinds = assert_memory_kinds(placed)
    >>> sorted(kinds)
    ['device', 'pinned_host']
  """
  units = set(placed.stack_array_prefixes)
  expected_units = PINNED_HOST if isinstance(placed.policy, LayerwiseHost) else DEVICE
  wrong: list[str] = []
  counts: dict[str, int] = {}
  for path, array in placed.arrays().items():
    kind = str(array.sharding.memory_kind)
    counts[kind] = counts.get(kind, 0) + 1
    is_unit = any(path == u or path.startswith(u + ".") for u in units)
    # "PATH[:d]": a stack's first d units, kept in device memory (device_resident_units).
    kept = path.endswith("]") and "[:" in path
    if is_unit and isinstance(placed.policy, DenseDiskStream):
      wrong.append(f"{path}: a dense stream holds units between passes ({kind})")
    elif kind != (expected_units if is_unit and not kept else DEVICE):
      want = expected_units if is_unit and not kept else DEVICE
      wrong.append(f"{path}: in {kind!r} memory, expected {want!r}")
  if wrong:
    raise AssertionError(
      f"arrays of the {placed.policy.name} placement in the wrong memory:\n  " + "\n  ".join(wrong)
    )
  return counts


def assert_within_budgets(placed: PlacedModel) -> None:
  """Asserts that every pass so far stayed within what the placement planned.

  Checks each pass report's peaks against ``placed.metadata``: device unit
  bytes within the device window (and a dense stream's device-resident units),
  host unit bytes within the host cache and host-resident units (a dense
  stream) or the host units (``LayerwiseHost``), and static plus those device
  bytes within the device budget, where there is one. The report's totals are checked
  too, so a pass older than the report's history (``report().passes`` keeps the
  most recent 256) is covered as well.

  Example:
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jax_residency as jr
    >>> from jax_residency.testing import assert_within_budgets
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=3), rngs=nnx.Rngs(0))
    >>> path = jr.save(model, "memory://within_budgets/toy", progress=False).path
    >>> with jr.place(model, jr.DenseDiskStream(host_budget_bytes="1MiB"), store=path) as p:
    ...   _ = p(jnp.zeros((1, 4), jnp.int32))
    ...   assert_within_budgets(p)
  """
  meta = placed.metadata
  host_plan = sum(
    meta.item_bytes(name) for name in ("host cache", "host units", "host-resident units")
  )
  device_plan = meta.device_window_bytes + meta.item_bytes("device-resident units")
  budget = meta.policy.offload().device_budget_bytes
  report = placed.report()
  limits = (
    ("peak_device_bytes", "unit bytes on a device, planned window (+ resident)", device_plan),
    ("peak_host_bytes", "unit bytes in host memory, planned", host_plan),
  )
  problems = []
  for field, what, planned in limits:
    over = [p for p in report.passes if getattr(p, field) > planned]
    problems += [f"pass {p.index}: {getattr(p, field)} {what} {planned}" for p in over]
    peak = getattr(report.total, field)
    if not over and peak > planned:  # the peak of a pass the history no longer keeps
      problems.append(f"a pass before the report's history: {peak} {what} {planned}")
  if budget is not None and meta.static_device_bytes + device_plan > budget:
    problems.append(
      f"planned static + window (+ resident units) {meta.static_device_bytes + device_plan} "
      f"exceeds the device budget {budget}"
    )
  if problems:
    raise AssertionError(
      f"the {meta.policy.name} placement held more than it planned:\n  " + "\n  ".join(problems)
    )
