"""`jr.plan` and ``jax-residency plan --auto`` (run/planner.py; docs/design.md, 4.8):
every placement the budgets admit, ranked by the cost model's prediction."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest
from cli_call import call
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src.cli.stored_models import write_model_record
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.run.measure import backend_key, store_key
from jax_residency.toy import ToyConfig

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=6)
UNIT = CFG.unit_bytes()
WORK = jr.Workload(prompt_len=4, decode_steps=3)
DECODE, PREFILL = "int32[1,1]", "int32[1,4]"

model, tokens, store = toy_fixtures(CFG, seeded=True)


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "cache"))


def _measurement(path: str, *, read: float = 1e8, h2d: float = 1e9, step: float = 1e-3):
  """A measurement of ``path`` on this backend with known figures (seconds per unit
  step ``step`` for decode, twice that for the prompt)."""
  return jr.Measurement(
    store=path,
    store_key=store_key(path),
    backend=backend_key(),
    unit_bytes=UNIT,
    units_read=2,
    disk_bytes_per_s=read,
    read_path_bytes_per_s=read,
    page_cache_bytes_per_s=10 * read,
    host_to_device_bytes_per_s=h2d,
    pinned_host=True,
    step_seconds={DECODE: {"layers": step}, PREFILL: {"layers": 2 * step}},
    date="2026-12-05T00:00:00+00:00",
  )


def test_every_candidate_fits_its_budgets_and_places(model, tokens, store):
  static = jr.save(model, "memory://planner/probe", progress=False).static_nbytes
  device = static + 4 * UNIT
  ranked = jr.plan(
    store,
    _measurement(store),
    device_budget_bytes=device,
    host_budget_bytes=3 * UNIT,
    workload=WORK,
  )
  kinds = {type(c.policy).__name__ for c in ranked}
  assert "FullyResident" not in kinds and {"LayerwiseHost", "DenseDiskStream"} <= kinds
  assert [c.total_seconds for c in ranked] == sorted(c.total_seconds for c in ranked)
  for c in ranked:
    assert c.metadata.static_device_bytes + c.metadata.device_window_bytes <= device
    assert c.total_seconds == pytest.approx(c.prefill_seconds + 3 * c.decode_seconds)
  want = np.asarray(model(tokens))
  for c in ranked[:3] + ranked[-2:]:  # the best and the worst place, as predicted to fit
    with jr.place(model, c.policy, store=store) as placed:
      np.testing.assert_allclose(np.asarray(placed(tokens)), want, rtol=1e-5, atol=1e-5)
    assert placed.metadata.prediction is None


def test_the_first_choice_places_and_records_its_prediction(model, tokens, store):
  best = jr.plan(
    store, _measurement(store), device_budget_bytes=None, host_budget_bytes=0, workload=WORK
  )[0]
  # A dense stream gives the eager model's bits, the others the jitted model's (parity.md).
  dense = isinstance(best.policy, jr.DenseDiskStream)
  want = model(tokens) if dense else jitted_plain(model, tokens)
  with best.place(model, store=store) as placed:
    np.testing.assert_array_equal(np.asarray(placed(tokens)), np.asarray(want))
    prediction = placed.metadata.prediction
    assert placed.policy == best.policy
  assert prediction["decode_seconds"] == best.decode_seconds
  assert prediction["regime"] == "disk" and prediction["workload"]["decode_steps"] == 3
  assert prediction["measured"] == "2026-12-05T00:00:00+00:00"


def test_a_quantized_stores_candidates_count_its_decoded_tensors(model, tokens):
  """A quantized store's decoded floats are planned in the device budget, as `place` plans
  them: the smallest placement fits a budget of exactly its plan, and one byte less is
  refused with that figure."""
  path = jr.save(model, "memory://planner/int8", progress=False, quantize="int8").path
  found = _measurement(path)

  def direct_stream(c: jr.Candidate) -> bool:  # host budget 0, nothing kept resident
    d = c.policy.dense
    return d is not None and d.host_budget_bytes == 0 and d.device_resident_units == 0

  roomy = jr.plan(path, found, device_budget_bytes=None, host_budget_bytes=0, workload=WORK)
  direct = next(c for c in roomy if direct_stream(c))
  meta = direct.metadata
  assert meta.item_bytes("decoded unit") + meta.item_bytes("decoded static") > 0
  need = meta.planned_device_bytes
  with pytest.raises(
    jr.PlacementError, match=f"smallest device budget any placement fits is {need} "
  ):
    jr.plan(path, found, device_budget_bytes=need - 1, host_budget_bytes=0, workload=WORK)
  fitting = jr.plan(path, found, device_budget_bytes=need, host_budget_bytes=0, workload=WORK)
  assert [direct_stream(c) for c in fitting] == [True]
  with jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=path) as default:
    want = np.asarray(default(tokens))
  with jr.place(model, fitting[0].policy, store=path) as placed:  # at exactly its budget
    np.testing.assert_array_equal(np.asarray(placed(tokens)), want)


def test_a_prediction_is_the_sum_of_each_units_max_of_compute_and_transfer(store):
  read, step = 1e8, 1e-4  # reading a unit (UNIT / read) takes longer than its step
  ranked = jr.plan(
    store,
    _measurement(store, read=read, step=step),
    device_budget_bytes=None,
    host_budget_bytes=0,
    workload=WORK,
  )
  by = {
    (type(c.policy).__name__, getattr(c.policy.dense, "device_resident_units", None)): c
    for c in ranked
  }
  assert ranked[0].policy == jr.FullyResident() and ranked[0].decode_seconds == pytest.approx(
    6 * step
  )
  direct = by["DenseDiskStream", 2]  # 2 units on the device, 4 read from disk each pass
  assert direct.decode_seconds == pytest.approx(2 * step + 4 * max(step, UNIT / read))
  assert direct.prefill_seconds == pytest.approx(2 * 2 * step + 4 * max(2 * step, UNIT / read))
  assert direct.bytes_per_token == 4 * UNIT
  assert by["DenseDiskStream", 6].decode_seconds == pytest.approx(6 * step)
  page_cache = jr.plan(
    store,
    _measurement(store, read=read, step=step),
    device_budget_bytes=None,
    host_budget_bytes=0,
    workload=WORK,
    regime="page cache",
  )
  fast = next(c for c in page_cache if c.policy == direct.policy)
  assert fast.decode_seconds == pytest.approx(2 * step + 4 * max(step, UNIT / (10 * read)))


def _assert_streamed_units_cost_the_engines_time(path: str) -> None:
  """A direct stream of ``path`` keeping 2 units on the device costs 2 steps and 4 times
  the measurement's engine-timed streamed unit (keyed by the stack's model path)."""
  step, streamed = 1e-4, 3e-3
  m = dataclasses.replace(
    _measurement(path, step=step),
    streamed_seconds={"direct, disk": {DECODE: {"layers": streamed}}},
  )
  ranked = jr.plan(path, m, device_budget_bytes=None, host_budget_bytes=0, workload=WORK)
  direct = next(c for c in ranked if c.policy.dense and c.policy.dense.device_resident_units == 2)
  assert direct.decode_seconds == pytest.approx(2 * step + 4 * streamed)


def test_a_streamed_unit_costs_what_the_engine_took_when_measured(store):
  """Where the measurement timed streamed units in the engine, a streamed unit costs that
  (read-ahead and overlap included) instead of the bandwidth model's estimate."""
  _assert_streamed_units_cost_the_engines_time(store)


