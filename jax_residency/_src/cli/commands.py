"""What ``jax-residency inspect``, ``verify``, ``plan``, ``run`` and ``rechunk`` do.

Each ``cmd_*`` takes the `argparse.Namespace` that `main.build_parser` produced and
returns the exit code (``demo`` lives in `demo.py`). Heavy modules (JAX, the
stores) are imported inside the commands, so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
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
  table,
)
from jax_residency._src.cli.plan_table import plan_budgets
from jax_residency._src.cli.stored_models import (
  MODEL_FILE,
  abstract_from_factory,
  abstract_toy,
  load_concrete,
  model_file,
  open_store,
  parse_prefix,
  read_model_record,
  single_device_mesh,
  toy_config,
)
from jax_residency._src.typing import path_str, tensor_nbytes

#: Default of `run`'s budget flags: not given (the policy's default applies).
UNSET: Any = object()


# --- inspect -----------------------------------------------------------------


def cmd_inspect(args: argparse.Namespace) -> int:
  """Describes the store: a summary, then its unit tensors (or all of it as JSON)."""
  info, specs = _read_inspection(args.path, args.units)
  if args.json:
    emit_json(info)
    return 0
  rows = _inspect_rows(info, units_flag=args.units)
  width = max(len(k) for k, _ in rows)
  lines = [f"{k:<{width}}  {v}" for k, v in rows]
  lines += ["", f"unit tensors ({len(specs)}, per unit):"]
  lines += ["  " + line for line in _tensor_table(specs)]
  emit("\n".join(lines))
  return 0


def _read_inspection(path: str, units: str | None) -> tuple[dict[str, Any], dict[Any, Any]]:
  """The JSON form of what ``inspect`` shows, and the unit tensors' specs by path."""
  from jax_residency._src.store.verify import checksums  # noqa: PLC0415

  with open_store(path, units=units, streamable=False) as store:
    specs = _unit_specs(store)
    info = {
      "path": path,
      "unit_prefix": path_str(store.unit_prefix),
      "unit_count": store.unit_count,
      "unit_bytes": store.unit_nbytes,
      "total_unit_bytes": store.total_unit_bytes,
      "static_bytes": store.static_nbytes,
      "static_tensors": len(store.static_specs),
      "unit_tensors": {
        path_str(p): {"shape": list(shape), "dtype": str(dtype)}
        for p, (shape, dtype) in sorted(specs.items())
      },
      "stacks": [
        {"prefix": path_str(st.prefix), "units": st.count, "unit_bytes": st.unit_nbytes}
        for st in store.stacks
      ],
      "chunked_per_unit": bool(store.chunked_per_unit),
      "bytes_read_per_byte_used": float(store.bytes_read_per_byte_used),
      "compressed": bool(getattr(store, "compressed", False)),
      "checksums": checksums(store),
      "streamable": bool(store.chunked_per_unit),
      "model": None,
      "quantization": _quantization_info(store.quantization),
    }
  record = read_model_record(path)
  if record is not None:
    info["model"] = {"kind": "toy", "config": record.get("config")}
  return info, specs


def _quantization_info(plan: Any) -> dict[str, Any] | None:
  """What ``inspect`` says of a quantized store: the scheme, the rule, the bytes."""
  from jax_residency._src.quant.encoding import MIN_QUANTIZED_DIM  # noqa: PLC0415

  if plan is None:
    return None
  return {
    **plan.quantization.to_dict(),
    "tensors": len(plan.tensors),
    "float_bytes": plan.float_nbytes,
    "stored_bytes": plan.stored_nbytes,
    "rule": f"floating matrices (per unit) with both dimensions >= {MIN_QUANTIZED_DIM}; "
    "vectors, scalars and smaller tensors stay as they are",
  }


