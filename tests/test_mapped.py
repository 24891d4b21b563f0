"""Mapped unit reads (mapped.py): on CPU a unit's chunks are mapped from the store, not copied."""

from __future__ import annotations

import gc
import mmap
import os
import shutil
import time

import jax
import numpy as np
import pytest
from damage import drop_pages
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency import testing
from jax_residency._src.store import fault_in, mapped
from jax_residency._src.store import unit_store as st
from jax_residency._src.store.buffers import release_dropped_buffers
from jax_residency._src.stream.streamed_stack import StreamedStack
from jax_residency.toy import ToyConfig

# Kernels of 16-64 KiB: stored out of line in the OCDBT data files, so mappable.
CFG = ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=128, n_layers=4)
UNIT = CFG.unit_bytes()
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))


model, tokens, store = toy_fixtures(CFG, seeded=True)


def _unit_bytes_alive(opened: st.UnitStore) -> int:
  gc.collect()
  release_dropped_buffers()
  return opened.buffer_bytes


def test_mapped_reads_match_copies_and_alias_the_file(store):
  copied = st.UnitStore.open(store)
  opened = st.UnitStore.open(store)
  assert opened.use_mapped_reads()
  for i in range(CFG.n_layers):
    got, want = opened.read_unit(i), copied.read_unit(i)
    assert sorted(got) == sorted(want)
    for key, value in want.items():
      assert got[key].dtype == value.dtype and got[key].shape == value.shape
      np.testing.assert_array_equal(got[key], value, err_msg=str(key))
  assert opened.mapped_bytes_total > 0
  unit = opened.read_unit(1)
  views = {k: a for k, a in unit.items() if fault_in.region_of(a) is not None}
  # A tensor is mapped exactly when its chunk lies out of line at an offset XLA
  # can alias (the biases are small enough to sit inline in the index).
  extents = {k: opened._stacks[0].mapper._extent(k, 1) for k in unit}  # type: ignore[union-attr]
  aligned = {k for k, e in extents.items() if e is not None and e.offset % mapped.ALIGNMENT == 0}
  assert set(views) == aligned and views
  assert all(k[1] == "kernel" for k in views)
  assert all(not a.flags.writeable for a in views.values())
  big = max(views.values(), key=lambda a: a.nbytes)
  on_device = jax.device_put(big, MESH1.devices.flat[0], may_alias=True)
  assert on_device.unsafe_buffer_pointer() == big.ctypes.data  # no copy at all
  assert _unit_bytes_alive(opened) > 0
  del unit, views, big, on_device, got, want
  assert _unit_bytes_alive(opened) == 0  # mappings end with their arrays
  copied.close()
  opened.close()


def test_unaligned_chunks_are_read_instead(store, monkeypatch):
  real = mapped.ocdbt_extents

  def shifted(root):  # every extent 4 bytes off: none can be aliased by XLA
    return {k: mapped.Extent(e.file, e.offset + 4, e.length) for k, e in real(root).items()}

  monkeypatch.setattr(mapped, "ocdbt_extents", shifted)
  # The shifted extents are not where the chunks are: copies go through TensorStore.
  monkeypatch.setenv(mapped.DIRECT_READS_ENV, "0")
  copied = st.UnitStore.open(store)
  opened = st.UnitStore.open(store)
  assert opened.use_mapped_reads()
  for key, value in copied.read_unit(2).items():
    np.testing.assert_array_equal(opened.read_unit(2)[key], value)
  assert opened.mapped_bytes_total == 0


def test_opt_out_and_remote_stores_copy(store, monkeypatch, toy_model):
  monkeypatch.setenv(mapped.MAPPED_READS_ENV, "0")
  assert not st.UnitStore.open(store).use_mapped_reads()
  monkeypatch.delenv(mapped.MAPPED_READS_ENV)
  path = "memory://test_mapped/remote"
  jr.save(toy_model(CFG, seed=1, seeded=True), path, progress=False)
  assert not st.UnitStore.open(path).use_mapped_reads()


def test_truncated_chunk_file_is_a_store_error_not_a_crash(model, tmp_path):
  path = str(tmp_path / "toy")
  jr.save(model, path, progress=False)
  opened = st.UnitStore.open(path)
  assert opened.use_mapped_reads()
  opened.read_unit(0)  # reads the index; unit 3 is not mapped yet
  mapper = opened._stacks[0].mapper
  assert mapper is not None
  extents = {k: mapper._extent(k, 3) for k in opened.unit_specs}
  key, extent = next(
    (k, e) for k, e in extents.items() if e is not None and e.offset % mapped.ALIGNMENT == 0
  )
  os.truncate(extent.file, extent.offset + 8)
  # A mapping past the end of a file would crash the process (SIGBUS) on first
  # touch: the chunk is read instead, and the read reports the damage.
  with pytest.raises(jr.StoreError, match=".".join(key)):
    opened.read_unit(3)


