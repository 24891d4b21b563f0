"""What ``jax-residency measure`` does: a store's and this backend's figures (`jr.measure`)."""

from __future__ import annotations

import argparse

from jax_residency._src.cli.console import emit, emit_json
from jax_residency._src.cli.stored_models import (
  abstract_from_factory,
  abstract_toy,
  open_store,
  read_model_record,
  toy_config,
)


def cmd_measure(args: argparse.Namespace) -> int:
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.run.measure import measure  # noqa: PLC0415

  with open_store(args.path, streamable=False):
    pass  # a store that cannot be read is a one-line error before anything is measured
  model = None
  if args.model is not None:
    model = abstract_from_factory(args.model)
  else:
    record = read_model_record(args.path)
    if record is not None:
      model = abstract_toy(toy_config(record), int(record.get("seed", 0)))
  shapes = [(args.batch, 1), (args.batch, args.prompt_len)]
  inputs = [(np.zeros(shape, np.int32),) for shape in shapes]
  timed = inputs if model is not None else ()
  found = measure(args.path, model, inputs=timed, refresh=args.refresh)
  if args.json:
    emit_json(found.to_dict())
    return 0
  emit(str(found))
  if model is None:
    emit("no unit step time: the store records no model; pass --model module:factory to time one")
  return 0
