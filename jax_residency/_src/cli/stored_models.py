"""Stored models for the command line: opening stores, model records, loading weights.

A store written by the demo (or any ``jax-residency`` command that builds a toy
model) records the toy config beside it, so ``run`` can rebuild the model class
abstractly and stream or load its weights.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import reprlib
from collections.abc import Mapping
from typing import Any

from jax_residency._src.cli.console import PROG, CommandError

#: Version of the model record written beside a store.
RECORD_FORMAT = 1

#: Where `run` finds a store's model class: a JSON file inside the store directory.
MODEL_FILE = "jax_residency_model.json"


def parse_prefix(text: str | None) -> tuple[str, ...] | None:
  return None if text is None else tuple(p for p in text.split(".") if p)


def open_store(path: str, *, units: str | None = None, streamable: bool = True) -> Any:
  """Opens a store's metadata; any failure to read it is a one-line error."""
  from jax_residency._src.errors import StoreError  # noqa: PLC0415
  from jax_residency._src.store.unit_store import UnitStore  # noqa: PLC0415

  if "://" not in path and not os.path.exists(path):
    raise CommandError(f"{path}: no such file or directory")
  try:
    return UnitStore.open(path, unit_prefix=parse_prefix(units), require_unit_chunks=streamable)
  except StoreError as e:
    if units is None and "unit prefix is unknown" in str(e):
      raise CommandError(f"{e} [here: pass --units PREFIX, e.g. --units params.layers]") from e
    raise
  except (OSError, ValueError) as e:  # e.g. a corrupt JSON file or a TensorStore failure
    raise CommandError(f"cannot read a unit store at {path}: {type(e).__name__}: {e}") from e


def model_file(path: str) -> str | None:
  local = path[len("file://") :] if path.startswith("file://") else path
  return None if "://" in local else os.path.join(os.path.expanduser(local), MODEL_FILE)


def write_model_record(path: str, config: Any, seed: int) -> None:
  """Records the toy config that built the store at ``path`` (local stores only)."""
  target = model_file(path)
  if target is None:
    return
  record = {
    "format": RECORD_FORMAT,
    "model": "toy",
    "config": dataclasses.asdict(config),
    "seed": seed,
  }
  tmp = f"{target}.tmp"
  with open(tmp, "w") as f:
    json.dump(record, f, indent=1)
  os.replace(tmp, target)


def read_model_record(path: str) -> dict[str, Any] | None:
  target = model_file(path)
  if target is None or not os.path.exists(target):
    return None
  try:
    with open(target, encoding="utf-8") as f:
      record = json.load(f)
  except (OSError, ValueError, RecursionError) as e:  # ValueError: not UTF-8, not JSON
    raise CommandError(f"cannot read {target}: {type(e).__name__}: {e}") from e
  if not isinstance(record, dict) or record.get("model") != "toy":
    raise CommandError(f"{target} does not record a toy model config")
  seed = record.get("seed", 0)
  if (
    not isinstance(record.get("config"), dict)
    or isinstance(seed, bool)
    or not isinstance(seed, int)
  ):
    raise CommandError(
      f"{target}: config must be an object and seed an int; found config="
      f"{reprlib.repr(record.get('config'))}, seed={reprlib.repr(seed)}. Delete the file, "
      f"or write the store again with `{PROG} demo --fresh`."
    )
  return record


def toy_config(record: Mapping[str, Any]) -> Any:
  from jax_residency._src.models.toy import ToyConfig  # noqa: PLC0415

  try:
    config = ToyConfig(**record["config"])
  except (KeyError, TypeError) as e:
    raise CommandError(f"the recorded toy config is not valid: {e}") from e
  bad = [
    f"{f.name}={reprlib.repr(getattr(config, f.name))}"
    for f in dataclasses.fields(config)
    if type(getattr(config, f.name)) is not type(getattr(ToyConfig(), f.name))
  ]
  if bad:
    raise CommandError(f"the recorded toy config is not valid: {', '.join(bad)} (wrong types)")
  return config


def abstract_toy(config: Any, seed: int) -> Any:
  from flax import nnx  # noqa: PLC0415

  from jax_residency._src.models.toy import ToyTransformer  # noqa: PLC0415

  return nnx.eval_shape(lambda: ToyTransformer(config, rngs=nnx.Rngs(seed)))


def converted_model(path: str) -> tuple[Any, int] | None:
  """The abstract model of a store written by ``convert`` (it records its checkpoint's
  config) and its vocabulary size; None for any other store."""
  from jax_residency._src.models.hf_convert import HF_CONFIG_FILE, load  # noqa: PLC0415

  if "://" in path or not os.path.isfile(os.path.join(path, HF_CONFIG_FILE)):
    return None
  model = load(path)
  return model, int(model.config.vocab_size)


def abstract_from_factory(spec: str) -> Any:
  from flax import nnx  # noqa: PLC0415

  module_name, sep, attr = spec.partition(":")
  if not sep or not module_name or not attr:
    raise CommandError(f"--model {spec!r}: write it as module:factory, e.g. mypkg.models:small")
  try:
    factory = getattr(importlib.import_module(module_name), attr)
  except (ImportError, AttributeError) as e:
    raise CommandError(f"--model {spec!r}: {e}") from e
  model = nnx.eval_shape(factory)
  if not isinstance(model, nnx.Module):
    raise CommandError(f"--model {spec!r} returned {type(model).__name__}, not an nnx.Module")
  return model


def single_device_mesh() -> Any:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  return jax.sharding.Mesh(np.array(jax.local_devices()[:1]), ("devices",))


def load_concrete(abstract: Any, store: Any) -> Any:
  """The model ``abstract`` with its weights read from ``store`` (each byte once)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jax_residency._src.plan.split import split_model  # noqa: PLC0415
  from jax_residency._src.store.loading import check_for, read_all  # noqa: PLC0415

  split = split_model(abstract)
  check_for(split, store, strict=True)
  values = [jax.device_put(v) for v in read_all(split, store)]
  graphdef, state = nnx.split(abstract)
  return nnx.merge(graphdef, jax.tree.unflatten(jax.tree.structure(state), values))
