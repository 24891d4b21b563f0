"""The plain model of a converted GGUF file, holding gguf-py's dequantized weights.

A store written by `gguf_convert.convert_gguf` keeps the file's blocks and decodes them
in the step (`quant.ggml`). The reference to hold its outputs to is the same Llama with
every weight as ``gguf.quants.dequantize`` gives it (llama.cpp's reference decoding, in
NumPy) and the Q/K rows un-permuted as the conversion does: `dequantized_model`. Tests
and benchmarks compare a placed store against it; it holds the whole model in float32
in memory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from jax_residency._src.models.gguf_convert import GgufTensor, gguf_tensor_map, unpermute_rows
from jax_residency._src.models.hf_convert import HF_CONFIG_FILE, load
from jax_residency._src.plan.split import split_model


def dequantized_model(gguf_path: str | os.PathLike[str], store: str | os.PathLike[str]) -> Any:
  """The model ``store`` (``gguf_path`` converted) runs, as a plain model holding the
  values gguf-py dequantizes from ``gguf_path``; needs the ``gguf`` package."""
  import gguf  # noqa: PLC0415 - an optional dependency

  tensors = {t.name: t for t in gguf.GGUFReader(gguf_path).tensors}
  config = json.loads((Path(store) / HF_CONFIG_FILE).read_text())
  static, unit = gguf_tensor_map(config)
  split = split_model(load(store))

  def value(spec: GgufTensor, i: int = 0) -> np.ndarray:
    t = tensors[spec.name.format(i=i)]
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    w = w.reshape([int(n) for n in reversed(t.shape.tolist())])
    w = w if spec.heads is None else unpermute_rows(w, spec.heads)
    return w.T if spec.transpose else w

  values = []
  for leaf in split.leaves:
    if leaf.path in static:
      values.append(jnp.asarray(value(static[leaf.path]), leaf.dtype))
    else:
      spec, count = unit[split.unit_rel_path(leaf)], split.stack_of(leaf).count
      stacked = np.stack([value(spec, i) for i in range(count)])
      values.append(jnp.asarray(stacked, leaf.dtype))
  return split.bind_stacks(values, ()).call
