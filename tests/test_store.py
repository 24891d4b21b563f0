"""Tests of the unit store: save, open, stream, check, rechunk (store/unit_store.py and the
read path: buffers.py, handles.py, unit_reads.py, discovery.py)."""

from __future__ import annotations

import gc
import json
import os
import uuid

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jax_residency._src import errors
from jax_residency._src.store import buffers, handles, rechunk
from jax_residency._src.store import unit_store as st
from jax_residency._src.store import writer as wr

N = 3
PREFIX = ("layers",)


def _units(seed: int = 0) -> dict[tuple[str, ...], np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    ("attn", "q", "kernel"): rng.standard_normal((N, 4, 6)).astype(np.float32),
    ("attn", "out", "bias"): rng.standard_normal((N, 5)).astype(ml_dtypes.bfloat16),
    ("mlp", "up"): rng.standard_normal((N, 3, 2, 2)).astype(np.float16),
    ("gate",): rng.integers(-100, 100, (N,)).astype(np.int8),
    ("mask",): rng.random((N, 7)) > 0.5,
  }


def _static(seed: int = 0) -> dict[tuple[str, ...], np.ndarray]:
  rng = np.random.default_rng(seed + 1)
  return {
    ("embed", "embedding"): rng.standard_normal((11, 4)).astype(ml_dtypes.bfloat16),
    ("head", "kernel"): rng.standard_normal((4, 11)).astype(np.float32),
    ("temperature",): np.array(0.5, np.float32),
    ("step",): np.array(7, np.int64),
  }


def _memory_path() -> str:
  return f"memory://test_store/{uuid.uuid4().hex}"


@pytest.fixture(params=["local", "memory"])
def any_path(request: pytest.FixtureRequest, tmp_path) -> str:
  return str(tmp_path / "store") if request.param == "local" else _memory_path()


def _assert_same(got: dict, want: dict) -> None:
  assert sorted(got) == sorted(want)
  for key, value in want.items():
    value = np.asarray(value)
    assert got[key].dtype == value.dtype, key
    assert got[key].shape == value.shape, key
    np.testing.assert_array_equal(got[key], value, err_msg=str(key))


def _save(path: str, seed: int = 0, **kwargs) -> st.StoreInfo:
  return wr.save_store(
    path, static=_static(seed), units=_units(seed), unit_prefix=PREFIX, progress=False, **kwargs
  )


def _nested(flat: dict[tuple[str, ...], np.ndarray]) -> dict:
  tree: dict = {}
  for path, value in flat.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  return tree


def _orbax_save(path: str, units: dict, static: dict, *, per_unit: bool, **ckptr_kwargs) -> None:
  flat = {**static, **{PREFIX + p: v for p, v in units.items()}}
  tree = _nested(flat)
  if per_unit:
    args = {
      p: ocp.SaveArgs(chunk_byte_size=v[0].nbytes, shard_axes=(0,))
      if p[: len(PREFIX)] == PREFIX
      else ocp.SaveArgs()
      for p, v in flat.items()
    }
    save_args = _nested(args)
  else:
    save_args = None
  ocp.PyTreeCheckpointer(**ckptr_kwargs).save(path, tree, save_args=save_args)


# --- round trip ----------------------------------------------------------------


def test_round_trip_reads_back_exactly(any_path: str) -> None:
  units, static = _units(), _static()
  info = _save(any_path)
  unit_nbytes = sum(v[0].nbytes for v in units.values())
  assert info.unit_count == N and info.unit_prefix == PREFIX
  assert info.unit_nbytes == unit_nbytes
  assert info.static_nbytes == sum(v.nbytes for v in static.values())
  with st.UnitStore.open(any_path) as store:
    assert store.unit_count == N and store.unit_prefix == PREFIX
    assert store.chunked_per_unit and not store.compressed
    assert store.unit_specs == {p: (v.shape[1:], v.dtype) for p, v in units.items()}
    assert store.static_specs == {p: (v.shape, v.dtype) for p, v in static.items()}
    assert store.unit_nbytes == unit_nbytes
    assert store.total_unit_bytes == N * unit_nbytes
    assert store.static_nbytes == info.static_nbytes
    assert store.info == info
    for i in range(N):
      _assert_same(store.read_unit(i), {p: v[i] for p, v in units.items()})
    _assert_same(store.read_static(), static)


