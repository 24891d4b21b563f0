"""Two JAX processes (jax.distributed, gloo on CPU) stream one store over a shared mesh.

Each process has 4 CPU devices; units are sharded over an 8-device ``model`` axis
spanning both, so each process must read only the half of each sharded tensor its
devices own, and the outputs must match the plain model.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)
WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.skipif(sys.platform != "linux", reason="gloo CPU collectives are tested on Linux")
@pytest.mark.parametrize("host_units", [0, 2])
def test_each_process_reads_only_its_shards(tmp_path, host_units):
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    model = ToyTransformer(CFG, rngs=nnx.Rngs(0), sharded=True)
  store = str(tmp_path / "store")
  jr.save(model, store, progress=False)
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % CFG.vocab
  expected = np.asarray(model(tokens))
  env = dict(os.environ)
  env["TOY_CONFIG"] = json.dumps(dataclasses.asdict(CFG))
  env["HOST_BUDGET"] = str(host_units * CFG.unit_bytes())
  env.pop("XLA_FLAGS", None)
  port = _free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, WORKER, str(pid), str(port), store, str(tmp_path)],
      env=env,
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
    )
    for pid in range(2)
  ]
  try:
    errors = [p.communicate(timeout=240)[1] for p in procs]
  finally:
    for p in procs:
      p.kill()
  assert [p.returncode for p in procs] == [0, 0], errors[0][-2000:] + errors[1][-2000:]
  halves = []
  for pid in range(2):
    np.testing.assert_allclose(np.load(tmp_path / f"out{pid}.npy"), expected, atol=1e-5)
    with open(tmp_path / f"reads{pid}.json") as f:
      record = json.load(f)
    index = record["reads"][0]
    # down.kernel (d_ff, d_model) is sharded over "model" on axis 0: each process reads half.
    assert index["down/kernel"] == [[pid * 32, pid * 32 + 32], [0, 32]]
    assert index["norm1/scale"] == [[0, 32]]  # replicated tensors are read whole
    halves.append(record["bytes_read"])
  # Together the processes read less than two full copies of the units.
  assert sum(halves) < 2 * CFG.n_layers * CFG.unit_bytes()