def _unit_specs(store: Any) -> dict[Any, Any]:
  """(shape, dtype) of every unit tensor: by path in the unit, or with several stacks,
  by full path."""
  if len(store.stacks) <= 1:
    return dict(store.unit_specs)
  return {
    st.prefix + rel: spec
    for k, st in enumerate(store.stacks)
    for rel, spec in store.stack_specs(k).items()
  }


#: What ``inspect`` says about a store's checksums (``store.verify.checksums``).
_CHECKSUMS = {
  "crc32c": "crc32c on every chunk, checked on every read",
  "some": "crc32c on some arrays only; the rest are not checked",
  "none": "none: damaged data cannot be detected (`jr.save` writes stores with them)",
}


def _inspect_rows(info: dict[str, Any], *, units_flag: str | None) -> list[tuple[str, str]]:
  """The summary's (field, text) rows, from ``info`` (the JSON form)."""
  rows = [("store", info["path"]), *_stack_rows(info["stacks"], info["total_unit_bytes"])]
  static = f"{fmt_bytes(info['static_bytes'])} ({plural(info['static_tensors'], 'tensor')})"
  rows.append(("static bytes", static))
  chunking = "one chunk per unit" if info["streamable"] else "several units per chunk"
  chunking += ", compressed" if info["compressed"] else ", uncompressed"
  rows.append(("chunking", chunking))
  rows.append(("checksums", _CHECKSUMS[info["checksums"]]))
  rows.append(("streamable", _streamable_verdict(info, units_flag=units_flag)))
  q = info["quantization"]
  if q is not None:
    groups = f", groups of {q['group_size']}" if "group_size" in q else ""
    rows.append(
      (
        "quantized",
        f"{q['scheme']}{groups}: {q['tensors']} matrices, "
        f"{fmt_bytes(q['float_bytes'])} as floats -> {fmt_bytes(q['stored_bytes'])} stored",
      )
    )
    rows.append(("", q["rule"]))
  if info["model"] is not None:
    rows.append(("model", f"toy {info['model']['config']} (`{PROG} run` works)"))
  return rows


def _stack_rows(stacks: list[dict[str, Any]], total: int) -> list[tuple[str, str]]:
  """The ``units`` and ``unit bytes`` rows: per stack, then the total bytes."""
  counts = ", ".join(f"{st['units']} under {st['prefix']!r}" for st in stacks)
  sizes = ", ".join(
    f"{fmt_bytes(st['unit_bytes'])} each" + (f" under {st['prefix']!r}" if len(stacks) > 1 else "")
    for st in stacks
  )
  return [("units", counts), ("unit bytes", f"{sizes}, {fmt_bytes(total)} total")]


def _streamable_verdict(info: dict[str, Any], *, units_flag: str | None) -> str:
  """Whether DenseDiskStream streams the store in place, and if not, how to rechunk it."""
  if info["streamable"]:
    verdict = "yes: DenseDiskStream reads each unit in place"
    if info["compressed"]:
      verdict += " (compressed: slower; `rechunk` writes it uncompressed)"
    return verdict
  units = f" --units {units_flag}" if units_flag else ""
  return (
    f"slowly: DenseDiskStream decodes {info['bytes_read_per_byte_used']:.1f} bytes for each "
    f"byte it uses; run `{PROG} rechunk {info['path']} DST{units}` once and stream DST"
  )


def _tensor_table(specs: dict[Any, Any]) -> list[str]:
  """One line per unit tensor: path, shape, dtype, bytes."""
  rows = [
    [
      path_str(p),
      "x".join(map(str, shape)) or "()",
      str(dtype),
      fmt_bytes(tensor_nbytes(shape, dtype)),
    ]
    for p, (shape, dtype) in sorted(specs.items())
  ]
  return table(("path", "shape", "dtype", "bytes"), rows)


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