def test_read_units_keeps_order_and_async_matches(any_path: str) -> None:
  units = _units()
  _save(any_path)
  with st.UnitStore.open(any_path) as store:
    order = [2, 0, 1, 2]
    seen = []
    for i, tensors in store.read_units(order, in_flight=2):
      seen.append(i)
      _assert_same(tensors, {p: v[i] for p, v in units.items()})
    assert seen == order
    pending = store.read_unit_async(1)
    assert pending.unit == 1 and pending.nbytes == store.unit_nbytes
    _assert_same(pending.result(timeout=30), {p: v[1] for p, v in units.items()})
    assert pending.done()


def test_sliced_reads_return_only_the_requested_parts(any_path: str) -> None:
  units = _units()
  _save(any_path)
  q, mask = ("attn", "q", "kernel"), ("mask",)
  with st.UnitStore.open(any_path) as store:
    got = store.read_unit(2, index={q: (slice(1, 3), slice(0, 6, 2)), mask: ()})
    assert sorted(got) == [q, mask]
    np.testing.assert_array_equal(got[q], units[q][2, 1:3, 0:6:2])
    np.testing.assert_array_equal(got[mask], units[mask][2])
    got = store.read_unit(0, index={q: (3,)})
    np.testing.assert_array_equal(got[q], units[q][0, 3])
    with pytest.raises(errors.StoreError, match=r"(?s)not unit tensors.*attn\.nope"):
      store.read_unit(0, index={("attn", "nope"): ()})


def test_returned_arrays_survive_buffer_reuse_and_close(tmp_path) -> None:
  units = _units()
  path = str(tmp_path / "s")
  _save(path)
  q = ("attn", "q", "kernel")
  store = st.UnitStore.open(path)
  kept = store.read_unit(0)[q][1:]  # a view into unit 0's buffer
  for i in range(N):
    store.read_unit(i)
  np.testing.assert_array_equal(kept, units[q][0, 1:])  # never overwritten while alive
  del kept
  gc.collect()
  created = store._pool.slabs_created
  for _ in range(3):
    for i in range(N):
      store.read_unit(i)
  assert store._pool.slabs_created == created  # dropped units' buffers are reused
  last = store.read_unit(2)
  store.close()
  _assert_same(last, {p: v[2] for p, v in units.items()})
  with pytest.raises(errors.ClosedError):
    store.read_unit(0)


