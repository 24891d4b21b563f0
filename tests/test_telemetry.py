"""Telemetry (docs/design.md, section 6): pass classification, commit-on-success,
totals, the immutable report."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency._src.plan.budget import check_budgets
from jax_residency._src.report.records import DECODE, PREFILL, PassCounters, PassReport, Totals
from jax_residency._src.report.stream_metrics import LedgerMetrics, TierMetrics, WorkerMetrics
from jax_residency._src.report.telemetry import Telemetry, count_tokens


def metadata(policy: jr.LayerWeightResidency | None = None) -> jr.ModelMetadata:
  return check_budgets(
    policy or jr.FullyResident(),
    static_device_bytes=100,
    unit_bytes=[10] * 4,
    device_unit_bytes=[10] * 4,
    host_unit_bytes=[10] * 4,
  )


def telemetry(**kwargs) -> Telemetry:
  policy = kwargs.pop("policy", jr.FullyResident())
  return Telemetry(policy=policy, metadata=metadata(policy), **kwargs)


def tokens(t: int, batch: int = 2) -> np.ndarray:
  return np.zeros((batch, t), np.int32)


def ledger(host: tuple[int, ...], device: tuple[int, ...]) -> LedgerMetrics:
  names = ("requests", "hits", "misses", "evictions", "evicted_bytes", "peak_units", "peak_bytes")
  return LedgerMetrics(
    host=TierMetrics(**dict(zip(names, host, strict=True))),
    device=TierMetrics(**dict(zip(names, device, strict=True))),
  )


# --- classification ----------------------------------------------------------


@pytest.mark.parametrize(
  "args, axis, expected",
  [
    ((tokens(5),), 1, 5),
    ((tokens(1),), 1, 1),
    ((tokens(5, batch=3),), 0, 3),
    ((tokens(5),), -1, 5),
    ((np.zeros((7,)), tokens(4)), 1, 4),  # the first array that has the axis
    (("not an array", 3, tokens(6)), 1, 6),
    ((), 1, 1),
    ((np.float32(2.0),), 1, 1),
    ((np.zeros((2, 3)),), -3, 1),
  ],
)
def test_count_tokens(args, axis, expected):
  assert count_tokens(args, axis) == expected


def test_more_than_one_token_is_prefill_else_decode():
  t = telemetry()
  assert t.commit_pass(args=(tokens(8),), seconds=0.1).phase == PREFILL
  assert t.commit_pass(args=(tokens(1),), seconds=0.1).phase == DECODE
  assert t.commit_pass(args=(jnp.zeros((4, 1, 3)),), seconds=0.1).phase == DECODE
  report = t.report()
  assert (report.prefill.passes, report.decode.passes, report.total.passes) == (1, 2, 3)
  assert [p.tokens for p in report.passes] == [8, 1, 1]
  assert [p.index for p in report.passes] == [0, 1, 2]


def test_the_sequence_axis_is_the_users_choice():
  t = telemetry(sequence_axis=0)
  assert t.sequence_axis == 0
  # (time=1, features=16): one token along axis 0 although axis 1 is long.
  assert t.commit_pass(args=(np.zeros((1, 16)),), seconds=0.0).phase == DECODE
  assert t.commit_pass(args=(np.zeros((3, 1)),), seconds=0.0).phase == PREFILL


# --- sums and peaks ----------------------------------------------------------


def test_totals_sum_counts_and_max_peaks():
  t = telemetry()
  t.commit_pass(
    args=(tokens(4),),
    seconds=0.5,
    ledger=ledger((4, 3, 1, 1, 10, 3, 30), (4, 2, 2, 2, 20, 2, 20)),
    worker=WorkerMetrics(submitted=3, completed=3, peak_queue_occupancy=2),
    counters=PassCounters(
      disk_to_host_bytes=30, host_to_device_bytes=40, stalls=1, stall_seconds=0.25
    ),
  )
  t.commit_pass(
    args=(tokens(6),),
    seconds=0.25,
    ledger=ledger((4, 4, 0, 0, 0, 2, 20), (4, 3, 1, 1, 10, 2, 20)),
    worker=WorkerMetrics(submitted=1, coalesced=2, completed=1, peak_queue_occupancy=1),
    counters=PassCounters(disk_to_host_bytes=10, disk_to_device_bytes=5, host_to_device_bytes=40),
  )
  t.commit_pass(
    args=(tokens(1),),
    seconds=0.125,
    ledger=ledger((1, 1, 0, 0, 0, 1, 10), (1, 0, 1, 0, 0, 1, 10)),
    counters=PassCounters(disk_to_device_bytes=10, stalls=2, stall_seconds=0.5),
  )
  r = t.report()
  assert r.prefill.passes == 2 and r.decode.passes == 1
  assert r.prefill.seconds == 0.75 and r.total.seconds == 0.875
  assert r.prefill.host == TierMetrics(
    requests=8, hits=7, misses=1, evictions=1, evicted_bytes=10, peak_units=3, peak_bytes=30
  )
  assert r.prefill.device.hits == 5 and r.prefill.device.peak_units == 2
  assert r.total.host.requests == 9 and r.total.host.hit_rate == 8 / 9
  assert r.prefill.worker == WorkerMetrics(
    submitted=4, coalesced=2, completed=4, peak_queue_occupancy=2
  )
  assert r.decode.worker is None and r.total.worker == r.prefill.worker
  assert (r.prefill.disk_to_host_bytes, r.prefill.disk_to_device_bytes) == (40, 5)
  assert r.prefill.bytes_read == 45 and r.decode.bytes_read == 10 and r.total.bytes_read == 55
  assert r.total.host_to_device_bytes == 80
  assert r.total.stalls == 3 and r.total.stall_seconds == 0.75
  assert (r.total.peak_host_units, r.total.peak_host_bytes) == (3, 30)
  assert (r.total.peak_device_units, r.total.peak_device_bytes) == (2, 20)
  assert r.total == r.prefill + r.decode
  assert r.passes[0].bytes_read == 30


def test_explicit_peaks_override_the_ledger():
  t = telemetry()
  p = t.commit_pass(
    args=(tokens(2),),
    seconds=0.0,
    peak_device_units=4,
    peak_device_bytes=40,
    peak_host_units=4,
    peak_host_bytes=40,
  )
  assert (p.peak_device_units, p.peak_device_bytes, p.peak_host_units, p.peak_host_bytes) == (
    4,
    40,
    4,
    40,
  )
  assert p.host is None and p.device is None


def test_empty_report():
  r = telemetry().report()
  assert r.passes == () and r.last is None
  assert r.total == Totals() and r.total.bytes_read == 0
  json.dumps(r.to_dict())
  assert "total" in str(r)


def test_history_is_bounded_but_totals_count_every_pass():
  t = telemetry(history=2)
  for n in (3, 1, 4, 1, 5):
    t.commit_pass(args=(tokens(n),), seconds=1.0)
  r = t.report()
  assert [p.index for p in r.passes] == [3, 4]
  assert r.total.passes == 5 and r.prefill.passes == 3 and r.decode.passes == 2


def test_concurrent_commits_are_all_counted():
  t = telemetry()

  def work():
    for _ in range(50):
      t.commit_pass(args=(tokens(2),), seconds=0.001, counters=PassCounters(stalls=1))

  threads = [threading.Thread(target=work) for _ in range(4)]
  for th in threads:
    th.start()
  for th in threads:
    th.join()
  r = t.report()
  assert r.total.passes == 200 and r.total.stalls == 200
  assert sorted(p.index for p in r.passes) == list(range(200 - len(r.passes), 200))


# --- samplers ----------------------------------------------------------------


def test_sampler_values_land_in_the_pass_and_the_totals():
  samples = iter(
    [
      {"rss_bytes": 100, "peak_rss_bytes": 150, "minor_faults": 3, "major_faults": 1},
      {"rss_bytes": 90, "peak_rss_bytes": 120, "minor_faults": 2, "major_faults": 0},
    ]
  )
  t = telemetry(samplers={"process": lambda: next(samples), "backend": lambda: {"source": "x"}})
  t.commit_pass(args=(tokens(4),), seconds=0.0)
  t.commit_pass(args=(tokens(1),), seconds=0.0)
  r = t.report()
  assert r.passes[0].process["peak_rss_bytes"] == 150
  assert r.passes[1].backend == {"source": "x"}
  assert (r.prefill.peak_rss_bytes, r.decode.peak_rss_bytes, r.total.peak_rss_bytes) == (
    150,
    120,
    150,
  )
  assert (r.total.minor_faults, r.total.major_faults) == (5, 1)
  text = str(r)
  assert "peak RSS: 150 B" in text and "5 minor, 1 major" in text


def test_a_failing_sampler_records_none_and_the_pass_commits():
  def broken():
    raise OSError("no /proc here")

  t = telemetry(samplers={"process": broken})
  p = t.commit_pass(args=(tokens(2),), seconds=0.0)
  assert p.process is None and t.report().total.passes == 1


def test_start_and_close_reach_samplers_that_have_them():
  events = []

  class Sampler:
    def start(self):
      events.append("start")

    def close(self):
      events.append("close")

    def __call__(self):
      return {"rss_bytes": 1}

  t = telemetry(samplers={"process": Sampler(), "backend": dict})
  t.start()
  t.close()
  assert events == ["start", "close"]


def test_for_policy_adds_the_samplers_the_flags_ask_for():
  def make(process, backend):
    opts = jr.LayerwiseLoadOptions(sample_process_memory=process, sample_backend_memory=backend)
    policy = jr.LayerwiseHost(opts)
    return Telemetry.for_policy(policy=policy, metadata=metadata(policy), sequence_axis=2)

  assert make(False, False)._samplers == {}
  assert set(make(True, False)._samplers) == {"process"}
  assert set(make(False, True)._samplers) == {"backend"}
  both = make(True, True)
  assert set(both._samplers) == {"process", "backend"} and both.sequence_axis == 2
  both.close()


# --- the report is immutable and serialisable --------------------------------


def test_report_is_immutable_and_json_serialisable():
  t = telemetry(samplers={"backend": lambda: {"source": "live_arrays", "by": {"device": 1}}})
  t.commit_pass(args=(tokens(3),), seconds=0.5, ledger=ledger((1,) * 7, (2,) * 7))
  r = t.report()
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.total = Totals()  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    r.passes[0].seconds = 1.0  # type: ignore[misc]
  with pytest.raises(TypeError):
    r.policy["kind"] = "x"  # type: ignore[index]
  with pytest.raises(TypeError):
    r.metadata["layer_count"] = 0  # type: ignore[index]
  with pytest.raises(TypeError):
    r.passes[0].backend["by"]["device"] = 2  # type: ignore[index]
  assert isinstance(r.metadata["unit_bytes"], tuple)

  d = r.to_dict()
  again = json.loads(json.dumps(d))
  assert again == d
  assert d["policy"] == {"kind": "fully_resident"}
  assert d["metadata"]["layer_count"] == 4 and d["metadata"]["unit_bytes"] == [10] * 4
  assert d["passes"][0]["phase"] == "prefill" and d["passes"][0]["host"]["hits"] == 1
  assert d["passes"][0]["backend"] == {"source": "live_arrays", "by": {"device": 1}}
  assert d["total"]["bytes_read"] == 0 and d["prefill"]["passes"] == 1
  d["policy"]["kind"] = "changed"  # a copy: the report is unaffected
  assert r.policy["kind"] == "fully_resident"


def test_pass_report_freezes_what_it_is_given():
  process = {"rss_bytes": 1}
  p = PassReport(
    index=0,
    phase=DECODE,
    tokens=1,
    seconds=0.0,
    host=None,
    device=None,
    disk_to_host_bytes=0,
    disk_to_device_bytes=0,
    host_to_device_bytes=0,
    stalls=0,
    stall_seconds=0.0,
    peak_device_units=0,
    peak_device_bytes=0,
    peak_host_units=0,
    peak_host_bytes=0,
    process=process,
  )
  process["rss_bytes"] = 2
  assert p.process == {"rss_bytes": 1}
  assert json.loads(json.dumps(p.to_dict()))["process"] == {"rss_bytes": 1}


def test_str_is_a_readable_table():
  t = telemetry()
  t.commit_pass(args=(tokens(3),), seconds=0.5, ledger=ledger((4, 3, 1, 0, 0, 2, 20), (0,) * 7))
  t.commit_pass(args=(tokens(1),), seconds=0.25)
  lines = str(t.report()).splitlines()
  assert lines[0] == "policy: fully_resident"
  assert lines[1].split() == [
    "passes",
    "seconds",
    "compile",
    "read",
    "host→dev",
    "stalls",
    "dev",
    "hit",
    "host",
    "hit",
  ]
  assert lines[2].split()[:3] == ["prefill", "1", "0.500"]
  assert lines[3].split()[:3] == ["decode", "1", "0.250"]
  assert lines[4].split()[:3] == ["total", "2", "0.750"]
  assert "75%" in lines[2]  # host hit rate
  assert lines[5].startswith("peak device:") and "peak host: 2 units" in lines[5]
  assert all(line == line.rstrip() for line in lines)


# --- compile time --------------------------------------------------------------


def fresh_jit():
  """A function JAX has not compiled yet (a new closure each call)."""
  salt = float(np.random.default_rng().integers(1, 1000))
  return jax.jit(lambda x: jnp.tanh(x * salt) + salt)


def test_a_pass_that_compiles_reports_its_compile_time():
  t = telemetry()
  start = time.perf_counter()
  fresh_jit()(jnp.ones(7)).block_until_ready()
  p = t.commit_pass(args=(tokens(2),), seconds=time.perf_counter() - start)
  assert 0 < p.compile_seconds <= p.seconds


def test_compiles_before_the_pass_or_on_other_threads_are_not_charged():
  t = telemetry()
  fresh_jit()(jnp.ones(7)).block_until_ready()  # before the pass
  start = time.perf_counter()
  worker = threading.Thread(target=lambda: fresh_jit()(jnp.ones(7)).block_until_ready())
  worker.start()
  worker.join()
  p = t.commit_pass(args=(tokens(2),), seconds=time.perf_counter() - start)
  assert p.compile_seconds == 0.0 and p.seconds > 0


def test_compile_seconds_add_up_and_reach_the_dict():
  t = telemetry()
  for n in (3, 1):
    start = time.perf_counter()
    fresh_jit()(jnp.ones(n)).block_until_ready()
    t.commit_pass(args=(tokens(n),), seconds=time.perf_counter() - start)
  r = t.report()
  first, second = (p.compile_seconds for p in r.passes)
  assert first > 0 and second > 0
  assert r.prefill.compile_seconds == first and r.decode.compile_seconds == second
  assert r.total.compile_seconds == first + second
  d = json.loads(json.dumps(r.to_dict()))
  assert d["passes"][0]["compile_seconds"] == first
  assert d["total"]["compile_seconds"] == first + second


def test_compile_spans_nested_in_each_other_count_once():
  from jax_residency._src.report import compile_time

  event = "/jax/core/compile/jaxpr_trace_duration"
  got = {}

  def on_a_fresh_thread():
    start = time.perf_counter() - 2.0
    compile_time._on_duration(event, 0.25)  # an inner trace, ending now...
    compile_time._on_duration(event, 1.0)  # ...inside an outer one that ends now too
    compile_time._on_duration("/jax/some/other_duration", 1.5)  # not compiling
    now = time.perf_counter()
    got["all"] = compile_time.seconds_between(start, now)
    got["clipped"] = compile_time.seconds_between(now - 0.5, now)
    compile_time.forget_before(now + 1)
    got["forgotten"] = compile_time.seconds_between(start, now)

  worker = threading.Thread(target=on_a_fresh_thread)
  worker.start()
  worker.join()
  assert got["all"] == pytest.approx(1.0, abs=0.05)
  assert got["clipped"] == pytest.approx(0.5, abs=0.05)
  assert got["forgotten"] == 0.0


# --- through place(): every policy, failures commit nothing ------------------


class Flaky(nnx.Module):
  """Layers stacked with nnx.vmap; a batch of 3 raises after the layers ran (a failing pass)."""

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(
      jax.random.split(rngs.params(), 4)
    )

  def __call__(self, x):
    y = jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)
    if x.shape[0] == 3:
      raise RuntimeError("this pass fails")
    return y


@pytest.fixture(scope="module")
def flaky():
  return Flaky(nnx.Rngs(0))


@pytest.fixture(scope="module")
def flaky_store(flaky, tmp_path_factory):
  from jax_residency._src.store.save import save

  path = str(tmp_path_factory.mktemp("telemetry") / "flaky")
  save(flaky, path, units="layers", progress=False)
  return path


def policies():
  return [
    jr.FullyResident(),
    jr.LayerwiseHost(jr.LayerwiseLoadOptions(offload=jr.OffloadConfig(prefetch_depth=2))),
    jr.DenseDiskStream(
      jr.DenseDiskStreamLoadOptions(host_budget_bytes="1MiB", device_budget_bytes="1MiB")
    ),
  ]


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_a_failed_pass_leaves_the_totals_unchanged(flaky, flaky_store, policy):
  kwargs = {"store": flaky_store} if policy.dense else {}
  with jr.place(flaky, policy, **kwargs) as placed:
    placed(jnp.ones((2, 4, 8)))  # prefill: 4 tokens along axis 1
    before = placed.report()
    with pytest.raises(RuntimeError, match="this pass fails"):
      placed(jnp.ones((3, 4, 8)))
    after = placed.report()
    assert after == before and after.total.passes == 1
    placed(jnp.ones((2, 1, 8)))  # decode
    last = placed.report()
  assert (last.prefill.passes, last.decode.passes) == (1, 1)
  assert [p.index for p in last.passes] == [0, 1]


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_report_per_policy(flaky, flaky_store, policy, mesh1):
  kwargs = {"store": flaky_store} if policy.dense else {}
  unit = 8 * 8 * 4 + 8 * 4
  with jr.place(flaky, policy, mesh=mesh1, **kwargs) as placed:
    placed(jnp.ones((2, 8)))
    r = placed.report()
  p = r.last
  assert r.policy["kind"] == policy.name and r.metadata["layer_count"] == 4
  assert p.phase == PREFILL and p.tokens == 8 and p.seconds > 0
  match policy:
    case jr.FullyResident():
      assert (p.peak_device_units, p.peak_device_bytes) == (4, 4 * unit)
      assert p.host_to_device_bytes == 0 and p.bytes_read == 0 and p.peak_host_units == 0
    case jr.LayerwiseHost():  # measured: its window is inside the program, not an array
      assert (p.peak_device_units, p.peak_device_bytes) == (0, 0)
      assert (p.peak_host_units, p.peak_host_bytes) == (4, 4 * unit)
      assert p.host_to_device_bytes == 4 * unit and p.bytes_read == 0
    case jr.DenseDiskStream():
      assert p.peak_device_units == 2 and p.bytes_read == 4 * unit
      assert p.device is not None and p.host is not None and p.worker is not None
  json.dumps(r.to_dict())
  assert str(r).startswith(f"policy: {policy.name}")


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_place_takes_the_sequence_axis(flaky, flaky_store, policy):
  kwargs = {"store": flaky_store} if policy.dense else {}
  with jr.place(flaky, policy, sequence_axis=0, **kwargs) as placed:
    placed(jnp.ones((1, 8)))  # one token along axis 0
    placed(jnp.ones((2, 8)))
    r = placed.report()
  assert [p.phase for p in r.passes] == [DECODE, PREFILL]


@pytest.mark.parametrize("policy", policies(), ids=lambda p: p.name)
def test_the_first_pass_compiles_and_an_identical_second_does_not(flaky, flaky_store, policy):
  kwargs = {"store": flaky_store} if policy.dense else {}
  x = jnp.ones((2, 11, 8))  # a shape no other test runs, so the first pass compiles
  with jr.place(flaky, policy, **kwargs) as placed:
    placed(x)
    placed(x)
    first, second = placed.report().passes
  assert 0 < first.compile_seconds <= first.seconds
  assert second.compile_seconds == 0.0


@pytest.mark.parametrize("axis", ["1", 1.0, True, None])
def test_place_rejects_a_non_int_sequence_axis(flaky, axis):
  with pytest.raises(jr.PlacementError, match="sequence_axis"):
    jr.place(flaky, sequence_axis=axis)


def test_each_compile_returns_the_heap_it_freed(monkeypatch):
  """docs/memory.md, "Process memory beside the plan": after each XLA compile (not a
  trace or a lowering) the C heap's free memory goes back to the system."""
  import platform

  from jax_residency._src.report import compile_time

  if platform.libc_ver()[0] != "glibc":
    assert compile_time.release_heap() is False
    return
  x = jnp.ones(9)
  fresh = float(time.time_ns() % 1_000_003)  # a program no compilation cache holds
  f = jax.jit(lambda x: jnp.cos(x) * fresh + 1.0)
  trims = []
  monkeypatch.setattr(compile_time, "_trim", lambda pad: trims.append(pad) or 1)
  compile_time.install()
  f(x).block_until_ready()  # traced, lowered, compiled: one compile
  assert trims == [0]
  f(x).block_until_ready()  # no compile, no trim
  assert trims == [0]
  compile_time._on_duration("/jax/core/compile/jaxpr_trace_duration", 0.1)  # a trace only
  assert trims == [0]