def test_a_pass_adds_what_the_measured_passes_took_beyond_their_units(store):
  """A placement that reads units from the store adds the measured pass's time beyond its
  units for its way of streaming (direct or cached); one that reads none adds the
  static layers' time."""
  step, direct, cached = 1e-4, 3e-3, 2e-3
  m = dataclasses.replace(
    _measurement(store, step=step),
    streamed_seconds={
      "direct, disk": {DECODE: {"layers": direct}},
      "cached, disk": {DECODE: {"layers": cached}},
    },
    overhead_seconds={"direct, disk": {DECODE: 0.5}, "cached, disk": {DECODE: 0.25}},
    static_seconds={DECODE: 0.125},
  )
  ranked = jr.plan(store, m, device_budget_bytes=None, host_budget_bytes=UNIT * 3, workload=WORK)

  def find(host: int, kept: int, held: int = 0) -> jr.Candidate:
    return next(
      c
      for c in ranked
      if c.policy.dense
      and c.policy.dense.host_budget_bytes == host
      and (c.policy.dense.device_resident_units, c.policy.dense.host_resident_units) == (kept, held)
    )

  assert find(0, 2).decode_seconds == pytest.approx(2 * step + 4 * direct + 0.5)
  assert find(3 * UNIT, 2).decode_seconds == pytest.approx(2 * step + 4 * cached + 0.25)
  # Everything kept, on the device or in host memory: nothing read, the static layers.
  assert find(3 * UNIT, 4, 2).decode_seconds == pytest.approx(6 * step + 0.125)
  resident = next(c for c in ranked if isinstance(c.policy, jr.FullyResident))
  assert resident.decode_seconds == pytest.approx(6 * step + 0.125)


