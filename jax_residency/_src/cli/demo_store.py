"""The demo's store: a seeded toy transformer written once under the cache directory.

Its path is a hash of the model's config, so each config gets its own store, and a
later ``jax-residency demo`` reuses it when its model record and metadata read back.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from typing import Any

from jax_residency._src.cache_dir import library_cache_dir
from jax_residency._src.cli.console import CommandError, fmt_bytes, status
from jax_residency._src.cli.stored_models import (
  abstract_toy,
  open_store,
  read_model_record,
  write_model_record,
)

#: Bumped when the demo's store or model recipe changes, so old caches are rebuilt.
DEMO_FORMAT = 1
DEMO_SEED = 0


def cache_root(cache_dir: str | None) -> str:
  """``--cache-dir`` if given, else the library's cache directory."""
  if cache_dir:
    return os.path.abspath(os.path.expanduser(cache_dir))
  return library_cache_dir()


def demo_store_path(root: str, config: Any) -> str:
  key = json.dumps(
    {"format": DEMO_FORMAT, "seed": DEMO_SEED, "config": dataclasses.asdict(config)},
    sort_keys=True,
  )
  return os.path.join(root, f"demo-{hashlib.sha256(key.encode()).hexdigest()[:12]}")


def demo_store_ready(path: str, config: Any) -> bool:
  from jax_residency._src.errors import ResidencyError  # noqa: PLC0415

  try:
    record = read_model_record(path)
  except CommandError:
    return False
  if record is None or record.get("config") != dataclasses.asdict(config):
    return False
  try:
    open_store(path).close()
  except (CommandError, ResidencyError):
    return False
  return True


def build_demo_store(path: str, config: Any) -> None:
  """Builds the seeded model and writes its store, in a child process.

  The child's memory goes back to the system when it exits, so the peak RSS the
  demo then measures is the same on the first run as on later ones.
  """
  size = fmt_bytes(config.unit_bytes() * config.n_layers)
  status(f"first run: building a seeded {config.n_layers}-layer toy model ({size} of unit weights)")
  status(f"writing it to {path} (once; later runs reuse it)")
  os.makedirs(os.path.dirname(path), exist_ok=True)
  request = json.dumps({"path": path, "config": dataclasses.asdict(config), "seed": DEMO_SEED})
  code = f"from {__name__} import write_demo_store as w; w({request!r})"
  done = subprocess.run([sys.executable, "-c", code], check=False)
  if done.returncode != 0:
    raise CommandError(
      f"building the demo store at {path} failed (exit code {done.returncode}; the error is "
      "printed above)"
    )


def write_demo_store(request: str) -> None:
  """The child process of :func:`build_demo_store`.

  The toy transformer's weights are drawn from a seeded NumPy generator (much
  faster than running the model's own initialisers eagerly): LayerNorm scales 1,
  biases 0, every other tensor uniform with variance ``1 / fan_in``.
  """
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.models.toy import ToyConfig  # noqa: PLC0415
  from jax_residency._src.plan.split import split_model  # noqa: PLC0415
  from jax_residency._src.store.writer import save_store  # noqa: PLC0415

  spec = json.loads(request)
  config, path, seed = ToyConfig(**spec["config"]), spec["path"], spec["seed"]
  split = split_model(abstract_toy(config, seed))
  rng = np.random.default_rng(seed)

  def init(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    if name == "scale":
      return np.ones(shape, dtype)
    if name == "bias":
      return np.zeros(shape, dtype)
    fan_in = shape[-1] if name == "embedding" or len(shape) < 2 else shape[-2]
    bound = np.sqrt(3.0 / fan_in)
    return (rng.random(shape, dtype=np.float32) * (2 * bound) - bound).astype(dtype)

  static = {
    leaf.path: init(leaf.path[-1], leaf.shape, leaf.dtype) for leaf in split.static_leaves()
  }
  units = {}
  for leaf in split.unit_leaves():
    stacked = np.empty(leaf.shape, leaf.dtype)
    for i in range(split.unit_count):
      stacked[i] = init(leaf.path[-1], leaf.shape[1:], leaf.dtype)
    units[split.unit_rel_path(leaf)] = stacked
  save_store(
    path,
    static=static,
    units=units,
    unit_prefix=split.unit_path_prefix,
    progress=None,
    overwrite=os.path.exists(path),
  )
  write_model_record(path, config, seed)
