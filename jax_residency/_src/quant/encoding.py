"""One stored tensor's encoding, the rule that picks the tensors a store quantizes, and
the pytree node that carries a quantized tensor to the step that decodes it.

An :class:`Encoding` turns one floating tensor into its *parts*, the arrays a
store holds for it (int8: ``codes`` and ``scale``; int4: ``codes``, ``scale``,
``offset``), and decodes the parts back in JAX. A placed model's parameter tree
holds a :class:`QuantizedTensor` (the parts plus their encoding) where the plain
model holds a float array; the layer loop decodes the units' tensors at the top
of each step, and static tensors are decoded where the placed forward begins (where
the decodes are traced: `quant.fused` computes each inside the operation that uses
it).

Which tensors a store quantizes (`quantized_axis`): floating matrices, per unit
for a layer stack's tensors, whose two dimensions both reach `MIN_QUANTIZED_DIM`, and
a mixture of experts' expert kernels (a module named `EXPERTS_NAME`, one ``(in, out)``
matrix per expert), each expert's matrix as one. Vectors (norms, biases), scalars,
other tensors of three or more dimensions per unit and small matrices stay as they are.
A matrix named ``embedding`` is a table looked up
by rows: its groups run along the last axis (a row's features). Any other matrix is
applied as ``x @ w``: its groups run along the first of its two axes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import QuantizationError
from jax_residency._src.quant import ggml, ggml_mixed
from jax_residency._src.quant.schemes import Quantization, Quantized, dequantize, quantize

#: A matrix is quantized only if both of its dimensions are at least this.
MIN_QUANTIZED_DIM = 32
#: Input rows of a kernel decoded as one block (8 KiB of a float32 activation row: XLA
#: on CPU fuses a decode into a matrix-vector product only while the vector is under
#: 16 KiB). A multiple of every group and GGML block size.
MATVEC_CHUNK = 2048
#: Names of lookup tables, whose groups run along their rows.
EMBEDDING_NAMES = ("embedding",)
#: The module name of a mixture of experts' kernels stacked per expert, ``(experts, in,
#: out)`` per unit (the Llama family's ``mlp.experts``).
EXPERTS_NAME = "experts"


def quantized_axis(path: Sequence[str], unit_shape: Sequence[int], dtype: Any) -> int | None:
  """The input axis (negative) a tensor is quantized along, or None when it is kept as is.

  Args:
    path: the tensor's parameter path (its last key names it).
    unit_shape: its shape, per unit for a layer stack's tensor (no layer axis).
    dtype: its dtype.

  Example:
    >>> quantized_axis(("layers", "mlp", "kernel"), (512, 2048), "float32")
    -2
    >>> quantized_axis(("embed", "embedding"), (32000, 512), "bfloat16")
    -1
    >>> quantized_axis(("norm", "scale"), (512,), "float32") is None
    True
    >>> quantized_axis(("layers", "mlp", "experts", "up_proj"), (8, 512, 1024), "bfloat16")
    -2
  """
  dt = np.dtype(dtype)
  floating = np.issubdtype(dt, np.floating) or dt.name == "bfloat16"
  experts = len(unit_shape) == 3 and EXPERTS_NAME in path[:-1]
  matrix = unit_shape[-2:] if experts else unit_shape
  if not floating or len(matrix) != 2 or min(matrix) < MIN_QUANTIZED_DIM:
    return None
  return -1 if path and path[-1] in EMBEDDING_NAMES else -2


@dataclasses.dataclass(frozen=True)
class Encoding:
  """How one floating tensor is stored: a scheme, the axis it runs along, the float dtype.

  Attributes:
    quantization: the scheme.
    axis: the input axis, counted from the end (-2 for ``(in, out)`` kernels, -1 for
      embedding tables), so it holds for a stack of units as for one.
    dtype: the dtype of the decoded tensor (the plain model's).
    ggml_type: for a tensor kept as a GGUF file held it (scheme ``"gguf"``): its
      GGML type (``"Q4_K"``, ``"F16"``, ...). Its one part, ``blocks``, holds the
      file's rows of blocks (uint8), a row along the last axis of the decoded
      tensor, or along its input axis when ``transpose`` is set. A layer stack whose
      layers have different types (llama.cpp's ``_M`` presets) names them all, joined
      by ``+`` in GGML id order (``"Q4_K+Q6_K"``): its rows are padded to the widest
      type's and end in a byte naming their own type (`ggml_mixed.decode_mixed`).
    transpose: the file's rows run along the tensor's input axis (a GGUF matrix is
      ``(out, in)``; a Flax kernel ``(in, out)``): the decode swaps the last two axes.
  """

  quantization: Quantization
  axis: int
  dtype: str
  ggml_type: str | None = None
  transpose: bool = False

  @property
  def ggml_types(self) -> tuple[str, ...]:
    """The GGML types of a GGUF tensor (two or more for a mixed one); () for int8/int4."""
    return tuple(self.ggml_type.split("+")) if self.ggml_type is not None else ()

  @property
  def part_names(self) -> tuple[str, ...]:
    if self.ggml_type is not None:
      return ("blocks",)
    if self.quantization.scheme == "int8":
      return ("codes", "scale")
    return ("codes", "scale", "offset")

  def part_shapes(self, shape: Sequence[int]) -> list[tuple[tuple[int, ...], np.dtype]]:
    """Shape and dtype of each part of a tensor of ``shape`` (units stacked or not)."""
    if self.ggml_type is not None:
      rows, types = self.rows_shape(shape), self.ggml_types
      if len(types) == 1:
        nbytes = ggml.row_bytes(types[0], rows[-1])
      else:  # a mixed stack's rows: the widest type's, and a byte naming their own
        nbytes = ggml_mixed.mixed_row_bytes(types, rows[-1])
      return [((*rows[:-1], nbytes), np.dtype(np.uint8))]
    q, rows = self.quantization, self.rows_shape(shape)
    lead, n_rows, n_in = rows[:-2], rows[-2], rows[-1]
    if q.scheme == "int8":
      return [(rows, np.dtype(np.int8)), ((*lead, n_rows, 1), np.dtype(np.float32))]
    assert q.group_size is not None
    groups = ((*lead, n_rows, n_in // q.group_size), np.dtype(np.float32))
    return [((*lead, n_rows // 2, n_in), np.dtype(np.uint8)), groups, groups]

  @property
  def kernel(self) -> bool:
    """Whether the parts hold the tensor's last two axes swapped: a kernel ``(in, out)``
    stored as rows along its input axis (or a GGUF matrix marked ``transpose``)."""
    return self.transpose if self.ggml_type is not None else self.axis == -2

  def rows_shape(self, shape: Sequence[int]) -> tuple[int, ...]:
    """``shape`` as rows along the input axis (the layout of the stored parts): a
    kernel's last two axes swapped, a table's as they are."""
    return (*shape[:-2], shape[-1], shape[-2]) if self.kernel else tuple(shape)

  def encode(self, w: Any, name: str = "tensor") -> tuple[np.ndarray, ...]:
    """The parts of ``w`` (NumPy, on the host)."""
    if self.ggml_type is not None:
      raise QuantizationError(
        f"{name}: a {self.ggml_type} tensor is kept as its GGUF file holds it; it is "
        "never encoded again. Convert the file with models.convert_gguf."
      )
    t = quantize(w, self.quantization, axis=self.axis, name=name)
    return tuple(p for p in t if p is not None)

  def decode(self, parts: Sequence[Any]) -> jax.Array:
    """The tensor's value from its parts, in JAX.

    A kernel with more than `MATVEC_CHUNK` inputs is decoded in blocks of that many
    input rows, concatenated: `quant.fused` then multiplies a one-token step's row by
    each block on its own, which XLA fuses with the block's decode.
    """
    # One named call (`rows_source`): `quant.fused` finds the parts of a matrix it
    # multiplies by, for the native one-row kernels (`quant.native`).
    if self.ggml_type is None:
      decode = _decode_kernel_rows if self.kernel else _decode_table_rows
      return decode(tuple(parts), self)
    return _ggml_rows(self.ggml_type, self.kernel)(tuple(parts), self)

  def _decode_blocks(self, parts: Sequence[Any]) -> jax.Array:
    n_in = np.shape(parts[0])[-1] if self.ggml_type is None else self._ggml_inputs(parts[0])
    if not self.kernel or n_in <= MATVEC_CHUNK:
      return self._decode(parts)
    blocks = [
      self._decode(parts, (start, min(start + MATVEC_CHUNK, n_in)))
      for start in range(0, n_in, MATVEC_CHUNK)
    ]
    return jnp.concatenate(blocks, axis=-2)

  def _decode(self, parts: Sequence[Any], inputs: tuple[int, int] | None = None) -> jax.Array:
    """The tensor, or a kernel's input rows ``inputs`` (start, stop)."""
    types = self.ggml_types
    if len(types) > 1:  # each type decoded from its own bytes of the range
      start, stop = inputs or (0, None)
      values = ggml_mixed.decode_mixed(parts[0], types, start=start, stop=stop)
    elif inputs is not None:
      return self._decode(self._inputs(parts, *inputs))
    elif types:
      values = ggml.decode(parts[0], types[0])
    else:
      return dequantize(Quantized(*parts), self.quantization, axis=self.axis, dtype=self.dtype)
    return (jnp.swapaxes(values, -1, -2) if self.transpose else values).astype(self.dtype)

  def _ggml_inputs(self, blocks: Any) -> int:
    types = self.ggml_types
    if len(types) > 1:
      return ggml_mixed.mixed_inputs(types, np.shape(blocks)[-1])
    t = ggml.ggml_type(types[0])
    return np.shape(blocks)[-1] // t.block_bytes * t.block_size

  def _inputs(self, parts: Sequence[Any], start: int, stop: int) -> tuple[Any, ...]:
    """The parts of input rows ``start:stop`` of a kernel (stored as rows along the
    input axis: the inputs are the parts' last axis)."""
    if self.ggml_type is not None:
      t = ggml.ggml_type(self.ggml_type)  # start, stop: multiples of the block size
      return (
        parts[0][..., start // t.block_size * t.block_bytes : stop // t.block_size * t.block_bytes],
      )
    if self.quantization.scheme == "int8":
      return (parts[0][..., start:stop], parts[1])
    g = self.quantization.group_size
    assert g is not None
    return (
      parts[0][..., start:stop],
      parts[1][..., start // g : stop // g],
      parts[2][..., start // g : stop // g],
    )

  def to_dict(self) -> dict[str, Any]:
    out = {**self.quantization.to_dict(), "axis": self.axis, "dtype": self.dtype}
    if self.ggml_type is not None:
      out.update(ggml_type=self.ggml_type, transpose=self.transpose)
    return out

  @classmethod
  def from_dict(cls, d: dict[str, Any]) -> Encoding:
    q = Quantization.of({k: d[k] for k in ("scheme", "group_size") if k in d})
    ggml_type = d.get("ggml_type")
    if ggml_type is not None:  # raises for a type this version lacks
      ggml_type = "+".join(ggml.ggml_type(t).name for t in str(ggml_type).split("+"))
    return cls(q, int(d["axis"]), str(d["dtype"]), ggml_type, bool(d.get("transpose", False)))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedTensor:
  """A quantized tensor in a parameter tree: its parts (pytree children) and encoding.

  Example:
    >>> import numpy as np
    >>> enc = Encoding(Quantization.of("int8"), -2, "float32")
    >>> w = np.eye(32, dtype=np.float32) * 127  # a scale of exactly 1: the codes are w
    >>> t = QuantizedTensor(enc.encode(w), enc)
    >>> bool((t.decode() == w).all()), [p.dtype.name for p in t.parts]
    (True, ['int8', 'float32'])
  """

  parts: tuple[Any, ...]
  encoding: Encoding = dataclasses.field(metadata={"static": True})

  def decode(self) -> jax.Array:
    """The value, as one jitted program (`is_decode_call` finds it in a jaxpr): a
    static tensor's decode, which `quant.fused` follows inside and a dense stream
    compiles with the operation that uses it (`stream.static_decode`)."""
    return _decode_jit(tuple(self.parts), self.encoding)


@functools.partial(jax.jit, static_argnums=1)
def _decode_jit(parts: tuple[Any, ...], encoding: Encoding) -> jax.Array:
  return encoding.decode(parts)


@functools.partial(jax.jit, static_argnums=1)
def _decode_kernel_rows(parts: tuple[Any, ...], encoding: Encoding) -> jax.Array:
  return encoding._decode_blocks(parts)


@functools.partial(jax.jit, static_argnums=1)
def _decode_table_rows(parts: tuple[Any, ...], encoding: Encoding) -> jax.Array:
  return encoding._decode_blocks(parts)


#: The name a traced static decode carries.
DECODE_JIT_NAME = "_decode_jit"
#: The names of an int8/int4 tensor's decode, by whether its rows are the decoded
#: matrix's columns (a kernel, ``(in, out)``) or its rows (a table).
ROWS_DECODE_NAMES = {"_decode_kernel_rows": True, "_decode_table_rows": False}
#: The start of the name of a GGUF tensor's decode: then ``kernel_`` or ``table_``, and
#: its `Encoding.ggml_type` (``"_ggml_rows_kernel_Q4_K+Q6_K"``).
GGML_ROWS_PREFIX = "_ggml_rows_"
#: The start of a GGUF tensor's scheme in `rows_source`, before its types.
GGML_SCHEME = "ggml:"


@functools.cache
def _ggml_rows(ggml_type: str, kernel: bool) -> Any:
  """The jitted decode of GGUF tensors of ``ggml_type``, named for `rows_source`."""

  def decode(parts: tuple[Any, ...], encoding: Encoding) -> jax.Array:
    return encoding._decode_blocks(parts)

  decode.__name__ = decode.__qualname__ = (
    f"{GGML_ROWS_PREFIX}{'kernel' if kernel else 'table'}_{ggml_type}"
  )
  return jax.jit(decode, static_argnums=1)


def rows_source(eqn: Any) -> tuple[str, bool] | None:
  """For a jaxpr equation that decodes one quantized tensor from its parts (its inputs,
  rows along the input axis): its scheme (``"int8"``, ``"int4"``, or ``"ggml:"`` and its
  GGML types, ``"ggml:Q4_K+Q6_K"``) and whether the decoded matrix is a kernel (its
  first axis is the input axis) or a table (its last); None for any other equation."""
  name = _called(eqn) or ""
  if name in ROWS_DECODE_NAMES:
    return ("int8" if len(eqn.invars) == 2 else "int4"), ROWS_DECODE_NAMES[name]
  if name.startswith(GGML_ROWS_PREFIX):
    shape, _, types = name.removeprefix(GGML_ROWS_PREFIX).partition("_")
    return f"{GGML_SCHEME}{types}", shape == "kernel"
  return None


def is_decode_call(eqn: Any) -> bool:
  """Whether a jaxpr equation is a call of `QuantizedTensor.decode`'s jitted program or of
  a GGML decode's (`ggml.DECODE_JIT_NAMES`)."""
  return _called(eqn) in (DECODE_JIT_NAME, *ggml.DECODE_JIT_NAMES)


def _called(eqn: Any) -> str | None:
  """The name of the jitted function a jaxpr equation calls; None for other equations."""
  return eqn.params.get("name") if eqn.primitive.name in ("pjit", "jit") else None


def is_quantized(x: Any) -> bool:
  return isinstance(x, QuantizedTensor)


def has_quantized(tree: Any) -> bool:
  """Whether ``tree`` holds a `QuantizedTensor`."""
  return any(is_quantized(x) for x in jax.tree.leaves(tree, is_leaf=is_quantized))


def decode_tree(tree: Any) -> Any:
  """``tree`` with every `QuantizedTensor` in it decoded (other leaves as they are)."""
  # Traced in place (not as a nested jit), so the step's fenced evaluation
  # (`quant.fused`) sees each decode next to the matmul that uses it.
  return jax.tree.map(
    lambda x: x.encoding.decode(x.parts) if is_quantized(x) else x, tree, is_leaf=is_quantized
  )


def encoded_nbytes(encoding: Encoding, shape: Sequence[int]) -> int:
  """Bytes at rest of a tensor of ``shape`` under ``encoding`` (all its parts)."""
  return sum(int(np.prod(s, dtype=np.int64)) * dt.itemsize for s, dt in encoding.part_shapes(shape))
