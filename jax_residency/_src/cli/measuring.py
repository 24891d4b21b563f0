"""What ``jax-residency measure`` does: a store's and this backend's figures (`jr.measure`)."""

from __future__ import annotations

import argparse
from typing import Any

from jax_residency._src.cli.console import CommandError, emit, emit_json, quantize_flags
from jax_residency._src.cli.stored_models import (
  abstract_from_factory,
  abstract_toy,
  converted_model,
  open_store,
  read_model_record,
  toy_config,
)


def _measured(args: argparse.Namespace, *, refresh: bool) -> tuple[Any, Any]:
  """The store's measurement (cached or taken now), timing a decode step and a prompt of
  ``args.prompt_len`` where the model is known; and the model (None: not known)."""
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.run.measure import measure  # noqa: PLC0415

  with open_store(args.path, streamable=False):
    pass  # a store that cannot be read is a one-line error before anything is measured
  model = None
  if args.model is not None:
    model = abstract_from_factory(args.model)
  elif (converted := converted_model(args.path)) is not None:
    model = converted[0]  # a store written by convert records its model
  else:
    record = read_model_record(args.path)
    if record is not None:
      model = abstract_toy(toy_config(record), int(record.get("seed", 0)))
  shapes = [(args.batch, 1), (args.batch, args.prompt_len)]
  inputs = [(np.zeros(shape, np.int32),) for shape in shapes]
  timed = inputs if model is not None else ()
  return measure(args.path, model, inputs=timed, refresh=refresh), model


def cmd_measure(args: argparse.Namespace) -> int:
  found, model = _measured(args, refresh=args.refresh)
  if args.json:
    emit_json(found.to_dict())
    return 0
  emit(str(found))
  if model is None:
    emit("no unit step time: the store records no model; pass --model module:factory to time one")
  return 0


def _given(args: argparse.Namespace, workload: Any, quantize: Any) -> tuple[Any, str]:
  """The measurement ``--accelerator FILE``'s figures make for ``args.path``, and where
  they come from, in words."""
  import json  # noqa: PLC0415

  from jax_residency._src.run.accelerator import Accelerator  # noqa: PLC0415

  try:
    with open(args.accelerator, encoding="utf-8") as f:
      data = json.load(f)
  except OSError as e:
    raise CommandError(f"--accelerator {args.accelerator}: {e.strerror}") from None
  except ValueError as e:
    raise CommandError(f"--accelerator {args.accelerator} is not JSON: {e}") from None
  if not isinstance(data, dict):
    raise CommandError(
      f"--accelerator {args.accelerator}: expected a JSON object of jr.Accelerator's fields"
    )
  try:
    accelerator = Accelerator.from_dict(data)
  except ValueError as e:
    raise CommandError(f"--accelerator {args.accelerator}: {e}") from None
  found = accelerator.measurement(args.path, workload, dtype=args.dtype, quantize=quantize)
  source = f"; {accelerator.source}" if accelerator.source else ""
  return found, f"from figures given for {accelerator.name} ({args.accelerator}{source})"


def cmd_plan_auto(args: argparse.Namespace) -> int:
  """``plan --auto``: every placement that fits, ranked by predicted time (`jr.plan`)."""
  from jax_residency._src.errors import PlacementError  # noqa: PLC0415
  from jax_residency._src.run.model_sizes import config_path  # noqa: PLC0415
  from jax_residency._src.run.planner import Workload, plan, ranking_table  # noqa: PLC0415

  workload = Workload(prompt_len=args.prompt_len, decode_steps=args.steps, batch=args.batch)
  quantize = quantize_flags(args)
  is_config = config_path(args.path) is not None
  if args.accelerator is not None:
    found, source = _given(args, workload, quantize)
  elif is_config:
    raise CommandError(
      f"{args.path} is a config.json: there is no store to measure, so --auto needs an "
      "accelerator's figures: --accelerator FILE (a JSON object of jr.Accelerator's fields)"
    )
  else:
    found, model = _measured(args, refresh=False)
    if model is None:
      raise CommandError(
        f"{args.path} records no model, so its unit step cannot be timed; pass --model "
        "module:factory for --auto"
      )
    source = f"from the measurement of {found.date}"
  try:
    ranked = plan(
      args.path,
      found,
      device_budget_bytes=args.device_budget,
      host_budget_bytes=args.host_budget,
      workload=workload,
      regime=args.regime,
      dtype=args.dtype if is_config else None,
      quantize=quantize,
    )
  except PlacementError as e:
    if "no placement fits" not in str(e):
      raise
    emit(str(e))
    return 1
  if args.json:
    emit_json(
      [
        {
          "policy": c.policy.to_dict(),
          "prefill_seconds": c.prefill_seconds,
          "decode_seconds": c.decode_seconds,
          "total_seconds": c.total_seconds,
          "bytes_per_token": c.bytes_per_token,
        }
        for c in ranked
      ]
    )
    return 0
  emit(
    f"{len(ranked)} placements fit; predicted for a {workload.prompt_len}-token prompt and "
    f"{workload.decode_steps} decode steps (batch {workload.batch}), streamed units from "
    f"the {args.regime}, {source}:"
  )
  emit(ranking_table(ranked))
  return 0
