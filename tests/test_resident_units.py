"""Units kept resident by a dense stream (docs/design.md, 4.6): the first
``device_resident_units`` of each stack on the device and the next
``host_resident_units`` in host memory, read once at placement. Parity on both meshes
and for two stacks is in tests/test_stacks.py (``dense_resident``); here: what moves,
the reads' order, the plan and budgets, and bad input.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from policies import one_program
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency import testing
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.stream import engine as engine_module
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency.toy import ToyConfig

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=8)
UNIT = CFG.unit_bytes()
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))

model, tokens, store = toy_fixtures(CFG, seeded=True)


def _dense(host_units: int | None, device_kept: int, host_kept: int, **fields):
  host = None if host_units is None else host_units * UNIT
  return jr.DenseDiskStream(
    host_budget_bytes=host,
    device_resident_units=device_kept,
    host_resident_units=host_kept,
    **fields,
  )


@pytest.mark.parametrize(
  "host_units, device_kept, host_kept",
  [(0, 3, 0), (0, 8, 0), (5, 2, 3), (8, 0, 8), (3, 1, 1)],
  ids=["direct-3-on-device", "direct-all-on-device", "cached-2+3", "all-in-host", "cached-1+1"],
)
def test_kept_units_move_nothing_after_placement(
  model, tokens, store, host_units, device_kept, host_kept
):
  """Three passes, each the plain model's output bit for bit: device-resident units are
  never read or moved, host-resident ones are moved to the device but never read, and
  the streamed rest move as in a stream without kept units."""
  want = np.asarray(model(tokens))
  policy = _dense(host_units, device_kept, host_kept)
  with jr.place(model, policy, store=store, mesh=MESH1) as placed:
    outs = [np.asarray(placed(tokens)) for _ in range(3)]
    report = placed.report()
    testing.assert_within_budgets(placed)
    meta = placed.metadata
  for out in outs:
    np.testing.assert_array_equal(out, want)
  streamed = 8 - device_kept - host_kept
  cache_room = max(0, host_units - host_kept)
  for k, p in enumerate(report.passes):
    read = p.disk_to_host_bytes + p.disk_to_device_bytes
    if host_units == 0:
      assert read == p.disk_to_device_bytes == streamed * UNIT
    elif k == 0:
      assert p.disk_to_host_bytes == streamed * UNIT and p.disk_to_device_bytes == 0
    elif streamed <= cache_room:  # every streamed unit stayed in the cache
      assert read == 0
    else:  # some of them did, or none (a cache of fewer units than a pass cycles through)
      assert 0 < p.disk_to_host_bytes <= streamed * UNIT and p.disk_to_device_bytes == 0
    assert p.host_to_device_bytes == (0 if host_units == 0 else (8 - device_kept) * UNIT)
    assert p.device.requests == 8 - device_kept  # kept units never ask the window
    assert p.host.requests == (0 if host_units == 0 else streamed)  # nor the host cache
    assert p.peak_device_units <= device_kept + 2
    assert p.peak_device_bytes >= device_kept * UNIT
    assert p.peak_host_units >= host_kept
  assert meta.item_bytes("device-resident units") == device_kept * UNIT
  assert meta.item_bytes("host-resident units") == host_kept * UNIT
  assert meta.resident.device == tuple(range(device_kept))
  assert meta.resident.host == tuple(range(device_kept, device_kept + host_kept))


def test_a_pass_reads_only_streamed_units_and_the_first_while_kept_ones_compute(
  model, tokens, store, monkeypatch
):
  """Direct loading with three units on the device: no read of a kept unit during a
  pass, and the first streamed unit (3) is read before the forward asks for the last
  kept one (2), so it is ready when the kept units are done."""
  events: list[tuple[str, int]] = []
  read_unit, fetch = UnitStore.read_unit, engine_module.DenseStreamEngine._fetch

  def logged_read(self, i, /, **kwargs):
    events.append(("read", i))
    return read_unit(self, i, **kwargs)

  def logged_fetch(self, i, upcoming):
    events.append(("fetch", i))
    return fetch(self, i, upcoming)

  monkeypatch.setattr(UnitStore, "read_unit", logged_read)
  monkeypatch.setattr(engine_module.DenseStreamEngine, "_fetch", logged_fetch)
  with jr.place(model, _dense(0, 3, 0), store=store, mesh=MESH1) as placed:
    assert events == [("read", 0), ("read", 1), ("read", 2)]  # at placement
    events.clear()
    placed(tokens)
  reads = [i for kind, i in events if kind == "read"]
  assert reads == [3, 4, 5, 6, 7]
  assert events.index(("read", 3)) < events.index(("fetch", 2))


def test_a_host_resident_unit_moves_to_the_cpu_device_in_place(model, tokens, store, monkeypatch):
  """On CPU a host-resident unit's move is no copy: its tensors sit page-aligned in
  memory the placement owns, and the device arrays of each move are those tensors
  (a copy each pass cost 80 ms on a 192 MiB unit: design 4.6)."""
  moved: list[tuple[list[int], list[int]]] = []
  to_device = StreamedStack.to_device

  def logged(self, host, **kw):
    arrays = to_device(self, host, **kw)
    sources = [host[p].ctypes.data for p in self.rel_paths]
    # A step takes an aligned host array as it is on one CPU device (`in_place`).
    moved.append((sources, [_address(a) for a in arrays]))
    return arrays

  monkeypatch.setattr(StreamedStack, "to_device", logged)
  with jr.place(model, _dense(3, 1, 1), store=store, mesh=MESH1) as placed:
    kept = placed._placed()._engine._kept.in_host(1)
    assert all(a.ctypes.data % 4096 == 0 for a in kept.values())
    moved.clear()
    np.testing.assert_array_equal(np.asarray(placed(tokens)), np.asarray(model(tokens)))
  ours = {a.ctypes.data for a in kept.values()}
  (sources, targets), *_ = [m for m in moved if set(m[0]) == ours]
  if jax.default_backend() == "cpu":
    assert targets == sources


def _address(a: np.ndarray | jax.Array) -> int:
  return a.ctypes.data if isinstance(a, np.ndarray) else a.unsafe_buffer_pointer()


def test_budget_errors_name_the_kept_units(model, store):
  with pytest.raises(jr.DeviceBudgetTooSmallError, match=r"device-resident=\d+ .*6 units") as e:
    jr.place(model, _dense(0, 6, 0, device_budget_bytes=7 * UNIT), store=store, mesh=MESH1)
  assert e.value.resident == 6 * UNIT and e.value.required > e.value.budget
  assert "device_resident_units" in str(e.value)
  with pytest.raises(jr.HostBudgetTooSmallError, match=r"host-resident=\d+ .*4 units") as e:
    jr.place(model, _dense(5, 0, 4), store=store, mesh=MESH1)  # 4 kept + 2 ahead > 5
  assert e.value.resident == 4 * UNIT and "host_resident_units" in str(e.value)


def test_more_kept_units_than_a_stack_holds_is_a_placement_error(model, store):
  with pytest.raises(jr.PlacementError, match=r"6 \+ host_resident_units=3 = 9 .*layers has 8"):
    jr.place(model, _dense(None, 6, 3), store=store, mesh=MESH1)


@pytest.mark.parametrize(
  "fields, error, match",
  [
    (
      {"host_budget_bytes": 0, "host_resident_units": 2},
      jr.errors.HostDisabledControlsError,
      "host_resident_units=2",
    ),
    (
      {"device_resident_units": -1},
      jr.errors.InvalidPolicyValueError,
      "device_resident_units=-1 is negative",
    ),
    (
      {"host_resident_units": True},
      jr.errors.InvalidPolicyValueError,
      "host_resident_units=True has type bool",
    ),
    ({"device_resident_units": 1.5}, jr.errors.InvalidPolicyValueError, "pass an int"),
  ],
)
def test_bad_kept_unit_counts_raise_typed_errors(fields, error, match):
  with pytest.raises(error, match=match):
    jr.DenseDiskStream(**fields)


def test_fully_resident_takes_no_kept_units_and_the_fields_round_trip():
  with pytest.raises(jr.errors.UnknownPolicyFieldError, match="only the device budget"):
    jr.FullyResident(device_resident_units=2)
  policy = jr.DenseDiskStream(device_resident_units=2, host_resident_units=1)
  assert jr.LayerWeightResidency.from_dict(policy.to_dict()) == policy
  assert "device_resident_units=2" in repr(policy)


# --- LayerwiseHost -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def reference(model, tokens):
  """The plain model under jit: what both programs give, bit for bit (the one over the
  units' views a CPU runs and the stacked one accelerators run, docs/parity.md)."""
  return np.asarray(nnx.jit(lambda m, t: m(t))(model, tokens))


@pytest.mark.parametrize("program", ["views", "one program"])
@pytest.mark.parametrize("kept, depth", [(1, 1), (3, 2), (7, 3), (8, 2)])
def test_layerwise_host_keeps_the_first_units_in_device_memory(
  model, tokens, reference, kept, depth, program
):
  """The kept units are arrays of their own in device memory, the rest in pinned_host;
  each pass moves only the rest (a part of the loop one unit long is run as a loop too,
  so the outputs stay bit for bit the plain model's), in either form a pass runs in."""
  policy = jr.LayerwiseHost(prefetch_depth=depth, device_resident_units=kept)
  with jr.place(model, policy, mesh=MESH1) as placed:
    if program == "one program":
      one_program(placed)
    for _ in range(2):
      np.testing.assert_array_equal(np.asarray(placed(tokens)), reference)
    last = placed.report().last
    testing.assert_within_budgets(placed)
    kinds = testing.assert_memory_kinds(placed)
    arrays, meta = placed.arrays(), placed.metadata
  assert last.host_to_device_bytes == (8 - kept) * UNIT
  assert (last.peak_device_units, last.peak_device_bytes) == (kept, kept * UNIT)
  assert (last.peak_host_units, last.peak_host_bytes) == (8 - kept, (8 - kept) * UNIT)
  assert meta.item_bytes("device-resident units") == kept * UNIT
  assert meta.item_bytes("host units") == (8 - kept) * UNIT
  first = [k for k in arrays if k.startswith("layers.") and k.endswith(f"[:{kept}]")]
  assert first and all(arrays[k].shape[0] == kept for k in first)
  assert all(arrays[k[: -len(f"[:{kept}]")]].shape[0] == 8 - kept for k in first)
  assert kinds["device"] > len(first)


def test_layerwise_host_with_kept_units_lowers_only_the_rest_to_pinned_host(model, tokens):
  policy = jr.LayerwiseHost(prefetch_depth=2, device_resident_units=3)
  with jr.place(model, policy, mesh=MESH1) as placed:
    text = placed.lower(tokens, platforms=("cuda",)).as_text()
  pinned = re.findall(r"tensor<(\d+)x[^>]*>[^%]*?mhlo.memory_kind = \"pinned_host\"", text)
  assert pinned and set(pinned) == {"5"}  # the 5 units not kept, and no others


class _FloatNet(nnx.Module):
  """Four stacked dense layers over a float input (so it has an input gradient)."""

  def __init__(self) -> None:
    @nnx.vmap
    def make(key: jax.Array) -> nnx.Linear:
      return nnx.Linear(8, 8, rngs=nnx.Rngs(key))

    self.layers = make(jax.random.split(jax.random.key(3), 4))

  def __call__(self, x: jax.Array) -> jax.Array:
    return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)


