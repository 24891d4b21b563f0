"""Soak: many dense-stream passes hold memory, threads and counters steady.

Marked ``slow``; run with ``python -m pytest -m slow``.
"""

from __future__ import annotations

import os
import threading

import jax
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer

pytestmark = pytest.mark.slow

CFG = ToyConfig(vocab=128, d_model=256, n_heads=4, d_ff=1024, n_layers=12)
UNIT = CFG.unit_bytes()


def _rss() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


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
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
  threads_before = threading.active_count()
  with jr.place(model, jr.DenseDiskStream(options), store=path, mesh=mesh) as placed:
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
  assert threading.active_count() == threads_before
  assert report.decode.passes == 20 + passes and report.prefill.passes == 1
  assert report.total.bytes_read == (21 + passes) * CFG.n_layers * UNIT
  assert report.total.peak_device_units <= 2
  assert report.total.peak_host_units <= host_units
  # Steady state: a few units of slack, no growth proportional to the passes.
  assert rss_end - rss_warm < 8 * UNIT, (rss_warm, rss_end)
