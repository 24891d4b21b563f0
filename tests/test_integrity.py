"""Store integrity: every chunk carries a CRC-32C, every read checks it, and a damaged or
unreadable store raises one error type whichever thread read it (docs/design.md, section 5.4)."""

from __future__ import annotations

import os
import re
import shutil
import time

import jax
import numpy as np
import pytest
from damage import damaged_copy, flip_bit_on_disk
from flax import nnx
from policies import dense
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src.cli import main as cli
from jax_residency._src.store import mapped, residency, writer
from jax_residency._src.store import unit_store as st
from jax_residency._src.store.verify import verify_store
from jax_residency.toy import ToyConfig

# Kernels of 16-64 KiB: stored out of line in the OCDBT data files, so mappable.
CFG = ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=128, n_layers=4)
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
KERNEL = "layers.up.kernel"  # (4, 64, 128) float32: 32 KiB per unit


model, tokens, store = toy_fixtures(CFG)


def test_saved_stores_carry_checksums_and_still_map(store):
  opened = st.UnitStore.open(store)
  result = verify_store(store, progress=False)
  assert result.ok and result.checksummed
  assert result.chunks == len(opened.static_specs) + CFG.n_layers * len(opened.unit_specs)
  assert opened.use_mapped_reads()
  unit = opened.read_unit(2)
  # Every out-of-line kernel still lies 64-byte aligned, so it is mapped, not copied.
  assert opened.mapped_bytes_total >= sum(a.nbytes for k, a in unit.items() if k[1] == "kernel")
  copied = st.UnitStore.open(store).read_unit(2)
  for key, value in copied.items():
    np.testing.assert_array_equal(unit[key], value, err_msg=str(key))
  opened.close()


@pytest.mark.parametrize(
  "policy, reads",
  [
    ("dense-host0", "mapped"),  # direct: mapped reads on the calling thread
    ("dense-host0", "direct"),  # copied straight from the data file, CRC checked here
    ("dense-host0", "tensorstore"),  # copied through TensorStore, which checks the CRC
    ("dense-cached", "mapped"),  # through the host cache: the prefetch worker reads
    ("dense-cached", "direct"),
    ("dense-cached", "tensorstore"),
    ("resident", "mapped"),  # read once at placement
    ("layerwise", "mapped"),
  ],
)
def test_a_flipped_bit_in_a_unit_raises_a_corruption_error(
  policy, reads, model, tokens, store, tmp_path, monkeypatch
):
  if reads != "mapped":
    monkeypatch.setenv(mapped.MAPPED_READS_ENV, "0")
  if reads == "tensorstore":
    monkeypatch.setenv(mapped.DIRECT_READS_ENV, "0")
  bad = damaged_copy(store, str(tmp_path / "bad"), (KERNEL, 2))
  chosen = {
    "dense-host0": dense(0),
    "dense-cached": dense("4MiB"),
    "resident": jr.FullyResident(),
    "layerwise": jr.LayerwiseHost(),
  }[policy]
  with pytest.raises(jr.errors.StoreCorruptionError) as info:
    with jr.place(model, chosen, store=bad, mesh=MESH1) as placed:
      placed(tokens)
  error = info.value
  assert isinstance(error, jr.StoreError) and not isinstance(error, jr.errors.PrefetchError)
  assert (error.store, error.tensor, error.unit) == (bad, KERNEL, 2)
  assert KERNEL in str(error) and "unit 2" in str(error).lower() and bad in str(error)


def test_a_flipped_bit_in_a_static_tensor_raises_a_corruption_error(model, store, tmp_path):
  bad = damaged_copy(store, str(tmp_path / "bad"), ("embed.embedding", None))
  with pytest.raises(jr.errors.StoreCorruptionError) as info:
    jr.place(model, dense(0), store=bad, mesh=MESH1)
  assert (info.value.tensor, info.value.unit) == ("embed.embedding", None)


def test_the_undamaged_store_still_matches_the_plain_model(model, tokens, store):
  # As documented (docs/parity.md): a dense stream runs the plain model eagerly, one
  # compiled step per unit; FullyResident runs it as one jitted program.
  eager = model(tokens)
  jitted = nnx.jit(lambda m, t: m(t))(model, tokens)
  for policy, want in ((dense(0), eager), (dense("4MiB"), eager), (jr.FullyResident(), jitted)):
    with jr.place(model, policy, store=store, mesh=MESH1) as placed:
      np.testing.assert_array_equal(placed(tokens), want)


