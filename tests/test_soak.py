"""Soak: many dense-stream passes hold memory, threads and counters steady.

`test_300_passes_of_a_tiny_model_stay_bounded_and_equal` runs in the default suite (a
few seconds); the long soak over a larger model is marked ``slow`` (run it with
``python -m pytest -m slow``).
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency import testing
from jax_residency._src.store import mapped
from jax_residency._src.store.buffers import buffer_layout
from jax_residency.toy import ToyConfig, ToyTransformer

CFG = ToyConfig(vocab=128, d_model=256, n_heads=4, d_ff=1024, n_layers=12)
UNIT = CFG.unit_bytes()
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
#: Units of ~131 KiB: a unit leaked per pass would be 38 MiB over 300 passes.
TINY = ToyConfig(vocab=32, d_model=64, n_heads=2, d_ff=128, n_layers=3)
TINY_UNIT = TINY.unit_bytes()


#: Threads of the process-wide read pool (direct reads and checksum checks): started
#: once, on first use, shared by every store, bounded; not a placement's.
READ_POOL = "jax_residency-read"


def _placement_threads() -> int:
  return sum(1 for t in threading.enumerate() if not t.name.startswith(READ_POOL))


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _slab_bytes(model: ToyTransformer) -> int:
  """One unit's read buffer: every tensor rounded up to a page."""
  specs = [
    (str(i), leaf.shape[1:], leaf.dtype)
    for i, leaf in enumerate(jax.tree.leaves(nnx.state(model.layers)))
  ]
  return buffer_layout(specs)[1]


@pytest.fixture(scope="module")
def tiny(seeded_nnx, tmp_path_factory):
  """The tiny model, its store, token ids and the plain model's output."""
  model = seeded_nnx(lambda: ToyTransformer(TINY, rngs=nnx.Rngs(0)))
  path = str(tmp_path_factory.mktemp("soak") / "tiny")
  jr.save(model, path, progress=False)
  tokens = jax.random.randint(jax.random.key(0), (1, 4), 0, TINY.vocab)
  return model, path, tokens, np.asarray(model(tokens))


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("host_units", [0, 2], ids=["direct", "cached"])
def test_300_passes_of_a_tiny_model_stay_bounded_and_equal(tiny, host_units):
  """300 passes: every output equals the plain model's; the caches, the read buffers and
  the process's RSS stay within bounds that do not grow with the passes; no pass reads a
  unit twice; no thread is left behind."""
  model, path, tokens, expected = tiny
  policy = jr.DenseDiskStream(
    host_budget_bytes=host_units * TINY_UNIT,
    host_lookahead=1 if host_units else 0,
    background_queue_capacity=1 if host_units else 0,
  )
  threads_before = _placement_threads()
  passes, warm = 300, 30
  differ = []
  with jr.place(model, policy, store=path, mesh=MESH1) as placed:
    half = (warm + passes) // 2
    for k in range(passes):
      if k == warm:  # allocators, compiled steps and the buffer pool are warm
        rss_warm = _rss()
      if k == half:
        rss_half = _rss()
      if not np.array_equal(np.asarray(placed(tokens)), expected):
        differ.append(k)
    rss_end = _rss()
    # Every pass's peaks (the totals cover those older than the 256-pass history) within
    # the planned device window and host cache.
    testing.assert_within_budgets(placed)
    report, meta = placed.report(), placed.metadata
    assert _placement_threads() == threads_before + (1 if host_units else 0)
  assert _placement_threads() == threads_before
  assert differ == []
  total = report.total  # peaks are the maximum over all 300 passes
  assert total.passes == passes and len(report.passes) <= passes
  reads = [p.bytes_read for p in report.passes]  # of the most recent passes
  assert max(reads) <= TINY.n_layers * TINY_UNIT  # no unit read twice in a pass
  if not host_units:  # one schedule: the device window keeps one unit between passes
    assert set(reads) == {(TINY.n_layers - 1) * TINY_UNIT}
  assert meta.device_window_bytes == 2 * TINY_UNIT
  assert meta.item_bytes("host cache") == host_units * TINY_UNIT
  assert 0 < total.peak_buffer_bytes <= (2 + host_units) * _slab_bytes(model)
  # The pass history (up to 256 reports) and allocator noise, not a unit per pass: RSS
  # does not keep growing. Each half of the passes gets half the bound, so a one-off
  # allocation in the process (the suite runs other files beside this one) is told
  # apart from growth per pass, which shows in both halves.
  growth = (rss_half - rss_warm, rss_end - rss_half)
  assert min(growth) < 12 * TINY_UNIT and sum(growth) < 36 * TINY_UNIT, growth


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux /proc")
@pytest.mark.parametrize("host_units", [0, 3])
def test_many_passes_hold_memory_and_threads_steady(tmp_path, host_units):
  model = ToyTransformer(CFG, rngs=nnx.Rngs(0))
  path = str(tmp_path / "soak")
  jr.save(model, path, progress=False)
  tokens = jax.random.randint(jax.random.key(0), (1, 8), 0, CFG.vocab)
  step = tokens[:, :1]
  expected_prefill, expected_step = model(tokens), model(step)
  options = jr.DenseDiskStreamLoadOptions(
    device_budget_bytes=64 * 2**20,
    host_budget_bytes=host_units * UNIT,
    host_lookahead=2 if host_units else 0,
    background_queue_capacity=2 if host_units else 0,
  )
  threads_before = _placement_threads()
  with jr.place(model, jr.DenseDiskStream(options), store=path, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), expected_prefill)
    for _ in range(20):  # warm up allocators and compile caches
      placed(step)
    rss_warm = _rss()
    passes = 300
    for k in range(passes):
      out = placed(step)
      if k % 50 == 0:
        np.testing.assert_array_equal(out, expected_step)
    rss_end = _rss()
    report = placed.report()
  assert _placement_threads() == threads_before
  pool = [t for t in threading.enumerate() if t.name.startswith(READ_POOL)]
  assert len(pool) <= mapped.DIRECT_READ_THREADS  # process-wide, bounded, shared
  assert report.decode.passes == 20 + passes and report.prefill.passes == 1
  assert report.total.bytes_read == (21 + passes) * CFG.n_layers * UNIT
  assert report.total.peak_device_units <= 2
  assert report.total.peak_host_units <= host_units
  # Steady state: a few units of slack, no growth proportional to the passes.
  assert rss_end - rss_warm < 8 * UNIT, (rss_warm, rss_end)
