"""What ``jax-residency inspect``, ``verify``, ``plan``, ``run`` and ``rechunk`` do.

Each ``cmd_*`` takes the `argparse.Namespace` that `main.build_parser` produced and
returns the exit code (``demo`` lives in `demo.py`). Heavy modules (JAX, the
stores) are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
from typing import Any

from jax_residency._src.cli.console import (
  PROG,
  CommandError,
  emit,
  emit_json,
  fmt_bytes,
  plural,
  quantize_flags,
)
from jax_residency._src.cli.inspection import quantization_info
from jax_residency._src.cli.stored_models import (
  MODEL_FILE,
  abstract_from_factory,
  abstract_toy,
  converted_model,
  load_concrete,
  model_file,
  open_store,
  parse_prefix,
  read_model_record,
  single_device_mesh,
  toy_config,
)
from jax_residency._src.typing import path_str

#: Default of `run`'s budget flags: not given (the policy's default applies).
UNSET: Any = object()


# --- verify ------------------------------------------------------------------


def cmd_verify(args: argparse.Namespace) -> int:
  """Reads every chunk; exit 0 if nothing is damaged, 1 if something is."""
  from jax_residency._src.store.verify import verify_store  # noqa: PLC0415

  if "://" not in args.path and not os.path.exists(args.path):
    raise CommandError(f"{args.path}: no such file or directory")
  result = verify_store(args.path, progress=None if not args.json else False)
  if args.json:
    emit_json(dataclasses.asdict(result) | {"ok": result.ok})
    return 0 if result.ok else 1
  lines = []
  for d in result.damaged:
    where = "static" if d.unit is None else f"unit {d.unit}"
    where += "" if d.expert is None else f", expert {d.expert}"
    kind = "corrupt" if d.corrupt else "unreadable"
    lines.append(f"{kind}: {d.tensor} ({where})")
  summary = f"{plural(result.chunks, 'chunk')} read ({fmt_bytes(result.nbytes)}): " + (
    "no damage found" if result.ok else f"{plural(len(result.damaged), 'damaged chunk')}"
  )
  if not result.checksummed:
    summary += (
      "; the store has no checksums on every array, so changed bytes there go "
      "undetected (only unreadable chunks are found)"
    )
  lines.append(summary)
  if not result.ok:
    lines.append(
      "Write the store again from the original model or checkpoint; "
      "the first damaged chunk's error:\n  " + result.damaged[0].message
    )
  emit("\n".join(lines))
  return 0 if result.ok else 1


# --- plan --------------------------------------------------------------------


def _default_platform() -> str:
  import jax  # noqa: PLC0415 - only plan without --platform needs the backend

  return jax.default_backend()


def cmd_plan(args: argparse.Namespace) -> int:
  from jax_residency._src.cli.measuring import cmd_plan_auto  # noqa: PLC0415
  from jax_residency._src.plan.quantized import plan_decoded_bytes  # noqa: PLC0415

  if args.auto:
    return cmd_plan_auto(args)
  from jax_residency._src.run.model_sizes import config_path, sizes_of  # noqa: PLC0415

  config = config_path(args.path)
  quantize = quantize_flags(args)
  if config is not None:
    sizes = sizes_of(config, dtype=args.dtype, quantize=quantize)
    static, stacks, quant, decoded = (
      sizes.static,
      list(sizes.stacks),
      sizes.quantization,
      sizes.decoded,
    )
    n, unit, streamable = sum(c for _, c, _ in stacks), max(b for _, _, b in stacks), True
  else:
    if quantize is not None:
      raise CommandError(
        "--quantize plans a config.json as if converted with it; a store is planned as "
        "it is stored (convert with --quantize to plan a quantized store)"
      )
    with open_store(args.path, units=args.units, streamable=False) as store:
      n, unit, static = store.unit_count, store.unit_nbytes, store.static_nbytes
      streamable = bool(store.chunked_per_unit)
      stacks = [(path_str(st.prefix), st.count, st.unit_nbytes) for st in store.stacks]
      quant = store.quantization
      decoded = (
        (0, 0) if quant is None else plan_decoded_bytes(quant, [st.prefix for st in store.stacks])
      )
  from jax_residency._src.cli.plan_table import plan_budgets  # noqa: PLC0415 - imports JAX

  plan = plan_budgets(
    args.path,
    units=n,
    unit_bytes=unit,
    static_bytes=static,
    device_budget=args.device_budget,
    host_budget=args.host_budget,
    lookahead=args.lookahead,
    streamable=streamable,
    device_is_host=(args.platform or _default_platform()) == "cpu",
    stacks=stacks if len(stacks) > 1 else (),
    decoded_bytes=decoded,
    quantization=quantization_info(quant),
  )
  if args.json:
    emit_json(plan.to_dict())
  else:
    emit(str(plan))
  return 0 if plan.fitting else 1


# --- run ---------------------------------------------------------------------


def policy_from_args(args: argparse.Namespace) -> Any:
  """The policy ``--policy`` names, shaped by the flags that apply to it (``run``,
  ``generate``, ``chat``); a flag that does not apply is a one-line error."""
  from jax_residency._src.policy.options import (  # noqa: PLC0415
    DenseDiskStreamLoadOptions,
    LayerwiseLoadOptions,
    OffloadConfig,
  )
  from jax_residency._src.policy.types import DenseDiskStream, FullyResident, LayerwiseHost  # noqa: PLC0415

  given = {
    "--device-budget": args.device_budget is not UNSET,
    "--host-budget": args.host_budget is not UNSET,
    "--lookahead": args.lookahead is not None,
    "--queue": args.queue is not None,
    "--prefetch-depth": args.prefetch_depth is not None,
    "--device-resident-units": bool(args.device_resident_units),
    "--host-resident-units": bool(args.host_resident_units),
  }
  kept = {"--device-resident-units"}
  allowed = {
    "fully_resident": set(),
    "layerwise_host": {"--device-budget", "--host-budget", "--prefetch-depth", *kept},
    "dense_disk_stream": {
      "--device-budget",
      "--host-budget",
      "--lookahead",
      "--queue",
      "--host-resident-units",
      *kept,
    },
  }[args.policy]
  extra = sorted(flag for flag, set_ in given.items() if set_ and flag not in allowed)
  if extra:
    raise CommandError(f"{', '.join(extra)} does not apply to --policy {args.policy}")
  if args.policy == "fully_resident":
    return FullyResident()
  if args.policy == "layerwise_host":
    return LayerwiseHost(
      LayerwiseLoadOptions(
        offload=OffloadConfig(
          device_budget_bytes=args.device_budget if given["--device-budget"] else None,
          host_budget_bytes=args.host_budget if given["--host-budget"] else None,
          prefetch_depth=args.prefetch_depth or 1,
        ),
        device_resident_units=args.device_resident_units or 0,
        sample_process_memory=True,
        sample_backend_memory=True,
      )
    )
  defaults = DenseDiskStreamLoadOptions()
  host = args.host_budget if given["--host-budget"] else defaults.host_budget_bytes
  device = args.device_budget if given["--device-budget"] else defaults.device_budget_bytes
  direct = host == 0
  return DenseDiskStream(
    DenseDiskStreamLoadOptions(
      device_budget_bytes=device,
      host_budget_bytes=host,
      host_lookahead=args.lookahead if args.lookahead is not None else (0 if direct else 2),
      background_queue_capacity=args.queue if args.queue is not None else (0 if direct else 2),
      device_resident_units=args.device_resident_units or 0,
      host_resident_units=args.host_resident_units or 0,
      sample_process_memory=True,
      sample_backend_memory=True,
    )
  )


def cmd_run(args: argparse.Namespace) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.run.place import place  # noqa: PLC0415

  policy = policy_from_args(args)
  store = open_store(args.path, streamable=args.policy == "dense_disk_stream")
  with store:
    if args.model is not None:
      if args.vocab is None:
        raise CommandError("--model needs --vocab: token ids are drawn from [0, VOCAB)")
      abstract, vocab = abstract_from_factory(args.model), args.vocab
    elif (converted := converted_model(args.path)) is not None:
      abstract, vocab = converted  # a store written by convert records its model
      vocab = args.vocab or vocab
    else:
      record = read_model_record(args.path)
      if record is None:
        raise CommandError(
          f"{args.path} has no recorded model: `run` runs stores written by `{PROG} "
          f"demo` ({MODEL_FILE}) or `{PROG} convert`, or any store with --model "
          "module:factory"
        )
      config = toy_config(record)
      if len(args.shape) != 2:
        raise CommandError(f"--shape {args.shape}: the toy model takes (batch, tokens), e.g. 1,16")
      abstract = abstract_toy(config, int(record.get("seed", 0)))
      vocab = args.vocab or config.vocab
    model = abstract
    kwargs: dict[str, Any] = {}
    if args.policy == "dense_disk_stream":
      kwargs["store"] = args.path
    else:
      model = load_concrete(abstract, store)
  tokens = jax.random.randint(jax.random.key(args.seed), args.shape, 0, vocab)
  with place(model, policy, mesh=single_device_mesh(), **kwargs) as placed:
    out = jax.block_until_ready(placed(tokens))
    report = placed.report()
    metadata = placed.metadata
  shape = tuple(np.shape(out))
  if args.json:
    emit_json(
      {
        "path": args.path,
        "policy": report.to_dict()["policy"],
        "input_shape": list(args.shape),
        "output_shape": list(shape),
        "output_dtype": str(out.dtype),
        "report": report.to_dict(),
      }
    )
    return 0
  lines = [
    f"ran {args.policy} on {args.path}: token ids {tuple(args.shape)} -> output {shape} "
    f"{out.dtype} in {report.total.seconds:.3f} s",
    "",
    str(metadata),
    "",
    str(report),
  ]
  emit("\n".join(lines))
  return 0


# --- rechunk -----------------------------------------------------------------


def cmd_rechunk(args: argparse.Namespace) -> int:
  from jax_residency._src.store.rechunk import rechunk_store  # noqa: PLC0415
  from jax_residency._src.typing import path_str  # noqa: PLC0415

  if "://" not in args.src and not os.path.exists(args.src):
    raise CommandError(f"{args.src}: no such file or directory")
  try:
    units = [p for u in (args.units or "").split(",") if (p := parse_prefix(u))]
    experts = None if args.experts is None else [e for e in args.experts.split(",") if e]
    info = rechunk_store(
      args.src,
      args.dst,
      stacks=units or None,
      progress=None,
      overwrite=args.overwrite,
      experts=[] if experts == ["none"] else experts,
    )
  except (OSError, ValueError) as e:
    from jax_residency._src.errors import ResidencyError  # noqa: PLC0415

    if isinstance(e, ResidencyError):
      raise
    raise CommandError(f"cannot rechunk {args.src}: {type(e).__name__}: {e}") from e
  src_model, dst_model = model_file(args.src), model_file(args.dst)
  if src_model and dst_model and os.path.exists(src_model):
    shutil.copyfile(src_model, dst_model)
  held = ", ".join(
    f"{st.count} units x {fmt_bytes(st.unit_nbytes)} under {path_str(st.prefix)!r}"
    + (f" ({st.experts} experts a unit, a chunk each)" if st.experts else "")
    for st in info.stacks
  )
  emit(
    f"rechunked {args.src} -> {args.dst}: {held}, static {fmt_bytes(info.static_nbytes)}; "
    "one uncompressed chunk per unit"
  )
  return 0


# --- convert -----------------------------------------------------------------


def cmd_convert(args: argparse.Namespace) -> int:
  from jax_residency._src.models.gguf_convert import convert_gguf  # noqa: PLC0415
  from jax_residency._src.models.hf_convert import convert_hf  # noqa: PLC0415

  gguf = args.format == "gguf"
  if gguf:  # its parser takes no --quantize: the file's GGML types are kept
    if not os.path.isfile(args.src):
      raise CommandError(f"{args.src}: not a file (a llama.cpp .gguf file)")
  elif not os.path.isdir(args.src):
    raise CommandError(f"{args.src}: not a directory (a Hugging Face checkpoint directory)")
  quantize = quantize_flags(args)
  common = {"dtype": args.dtype, "progress": None, "overwrite": args.overwrite}
  try:
    if gguf:
      info = convert_gguf(args.src, args.dst, **common)
    else:
      info = convert_hf(args.src, args.dst, quantize=quantize, **common)
  except (OSError, TypeError) as e:
    raise CommandError(f"cannot convert {args.src}: {type(e).__name__}: {e}") from e
  stacks = ", ".join(f"{s.count} units under {path_str(s.prefix)!r}" for s in info.stacks)
  quantized = ""
  if info.quantization is not None:
    plan = info.quantization
    types = sorted({t.encoding.ggml_type or "" for t in plan.tensors})
    kind = f"in GGML types {', '.join(types)}" if gguf else f"as {args.quantize}"
    quantized = (
      f"; {len(plan.tensors)} matrices {kind}: {fmt_bytes(plan.float_nbytes)} as floats "
      f"-> {fmt_bytes(plan.stored_nbytes)}"
    )
  emit(
    f"converted {args.src} -> {args.dst}: {stacks} ({fmt_bytes(info.total_unit_bytes)}), "
    f"static {fmt_bytes(info.static_nbytes)}{quantized}"
  )
  return 0
