"""llama.cpp GGUF files of the Llama architecture to unit stores whose matrices stay in
their GGML blocks.

`convert_gguf` reads a GGUF file with the ``gguf`` package's ``GGUFReader`` (which
maps the file) and writes a unit store as `hf_convert.convert_hf` does: lazy
arrays, a layer stack one unit at a time, the store put in place when complete.
Every matrix keeps the file's bytes, row for row (a uint8 ``blocks`` part, of the
`quant.ggml` types), decoded at the top of the step that uses it, so nothing is
widened to floats on the host; norm weights are stored as floats. The store carries
a Hugging Face ``config.json`` derived from the ``llama.*`` metadata
(`HF_CONFIG_FILE`, which `hf_convert.load` reads), a ``tokenizer.json`` built
from the ``tokenizer.ggml.*`` metadata (`gguf_tokenizer`), and, where the file has a
chat template, a ``tokenizer_config.json`` holding it (`chat_template`).

llama.cpp's converter reorders the rows of ``attn_q`` and ``attn_k`` within each
head (Hugging Face's rotary layout, a head's two halves, becomes GGML's adjacent
pairs); `unpermute_rows` puts them back, as transformers does. Rows are whole
blocks, so this moves bytes and is exact. A layer stack is one array: where llama.cpp's
``_S`` / ``_M`` / ``_L`` presets give a tensor name another type in some layers, its
rows are padded to the widest type's and each ends in a byte naming its own type
(`quant.ggml_mixed.decode_mixed`), the padding the one cost.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jax_residency._src.errors import ModelConfigError, StoreError
from jax_residency._src.models.chat_template import TOKENIZER_CONFIG_FILE, gguf_tokenizer_config
from jax_residency._src.models.gguf_file import GGUF_MAGIC
from jax_residency._src.models.gguf_tokenizer import tokenizer_json
from jax_residency._src.models.hf_convert import (
  CONVERSION_FILE,
  CONVERT_IN_FLIGHT_BYTES,
  HF_CONFIG_FILE,
  STATIC_CHUNK_BYTES,
  abstract_model,
)
from jax_residency._src.plan.quantized import QuantizedLeaf, QuantPlan
from jax_residency._src.plan.split import split_model
from jax_residency._src.quant import ggml
from jax_residency._src.quant.encoding import Encoding
from jax_residency._src.quant.schemes import GGUF_SCHEME, Quantization
from jax_residency._src.store.info import StoreInfo
from jax_residency._src.store.writer import save_store
from jax_residency._src.typing import ParamPath

#: ``general.architecture`` values a conversion accepts.
ARCHITECTURES = ("llama",)
#: The types a 1-D tensor (a norm weight) may have: it is stored as floats.
VECTOR_TYPES = ("F32", "F16", "BF16")
_SCHEME = Quantization.of({"scheme": GGUF_SCHEME})


@dataclasses.dataclass(frozen=True)
class GgufTensor:
  """The GGUF tensor of one parameter: its name (``{i}``: the layer), whether its rows
  become a kernel's columns (``transpose``), and the heads whose rows llama.cpp
  permuted (``heads``; None: not permuted)."""

  name: str
  transpose: bool = False
  heads: int | None = None


def gguf_tensor_map(hf: Mapping[str, Any]) -> tuple[dict, dict]:
  """``(static, per_unit)``: the GGUF tensor of every parameter of the Llama ``hf``
  describes, by parameter path (per unit: inside ``layers``), as
  `llama_load.hf_tensor_map` names the safetensors ones.

  Example:
    >>> static, unit = gguf_tensor_map({"num_attention_heads": 4, "num_key_value_heads": 2,
    ...                                 "tie_word_embeddings": True})
    >>> sorted(static)
    [('embed_tokens', 'embedding'), ('norm', 'scale')]
    >>> unit[("self_attn", "k_proj", "kernel")]
    GgufTensor(name='blk.{i}.attn_k.weight', transpose=True, heads=2)
  """
  heads, kv_heads = int(hf["num_attention_heads"]), int(hf["num_key_value_heads"])
  static = {
    ("embed_tokens", "embedding"): GgufTensor("token_embd.weight"),
    ("norm", "scale"): GgufTensor("output_norm.weight"),
  }
  if not hf["tie_word_embeddings"]:
    static[("lm_head", "kernel")] = GgufTensor("output.weight", transpose=True)
  unit = {
    ("input_layernorm", "scale"): GgufTensor("blk.{i}.attn_norm.weight"),
    ("post_attention_layernorm", "scale"): GgufTensor("blk.{i}.ffn_norm.weight"),
    ("self_attn", "q_proj", "kernel"): GgufTensor("blk.{i}.attn_q.weight", True, heads),
    ("self_attn", "k_proj", "kernel"): GgufTensor("blk.{i}.attn_k.weight", True, kv_heads),
  }
  for path, name in (
    (("self_attn", "v_proj"), "attn_v"),
    (("self_attn", "o_proj"), "attn_output"),
    (("mlp", "gate_proj"), "ffn_gate"),
    (("mlp", "up_proj"), "ffn_up"),
    (("mlp", "down_proj"), "ffn_down"),
  ):
    unit[(*path, "kernel")] = GgufTensor(f"blk.{{i}}.{name}.weight", transpose=True)
  return static, unit


def permute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's reordering of Q/K rows: within each head, row ``j`` of the first half
  goes to ``2j`` and row ``j`` of the second half to ``2j + 1``.

  Example:
    >>> permute_rows(np.arange(8), heads=2).tolist()
    [0, 2, 1, 3, 4, 6, 5, 7]
  """
  half = rows.shape[0] // heads // 2
  return rows.reshape(heads, 2, half, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def unpermute_rows(rows: np.ndarray, heads: int) -> np.ndarray:
  """The inverse of `permute_rows`: a GGUF ``attn_q`` / ``attn_k`` tensor's rows (any
  row width: floats, or the raw bytes of a row of blocks) in Hugging Face's order.

  Example:
    >>> unpermute_rows(permute_rows(np.arange(8), heads=2), heads=2).tolist()
    [0, 1, 2, 3, 4, 5, 6, 7]
  """
  half = rows.shape[0] // heads // 2
  return rows.reshape(heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _numpy_shape(t: Any) -> tuple[int, ...]:
  """A reader tensor's shape in NumPy (row-major) order: GGUF lists ``ne0`` (a row) first."""
  return tuple(int(d) for d in reversed(t.shape.tolist()))


def _raw_rows(t: Any) -> np.ndarray:
  """A 2-D tensor's raw rows, uint8 ``(rows, row_bytes)``, a view of the mapped file."""
  return np.asarray(t.data).view(np.uint8).reshape(_numpy_shape(t)[0], -1)


def _vector(t: Any, dtype: np.dtype) -> np.ndarray:
  """A 1-D F32, F16 or BF16 tensor as floats of ``dtype`` (exact for the float types)."""
  raw = np.asarray(t.data).view(np.uint8).reshape(-1)
  source = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}[t.tensor_type.name]
  return raw.view(source).astype(np.float32).astype(dtype)


class _Lazy:
  """One parameter's stored array, read from the mapped file when the writer asks: a
  layer stack's unit ``a[i]``, a static tensor whole or a range of its rows.

  Matrices are their file's rows (``blocks``, uint8), Q/K rows un-permuted; a mixed
  stack's rows (``types``: its GGML types, two or more) padded to ``shape[-1] - 1``
  bytes, then the index of their type. Vectors are floats of ``dtype``.
  """

  def __init__(
    self,
    tensors: list[Any],
    spec: GgufTensor,
    shape: tuple[int, ...],
    dtype: np.dtype,
    types: tuple[str, ...] = (),
  ) -> None:
    self._tensors, self._spec, self._types = tensors, spec, types
    self._stacked = len(tensors) > 1 or "{i}" in spec.name
    self.shape, self.dtype, self.ndim = shape, dtype, len(shape)
    self.chunk_shape: tuple[int, ...] | None = None
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if not self._stacked and len(shape) == 2 and nbytes > STATIC_CHUNK_BYTES:
      self.chunk_shape = (max(1, STATIC_CHUNK_BYTES // (nbytes // shape[0])), shape[1])

  def _one(self, t: Any, rows: slice = slice(None)) -> np.ndarray:
    if self.dtype != np.uint8:
      return _vector(t, self.dtype)
    raw = _raw_rows(t)
    if self._spec.heads is not None:
      raw = unpermute_rows(raw, self._spec.heads)
    if len(self._types) < 2:
      return np.array(raw[rows])
    out = np.zeros((raw.shape[0], self.shape[-1]), np.uint8)
    out[:, : raw.shape[1]] = raw
    out[:, -1] = self._types.index(t.tensor_type.name)
    return out[rows]

  def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
    if self._stacked:
      out = np.stack([self._one(t) for t in self._tensors])
    else:
      out = self._one(self._tensors[0])
    return out if dtype is None else out.astype(dtype)

  def __getitem__(self, i: Any) -> np.ndarray:
    if self._stacked:
      return self._one(self._tensors[int(i)])
    return self._one(self._tensors[0], i[0])


@dataclasses.dataclass
class _GgufFile:
  """A GGUF file, read: its path, metadata (key → value) and tensors by name."""

  path: Path
  meta: dict[str, Any]
  tensors: dict[str, Any]
  reader: Any


def _read(path: Path) -> _GgufFile:
  """Opens a GGUF file with ``gguf.GGUFReader`` and checks it is whole.

  Raises:
    FileNotFoundError: no file at ``path``.
    ModuleNotFoundError: the ``gguf`` package is not installed.
    StoreError: not a GGUF file (its magic), or a truncated or damaged one.
  """
  try:
    import gguf  # noqa: PLC0415 - an optional dependency, needed only here
  except ModuleNotFoundError as e:
    raise ModuleNotFoundError(
      "converting GGUF files needs the 'gguf' package: pip install 'jax-residency[gguf]'"
    ) from e
  if not path.is_file():
    raise FileNotFoundError(f"{path}: no such file (a llama.cpp GGUF file)")
  with open(path, "rb") as f:
    magic = f.read(len(GGUF_MAGIC))
  if magic != GGUF_MAGIC:
    raise StoreError(
      f"{path}: not a GGUF file: it starts with {magic!r}, where a GGUF file starts with "
      f"{GGUF_MAGIC!r}; nothing was written. Point at a llama.cpp .gguf file."
    )
  size = path.stat().st_size
  try:
    reader = gguf.GGUFReader(path)
    meta = {key: field.contents() for key, field in reader.fields.items()}
  except (ValueError, IndexError, KeyError, OverflowError, TypeError) as e:
    raise StoreError(
      f"{path}: the GGUF file ({size} bytes) is truncated or damaged: reading it failed "
      f"with {type(e).__name__}: {e}; nothing was written. Download or copy it again."
    ) from e
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size or t.data.nbytes != t.n_bytes:
      raise StoreError(
        f"{path}: the GGUF file is truncated: tensor {t.name} needs bytes up to "
        f"{t.data_offset + t.n_bytes}, the file has {size}; nothing was written. "
        "Download or copy it again."
      )
  return _GgufFile(path, meta, {t.name: t for t in reader.tensors}, reader)


def _hf_config(f: _GgufFile) -> dict[str, Any]:
  """A Hugging Face ``LlamaForCausalLM`` ``config.json`` of the file's ``llama.*`` metadata.

  Raises:
    ModelConfigError: another architecture, missing sizes, or math the decoder does
      not implement (experts, rotary scaling, partial rotary, per-layer sizes).
  """
  arch = f.meta.get("general.architecture")
  if arch not in ARCHITECTURES:
    raise ModelConfigError(
      f"{f.path}: general.architecture={arch!r} is not an architecture this version "
      f"converts from GGUF; supported: {', '.join(map(repr, ARCHITECTURES))} (Llama, "
      "Mistral and their fine-tunes, as llama.cpp writes them)."
    )
  m = {k.removeprefix("llama."): v for k, v in f.meta.items() if k.startswith("llama.")}
  sizes = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
  missing = [f"llama.{k}" for k in sizes if k not in m]
  if missing:
    raise ModelConfigError(f"{f.path}: the metadata lacks {', '.join(missing)}")
  bad = [f"llama.{k}={v!r}" for k, v in m.items() if isinstance(v, list)]
  if m.get("expert_count"):
    bad.append(f"llama.expert_count={m['expert_count']} (mixture of experts)")
  scaling = m.get("rope.scaling.type")
  if scaling not in (None, "none"):
    bad.append(f"llama.rope.scaling.type={scaling!r} (rotary scaling)")
  if bad:
    raise ModelConfigError(
      f"{f.path}: this version converts Llama files with one size per model, no experts "
      f"and unscaled rotary embeddings; not supported: {'; '.join(bad)}"
    )
  hidden, heads = int(m["embedding_length"]), int(m["attention.head_count"])
  head_dim = int(m.get("attention.key_length", hidden // heads))
  for key in ("attention.value_length", "rope.dimension_count"):
    if int(m.get(key, head_dim)) != head_dim:
      raise ModelConfigError(
        f"{f.path}: llama.{key}={m[key]} differs from the head width {head_dim}; this "
        "decoder rotates whole heads, with keys and values of one width"
      )
  embed = f.tensors.get("token_embd.weight")
  tok = "tokenizer.ggml."
  return {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": hidden,
    "intermediate_size": int(m["feed_forward_length"]),
    "num_hidden_layers": int(m["block_count"]),
    "num_attention_heads": heads,
    "num_key_value_heads": int(m.get("attention.head_count_kv", heads)),
    "head_dim": head_dim,
    "rms_norm_eps": float(m.get("attention.layer_norm_rms_epsilon", 1e-5)),
    "rope_theta": float(m.get("rope.freq_base", 10000.0)),
    "vocab_size": _numpy_shape(embed)[0] if embed is not None else int(m.get("vocab_size", 0)),
    "max_position_embeddings": int(m.get("context_length", 2048)),
    "tie_word_embeddings": "output.weight" not in f.tensors,
    "bos_token_id": f.meta.get(f"{tok}bos_token_id"),
    "eos_token_id": f.meta.get(f"{tok}eos_token_id"),
    "pad_token_id": f.meta.get(f"{tok}padding_token_id"),
    "torch_dtype": "float32",
  }


def _check_tensors(f: _GgufFile, static: dict, unit: dict, layers: int) -> None:
  """Checks the file holds exactly the tensors of the model, in types this version reads.

  Raises:
    StoreError: tensors are missing.
    ModelConfigError: tensors the model does not read (rotary factors, biases...), or
      types `quant.ggml` does not decode; each error lists every such tensor.
  """
  names = [s.name for s in static.values()]
  names += [s.name.format(i=i) for s in unit.values() for i in range(layers)]
  missing = [n for n in names if n not in f.tensors]
  if missing:
    raise StoreError(
      f"{f.path} lacks {len(missing)} tensors a Llama of its metadata needs; nothing was "
      f"written: {', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}"
    )
  unused = sorted(set(f.tensors) - set(names))
  if unused:
    raise ModelConfigError(
      f"{f.path} holds tensors this version's Llama does not read (rotary factors, "
      f"biases, experts...); nothing was written: {', '.join(unused[:20])}"
    )
  supported = [t.name for t in ggml.GGML_TYPES]
  bad = []
  for n in names:
    t = f.tensors[n]
    allowed = VECTOR_TYPES if len(t.shape) == 1 else supported
    if t.tensor_type.name not in allowed:
      bad.append(f"{n}: {t.tensor_type.name}")
  if bad:
    raise ModelConfigError(
      f"{f.path}: {len(bad)} tensors have GGML types this version does not read: "
      f"{'; '.join(bad[:20])}. Supported: {', '.join(supported)} (vectors: "
      f"{', '.join(VECTOR_TYPES)}); requantize the file with llama-quantize to one of them."
    )


def _array(
  f: _GgufFile, spec: GgufTensor, leaf: Any, layers: int | None, problems: list[str]
) -> tuple[_Lazy, QuantizedLeaf | None]:
  """Parameter ``leaf``'s lazy array (a matrix's ``blocks``, else floats) and, for a
  matrix, its entry of the plan; a tensor whose shape is not the parameter's (a
  matrix's rows transposed, per layer) is noted in ``problems``."""
  names = [spec.name] if layers is None else [spec.name.format(i=i) for i in range(layers)]
  tensors = [f.tensors[n] for n in names]
  one = leaf.shape if layers is None else leaf.shape[1:]
  want = tuple(reversed(one)) if spec.transpose else tuple(one)
  problems += [
    f"{n}: {_numpy_shape(t)}, expected {want}"
    for n, t in zip(names, tensors, strict=True)
    if _numpy_shape(t) != want
  ]
  dtype = np.dtype(leaf.dtype)
  if len(one) == 1:
    return _Lazy(tensors, spec, leaf.shape, dtype), None
  axis = -2 if spec.transpose else -1
  ids = {ggml.ggml_type(t.tensor_type.name) for t in tensors}
  types = tuple(t.name for t in sorted(ids, key=lambda t: t.type_id))
  enc = Encoding(_SCHEME, axis, dtype.name, "+".join(types), spec.transpose)
  ((stored, _),) = enc.part_shapes(leaf.shape)
  array = _Lazy(tensors, spec, stored, np.dtype(np.uint8), types)
  return array, QuantizedLeaf(leaf.path, leaf.shape, enc)


def _lazy_arrays(f: _GgufFile, hf: dict[str, Any], dtype: Any) -> tuple[dict, dict, QuantPlan]:
  """``(static, stacks, plan)`` for `save_store`: the file's tensors as lazy arrays, in
  the model's leaf order.

  Raises:
    StoreError: tensors are missing or misshapen (every one listed).
    ModelConfigError: see `_check_tensors`.
  """
  split = split_model(abstract_model(hf, dtype=dtype, where=str(f.path)))
  static_map, unit_map = gguf_tensor_map(hf)
  _check_tensors(f, static_map, unit_map, int(hf["num_hidden_layers"]))
  problems: list[str] = []
  plan: list[QuantizedLeaf] = []

  def add(arrays: dict, key: ParamPath, leaf: Any, spec: GgufTensor, layers: int | None) -> None:
    array, t = _array(f, spec, leaf, layers, problems)
    arrays[key if t is None else (*key, "blocks")] = array
    plan.extend([] if t is None else [t])

  static: dict[ParamPath, Any] = {}
  for leaf in split.static_leaves():
    add(static, leaf.path, leaf, static_map[leaf.path], None)
  stacks: dict[ParamPath, dict[ParamPath, Any]] = {}
  for stack in split.stacks:
    arrays = stacks.setdefault(stack.path_prefix, {})
    for leaf in split.stack_leaves(stack):
      rel = split.unit_rel_path(leaf)
      add(arrays, rel, leaf, unit_map[rel], stack.count)
  if problems:
    raise StoreError(
      f"{f.path}: {len(problems)} tensors do not have the shapes its metadata gives; "
      "nothing was written:\n  " + "\n  ".join(problems[:20])
    )
  return static, stacks, QuantPlan(_SCHEME, tuple(plan))


def convert_gguf(
  path: str | os.PathLike[str],
  store: str | os.PathLike[str],
  *,
  dtype: Any = None,
  progress: bool | None = None,
  overwrite: bool = False,
) -> StoreInfo:
  """Converts a llama.cpp GGUF file of a Llama model into a unit store, its tensors kept
  in their GGML types.

  Each matrix is stored as the file's rows of blocks and decoded in the step that
  uses it (`quant.ggml`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K,
  Q6_K, IQ4_NL, IQ4_XS); a layer stack is read and written one unit at a time. A
  tensor name with several types across layers (llama.cpp's Q4_K_M and other mixed
  presets) keeps each layer's type: its rows are padded to the widest type's, plus
  a byte naming their type, and its encoding names the types (``"Q4_K+Q6_K"``).
  The store carries a Hugging Face ``config.json`` derived from the metadata, so
  ``models.load(store)`` gives the model, and a ``tokenizer.json`` when the file
  describes its tokenizer (and a ``tokenizer_config.json`` of its chat template, where
  it has one).

  Args:
    path: the ``.gguf`` file (one file; split files are not read).
    store: where to write the store (a directory or kvstore URL).
    dtype: the dtype the model decodes its weights to and computes in (e.g.
      ``"bfloat16"``); default float32. The stored blocks are the file's either way.
    progress: show a progress bar (None: when stderr is a terminal).
    overwrite: replace an existing store at ``store``.

  Returns:
    What was written; ``info.quantization`` lists every matrix with its GGML type.

  Raises:
    FileNotFoundError: no file at ``path``.
    ModuleNotFoundError: the ``gguf`` package is missing (``pip install
      'jax-residency[gguf]'``).
    StoreError: not a GGUF file, a truncated or damaged one, or tensors missing or
      misshapen (each named); nothing is written.
    ModelConfigError: an architecture other than ``llama``, math the decoder does
      not implement, a GGML type it does not decode, or a tokenizer model other than
      ``gpt2`` / ``llama`` (each named); nothing is written.

  Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> import jax_residency as jr
    >>> from jax_residency.models import convert_gguf
    >>> src = Path(jr.__file__).parents[1] / "tests" / "fixtures" / "gguf_tiny_tied" / "model.gguf"
    >>> info = convert_gguf(src, tempfile.mkdtemp() + "/store", progress=False)
    >>> info.quantization.tensors[0].encoding.ggml_type, [s.count for s in info.stacks]
    ('IQ4_XS', [2])
  """
  f = _read(Path(path))
  hf = _hf_config(f)
  tokenizer = tokenizer_json(f.meta, str(f.path))
  static, stacks, plan = _lazy_arrays(f, hf, dtype)
  extra: dict[str, Any] = {
    HF_CONFIG_FILE: hf,
    CONVERSION_FILE: {
      "source": str(f.path),
      "format": "gguf",
      "dtype": None if dtype is None else str(np.dtype(dtype)),
    },
  }
  if tokenizer is not None:
    extra["tokenizer.json"] = json.dumps(tokenizer, ensure_ascii=False)
  if (tokenizer_config := gguf_tokenizer_config(f.meta)) is not None:
    extra[TOKENIZER_CONFIG_FILE] = json.dumps(tokenizer_config, ensure_ascii=False, indent=1)
  return save_store(
    os.fspath(store),
    static=static,
    stacks=stacks,
    progress=progress,
    overwrite=overwrite,
    in_flight_bytes=CONVERT_IN_FLIGHT_BYTES,
    extra=extra,
    desc="convert",
    quantization=plan,
  )