def test_a_linen_stores_stacks_match_the_measurements(seeded_linen, saved_store, tokens):
  """A Linen model's store records its stack under ``params``; the measurement keys it
  by the model's path, as the placement names it: the engine's time is still used."""
  from jax_residency.toy import LinenToyTransformer  # noqa: PLC0415

  lm = LinenToyTransformer(CFG)
  path = saved_store("test_planner-linen", lm, params=seeded_linen(lm, tokens)).path
  _assert_streamed_units_cost_the_engines_time(path)


def test_plan_errors_name_the_fix(store, tmp_path):
  with pytest.raises(jr.PlacementError, match=r"smallest device budget .*DenseDiskStream"):
    jr.plan(
      store, _measurement(store), device_budget_bytes=UNIT, host_budget_bytes=None, workload=WORK
    )
  bare = dataclasses.replace(_measurement(store), step_seconds={})
  with pytest.raises(jr.PlacementError, match=r"no unit step time for the input int32\[1,128\]"):
    jr.plan(store, bare, device_budget_bytes=None, host_budget_bytes=None)
  other = str(tmp_path / "other")
  shutil.copytree(store, other)
  with pytest.raises(jr.errors.MeasurementMismatchError):
    jr.plan(
      other, _measurement(store), device_budget_bytes=None, host_budget_bytes=None, workload=WORK
    )
  with pytest.raises(jr.PlacementError, match="regime"):
    jr.plan(
      store, _measurement(store), device_budget_bytes=None, host_budget_bytes=None, regime="ssd"
    )


def test_plan_auto_prints_the_ranking(store, tmp_path):
  path = str(tmp_path / "store")
  shutil.copytree(store, path)
  code, _, err = call("plan", path, "--auto")
  assert code == 2 and "records no model" in err
  write_model_record(path, CFG, 0)
  code, out, err = call("plan", path, "--auto", "--prompt-len", "4", "--steps", "2")
  assert code == 0, err
  assert "placements fit; predicted for a 4-token prompt and 2 decode steps" in out
  assert out.splitlines()[2].split()[1] == "FullyResident()"  # unbounded: nothing moves
  code, out, _ = call("plan", path, "--auto", "--prompt-len", "4", "--device-budget", "1KiB")
  assert code == 1 and "smallest device budget" in out


def test_a_draft_beside_the_target_takes_its_share_of_the_device_budget(model, store):
  """``draft_device_bytes``: every candidate fits the device budget less the draft's
  bytes and carries that as its budget; a draft that leaves nothing, or too little for
  any placement, or is no byte count, is refused naming the fix."""
  static = jr.save(model, "memory://planner/probe-draft", progress=False).static_nbytes
  device, draft = static + 6 * UNIT, 2 * UNIT
  common = {"host_budget_bytes": 3 * UNIT, "workload": WORK}
  alone = jr.plan(store, _measurement(store), device_budget_bytes=device, **common)
  beside = jr.plan(
    store, _measurement(store), device_budget_bytes=device, draft_device_bytes=draft, **common
  )
  assert {c.policy.offload().device_budget_bytes for c in beside} == {device - draft}
  for c in beside:
    assert c.metadata.static_device_bytes + c.metadata.device_window_bytes <= device - draft
  assert len(beside) < len(alone)  # FullyResident (all 6 units) no longer fits
  assert "FullyResident" in {type(c.policy).__name__ for c in alone}
  assert "FullyResident" not in {type(c.policy).__name__ for c in beside}
  with pytest.raises(jr.PlacementError, match="leaves nothing of device_budget_bytes"):
    jr.plan(
      store, _measurement(store), device_budget_bytes=device, draft_device_bytes=device, **common
    )
  with pytest.raises(jr.PlacementError, match="what a draft of .* leaves"):
    jr.plan(
      store,
      _measurement(store),
      device_budget_bytes=device,
      draft_device_bytes=device - 1,
      **common,
    )
  for bad in (-1, 1.5, True):
    with pytest.raises(jr.PlacementError, match="draft_device_bytes"):
      jr.plan(
        store, _measurement(store), device_budget_bytes=device, draft_device_bytes=bad, **common
      )
