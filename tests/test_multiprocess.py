"""Two JAX processes (jax.distributed, gloo on CPU) stream one store over a shared mesh.

Each process has 4 CPU devices; units are sharded over an 8-device ``model`` axis
spanning both, so each process must read only the half of each sharded tensor its
devices own, and the outputs must match the plain model.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from user_env import run_script, user_env

from jax_residency.toy import ToyConfig

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)
WORKER = os.path.join(os.path.dirname(__file__), "multiprocess_worker.py")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


#: Host budgets, in units: no host cache (direct), and a cache of two units.
HOST_UNITS = (0, 2)


@pytest.fixture(scope="module")
def outputs(toy_model, saved_store, tmp_path_factory, zygote):
  """One pair of worker processes places the store under every budget of HOST_UNITS in
  turn; returns the plain model's output and the directory of what the workers wrote."""
  mesh = jax.make_mesh((1,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  model = toy_model(CFG, mesh=mesh)
  store = saved_store(("toy", CFG, 0, mesh, False), model).path
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % CFG.vocab
  expected = np.asarray(model(tokens))
  out_dir = tmp_path_factory.mktemp("multiprocess")
  env = user_env(out_dir)  # the worker sets its own four devices
  env["TOY_CONFIG"] = json.dumps(dataclasses.asdict(CFG))
  env["HOST_BUDGETS"] = ",".join(str(units * CFG.unit_bytes()) for units in HOST_UNITS)
  port = _free_port()

  def worker(pid: int) -> subprocess.CompletedProcess:  # forked from the zygote, side by side
    cmd = [sys.executable, WORKER, str(pid), str(port), store, str(out_dir)]
    return run_script(cmd, zygote, env=env, capture_output=True, text=True, timeout=240)

  with concurrent.futures.ThreadPoolExecutor(2) as pool:
    done = list(pool.map(worker, range(2)))
  assert [d.returncode for d in done] == [0, 0], done[0].stderr[-2000:] + done[1].stderr[-2000:]
  return expected, out_dir


@pytest.mark.skipif(sys.platform != "linux", reason="gloo CPU collectives are tested on Linux")
@pytest.mark.parametrize("host_units", HOST_UNITS)
def test_each_process_reads_only_its_shards(outputs, host_units):
  expected, out_dir = outputs
  halves = []
  for pid in range(2):
    name = f"{pid}-{host_units * CFG.unit_bytes()}"
    np.testing.assert_allclose(np.load(out_dir / f"out{name}.npy"), expected, atol=1e-5)
    with open(out_dir / f"reads{name}.json") as f:
      record = json.load(f)
    index = record["reads"][0]
    # down.kernel (d_ff, d_model) is sharded over "model" on axis 0: each process reads half.
    assert index["down/kernel"] == [[pid * 32, pid * 32 + 32], [0, 32]]
    assert index["norm1/scale"] == [[0, 32]]  # replicated tensors are read whole
    halves.append(record["bytes_read"])
  # Together the processes read less than two full copies of the units.
  assert sum(halves) < 2 * CFG.n_layers * CFG.unit_bytes()