def _hf_config_path(path: str) -> str | None:
  """``path`` as a Hugging Face config.json to plan from (a directory with one and no
  store sidecar), else None."""
  if path.endswith(".json") and os.path.isfile(path):
    return path
  config = os.path.join(path, "config.json")
  if os.path.isfile(config) and not os.path.exists(os.path.join(path, "jax_residency.json")):
    return config
  return None


def _sizes_from_hf_config(path: str, dtype: str | None) -> tuple[int, int, list[Any]]:
  """(static bytes, largest unit bytes, stacks) of the model a config.json describes."""
  from jax_residency._src.models.hf_convert import abstract_model  # noqa: PLC0415
  from jax_residency._src.plan.split import split_model  # noqa: PLC0415

  with open(path) as f:
    hf = json.load(f)
  model = abstract_model(hf, dtype=dtype or hf.get("torch_dtype") or None, where=path)
  split = split_model(model)
  static = sum(leaf.nbytes for leaf in split.static_leaves())
  stacks = [
    (s.name, s.count, sum(leaf.nbytes for leaf in split.stack_leaves(s)) // s.count)
    for s in split.stacks
  ]
  return static, max(b for _, _, b in stacks), stacks


def cmd_plan(args: argparse.Namespace) -> int:
  config = _hf_config_path(args.path)
  if config is not None:
    static, unit, stacks = _sizes_from_hf_config(config, args.dtype)
    n, streamable = sum(c for _, c, _ in stacks), True
  else:
    with open_store(args.path, units=args.units, streamable=False) as store:
      n, unit, static = store.unit_count, store.unit_nbytes, store.static_nbytes
      streamable = bool(store.chunked_per_unit)
      stacks = [(path_str(st.prefix), st.count, st.unit_nbytes) for st in store.stacks]
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
  )
  if args.json:
    emit_json(plan.to_dict())
  else:
    emit(str(plan))
  return 0 if plan.fitting else 1


# --- run ---------------------------------------------------------------------


def _policy_from_args(args: argparse.Namespace) -> Any:
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
  }
  allowed = {
    "fully_resident": set(),
    "layerwise_host": {"--device-budget", "--host-budget", "--prefetch-depth"},
    "dense_disk_stream": {"--device-budget", "--host-budget", "--lookahead", "--queue"},
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
      sample_process_memory=True,
      sample_backend_memory=True,
    )
  )


def cmd_run(args: argparse.Namespace) -> int:
  import jax  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415

  from jax_residency._src.run.place import place  # noqa: PLC0415

  policy = _policy_from_args(args)
  store = open_store(args.path, streamable=args.policy == "dense_disk_stream")
  with store:
    if args.model is not None:
      if args.vocab is None:
        raise CommandError("--model needs --vocab: token ids are drawn from [0, VOCAB)")
      abstract, vocab = abstract_from_factory(args.model), args.vocab
    else:
      record = read_model_record(args.path)
      if record is None:
        raise CommandError(
          f"{args.path} has no recorded toy config ({MODEL_FILE}); `run` only runs stores "
          f"written by `{PROG} demo`, unless you pass --model module:factory"
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
    info = rechunk_store(
      args.src, args.dst, stacks=units or None, progress=None, overwrite=args.overwrite
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
  if gguf:
    given = [f for f, v in (("--quantize", args.quantize), ("--group-size", args.group_size)) if v]
    if given:
      raise CommandError(
        f"{' and '.join(given)}: not for gguf, whose tensors keep the GGML types the file "
        "gives them; leave them out"
      )
    if not os.path.isfile(args.src):
      raise CommandError(f"{args.src}: not a file (a llama.cpp .gguf file)")
  elif not os.path.isdir(args.src):
    raise CommandError(f"{args.src}: not a directory (a Hugging Face checkpoint directory)")
  if args.group_size is not None and args.quantize != "int4":
    raise CommandError(f"--group-size {args.group_size} is for --quantize int4; leave it out")
  quantize = None
  if args.quantize is not None:
    quantize = {"scheme": args.quantize, "group_size": args.group_size}
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