def test_streaming_reuses_a_fixed_set_of_buffers(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    for _ in range(4):
      for _, tensors in store.read_units(range(N), in_flight=2):
        del tensors
    # Two reads in flight plus the unit being consumed, reused pass after pass.
    assert store._pool.slabs_created <= 3


def test_unit_index_out_of_range(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    for bad in (-1, N):
      with pytest.raises(errors.StoreError, match="out of range"):
        store.read_unit(bad)


# --- Orbax compatibility -------------------------------------------------------


def test_orbax_restores_our_store(tmp_path) -> None:
  path = str(tmp_path / "s")
  _save(path)
  restored = ocp.PyTreeCheckpointer().restore(path)
  want = _nested({**_static(), **{PREFIX + p: v for p, v in _units().items()}})
  assert jax.tree.structure(restored) == jax.tree.structure(want)
  for got, expected in zip(jax.tree.leaves(restored), jax.tree.leaves(want), strict=True):
    assert isinstance(got, np.ndarray)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)
  with open(os.path.join(path, st.SIDECAR_KEY)) as f:
    sidecar = json.load(f)
  assert sidecar["unit_prefix"] == list(PREFIX) and sidecar["unit_count"] == N


@pytest.mark.parametrize(
  "ckptr_kwargs",
  [{"use_zarr3": True, "use_compression": False}, {}],
  ids=["zarr3-uncompressed", "zarr2-zstd"],
)
def test_orbax_store_with_per_unit_chunks_streams_in_place(tmp_path, ckptr_kwargs) -> None:
  units, static = _units(), _static()
  path = str(tmp_path / "orbax")
  _orbax_save(path, units, static, per_unit=True, **ckptr_kwargs)
  with pytest.raises(errors.StoreError, match=r"(?s)unit_prefix=.*layers\.attn"):
    st.UnitStore.open(path)  # no sidecar: the prefix must be given
  with st.UnitStore.open(path, unit_prefix=PREFIX) as store:
    assert store.chunked_per_unit
    assert store.compressed == (not ckptr_kwargs)
    for i, tensors in store.read_units(range(N)):
      _assert_same(tensors, {p: v[i] for p, v in units.items()})
    _assert_same(store.read_static(), static)


def test_whole_array_chunks_need_rechunk(tmp_path, monkeypatch) -> None:
  units, static = _units(), _static()
  src, dst = str(tmp_path / "orbax"), str(tmp_path / "streamable")
  _orbax_save(src, units, static, per_unit=False)
  with pytest.raises(errors.StoreLayoutError) as e:
    st.UnitStore.open(src, unit_prefix=PREFIX)
  message = str(e.value)
  assert "jax-residency rechunk" in message and "rechunk_store" in message
  assert f"layers.attn.q.kernel: chunk shape {(N, 4, 6)}" in message
  with st.UnitStore.open(src, unit_prefix=PREFIX, require_unit_chunks=False) as store:
    assert not store.chunked_per_unit

  reads = []
  real = rechunk._read_unit_slice

  def spy(handle, i):
    out = real(handle, i)
    reads.append((i, out.shape, tuple(handle.shape)))
    return out

  monkeypatch.setattr(rechunk, "_read_unit_slice", spy)
  info = rechunk.rechunk_store(src, dst, unit_prefix=PREFIX, progress=False)
  # Every unit array was read one unit at a time, never whole.
  assert len(reads) == N * len(units)
  assert all(shape == full[1:] for _, shape, full in reads)
  assert sorted(i for i, _, _ in reads) == sorted(list(range(N)) * len(units))
  assert info.unit_count == N and info.path == dst
  with st.UnitStore.open(dst) as store:  # the sidecar now records the prefix
    assert store.chunked_per_unit and not store.compressed
    for i in range(N):
      _assert_same(store.read_unit(i), {p: v[i] for p, v in units.items()})
    _assert_same(store.read_static(), static)
  assert not [n for n in os.listdir(tmp_path) if "jax-residency" in n]


# --- writing: atomicity and destinations ---------------------------------------


def _fail_on_write(monkeypatch, after: int) -> None:
  calls = []
  real = wr._write_chunk

  def failing(handle, index, value):
    calls.append(index)
    if len(calls) > after:
      raise OSError("disk on fire")
    return real(handle, index, value)

  monkeypatch.setattr(wr, "_write_chunk", failing)


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch) -> None:
  path = tmp_path / "store"
  _fail_on_write(monkeypatch, after=len(_static()) + 2)  # midway through the units
  with pytest.raises(OSError, match="disk on fire"):
    _save(str(path))
  assert os.listdir(tmp_path) == []


def test_failed_overwrite_keeps_the_old_store(tmp_path, monkeypatch) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)
  _fail_on_write(monkeypatch, after=5)
  with pytest.raises(OSError, match="disk on fire"):
    _save(path, seed=1, overwrite=True)
  assert os.listdir(tmp_path) == ["store"]
  with st.UnitStore.open(path) as store:
    _assert_same(store.read_unit(1), {p: v[1] for p, v in _units(0).items()})


def test_existing_destination_needs_overwrite(any_path: str) -> None:
  _save(any_path, seed=0)
  with pytest.raises(errors.StoreError, match=r"already exists at .*overwrite=True") as e:
    _save(any_path, seed=1)
  assert any_path in str(e.value)
  _save(any_path, seed=1, overwrite=True)
  with st.UnitStore.open(any_path) as store:
    _assert_same(store.read_unit(0), {p: v[0] for p, v in _units(1).items()})
    _assert_same(store.read_static(), _static(1))


