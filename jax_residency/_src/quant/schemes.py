"""How stored weights are quantized, and how one tensor is encoded and decoded.

Two schemes, each a :class:`Quantization`:

* ``"int8"``: symmetric, one float32 scale per output channel: a code ``c`` in
  ``[-127, 127]`` decodes to ``c * scale``. A channel of zeros has scale 1.
* ``"int4"``: asymmetric, in groups of ``group_size`` (32, 64 or 128; default
  64) consecutive values along the input dimension, each group with a float32
  ``scale`` and ``offset`` (its minimum): a code ``c`` in ``[0, 15]`` decodes to
  ``c * scale + offset``.

"The input dimension" is the axis a layer contracts over: for a matrix applied
as ``x @ w`` (an ``nnx.Linear`` kernel, ``(in, out)``) it is the first of the
matrix's two axes (``axis=-2``), and an output channel is a column; for an
embedding table ``(vocab, features)`` it is the last (``axis=-1``). Leading axes
(a stack of layers) keep their scales apart.

**Layout at rest: rows along the input axis.** The parts are stored as *rows*:
the matrix with its input axis last (a kernel is stored transposed, ``(out,
in)``; a table as it is), one row per output channel, as GGUF files store their
matrices too. Decoding then reads each row's codes contiguously, and XLA on CPU
compiles a one-token ``x @ w`` on a decoded kernel into one loop that reads the
codes once (the decode fused into the product) instead of writing the float
matrix and reading it back. int8 codes are ``(..., rows, in)`` with a scale per
row ``(..., rows, 1)``; int4 codes pack two rows per byte, row ``r`` in the low
nibble and row ``r + rows/2`` in the high one, ``(..., rows/2, in)`` (unpacking
is then two elementwise ops and a concatenation along the rows, which keeps that
fusion), with ``(..., rows, in/group)`` scales and offsets.

Encoding runs on the host in NumPy, once, when a store is written; decoding runs
in JAX, inside the step that uses the weights, and is the definition of a
quantized tensor's value: the same function gives the reference that placed
models are compared with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import (
  InvalidPolicyValueError,
  QuantizationError,
  UnknownPolicyFieldError,
)

#: The schemes a save or a conversion can be asked for.
SCHEMES = ("int8", "int4")
#: The scheme of a store converted from a GGUF file: each tensor keeps the GGML type
#: its file gave it (`quant.ggml`); no save writes it on request.
GGUF_SCHEME = "gguf"
#: The int4 group sizes a store can use, and the default.
INT4_GROUP_SIZES = (32, 64, 128)
DEFAULT_INT4_GROUP_SIZE = 64
#: The largest code magnitude of int8 (symmetric: -127..127; -128 is never used).
INT8_MAX = 127
#: The largest int4 code (asymmetric: 0..15).
INT4_MAX = 15


@dataclasses.dataclass(frozen=True, kw_only=True)
class Quantization:
  """A quantization scheme for a store's floating matrices.

  Attributes:
    scheme: ``"int8"`` or ``"int4"``.
    group_size: int4 only: values per group along the input dimension (32, 64
      or 128); ``None`` takes 64. Must be ``None`` for int8.

  Example:
    >>> Quantization.of("int4")
    Quantization(scheme='int4', group_size=64)
    >>> Quantization.of({"scheme": "int8"}).to_dict()
    {'scheme': 'int8'}
  """

  scheme: str
  group_size: int | None = None

  def __post_init__(self) -> None:
    if self.scheme == GGUF_SCHEME and self.group_size is None:
      return
    if self.scheme not in SCHEMES:
      raise InvalidPolicyValueError(
        f"quantize={self.scheme!r} is not a quantization scheme; use one of {SCHEMES}."
      )
    if self.scheme == "int8":
      if self.group_size is not None:
        raise InvalidPolicyValueError(
          f"group_size={self.group_size!r}: int8 has one scale per output channel, no "
          "groups; leave group_size out."
        )
      return
    size = DEFAULT_INT4_GROUP_SIZE if self.group_size is None else self.group_size
    if isinstance(size, bool) or size not in INT4_GROUP_SIZES:
      raise InvalidPolicyValueError(
        f"group_size={self.group_size!r} is not an int4 group size; use one of "
        f"{INT4_GROUP_SIZES} (default {DEFAULT_INT4_GROUP_SIZE})."
      )
    object.__setattr__(self, "group_size", size)

  @classmethod
  def of(cls, value: str | Mapping[str, Any] | Quantization) -> Quantization:
    """A scheme from its name, its `to_dict` form, or itself."""
    if isinstance(value, Quantization):
      return value
    if isinstance(value, str):
      return cls(scheme=value)
    if isinstance(value, Mapping):
      unknown = sorted(set(value) - {"scheme", "group_size"})
      if unknown:
        raise UnknownPolicyFieldError(
          f"quantize={dict(value)!r} has unknown fields {unknown}; it takes 'scheme' and, for "
          "int4, 'group_size'."
        )
      if "scheme" not in value:
        raise InvalidPolicyValueError(f"quantize={dict(value)!r} names no 'scheme'.")
      return cls(scheme=value["scheme"], group_size=value.get("group_size"))
    raise InvalidPolicyValueError(
      f"quantize={value!r} is not a quantization; pass 'int8', 'int4' or "
      "{'scheme': 'int4', 'group_size': 128}."
    )

  def to_dict(self) -> dict[str, Any]:
    """The JSON form a store's sidecar records; `of` reads it back."""
    out: dict[str, Any] = {"scheme": self.scheme}
    if self.group_size is not None:
      out["group_size"] = self.group_size
    return out

  def check(self, shape: tuple[int, ...], axis: int, name: str) -> None:
    """Raises `QuantizationError` naming the tensor when this scheme cannot encode a
    tensor of ``shape`` along ``axis``: the axis must be one of its last two; for
    int4 the group size must divide the input dimension and the other one (the
    rows, two to a byte) must be even."""
    if len(shape) < 2 or _last_two(axis, len(shape)) is None:
      raise QuantizationError(
        f"{name}: shape {shape} has no input axis {axis} among its last two; only "
        "matrices (and stacks of them) are quantized."
      )
    n = shape[axis]
    if self.scheme == "int4" and self.group_size is not None and n % self.group_size:
      raise QuantizationError(
        f"{name}: group_size={self.group_size} does not divide its input dimension {n} "
        f"(shape {shape}); choose a group size among {INT4_GROUP_SIZES} that divides {n}, "
        "or int8."
      )
    rows = shape[-1 if _last_two(axis, len(shape)) == -2 else -2]
    if self.scheme == "int4" and rows % 2:
      raise QuantizationError(
        f"{name}: int4 packs two output channels a byte, but it has {rows} (shape "
        f"{shape}, an odd number); use int8."
      )

  def stored_nbytes(self, shape: tuple[int, ...], axis: int) -> int:
    """Bytes of a tensor of ``shape`` at rest under this scheme: codes, scales, offsets."""
    n = int(np.prod(shape, dtype=np.int64))
    lanes = n // shape[axis]  # one scale per output channel (and per stacked layer)
    if self.scheme == "int8":
      return n + 4 * lanes
    assert self.group_size is not None
    groups = lanes * (shape[axis] // self.group_size)
    return n // 2 + 8 * groups


class Quantized(NamedTuple):
  """One tensor at rest: its integer codes and the float32 numbers that decode them.

  Attributes:
    codes: int8, the tensor's shape (int8); or uint8 with the input axis halved,
      two codes per byte (int4).
    scale: float32; the tensor's shape with the input axis 1 (int8) or one per
      group (int4).
    offset: float32, shaped as ``scale`` (int4); ``None`` for int8.
  """

  codes: Any
  scale: Any
  offset: Any = None


def _exact_products(scale: Any, *, code_bits: int) -> np.ndarray:
  """``scale`` in float32, rounded to ``24 - code_bits`` significant bits, so that a code
  of ``code_bits`` bits times it is exact in float32. Decoding ``c * scale + offset``
  then rounds once, whether or not the compiler fuses the two into a multiply-add,
  and every program that decodes a tensor gets the same bits."""
  drop = code_bits  # low mantissa bits cleared (float32 keeps 23 + the implicit one)
  bits = np.asarray(scale, np.float32).view(np.uint32)
  half = np.uint32(1 << (drop - 1))
  rounded = (bits + half) & ~np.uint32((1 << drop) - 1)
  return rounded.view(np.float32)


def _last_two(axis: int, ndim: int) -> int | None:
  """``axis`` as -2 or -1 when it is one of the last two of ``ndim``; else None."""
  a = axis - ndim if axis >= 0 else axis
  return a if a in (-2, -1) else None


def _to_rows(x: Any, axis: int | None) -> Any:
  """A tensor with input axis ``axis`` (-2 or -1), as rows along its input axis."""
  return x.swapaxes(-1, -2) if axis == -2 else x


def quantize(w: Any, q: Quantization, *, axis: int, name: str = "tensor") -> Quantized:
  """Encodes ``w`` (any floating dtype; computed in float32) under ``q`` along ``axis``,
  as rows along the input axis (see the module's docstring).

  Raises:
    QuantizationError: ``w`` is not a floating matrix (or stack of them), its input
      dimension does not split into ``q``'s groups, or (int4) its output channels
      are odd in number; the message names ``name``.
  """
  w = np.asarray(w)
  if not np.issubdtype(w.dtype, np.floating) and w.dtype.name != "bfloat16":
    raise QuantizationError(
      f"{name}: dtype {w.dtype} is not floating; only floating matrices are quantized."
    )
  q.check(tuple(w.shape), axis, name)
  rows = _to_rows(w.astype(np.float32), _last_two(axis, w.ndim))
  if q.scheme == "int8":
    amax = np.max(np.abs(rows), axis=-1, keepdims=True)
    scale = _exact_products(np.where(amax > 0, amax / INT8_MAX, 1.0), code_bits=7)
    codes = np.clip(np.rint(rows / scale), -INT8_MAX, INT8_MAX).astype(np.int8)
    return Quantized(np.ascontiguousarray(codes), scale)
  assert q.group_size is not None
  n, g = rows.shape[-1], q.group_size
  groups = rows.reshape(*rows.shape[:-1], n // g, g)
  low = groups.min(axis=-1, keepdims=True)
  span = groups.max(axis=-1, keepdims=True) - low
  scale = _exact_products(np.where(span > 0, span / INT4_MAX, 1.0), code_bits=4)
  codes = np.clip(np.rint((groups - low) / scale), 0, INT4_MAX).astype(np.uint8)
  codes = codes.reshape(rows.shape)
  half = rows.shape[-2] // 2
  packed = codes[..., :half, :] | (codes[..., half:, :] << 4)
  return Quantized(packed, scale[..., 0], low[..., 0].astype(np.float32))


def dequantize(t: Quantized, q: Quantization, *, axis: int, dtype: Any = jnp.float32) -> Any:
  """The value of a quantized tensor (a JAX array of ``dtype``), traceable under ``jit``.

  Only elementwise ops, a broadcast of the scales, a concatenation along the rows
  (int4) and a final transpose for kernels: XLA fuses them into the op that
  consumes the tensor (see the module's docstring).
  """
  codes, scale = jnp.asarray(t.codes), jnp.asarray(t.scale)
  a = _last_two(axis, codes.ndim)
  if q.scheme == "int8":
    return _to_rows((codes.astype(jnp.float32) * scale).astype(dtype), a)
  assert q.group_size is not None and t.offset is not None
  both = jnp.concatenate([codes & 0xF, codes >> 4], axis=-2).astype(jnp.float32)
  grouped = both.reshape(*both.shape[:-1], -1, q.group_size)
  values = grouped * scale[..., None] + jnp.asarray(t.offset)[..., None]
  return _to_rows(values.reshape(both.shape).astype(dtype), a)
