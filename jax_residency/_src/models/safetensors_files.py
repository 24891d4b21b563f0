"""Reading safetensors checkpoints one tensor at a time, with bounded memory.

A safetensors file is an 8-byte little-endian header length, a JSON header
(tensor name → dtype, shape, byte range of its data), then the data. Reading a
tensor here is one ``pread`` of its byte range into a fresh NumPy array: no
mapping, so nothing of the file stays in this process once the array is
dropped, and converting a checkpoint far larger than memory holds one tensor at
a time. ``SafetensorsFiles`` reads a single ``model.safetensors`` or a sharded
checkpoint (``model.safetensors.index.json`` and its shards).
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

#: safetensors dtype names → NumPy dtypes (bfloat16 and float8 from ml_dtypes).
DTYPES: dict[str, np.dtype] = {
  "F64": np.dtype(np.float64),
  "F32": np.dtype(np.float32),
  "F16": np.dtype(np.float16),
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
  "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
  "I64": np.dtype(np.int64),
  "I32": np.dtype(np.int32),
  "I16": np.dtype(np.int16),
  "I8": np.dtype(np.int8),
  "U8": np.dtype(np.uint8),
  "BOOL": np.dtype(np.bool_),
}

#: A header larger than this is not a safetensors header (the format caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


@dataclasses.dataclass(frozen=True)
class TensorEntry:
  """Where one tensor's bytes are: its file, dtype, shape and absolute byte range."""

  file: Path
  dtype: np.dtype
  shape: tuple[int, ...]
  start: int
  end: int

  @property
  def nbytes(self) -> int:
    return self.end - self.start


def _header(file: Path) -> dict[str, TensorEntry]:
  with open(file, "rb") as f:
    raw = f.read(8)
    if len(raw) != 8:
      raise ValueError(f"{file}: not a safetensors file (shorter than its 8-byte header length)")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
      raise ValueError(f"{file}: not a safetensors file (header length {n})")
    header = json.loads(f.read(n))
  base = 8 + n
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    dtype = DTYPES.get(meta["dtype"])
    if dtype is None:
      raise ValueError(f"{file}: tensor {name!r} has dtype {meta['dtype']!r}, not supported")
    b, e = meta["data_offsets"]
    shape = tuple(int(d) for d in meta["shape"])
    if e - b != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
      raise ValueError(f"{file}: tensor {name!r}: {e - b} bytes for shape {shape} {dtype}")
    out[name] = TensorEntry(file, dtype, shape, base + b, base + e)
  return out


class SafetensorsFiles:
  """The tensors of a safetensors checkpoint, read on demand.

  Example:
    >>> import tempfile, numpy as np
    >>> from safetensors.numpy import save_file
    >>> d = tempfile.mkdtemp()
    >>> save_file({"w": np.arange(6, dtype=np.float32).reshape(2, 3)}, d + "/model.safetensors")
    >>> files = SafetensorsFiles(d)
    >>> files.entry("w").shape, files.read("w")[1].tolist()
    ((2, 3), [3.0, 4.0, 5.0])
  """

  def __init__(self, path: str | os.PathLike[str]) -> None:
    p = Path(path)
    index = p / "model.safetensors.index.json"
    if p.is_dir() and not (p / "model.safetensors").is_file() and index.is_file():
      weight_map = json.loads(index.read_text())["weight_map"]
      shards = sorted(set(weight_map.values()))
      self.files = [p / s for s in shards]
    else:
      single = p / "model.safetensors" if p.is_dir() else p
      if not single.is_file():
        raise FileNotFoundError(
          f"no safetensors checkpoint at {str(p)!r} (no model.safetensors, nor a "
          "model.safetensors.index.json with its shards)"
        )
      self.files = [single]
    self.entries: dict[str, TensorEntry] = {}
    for file in self.files:
      if not file.is_file():
        raise FileNotFoundError(f"{file}: a shard the index names is missing")
      self.entries.update(_header(file))

  def entry(self, name: str) -> TensorEntry:
    found = self.entries.get(name)
    if found is None:
      raise KeyError(f"the checkpoint has no tensor {name!r}")
    return found

  def read(self, name: str, rows: slice | None = None) -> np.ndarray:
    """One tensor (or ``rows`` of it: a range along axis 0), read unbuffered, with no
    mapping, straight into a new array."""
    e = self.entry(name)
    shape, start = e.shape, e.start
    if rows is not None:
      a, b, _ = rows.indices(shape[0])
      row = e.nbytes // max(shape[0], 1)
      shape, start = (b - a, *shape[1:]), e.start + a * row
    out = np.empty(shape, e.dtype)
    view = memoryview(out.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    with open(e.file, "rb", buffering=0) as f:
      f.seek(start)
      done = 0
      while done < out.nbytes:
        n = f.readinto(view[done:])
        if not n:
          raise OSError(f"{e.file}: truncated while reading tensor {name!r}")
        done += n
    return out
