"""`jr.measure` and ``jax-residency measure`` (run/measure.py; docs/design.md, 4.7): a
store's read bandwidths, host-to-device bandwidth and a unit step's time, cached by store
and backend, refused for another store or backend."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest
from cli_call import call
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src.cli.stored_models import write_model_record
from jax_residency._src.run import measure as measure_module
from jax_residency._src.store.unit_store import UnitStore
from jax_residency.toy import ToyConfig

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=6)
INPUTS = [(np.zeros((1, 1), np.int32),), (np.zeros((2, 8), np.int32),)]

model, tokens, store = toy_fixtures(CFG, seeded=True)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))
  return tmp_path / "cache"


@pytest.fixture
def own_store(store, tmp_path):
  """A copy of the toy store this test may rewrite."""
  import shutil  # noqa: PLC0415

  path = str(tmp_path / "store")
  shutil.copytree(store, path)
  return path


def test_a_measurement_has_every_figure_and_a_step_time_per_input(model, own_store):
  found = jr.measure(own_store, model, inputs=INPUTS)
  assert found.unit_bytes == CFG.unit_bytes() and found.units_read == CFG.n_layers
  for rate in (
    found.disk_bytes_per_s,
    found.read_path_bytes_per_s,
    found.page_cache_bytes_per_s,
    found.host_to_device_bytes_per_s,
  ):
    assert rate is not None and rate > 0
  assert found.pinned_host  # the CPU backend lists pinned_host memory
  assert set(found.step_seconds) == {"int32[1,1]", "int32[2,8]"}
  for per_stack in found.step_seconds.values():
    assert set(per_stack) == {"layers"} and 0 < per_stack["layers"] < 1.0
  # Streamed units timed too, direct and through a two-unit host cache, in the page
  # cache and with the pages dropped; and the passes' time beyond their units.
  hows = {f"{mode}, {regime}" for mode in ("direct", "cached") for regime in ("page cache", "disk")}
  assert set(found.streamed_seconds) == set(found.overhead_seconds) == hows
  for per in found.streamed_seconds.values():
    assert set(per) == {"int32[1,1]", "int32[2,8]"}
    assert all(0 < s["layers"] < 1.0 for s in per.values())
  for per in found.overhead_seconds.values():
    assert set(per) == {"int32[1,1]", "int32[2,8]"} and all(0 <= s < 1.0 for s in per.values())
  assert set(found.static_seconds) == {"int32[1,1]", "int32[2,8]"}
  assert all(0 <= s < 1.0 for s in found.static_seconds.values())
  assert found.backend == f"cpu:cpu x{len(jax.devices())}"
  assert jr.Measurement.from_dict(json.loads(json.dumps(found.to_dict()))) == found
  assert "unit step, int32[2,8], layers" in str(found)


def test_a_measurement_is_cached_by_store_and_backend(model, own_store, cache_dir, monkeypatch):
  first = jr.measure(own_store)  # the bandwidths alone: no model
  assert os.path.isfile(measure_module.cache_path(first.key))
  reads = []
  read_unit = UnitStore.read_unit_async

  def counted(self, i, /, **kwargs):
    reads.append(i)
    return read_unit(self, i, **kwargs)

  monkeypatch.setattr(UnitStore, "read_unit_async", counted)
  assert jr.measure(own_store) == first and reads == []  # a hit reads nothing
  again = jr.measure(own_store, refresh=True)
  assert reads and again.key == first.key and again is not first
  reads.clear()
  timed = jr.measure(own_store, model, inputs=INPUTS[:1])  # an input not timed yet
  assert reads and set(timed.step_seconds) == {"int32[1,1]"}
  reads.clear()
  assert jr.measure(own_store, model, inputs=INPUTS[:1]) == timed and reads == []
  jr.save(model, own_store, overwrite=True, progress=False)  # another version of the store
  rewritten = jr.measure(own_store)
  assert reads and rewritten.store_key != first.store_key


def test_a_measurement_of_another_store_or_backend_is_refused(own_store, store):
  found = jr.measure(own_store)
  found.check(own_store)
  assert found.step_seconds == {}
  with pytest.raises(jr.errors.MeasurementMismatchError, match="not of") as e:
    found.check(store)
  assert found.store_key in str(e.value) and "jr.measure" in str(e.value)
  if len(jax.devices()) > 1:
    with pytest.raises(jr.errors.MeasurementMismatchError, match="cpu:cpu x1"):
      found.check(own_store, devices=jax.devices()[:1])


def test_the_measure_command_prints_the_figures(own_store):
  code, out, err = call("measure", own_store)
  assert code == 0, err
  assert "disk, raw, 1 thread" in out and "no unit step time" in out
  write_model_record(own_store, CFG, 0)
  code, out, err = call("measure", own_store, "--prompt-len", "4", "--json")
  assert code == 0, err
  data = json.loads(out)
  assert set(data["step_seconds"]) == {"int32[1,1]", "int32[1,4]"}
  code, _, err = call("measure", os.path.join(own_store, "absent"))
  assert code == 2 and "no such file" in err
