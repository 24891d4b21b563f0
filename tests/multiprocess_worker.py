"""One process of the two-process dense-stream test (run by test_multiprocess.py).

Usage: python multiprocess_worker.py PROCESS_ID PORT STORE OUT_DIR

Places the store once per host budget in ``$HOST_BUDGETS`` (comma-separated bytes), one
after the other in this one process, and writes ``out{pid}-{budget}.npy`` (the gathered
output) and ``reads{pid}-{budget}.json`` (the read index of every unit read, and the
bytes read) for each.
"""

from __future__ import annotations

import json
import os
import sys


def main(pid: int, port: int, store: str, out_dir: str) -> None:
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
  import jax

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid
  )
  import numpy as np
  from flax import nnx
  from jax.experimental import multihost_utils

  import jax_residency as jr
  from jax_residency._src.store import unit_store as store_mod
  from jax_residency.toy import ToyConfig, ToyTransformer

  cfg = ToyConfig(**json.loads(os.environ["TOY_CONFIG"]))
  mesh = jax.make_mesh((8,), ("model",), axis_types=(jax.sharding.AxisType.Auto,))
  with jax.set_mesh(mesh):
    abstract = nnx.eval_shape(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0), sharded=True))
  reads: list[dict] = []
  real = store_mod.UnitStore.read_unit_async

  def spy(self, i, *, index=None, skip=()):
    reads.append({"/".join(k): [[s.start, s.stop] for s in v] for k, v in (index or {}).items()})
    return real(self, i, index=index, skip=skip)

  store_mod.UnitStore.read_unit_async = spy
  tokens = np.arange(12, dtype=np.int32).reshape(2, 6) % cfg.vocab
  for host_budget in (int(b) for b in os.environ["HOST_BUDGETS"].split(",")):
    options = jr.DenseDiskStreamLoadOptions(
      device_budget_bytes="64MiB",
      host_budget_bytes=host_budget,
      host_lookahead=2 if host_budget else 0,
      background_queue_capacity=2 if host_budget else 0,
    )
    reads.clear()
    with jr.place(abstract, jr.DenseDiskStream(options), store=store, mesh=mesh) as placed:
      out = multihost_utils.process_allgather(placed(tokens), tiled=True)
      bytes_read = placed.report().last.bytes_read
    name = f"{pid}-{host_budget}"
    np.save(os.path.join(out_dir, f"out{name}.npy"), np.asarray(out))
    with open(os.path.join(out_dir, f"reads{name}.json"), "w") as f:
      json.dump({"reads": reads, "bytes_read": bytes_read}, f)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
