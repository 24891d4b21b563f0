"""``jax-residency inspect``: what a store holds, as a summary or as JSON."""

from __future__ import annotations

import argparse
from typing import Any

from jax_residency._src.cli.console import PROG, emit, emit_json, fmt_bytes, plural, table
from jax_residency._src.cli.stored_models import open_store, read_model_record
from jax_residency._src.typing import path_str, tensor_nbytes


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
        {
          "prefix": path_str(st.prefix),
          "units": st.count,
          "unit_bytes": st.unit_nbytes,
          "experts": st.experts,
        }
        for st in store.stacks
      ],
      "chunked_per_unit": bool(store.chunked_per_unit),
      "bytes_read_per_byte_used": float(store.bytes_read_per_byte_used),
      "compressed": bool(getattr(store, "compressed", False)),
      "checksums": checksums(store),
      "streamable": bool(store.chunked_per_unit),
      "model": None,
      "quantization": quantization_info(store.quantization),
    }
  record = read_model_record(path)
  if record is not None:
    info["model"] = {"kind": "toy", "config": record.get("config")}
  return info, specs


def quantization_info(plan: Any) -> dict[str, Any] | None:
  """What ``inspect`` and ``plan`` say of a quantized store: the scheme, the rule that
  picked its matrices, the bytes."""
  from jax_residency._src.quant.encoding import MIN_QUANTIZED_DIM  # noqa: PLC0415

  if plan is None:
    return None
  if plan.quantization.scheme == "gguf":
    types: dict[str, int] = {}
    for t in plan.tensors:
      types[t.encoding.ggml_type] = types.get(t.encoding.ggml_type, 0) + 1
    kept = ", ".join(f"{name} x{n}" for name, n in sorted(types.items()))
    rule = f"matrices keep the GGML types of their GGUF file ({kept}); norms are floats"
  else:
    rule = (
      f"floating matrices (per unit, and per expert of an 'experts' module) with both "
      f"dimensions >= {MIN_QUANTIZED_DIM}; vectors, scalars and smaller tensors stay as they are"
    )
  return {
    **plan.quantization.to_dict(),
    "tensors": len(plan.tensors),
    "float_bytes": plan.float_nbytes,
    "stored_bytes": plan.stored_nbytes,
    "rule": rule,
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
  "crc32c": "crc32c on every chunk, checked when read from disk",
  "some": "crc32c on some arrays only; the rest are not checked",
  "none": "none: damaged data cannot be detected (`jr.save` writes stores with them)",
}


def _inspect_rows(info: dict[str, Any], *, units_flag: str | None) -> list[tuple[str, str]]:
  """The summary's (field, text) rows, from ``info`` (the JSON form)."""
  rows = [("store", info["path"]), *_stack_rows(info["stacks"], info["total_unit_bytes"])]
  static = f"{fmt_bytes(info['static_bytes'])} ({plural(info['static_tensors'], 'tensor')})"
  rows.append(("static bytes", static))
  chunking = "one chunk per unit" if info["streamable"] else "several units per chunk"
  if info["streamable"] and any(st.get("experts") for st in info["stacks"]):
    chunking += " (one per expert for the experts)"
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
  rows = [("units", counts), ("unit bytes", f"{sizes}, {fmt_bytes(total)} total")]
  experts = [st for st in stacks if st.get("experts")]
  if experts:
    rows.append(
      (
        "experts",
        ", ".join(
          f"{st['experts']} per unit under {st['prefix']!r}, a chunk each (read alone)"
          for st in experts
        ),
      )
    )
  return rows


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