def test_a_program_is_compiled_once_for_shardings_written_two_ways(tmp_path):
  """A model's cache can come back sharded ``P()`` from one call and ``P(None, None)``
  from another (an int8-activations draft's steps): one placement written two ways, so
  one program (`report.compile_time.signature`); a speculative generation compiles its
  int8 draft once for its prefill and once for its one-token calls."""
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  from jax_residency import models
  from jax_residency._src.report.compile_time import signature

  mesh = jax.sharding.Mesh(jax.devices()[:1], ("devices",))
  x = jnp.zeros((2, 3))
  a, b = (jax.device_put(x, NamedSharding(mesh, spec)) for spec in (P(), P(None, None)))
  assert signature((a,), {}) == signature((b,), {})
  assert signature((a,), {}) != signature(
    (jax.device_put(x, NamedSharding(mesh, P("devices"))),), {}
  )

  cfg = models.LlamaConfig(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
  )
  model = models.init_llama(cfg, seed=3)
  store = jr.save(model, str(tmp_path / "s"), progress=False, quantize="int8").path
  with (
    jr.place(model, jr.FullyResident()) as target,
    jr.place(model, jr.FullyResident(), store=store, activations="int8") as draft,
  ):
    _, report = models.speculate(
      target,
      [[3, 4, 5, 6, 7]],
      8,
      config=cfg,
      draft=draft,
      draft_config=cfg,
      draft_tokens=2,
      stop_tokens=(),
    )
    assert report.rounds >= 2
    for placed in (target, draft):  # a prefill program and one for the rounds' calls
      assert len(placed._placed()._compiled) == 2  # noqa: SLF001