def test_mapped_arrays_keep_their_values_when_the_store_is_replaced(model, tmp_path, toy_model):
  path = str(tmp_path / "toy")
  jr.save(model, path, progress=False)
  opened = st.UnitStore.open(path)
  assert opened.use_mapped_reads()
  unit = opened.read_unit(0)
  before = {k: np.array(v) for k, v in unit.items()}
  jr.save(toy_model(CFG, seed=5, seeded=True), path, overwrite=True, progress=False)
  for key, value in before.items():
    np.testing.assert_array_equal(unit[key], value)


def _stream(host_units: int) -> jr.DenseDiskStream:
  """A dense stream with a host cache of ``host_units`` units (0: none)."""
  return jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      device_budget_bytes=2**30,
      host_budget_bytes=host_units * UNIT,
      host_lookahead=min(2, host_units),
      background_queue_capacity=2 if host_units else 0,
    )
  )


@pytest.mark.parametrize("host_units", [0, 2, 4])
@pytest.mark.parametrize("enabled", [True, False], ids=["mapped", "copied"])
def test_stream_parity_and_accounting_with_and_without_mapping(
  model, tokens, store, host_units, enabled, monkeypatch
):
  if not enabled:
    monkeypatch.setenv(mapped.MAPPED_READS_ENV, "0")
  policy = _stream(host_units)
  expected = model(tokens)
  with jr.place(model, policy, store=store, mesh=MESH1) as placed:
    for _ in range(2):
      np.testing.assert_array_equal(placed(tokens), expected)
    np.testing.assert_array_equal(placed(tokens[:, :1]), model(tokens[:, :1]))
    testing.assert_within_budgets(placed)  # peaks within the planned device window and host cache
    report = placed.report()
  moved = report.total.disk_to_device_bytes + report.total.disk_to_host_bytes
  assert moved > 0
  if enabled and not host_units:
    assert 0 < report.total.mapped_bytes <= moved
  else:  # a host cache holds copies (docs/design.md, 4.2)
    assert report.total.mapped_bytes == 0


def test_steps_take_mapped_units_in_place_on_one_cpu_device(model, tokens, store, monkeypatch):
  """docs/design.md, section 4.2: on one CPU device the stream hands a step its unit's
  aligned host arrays as they are, the mapped ones included (no ``device_put``)."""
  handed: list[tuple[dict, list]] = []
  to_device = StreamedStack.to_device

  def logged(self, host, **kw):
    arrays = to_device(self, host, **kw)
    handed.append((dict(host), arrays))
    return arrays

  monkeypatch.setattr(StreamedStack, "to_device", logged)
  policy = _stream(0)
  with jr.place(model, policy, store=store, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), model(tokens))
    units = placed._placed()._engine._stacks  # type: ignore[attr-defined]
  assert len(handed) == CFG.n_layers
  in_place = jax.default_backend() == "cpu" and all(u.host_is_device for u in units)
  mapped_ones = 0
  for host, arrays in handed:
    for path, array in zip(units[0].rel_paths, arrays, strict=True):
      assert (array is host[path]) == in_place, path
      mapped_ones += fault_in.region_of(host[path]) is not None
  assert mapped_ones > 0


def test_retired_mappings_count_as_gone_and_still_read_their_bytes(store):
  """`UnitMapper.retire` drops a unit's mapped pages while its arrays live on: the
  mapper counts them gone at once (never twice), other arrays are left alone, and a
  read after it faults the file's pages in again, with the same bytes."""
  opened = st.UnitStore.open(store)
  assert opened.use_mapped_reads()
  want = {k: np.array(v) for k, v in opened.read_unit(2).items()}
  unit = opened.read_unit(2)
  mapper = opened._stacks[0].mapper
  assert mapper is not None and mapper.mapped_bytes > 0
  elsewhere = [np.ones(1024, np.float32)]
  assert opened.retire_mapped([*unit.values(), *elsewhere]) > 0
  assert mapper.mapped_bytes == 0
  assert opened.retire_mapped(list(unit.values())) == 0  # once only
  for key, value in want.items():
    np.testing.assert_array_equal(unit[key], value)
  del unit
  assert _unit_bytes_alive(opened) == 0 and mapper.mapped_bytes == 0
  opened.close()


@pytest.mark.parametrize("host_units", [0, 4])
def test_a_stream_unmaps_each_finished_unit_as_it_leaves_the_window(
  model, tokens, store, host_units, monkeypatch
):
  """docs/design.md, section 4.2: XLA holds a unit a step took in place until the step
  queued after it has run, so as a unit whose step is done leaves the window the stream
  unmaps it (`UnitMapper.retire`), unless a host cache holds it: each load from the
  third on retires the unit run two steps before it, and every mapping it retires counts
  as gone at once."""
  from jax_residency._src.stream import device_window

  retired: list[tuple[int, int]] = []
  retire = device_window.retire_finished

  def logged(source, arrays):
    before = source.buffer_bytes
    retire(source, arrays)
    retired.append((len(arrays), before - source.buffer_bytes))

  monkeypatch.setattr(device_window, "retire_finished", logged)
  policy = _stream(host_units)
  with jr.place(model, policy, store=store, mesh=MESH1) as placed:
    for _ in range(2):
      retired.clear()
      np.testing.assert_array_equal(placed(tokens), model(tokens))
    testing.assert_within_budgets(placed)
  if host_units:
    assert retired == []  # the host cache holds every unit
    return
  # Units 2 .. n-1 are loaded after a step is done; each evicts the unit two before it.
  assert len(retired) == CFG.n_layers - 2
  mapped_bytes = [gone for _, gone in retired]
  assert all(gone > 0 for gone in mapped_bytes), mapped_bytes