@pytest.mark.parametrize("kept", [1, 2])
def test_layerwise_host_input_gradients_with_kept_units(kept):
  net, x = _FloatNet(), jax.random.normal(jax.random.key(4), (2, 8))
  loss = lambda f: lambda x: (f(x) ** 2).sum()  # noqa: E731
  want = nnx.jit(lambda m, x: nnx.grad(lambda x, m: (m(x) ** 2).sum())(x, m))(net, x)
  policy = jr.LayerwiseHost(prefetch_depth=2, device_resident_units=kept)
  with jr.place(net, policy, units="layers", mesh=MESH1) as placed:
    got = jax.grad(loss(placed))(x)
  assert float(jnp.abs(want).max()) > 1e-3
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_layerwise_host_budgets_count_the_kept_units(model):
  policy = lambda **kw: jr.LayerwiseHost(device_resident_units=3, **kw)  # noqa: E731
  with jr.place(model, policy(host_budget_bytes=5 * UNIT), mesh=MESH1) as placed:
    static = placed.metadata.static_device_bytes
  with pytest.raises(jr.HostBudgetTooSmallError, match="all but the 3 device-resident"):
    jr.place(model, policy(host_budget_bytes=5 * UNIT - 1), mesh=MESH1)
  with pytest.raises(jr.DeviceBudgetTooSmallError, match=r"device-resident=\d+ .*3 units") as e:
    jr.place(model, policy(device_budget_bytes=static + 4 * UNIT - 1), mesh=MESH1)
  assert e.value.resident == 3 * UNIT
  with pytest.raises(jr.PlacementError, match="device_resident_units=9 .*layers has 8"):
    jr.place(model, jr.LayerwiseHost(device_resident_units=9), mesh=MESH1)