def test_refuses_to_overwrite_a_directory_that_is_not_a_store(tmp_path) -> None:
  (tmp_path / "precious.txt").write_text("keep me")
  with pytest.raises(errors.StoreError, match="not a checkpoint directory"):
    _save(str(tmp_path), overwrite=True)
  assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_save_rejects_bad_inputs(tmp_path) -> None:
  path = str(tmp_path / "s")
  units = {("a",): np.zeros((3, 2)), ("b", "c"): np.zeros((4, 2)), ("d",): np.zeros((3,))}
  with pytest.raises(errors.StoreError) as e:
    wr.save_store(path, static={}, units=units, unit_prefix=PREFIX)
  assert "layers.a: leading dim 3\n  layers.b.c: leading dim 4\n  layers.d: leading dim 3" in str(
    e.value
  )
  with pytest.raises(errors.StoreError, match=r"(?s)under unit_prefix.*layers\.x"):
    wr.save_store(
      path,
      static={("layers", "x"): np.zeros(2)},
      units={("a",): np.zeros((3, 2))},
      unit_prefix=PREFIX,
    )
  with pytest.raises(errors.StoreError, match="at least one unit"):
    wr.save_store(path, static={("x",): np.zeros(2)}, units={}, unit_prefix=PREFIX)
  with pytest.raises(errors.StoreError, match="join to this Orbax name"):
    wr.save_store(
      path,
      static={("a.b",): np.zeros(2), ("a", "b"): np.zeros(2)},
      units={("u",): np.zeros((3, 2))},
      unit_prefix=PREFIX,
    )
  assert os.listdir(tmp_path) == []


def test_a_short_save_is_silent_without_a_terminal(tmp_path, capsys) -> None:
  """No bar without a terminal, and no progress lines for work shorter than
  `progress.LINE_START_SECONDS` (tests/test_progress.py has the lines)."""
  wr.save_store(
    str(tmp_path / "s"), static={}, units={("u",): np.zeros((2, 3))}, unit_prefix=PREFIX
  )
  assert capsys.readouterr().err == ""


def test_open_errors(tmp_path) -> None:
  with pytest.raises(errors.StoreNotFoundError, match="No unit store"):
    st.UnitStore.open(str(tmp_path / "missing"))
  with pytest.raises(errors.StoreNotFoundError, match="manifest.ocdbt"):
    st.UnitStore.open(str(tmp_path))
  with pytest.raises(errors.StoreNotFoundError):
    st.UnitStore.open(_memory_path())
  _save(str(tmp_path / "s"))
  with pytest.raises(errors.ZeroMaxCachedShardsError):
    st.UnitStore.open(str(tmp_path / "s"), max_cached_shards=0)
  with pytest.raises(errors.StoreError, match="no arrays under unit_prefix"):
    st.UnitStore.open(str(tmp_path / "s"), unit_prefix=("nope",))


# --- checking against a model ----------------------------------------------------


def _expected() -> tuple[dict, dict]:
  units = {p: (v.shape[1:], v.dtype) for p, v in _units().items()}
  static = {p: (v.shape, v.dtype) for p, v in _static().items()}
  return units, static


