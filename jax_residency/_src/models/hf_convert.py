"""Hugging Face checkpoints to unit stores, one tensor at a time; models from either.

`convert_hf` reads a checkpoint directory (``config.json`` and
``model.safetensors`` or sharded ``model-0000x-of-0000n.safetensors`` with their
index) and writes a unit store with :func:`jax_residency._src.store.writer.save_store`,
handing it lazy arrays: a static tensor is read when it is written, a layer
stack one unit at a time, each tensor with one unbuffered read
(`safetensors_files`) and no mapping of the checkpoint. Chunk writes in flight
are capped (`CONVERT_IN_FLIGHT_BYTES`), so host memory holds about one tensor
plus that cap, whatever the model's size. The store is written to a temporary
directory and put in place when complete, records its stacks like any store,
and carries the checkpoint's ``config.json`` (`HF_CONFIG_FILE`), which `load`
reads to rebuild the model, and its tokenizer and generation files
(`CARRIED_FILES`), so the store alone serves generation.

The model family comes from ``config.json``'s ``architectures`` (`FAMILIES`):
each family names its config parser, its model class and its tensor map (which
Hugging Face tensor, transposed or not, fills each parameter).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from jax_residency._src.errors import ModelConfigError, StoreError
from jax_residency._src.models.hf_loader import HFTensor, abstract_of
from jax_residency._src.models.llama import EXPERTS_PATH
from jax_residency._src.models.safetensors_files import SafetensorsFiles
from jax_residency._src.plan.quantized import quantize_arrays
from jax_residency._src.plan.split import split_model
from jax_residency._src.quant.schemes import Quantization
from jax_residency._src.store.info import StoreInfo
from jax_residency._src.store.writer import save_store
from jax_residency._src.typing import ParamPath, path_str

#: Bytes of chunk writes a conversion keeps in flight (the writer's cap).
CONVERT_IN_FLIGHT_BYTES = 32 << 20
#: A static tensor larger than this (an embedding, an untied head) is written in
#: chunks of at most this size, each read on its own, so no static tensor is ever
#: whole in memory.
STATIC_CHUNK_BYTES = 32 << 20
#: The checkpoint's ``config.json``, as a converted store carries it.
HF_CONFIG_FILE = "hf_config.json"
#: What a converted store records of the conversion (the dtype written).
CONVERSION_FILE = "jax_residency_conversion.json"
#: Files of the checkpoint directory a converted store carries as they are, so a
#: store serves generation on its own (the tokenizer, the generation defaults).
CARRIED_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "generation_config.json",
)


@dataclasses.dataclass(frozen=True)
class Family:
  """A model family: where its config class, model class, tensor map and loader live,
  each as ``"module:name"`` under ``jax_residency._src.models``.

  The config class has ``from_hf(dict)``; the model is built as
  ``model(config, rngs=...)``; ``tensor_map(config) -> (static, per_unit)`` maps
  each parameter path to an object with ``name`` (per-unit names hold ``{i}``)
  and ``transpose``; ``loader(dir)`` reads a checkpoint into a model.
  """

  config: str
  model: str
  tensor_map: str
  loader: str

  def get(self, what: str) -> Any:
    module, name = getattr(self, what).split(":")
    return getattr(importlib.import_module(f"jax_residency._src.models.{module}"), name)


_LLAMA = Family(
  "llama_config:LlamaConfig", "llama:Llama", "llama_load:hf_tensor_map", "llama_load:load_llama"
)
#: ``architectures`` names a conversion accepts.
FAMILIES: dict[str, Family] = {
  "LlamaForCausalLM": _LLAMA,
  "MistralForCausalLM": _LLAMA,
  "Qwen2ForCausalLM": _LLAMA,
  "MixtralForCausalLM": _LLAMA,
  "Qwen2MoeForCausalLM": _LLAMA,
}


def _family(config: Mapping[str, Any], where: str) -> Family:
  names = config.get("architectures") or []
  for name in names:
    if name in FAMILIES:
      return FAMILIES[name]
  raise ModelConfigError(
    f"{where}: architectures={names!r} is not a family this version converts; supported: "
    f"{', '.join(sorted(FAMILIES))}"
  )


def abstract_model(hf_config: Mapping[str, Any], *, dtype: Any = None, where: str = "") -> Any:
  """The model a Hugging Face ``config.json`` describes, abstract (no weights), with
  its floating parameters in ``dtype`` when given."""
  family = _family(hf_config, where or "config.json")
  # The family's config builds every parameter in its dtype (default float32).
  config = family.get("config").from_hf(
    dict(hf_config), **({} if dtype is None else {"dtype": np.dtype(dtype).name})
  )
  return abstract_of(family.get("model"), config)


class _Tensor:
  """A checkpoint tensor as a lazy array: read, transposed and cast when written.

  With ``layers`` it is a stacked unit array: indexing by unit ``i`` reads the
  tensor named with ``{i}`` replaced by ``i`` (a mixture's experts: one tensor per
  expert, stacked; `HFTensor.names`).
  """

  def __init__(
    self,
    files: SafetensorsFiles,
    source: HFTensor,
    shape: tuple[int, ...],
    dtype: np.dtype,
    layers: int | None = None,
  ) -> None:
    self._files, self._source, self._layers = files, source, layers
    self._transpose = source.transpose
    #: The shape one checkpoint tensor has (a unit's, an expert's, or the whole array).
    self.one = shape[2:] if source.experts else shape[1:] if layers is not None else shape
    self.shape, self.dtype, self.ndim = shape, dtype, len(shape)
    #: For a large 2-D static tensor: chunks of whole source rows, at most
    #: `STATIC_CHUNK_BYTES` (along axis 1 of a transposed one, axis 0 otherwise).
    self.chunk_shape: tuple[int, ...] | None = None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if layers is None and len(shape) == 2 and nbytes > STATIC_CHUNK_BYTES:
      axis = 1 if self._transpose else 0
      rows = max(1, STATIC_CHUNK_BYTES // (nbytes // shape[axis]))
      self.chunk_shape = (shape[0], rows) if self._transpose else (rows, shape[1])

  def _read(self, name: str, rows: slice | None = None, shape: Any = None) -> np.ndarray:
    raw = self._files.read(name, rows)
    if self._transpose:
      raw = raw.T
    return np.ascontiguousarray(raw.reshape(shape or self.one), dtype=self.dtype)

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    out = self._read(self._source.name)
    return out if dtype is None else out.astype(dtype)

  def __getitem__(self, i: Any) -> np.ndarray:
    if self._layers is not None:  # one unit of a stack (its experts, stacked)
      read = [self._read(name) for name in self._source.names(int(i))]
      return np.stack(read) if self._source.experts else read[0]
    # A chunk of a static tensor: a range of the source's rows.
    rows = i[1] if self._transpose else i[0]
    a, b, _ = rows.indices(self.shape[1 if self._transpose else 0])
    shape = (self.shape[0], b - a) if self._transpose else (b - a, self.shape[1])
    return self._read(self._source.name, slice(a, b), shape)


def _check_tensor(
  files: SafetensorsFiles, name: str, transpose: bool, shape: tuple[int, ...], problems: list[str]
) -> None:
  try:
    entry = files.entry(name)
  except KeyError:
    problems.append(f"{name}: missing")
    return
  found = tuple(reversed(entry.shape)) if transpose else entry.shape
  if int(np.prod(found, dtype=np.int64)) != int(np.prod(shape, dtype=np.int64)):
    problems.append(f"{name}: shape {entry.shape}, expected {shape} (transposed: {transpose})")


def _lazy_tensor(
  files: SafetensorsFiles,
  source: Any,
  path: ParamPath,
  shape: tuple[int, ...],
  dtype: np.dtype,
  layers: int | None,
  problems: list[str],
) -> _Tensor | None:
  """The lazy array of parameter ``path`` (a stack of ``layers`` units, if given) from
  its tensor map entry ``source``; ``None``, and every problem noted, if it cannot be."""
  if source is None:
    problems.append(f"{path_str(path)}: no checkpoint tensor maps to it")
    return None
  tensor = _Tensor(files, source, shape, dtype, layers=layers)
  names = [source.name] if layers is None else [n for i in range(layers) for n in source.names(i)]
  for name in names:  # each checkpoint tensor of the array, of the shape it reads
    _check_tensor(files, name, source.transpose, tensor.one, problems)
  return tensor


def _lazy_arrays(
  src: Path, hf: Mapping[str, Any], where: str, dtype: Any
) -> tuple[dict[ParamPath, Any], dict[ParamPath, dict[ParamPath, Any]]]:
  """``(static, stacks)`` of the model ``hf`` describes, as lazy arrays (`_Tensor`) of
  the checkpoint in ``src``, for :func:`~jax_residency._src.store.writer.save_store`.

  Raises:
    StoreError: tensors are missing or misshapen (every problem listed).
  """
  family = _family(hf, where)
  config = family.get("config").from_hf(dict(hf))
  tensor_map = family.get("tensor_map")
  split = split_model(abstract_model(hf, dtype=dtype, where=where))
  files = SafetensorsFiles(src)
  static_map, unit_map = tensor_map(config)
  problems: list[str] = []
  static: dict[ParamPath, Any] = {}
  for leaf in split.static_leaves():
    source = static_map.get(leaf.path)
    array = _lazy_tensor(files, source, leaf.path, leaf.shape, leaf.dtype, None, problems)
    if array is not None:
      static[leaf.path] = array
  stacks: dict[ParamPath, dict[ParamPath, Any]] = {}
  for stack in split.stacks:
    arrays = stacks.setdefault(stack.path_prefix, {})
    for leaf in split.stack_leaves(stack):
      rel = split.unit_rel_path(leaf)
      source = unit_map.get(rel)
      array = _lazy_tensor(files, source, leaf.path, leaf.shape, leaf.dtype, stack.count, problems)
      if array is not None:
        arrays[rel] = array
  if problems:
    shown = "\n".join(f"  {p}" for p in problems[:20])
    more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
    raise StoreError(
      f"{src} does not hold the weights its config.json describes ({len(problems)} "
      f"problem(s)); nothing was written:\n{shown}{more}"
    )
  return static, stacks


def convert_hf(
  src_dir: str | os.PathLike[str],
  store: str | os.PathLike[str],
  *,
  dtype: Any = None,
  progress: bool | None = None,
  overwrite: bool = False,
  quantize: str | Mapping[str, Any] | Quantization | None = None,
) -> StoreInfo:
  """Converts a Hugging Face checkpoint directory into a unit store, tensor by tensor.

  Host memory stays near one tensor plus `CONVERT_IN_FLIGHT_BYTES` of writes in
  flight, whatever the checkpoint's size (``benchmarks/convert.py`` measures it);
  the store matches what :func:`jax_residency.save` writes for the same model.

  Args:
    src_dir: a directory with ``config.json`` and the safetensors weights
      (one file, or shards with ``model.safetensors.index.json``).
    store: where to write the store (a directory or kvstore URL).
    dtype: store floating parameters in this dtype (e.g. ``"bfloat16"``);
      default: the model's own (float32).
    progress: show a progress bar (None: when stderr is a terminal).
    overwrite: replace an existing store at ``store``.
    quantize: store the floating matrices quantized, as `jax_residency.save`
      does (``"int8"``, ``"int4"``, ``{"scheme": "int4", "group_size": 128}``);
      each tensor is read and encoded a unit at a time, so the memory bound holds.

  Returns:
    What was written (its ``stacks`` say where the layers are).

  Raises:
    FileNotFoundError: no ``config.json`` or no weights in ``src_dir``.
    ModelConfigError: an unsupported architecture or config field (named).
    StoreError: tensors the model needs are missing or misshapen (every one
      listed), or the store cannot be written; nothing is left written.
    QuantizationError, InvalidPolicyValueError: ``quantize`` cannot encode the
      model's tensors (each named), or is no scheme; nothing is written.

  Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import jax_residency as jr
    >>> from jax_residency.models import convert_hf
    >>> # A tiny Llama saved by transformers, from the repository's test fixtures.
    >>> src = Path(jr.__file__).parents[1] / "tests" / "fixtures" / "llama_tiny_untied"
    >>> info = convert_hf(src, tempfile.mkdtemp() + "/store", progress=False)
    >>> [(s.prefix, s.count) for s in info.stacks]
    [(('layers',), 3)]
  """
  src = Path(src_dir)
  config_file = src / "config.json"
  if not config_file.is_file():
    raise FileNotFoundError(f"{src}: no config.json; point at a Hugging Face checkpoint directory")
  hf = json.loads(config_file.read_text())
  static, stacks = _lazy_arrays(src, hf, str(config_file), dtype)
  plan = None
  if quantize is not None:
    plan, static, stacks = quantize_arrays(static, stacks, quantize)
  # A mixture of experts' experts: a chunk each (as `Llama.residency_experts` says).
  where = tuple(EXPERTS_PATH.split("."))
  moe = any(tuple(p)[: len(where)] == where for a in stacks.values() for p in a)
  return save_store(
    os.fspath(store),
    static=static,
    stacks=stacks,
    experts=(EXPERTS_PATH,) if moe else (),
    progress=progress,
    overwrite=overwrite,
    in_flight_bytes=CONVERT_IN_FLIGHT_BYTES,
    extra={
      **{name: (src / name).read_text() for name in CARRIED_FILES if (src / name).is_file()},
      HF_CONFIG_FILE: hf,
      CONVERSION_FILE: {
        "source": str(src),
        "dtype": None if dtype is None else str(np.dtype(dtype)),
      },
    },
    desc="convert",
    quantization=plan,
  )


def load(path: str | os.PathLike[str]) -> Any:
  """A model ready for :func:`jax_residency.place`, from a store or a checkpoint directory.

  From a store written by `convert_hf` (it carries the checkpoint's
  ``config.json``), the model is abstract: place it with ``store=path``, and
  every policy reads its weights from the store. From a Hugging Face checkpoint
  directory, the model holds the checkpoint's weights.

  Raises:
    FileNotFoundError: neither a converted store nor a checkpoint directory.
    ModelConfigError: an unsupported architecture or config field.

  Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import jax.numpy as jnp, jax_residency as jr
    >>> from flax import nnx
    >>> from jax_residency import models
    >>> src = Path(jr.__file__).parents[1] / "tests" / "fixtures" / "qwen2_tiny"
    >>> store = tempfile.mkdtemp() + "/store"
    >>> _ = models.convert_hf(src, store, progress=False)
    >>> model = models.load(store)  # abstract: the weights stay in the store
    >>> tokens = jnp.asarray([[1, 5, 9, 12]])
    >>> with jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=store) as placed:
    ...   streamed = placed(tokens)
    >>> plain = nnx.jit(lambda m, t: m(t))(models.load(src), tokens)  # the checkpoint's model
    >>> bool(jnp.allclose(streamed, plain, atol=1e-5))
    True
  """
  p = Path(path)
  recorded = p / HF_CONFIG_FILE
  if recorded.is_file():
    hf = json.loads(recorded.read_text())
    conversion = p / CONVERSION_FILE
    dtype = json.loads(conversion.read_text()).get("dtype") if conversion.is_file() else None
    return abstract_model(hf, dtype=dtype, where=str(recorded))
  if (p / "config.json").is_file():
    hf = json.loads((p / "config.json").read_text())
    return _family(hf, str(p / "config.json")).get("loader")(p)
  raise FileNotFoundError(
    f"{p}: neither a store written by convert_hf (no {HF_CONFIG_FILE}) nor a Hugging Face "
    "checkpoint directory (no config.json)"
  )
