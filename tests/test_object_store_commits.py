"""Saves to object stores replace a store atomically (store/pointers.py; docs/design.md,
5.2 "Commits"): a new generation is written under the path and a pointer object is
switched to it last. Checked here on ``memory://``, in process, at every write of an
overwrite; tests/test_s3.py kills real writers against an S3 server.
"""

from __future__ import annotations

import signal
import threading
import uuid

import pytest
import tensorstore as ts
from test_store_safety import N, _save, _version

from jax_residency._src import errors
from jax_residency._src.store import pointers
from jax_residency._src.store import unit_store as st
from jax_residency._src.store import writer as wr
from jax_residency._src.store.handles import store_context
from jax_residency._src.store.locations import locate


def _url() -> str:
  return f"memory://object-commits/{uuid.uuid4().hex}"


def _kv(url: str) -> ts.KvStore:
  """The kvstore at ``url`` as the library opens it (``s3://`` at the environment's
  endpoint, `locations.locate`)."""
  return ts.KvStore.open(locate(url).base, context=store_context()).result()


def _top_keys(url: str) -> set[str]:
  """The first path component of every key under ``url`` (also used by test_s3.py)."""
  return {k.decode().split("/")[0] for k in _kv(url).list().result()}


def _one_generation(url: str) -> None:
  keys = _top_keys(url)
  assert pointers.POINTER_KEY in keys
  assert len(keys) == 2 and all(k.startswith("g-") for k in keys - {pointers.POINTER_KEY}), keys


@pytest.mark.parametrize("replacing", [True, False], ids=["overwrite", "fresh"])
def test_an_object_store_path_holds_the_old_store_or_the_new_at_every_write(
  monkeypatch, replacing
) -> None:
  url = _url()
  if replacing:
    _save(url, 0)
  old = 0 if replacing else None
  seen: list[tuple[str, int | None]] = []
  write_chunk, switch = wr._write_chunk, pointers.switch

  def watched_write(handle, index, value):
    seen.append(("chunk", _version(url)))
    return write_chunk(handle, index, value)

  def watched_switch(kv, name):
    seen.append(("switch", _version(url)))
    switch(kv, name)
    seen.append(("switched", _version(url)))

  monkeypatch.setattr(wr, "_write_chunk", watched_write)
  monkeypatch.setattr(pointers, "switch", watched_switch)
  _save(url, 1, overwrite=replacing)
  assert [v for step, v in seen if step != "switched"] == [old] * (len(seen) - 1)
  assert len(seen) > 2 * N and seen[-1] == ("switched", 1)
  assert _version(url) == 1
  _one_generation(url)  # the old generation is gone


def test_a_failed_overwrite_on_an_object_store_leaves_the_old_store_and_nothing_else(
  monkeypatch,
) -> None:
  url = _url()
  _save(url, 0)
  before = _top_keys(url)
  calls, write_chunk = [], wr._write_chunk

  def failing(handle, index, value):
    calls.append(index)
    if len(calls) == 3:
      raise OSError("injected write failure")
    return write_chunk(handle, index, value)

  monkeypatch.setattr(wr, "_write_chunk", failing)
  with pytest.raises(OSError, match="injected"):
    _save(url, 1, overwrite=True)
  assert _version(url) == 0
  assert _top_keys(url) == before  # the new generation was removed


def test_sigint_as_the_pointer_switches_finishes_the_switch_and_its_cleanup(monkeypatch) -> None:
  """A real SIGINT that arrives as the pointer is written: the switch and the removal of
  the old generation run to their end (an interrupt cutting the switch's wait could
  let the pointer land on a generation the cleanup then deletes), then the save raises
  KeyboardInterrupt; the path holds the new store and nothing else."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signals are handled on the main thread, and this test is not on it")
  url = _url()
  _save(url, 0)
  switch = pointers.switch

  def interrupted(kv, name):
    signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    switch(kv, name)

  monkeypatch.setattr(pointers, "switch", interrupted)
  with pytest.raises(KeyboardInterrupt):
    _save(url, 1, overwrite=True)
  assert _version(url) == 1
  _one_generation(url)


def test_a_flat_store_on_an_object_store_is_replaced_through_a_pointer() -> None:
  """A store written flat at the path (by Orbax, or by versions before the pointer)
  is read as it is, and an overwrite leaves the pointer and one generation only."""
  source, flat = _url(), _url()
  _save(source, 0)
  src = _kv(source)
  (name,) = _top_keys(source) - {pointers.POINTER_KEY}
  dst = _kv(flat)
  for key in src.list(ts.KvStore.KeyRange(name + "/", name + "0")).result():
    dst.write(key.decode()[len(name) + 1 :], src.read(key).result().value).result()
  assert pointers.POINTER_KEY not in _top_keys(flat)
  assert _version(flat) == 0
  with pytest.raises(errors.StoreError, match="already exists"):
    _save(flat, 1)
  _save(flat, 1, overwrite=True)
  assert _version(flat) == 1
  _one_generation(flat)


@pytest.mark.parametrize(
  "pointer",
  [b"not json", b'{"generation": "../elsewhere"}', b'{"format": "x"}', b"\xff\xfe"],
)
def test_a_damaged_pointer_is_a_layout_error_naming_it(pointer: bytes) -> None:
  url = _url()
  _save(url, 0)
  _kv(url).write(pointers.POINTER_KEY, pointer).result()
  with pytest.raises(errors.StoreLayoutError, match=f"{url}/{pointers.POINTER_KEY}.*write the"):
    st.UnitStore.open(url)