def test_a_compiled_cpu_call_uses_an_aligned_host_array_in_place():
  """What `StreamedStack.to_device(in_place=True)` relies on: a compiled call on one CPU
  device takes an aligned NumPy argument without a copy, and so costs a small part of
  the same call on the same bytes 4 bytes off alignment, which XLA must copy first. An
  unaligned tensor goes through ``device_put``."""
  if jax.default_backend() != "cpu":
    pytest.skip("XLA's CPU client only")
  region = mmap.mmap(-1, (64 << 20) + 64)
  aligned = np.frombuffer(region, np.float32, 16 << 20, 0).reshape(4096, -1)
  shifted = np.frombuffer(region, np.float32, 16 << 20, 4).reshape(4096, -1)
  corner = jax.jit(lambda x: x[0, 0]).lower(aligned).compile()

  def best(x: np.ndarray) -> float:
    times = []
    for _ in range(5):
      start = time.perf_counter()
      corner(x).block_until_ready()
      times.append(time.perf_counter() - start)
    return min(times)

  assert best(aligned) < 0.1 * best(shifted)
  device = jax.sharding.SingleDeviceSharding(MESH1.devices.flat[0])
  unit = StreamedStack(
    name="layers",
    count=1,
    rel_paths=(("a",), ("b",)),
    shapes=(aligned.shape, shifted.shape),
    shardings=(device, device),
    read_index=None,
    host_bytes=0,
    device_bytes=0,
    host_is_device=True,
  )
  got = unit.to_device({("a",): aligned, ("b",): shifted}, alias=True, in_place=True)
  assert got[0] is aligned and isinstance(got[1], jax.Array)
  np.testing.assert_array_equal(got[1], shifted)
  del got, aligned, shifted


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
def test_direct_loading_from_disk_asks_for_the_unit_after_next(
  model, tokens, store, tmp_path, monkeypatch
):
  """docs/design.md, section 4.2: without a host cache, while units come from disk the
  stream asks the kernel for the unit after next, into the page cache only; a pass
  served from the page cache asks for nothing."""
  copy = str(tmp_path / "store")
  shutil.copytree(store, copy)
  asked: list[tuple[int, int]] = []
  real = st.UnitStore.advise_unit

  def advise(self: st.UnitStore, i: int) -> int:
    nbytes = real(self, i)
    asked.append((i, nbytes))
    return nbytes

  monkeypatch.setattr(st.UnitStore, "advise_unit", advise)
  policy = _stream(0)
  expected = model(tokens)
  with jr.place(model, policy, store=copy, mesh=MESH1) as placed:
    drop_pages(copy)
    np.testing.assert_array_equal(placed(tokens), expected)
    # Units 0 and 1 are read first; each later one is asked for a unit ahead (what the
    # kernel's own read-ahead of units 0 and 1 brought in is not asked for again).
    assert [i for i, _ in asked] == list(range(2, CFG.n_layers))
    asked.clear()
    np.testing.assert_array_equal(placed(tokens), expected)  # from the page cache
    assert asked == []
    testing.assert_within_budgets(placed)


def test_odd_sized_values_do_not_shift_the_others_off_alignment(toy_store):
  """Biases of 1056 bytes (not a multiple of 64, too big to be inline) are written
  alone, so every other chunk still lies at an offset XLA can alias."""
  cfg = ToyConfig(vocab=64, d_model=264, n_heads=4, d_ff=512, n_layers=3)
  path = toy_store(cfg, seeded=True)  # sizes matter here, not values
  opened = st.UnitStore.open(path)
  assert opened.use_mapped_reads()
  mapper = opened._stacks[0].mapper
  assert mapper is not None
  specs = opened.unit_specs
  odd = [k for k, (shape, dtype) in specs.items() if np.prod(shape) * dtype.itemsize % 64]
  assert odd and all(np.prod(specs[k][0]) * specs[k][1].itemsize > 1024 for k in odd)
  for i in range(cfg.n_layers):
    unit = opened.read_unit(i)
    for key in specs:
      extent = mapper._extent(key, i)
      assert extent is not None, key  # out of line
      if key not in odd:
        assert extent.offset % mapped.ALIGNMENT == 0, (key, i, extent)
        assert fault_in.region_of(unit[key]) is not None, key
