"""Memory sampling: the RSS sampler thread, /proc parsing, backend memory, wiring into place()."""

from __future__ import annotations

import gc
import mmap
import sys
import threading
import time
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency._src.report import sampling
from jax_residency._src.report.sampling import ProcessMemorySampler, backend_memory

THREAD_NAME = "jax_residency-memory-sampler"
LINUX = sys.platform.startswith("linux")
MiB = 2**20


def touch(nbytes: int) -> mmap.mmap:
  """Anonymous memory, made resident; closing it returns it to the system at once.

  (``mmap`` rather than numpy: a store may have tuned malloc to keep freed memory.)
  """
  block = mmap.mmap(-1, nbytes)
  page = b"x" * mmap.PAGESIZE
  for offset in range(0, nbytes, mmap.PAGESIZE):
    block[offset : offset + mmap.PAGESIZE] = page
  return block


def sampler_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == THREAD_NAME]


@pytest.fixture(autouse=True)
def no_thread_left_behind():
  before = len(sampler_threads())
  yield
  assert len(sampler_threads()) == before


# --- the process sampler -----------------------------------------------------


@pytest.mark.skipif(not LINUX, reason="/proc/self is Linux only")
def test_values_present_on_linux():
  with ProcessMemorySampler(interval=0.005) as sampler:
    assert sampler.running and len(sampler_threads()) == 1
    sample = sampler.sample()
  assert sample is not None
  assert set(sample) == {"rss_bytes", "peak_rss_bytes", "minor_faults", "major_faults"}
  assert sample["peak_rss_bytes"] >= sample["rss_bytes"] > 0
  assert sample["minor_faults"] >= 0 and sample["major_faults"] >= 0


def test_thread_stops_on_close():
  sampler = ProcessMemorySampler(interval=0.005).start()
  assert sampler.running == sampling.process_memory_supported()
  sampler.close()
  assert not sampler.running
  assert sampler_threads() == []
  sampler.close()  # idempotent
  sampler.stop()


def test_context_manager_stops_on_error():
  with pytest.raises(RuntimeError), ProcessMemorySampler(interval=0.005):
    raise RuntimeError("boom")
  assert sampler_threads() == []


@pytest.mark.skipif(not LINUX, reason="/proc/self is Linux only")
def test_thread_catches_a_transient_peak():
  with ProcessMemorySampler(interval=0.002) as sampler:
    base = sampler.sample()["rss_bytes"]
    block = touch(96 * MiB)
    time.sleep(0.1)  # the thread samples while the block lives
    block.close()
    sample = sampler.sample()
  # The block is gone by the time of the sample, but the thread saw it.
  assert sample["peak_rss_bytes"] >= base + 64 * MiB
  assert sample["peak_rss_bytes"] > sample["rss_bytes"]


@pytest.mark.skipif(not LINUX, reason="/proc/self is Linux only")
def test_samples_cover_the_interval_since_the_previous_one():
  with ProcessMemorySampler(interval=0.002) as sampler:
    block = touch(64 * MiB)
    time.sleep(0.05)
    block.close()
    first = sampler.sample()
    second = sampler.sample()
  assert first["peak_rss_bytes"] > second["peak_rss_bytes"]  # the peak was reset
  assert first["minor_faults"] > second["minor_faults"]  # faults are per interval


@pytest.mark.skipif(not LINUX, reason="/proc/self is Linux only")
def test_the_thread_waits_between_samples(monkeypatch):
  calls = []
  real = sampling.read_rss_bytes
  monkeypatch.setattr(sampling, "read_rss_bytes", lambda: calls.append(1) or real())
  with ProcessMemorySampler(interval=0.05):
    time.sleep(0.3)
  # About 6 samples in 0.3 s at 0.05 s; a busy loop would take thousands.
  assert 2 <= len(calls) <= 12


def test_absent_elsewhere(monkeypatch):
  monkeypatch.setattr(sampling, "process_memory_supported", lambda: False)
  sampler = ProcessMemorySampler()
  with sampler:
    assert not sampler.running
    assert sampler_threads() == []
    assert sampler.sample() is None
    assert sampler() is None
  assert "unsupported" in repr(sampler)


def test_sample_without_start_is_an_instant():
  sampler = ProcessMemorySampler()
  sample = sampler.sample()
  if sample is not None:
    assert sample["peak_rss_bytes"] == sample["rss_bytes"]
    assert sample["minor_faults"] == sample["major_faults"] == 0
  assert sampler_threads() == []


@pytest.mark.parametrize("interval", [0, -1.0])
def test_interval_must_be_positive(interval):
  with pytest.raises(ValueError, match="interval"):
    ProcessMemorySampler(interval=interval)


def test_page_faults_parse_a_command_with_spaces_and_parens(tmp_path, monkeypatch):
  stat = tmp_path / "stat"
  # pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt ...
  stat.write_text("42 (my (odd) prog) S 1 42 42 0 -1 4194560 111 5 222 7 3 4 0 0 20 0\n")
  monkeypatch.setattr(sampling, "_STAT", str(stat))
  assert sampling.read_page_faults() == (111, 222)


def test_rss_reads_statm(tmp_path, monkeypatch):
  statm = tmp_path / "statm"
  statm.write_text("1000 250 10 1 0 100 0\n")
  monkeypatch.setattr(sampling, "_STATM", str(statm))
  assert sampling.read_rss_bytes() == 250 * sampling.os.sysconf("SC_PAGE_SIZE")


# --- backend memory ----------------------------------------------------------


class FakeDevice:
  def __init__(self, name: str, stats: dict | None):
    self.name, self.stats = name, stats

  def memory_stats(self) -> dict | None:
    return self.stats

  def __str__(self) -> str:
    return self.name