def test_stores_without_checksums_keep_loading_and_mapping(model, tokens, tmp_path, monkeypatch):
  monkeypatch.setattr(writer, "WRITE_CHECKSUMS", False)
  path = str(tmp_path / "plain")
  jr.save(model, path, progress=False)
  result = verify_store(path, progress=False)
  assert result.ok and not result.checksummed
  with jr.place(model, dense(0), store=path, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), model(tokens))
    assert placed.report().total.mapped_bytes > 0


def test_verify_lists_every_damaged_tensor(store, tmp_path, capsys):
  chunks = [(KERNEL, 1), (KERNEL, 3), ("layers.qkv.kernel", 0), ("head.kernel", None)]
  bad = damaged_copy(store, str(tmp_path / "bad"), *chunks)
  result = verify_store(bad, progress=False)
  assert not result.ok and result.checksummed
  assert {(d.tensor, d.unit) for d in result.damaged} == set(chunks)
  assert all(d.corrupt for d in result.damaged)

  assert cli.main(["verify", bad]) == 1
  out = capsys.readouterr().out
  for tensor, unit in chunks:
    assert f"corrupt: {tensor} ({'static' if unit is None else f'unit {unit}'})" in out
  assert cli.main(["verify", store]) == 0
  assert "no damage" in capsys.readouterr().out.lower()


def test_verify_reports_a_missing_data_file_as_unreadable(store, tmp_path):
  bad = str(tmp_path / "bad")
  shutil.copytree(store, bad)
  extent = mapped.ocdbt_extents(bad)[f"{KERNEL}/c/2/0/0"]
  os.remove(extent.file)
  result = verify_store(bad, progress=False)
  assert (KERNEL, 2) in {(d.tensor, d.unit) for d in result.damaged}
  assert not any(d.corrupt for d in result.damaged)


def test_inspect_says_whether_a_store_has_checksums(model, store, tmp_path, monkeypatch, capsys):
  assert cli.main(["inspect", store]) == 0
  assert re.search(r"^checksums +crc32c on every chunk", capsys.readouterr().out, re.M)
  monkeypatch.setattr(writer, "WRITE_CHECKSUMS", False)
  plain = str(tmp_path / "plain")
  jr.save(model, plain, progress=False)
  assert cli.main(["inspect", plain]) == 0
  assert re.search(r"^checksums +none", capsys.readouterr().out, re.M)