def test_check_against_accepts_the_matching_model(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    store.check_against(*_expected(), strict=True)


def test_check_against_lists_every_missing_path_sorted(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  units, static = _expected()
  units[("zz", "w")] = ((2,), np.float32)
  units[("attn", "k", "kernel")] = ((4, 6), np.float32)
  static[("aa",)] = ((1,), np.int32)
  units[("mlp", "up")] = ((3, 2, 9), np.float16)  # also a mismatch
  del static[("step",)]  # and an unexpected tensor
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    with pytest.raises(errors.MissingCheckpointParametersError) as e:
      store.check_against(units, static, strict=True)
  message = str(e.value)
  lines = [line.strip() for line in message.splitlines() if line.startswith("  ")]
  assert lines == [
    "aa: expected (1,) int32",
    "layers.attn.k.kernel (per unit): expected (4, 6) float32",
    "layers.zz.w (per unit): expected (2,) float32",
  ]
  assert "1 shape/dtype mismatch(es), 1 unexpected tensor(s)" in message


def test_check_against_lists_every_mismatch_sorted(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  units, static = _expected()
  units[("mlp", "up")] = ((3, 2, 9), np.float16)
  units[("attn", "out", "bias")] = ((5,), np.float32)
  static[("embed", "embedding")] = ((12, 4), ml_dtypes.bfloat16)
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    with pytest.raises(errors.CheckpointShapeMismatchError) as e:
      store.check_against(units, static, strict=False)
  lines = [line.strip() for line in str(e.value).splitlines() if line.startswith("  ")]
  assert lines == [
    "embed.embedding: expected (12, 4) bfloat16, found (11, 4) bfloat16",
    "layers.attn.out.bias (per unit): expected (5,) float32, found (5,) bfloat16",
    "layers.mlp.up (per unit): expected (3, 2, 9) float16, found (3, 2, 2) float16",
  ]


def test_check_against_strict_lists_unexpected_tensors(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  units, static = _expected()
  del units[("mask",)], units[("gate",)], static[("step",)]
  with st.UnitStore.open(str(tmp_path / "s")) as store:
    store.check_against(units, static, strict=False)
    with pytest.raises(errors.UnexpectedCheckpointParametersError) as e:
      store.check_against(units, static, strict=True)
  lines = [line.strip() for line in str(e.value).splitlines() if line.startswith("  ")]
  assert lines == [
    "layers.gate (per unit): () int8",
    "layers.mask (per unit): (7,) bool",
    "step: () int64",
  ]
  assert "strict_loading=False" in str(e.value)


# --- the read path's pieces ------------------------------------------------------


def test_open_handles_never_exceed_max_cached_shards(tmp_path) -> None:
  _save(str(tmp_path / "s"))
  with st.UnitStore.open(str(tmp_path / "s"), max_cached_shards=2) as store:
    assert store.open_handles == 0  # opened lazily
    counts = []
    real = store._handles._opener

    def opener(name):
      counts.append(store._handles.open_count)
      return real(name)

    store._handles._opener = opener
    for i in range(N):
      store.read_unit(i)
      counts.append(store.open_handles)
    store.read_static()
    assert max(counts) <= 2 and store.open_handles == 2
    assert store._handles.evicted > 0


def test_handle_cache_evicts_least_recently_used() -> None:
  opened = []
  cache = handles.HandleCache(2, lambda name: opened.append(name) or name)
  for name in ["a", "b", "a", "c", "a", "b"]:
    cache.get(name)
  assert opened == ["a", "b", "c", "b"]  # "b" was evicted by "c", "c" by "b"
  assert cache.names == ["a", "b"] and cache.open_count == 2


def test_buffer_pool_reuses_slabs_and_bounds_idle_ones() -> None:
  pool = buffers.BufferPool(spare=1)
  layout, nbytes = buffers.buffer_layout(
    [("x", (3, 5), np.dtype(np.float32)), ("y", (7,), np.dtype(np.int8))]
  )
  assert [offset for *_, offset in layout] == [0, buffers.BUFFER_ALIGNMENT]
  first = pool.lease(layout, nbytes)
  first["x"][:] = 1
  second = pool.lease(layout, nbytes)
  assert pool.slabs_created == 2
  del first, second
  gc.collect()
  assert pool.idle_bytes == nbytes  # one kept, one released
  third = pool.lease(layout, nbytes)
  assert pool.slabs_created == 2 and third["x"].flags.writeable


def test_tune_malloc_is_idempotent() -> None:
  first = buffers.tune_malloc()
  assert buffers.tune_malloc() is first


def test_handle_cache_opens_misses_together_and_keeps_its_bound() -> None:
  opened: list[str] = []

  class Done:
    def __init__(self, name: str):
      self.name = name

    def result(self) -> str:
      return f"handle:{self.name}"

  def open_async(name: str) -> Done:
    opened.append(name)
    return Done(name)

  cache = handles.HandleCache(2, lambda name: f"handle:{name}")
  names = ["a", "b", "c", "a"]
  assert cache.get_many(names, open_async) == [f"handle:{n}" for n in names]
  assert opened == ["a", "b", "c"]  # each miss opened once, all issued before waiting
  assert cache.open_count == 2 and cache.names == ["b", "c"]
  assert cache.get_many(["c"], open_async) == ["handle:c"] and opened == ["a", "b", "c"]