def test_backend_memory_uses_memory_stats_when_the_backend_has_them():
  stats = {"bytes_in_use": np.int64(10), "peak_bytes_in_use": 20, "bytes_limit": 100}
  out = backend_memory([FakeDevice("gpu:0", stats), FakeDevice("gpu:1", {"bytes_in_use": 5})])
  assert out["source"] == "memory_stats"
  assert out["devices"]["gpu:0"] == {
    "bytes_in_use": 10,
    "peak_bytes_in_use": 20,
    "bytes_limit": 100,
  }
  assert type(out["devices"]["gpu:0"]["bytes_in_use"]) is int
  assert out["devices"]["gpu:1"] == {"bytes_in_use": 5}


def test_backend_memory_falls_back_to_live_arrays():
  class Raising(FakeDevice):
    def memory_stats(self) -> dict:
      raise RuntimeError("not supported")

  for devices in ([FakeDevice("cpu:0", None)], [Raising("cpu:0", None)]):
    assert backend_memory(devices)["source"] == "live_arrays"


def test_live_arrays_counted_per_memory_kind():
  """Live arrays are counted process-wide, so arrays an earlier test left to the garbage
  collector (or to a finishing background read) may be freed while this test measures:
  it collects first, and measures again if the count moved the other way."""
  device = jax.devices()[0]
  kinds = {m.kind for m in device.addressable_memories()}
  for attempt in range(3):
    gc.collect()
    before = backend_memory([FakeDevice("cpu", None)])["bytes_by_memory_kind"]
    on_device = jax.device_put(jnp.ones((256, 256), jnp.float32), device)
    host = None
    if "pinned_host" in kinds:
      host_sharding = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
      host = jax.device_put(np.ones((128, 128), np.float32), host_sharding)
    after = backend_memory([FakeDevice("cpu", None)])["bytes_by_memory_kind"]
    grew = after["device"] - before.get("device", 0) >= on_device.nbytes
    if host is not None:
      grew = grew and after["pinned_host"] - before.get("pinned_host", 0) >= host.nbytes
    if grew or attempt == 2:
      break
    on_device = host = None  # freed before the next count starts
  assert after["device"] - before.get("device", 0) >= on_device.nbytes
  if host is not None:
    assert after["pinned_host"] - before.get("pinned_host", 0) >= host.nbytes


def test_cpu_backend_reports_live_arrays():
  # The CPU backend has no memory_stats(); the fallback is what a CPU run reports.
  if jax.devices()[0].memory_stats():
    pytest.skip("this backend reports memory_stats")
  assert backend_memory()["source"] == "live_arrays"


# --- wiring into place() -----------------------------------------------------


class Net(nnx.Module):
  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, rngs: nnx.Rngs):
    self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(
      jax.random.split(rngs.params(), 3)
    )

  def __call__(self, x):
    return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)


@pytest.fixture(scope="module")
def net():
  return Net(nnx.Rngs(0))


def layerwise(process: bool, backend: bool) -> jr.LayerwiseHost:
  return jr.LayerwiseHost(
    jr.LayerwiseLoadOptions(sample_process_memory=process, sample_backend_memory=backend)
  )


def test_placed_model_runs_the_sampler_until_close(net):
  x = jnp.ones((2, 8))
  placed = jr.place(net, layerwise(True, True))
  try:
    assert len(sampler_threads()) == (1 if sampling.process_memory_supported() else 0)
    placed(x)
    p = placed.report().last
  finally:
    placed.close()
  assert sampler_threads() == []
  assert p.backend is not None and p.backend["source"] in ("live_arrays", "memory_stats")
  if LINUX:
    assert p.process is not None and p.process["peak_rss_bytes"] >= p.process["rss_bytes"] > 0
  else:
    assert p.process is None


def test_process_sample_is_absent_off_linux(net, monkeypatch):
  monkeypatch.setattr(sampling, "process_memory_supported", lambda: False)
  with jr.place(net, layerwise(True, False)) as placed:
    assert sampler_threads() == []
    placed(jnp.ones((2, 8)))
    report = placed.report()
  assert report.last.process is None
  assert report.total.peak_rss_bytes is None and report.total.minor_faults is None
  assert "peak RSS" not in str(report)


@pytest.mark.parametrize("policy", [jr.FullyResident(), layerwise(False, False)])
def test_no_samplers_unless_the_policy_asks(net, policy):
  with jr.place(net, policy) as placed:
    assert sampler_threads() == []
    placed(jnp.ones((2, 8)))
    p = placed.report().last
  assert p.process is None and p.backend is None


def test_only_the_backend_sampler(net):
  with jr.place(net, layerwise(False, True)) as placed:
    assert sampler_threads() == []
    placed(jnp.ones((2, 8)))
    p = placed.report().last
  assert p.process is None and p.backend is not None


def test_dense_stream_samples_and_stops(net, tmp_path):
  from jax_residency._src.store.save import save

  path = str(tmp_path / "net")
  save(net, path, progress=False)
  policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      host_budget_bytes="1MiB", sample_process_memory=True, sample_backend_memory=True
    )
  )
  x = jnp.ones((2, 8))
  with jr.place(net, policy, store=path) as placed:
    np.testing.assert_array_equal(placed(x), net(x))
    p = placed.report().last
  assert sampler_threads() == []
  assert p.backend is not None
  assert (p.process is not None) == sampling.process_memory_supported()


def test_a_failed_placement_leaves_no_sampler_thread(net):
  options = jr.LayerwiseLoadOptions(
    offload=jr.OffloadConfig(device_budget_bytes=1), sample_process_memory=True
  )
  with pytest.raises(jr.DeviceBudgetTooSmallError):
    jr.place(net, jr.LayerwiseHost(options))
  assert sampler_threads() == []