def test_a_store_replaced_under_a_live_placement_fails_clearly(
  model, tokens, store, tmp_path, toy_model
):
  """A placement serves the store it opened: once the store on disk is replaced (or
  rewritten in place), the next read from disk raises StoreReplacedError; weights read
  before (FullyResident's, at placement) keep serving; placing again reads the new one."""
  path = str(tmp_path / "live")
  shutil.copytree(store, path)
  other = toy_model(CFG, seed=7)
  old, new = model(tokens), other(tokens)
  streamed = jr.place(model, dense(0), store=path, mesh=MESH1)
  resident = jr.place(model, jr.FullyResident(), store=path, mesh=MESH1)
  np.testing.assert_array_equal(streamed(tokens), old)
  jr.save(other, path, progress=False, overwrite=True)
  with pytest.raises(jr.errors.StoreReplacedError, match="place the model again") as info:
    streamed(tokens)
  assert info.value.store == path and isinstance(info.value, jr.StoreError)
  with pytest.raises(jr.errors.StoreReplacedError):  # and on every pass after
    streamed(tokens)
  np.testing.assert_array_equal(resident(tokens), old)  # loaded at placement
  streamed.close()
  resident.close()
  with jr.place(other, dense(0), store=path, mesh=MESH1) as again:
    np.testing.assert_array_equal(again(tokens), new)
    manifest = os.path.join(path, "manifest.ocdbt")
    stat = os.stat(manifest)
    os.utime(manifest, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # a new commit
    with pytest.raises(jr.errors.StoreReplacedError, match="replaced or rewritten"):
      again(tokens)


def test_direct_reads_match_tensorstore_reads(store, monkeypatch):
  """Copied reads of raw chunks go straight from the data file into the unit's buffer
  (`UnitMapper.read_into`: TensorStore checks a checksummed chunk at well under memory
  speed); they return what TensorStore returns."""
  calls = []
  real = mapped._read_extent
  monkeypatch.setattr(mapped, "_read_extent", lambda *a: calls.append(a[4]) or real(*a))
  direct = st.UnitStore.open(store)
  monkeypatch.setenv(mapped.DIRECT_READS_ENV, "0")
  through_tensorstore = st.UnitStore.open(store)
  for i in range(CFG.n_layers):
    want = through_tensorstore.read_unit(i)
    monkeypatch.delenv(mapped.DIRECT_READS_ENV)
    got = direct.read_unit(i)
    monkeypatch.setenv(mapped.DIRECT_READS_ENV, "0")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
      np.testing.assert_array_equal(got[key], value, err_msg=str(key))
  # Every out-of-line kernel was read directly (the small biases sit inline in the index).
  assert {"layers.up.kernel", "layers.down.kernel", "layers.qkv.kernel"} <= set(calls)
  assert len(calls) == CFG.n_layers * len(set(calls))


@pytest.mark.parametrize("reads", ["mapped", "direct", "mapped-mincore"])
def test_a_chunk_is_checked_when_read_from_disk_not_on_each_page_cache_hit(
  reads, store, tmp_path, monkeypatch
):
  """docs/design.md, section 5.4: a chunk's CRC is checked on its first read, and again
  only when its pages come back from disk; a bit flipped on disk after a verified read
  is caught once the page cache no longer holds the page."""
  if reads == "direct":
    monkeypatch.setenv(mapped.MAPPED_READS_ENV, "0")
  if reads == "mapped-mincore":  # kernels before cachestat(2), and macOS
    monkeypatch.setattr(residency, "_cachestat_ok", False)
  copy = str(tmp_path / "store")
  shutil.copytree(store, copy)
  opened = st.UnitStore.open(copy)
  if reads != "direct":
    assert opened.use_mapped_reads()

  def checked() -> int:  # chunk bytes whose CRC the store's readers computed so far
    return sum(m.checked_bytes for m in opened._mappers)

  first = {i: opened.read_unit(i) for i in range(CFG.n_layers)}
  before = checked()
  kernel_bytes = first[1][("up", "kernel")].nbytes
  assert before >= CFG.n_layers * kernel_bytes  # every raw chunk, on its first read
  del first
  for i in range(CFG.n_layers):  # served from the page cache: nothing checked again
    opened.read_unit(i)
  assert checked() == before
  extent = flip_bit_on_disk(copy, KERNEL, 1)
  with pytest.raises(jr.errors.StoreCorruptionError) as info:
    opened.read_unit(1)
  assert (info.value.tensor, info.value.unit) == (KERNEL, 1)
  assert extent.file in str(info.value)
  opened.close()


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise")
@pytest.mark.parametrize("reads", ["mapped", "direct"])
def test_a_chunk_read_ahead_from_disk_is_checked_when_read(reads, store, tmp_path, monkeypatch):
  """docs/design.md, section 5.4: direct loading asks the kernel for a unit's chunks ahead
  of their read, so their pages are cached by the time it runs; a chunk that was out of
  the page cache when asked for came from disk, and its read checks it."""
  if reads == "direct":
    monkeypatch.setenv(mapped.MAPPED_READS_ENV, "0")
  copy = str(tmp_path / "store")
  shutil.copytree(store, copy)
  opened = st.UnitStore.open(copy)
  if reads == "mapped":
    assert opened.use_mapped_reads()
  opened.read_unit(1)  # checked once, on its first read
  extent = flip_bit_on_disk(copy, KERNEL, 1)
  assert opened.advise_unit(1) >= extent.length
  assert opened.advised_bytes >= extent.length
  fd = os.open(extent.file, os.O_RDONLY)
  try:
    deadline = time.monotonic() + 30
    while not residency.resident_in_file(fd, extent.offset, extent.length):
      assert time.monotonic() < deadline, "the read-ahead never brought the chunk in"
      time.sleep(0.005)
  finally:
    os.close(fd)
  with pytest.raises(jr.errors.StoreCorruptionError) as info:
    opened.read_unit(1)
  assert (info.value.tensor, info.value.unit) == (KERNEL, 1)
  assert opened.advise_unit(0) == 0  # cached since its first read: nothing to ask for
  opened.close()
