"""llama.cpp's GGML tensor types, decoded from their raw block bytes in JAX.

A GGUF checkpoint stores each tensor row by row; a row of ``n`` values is
``n / block_size`` blocks laid end to end, and a block is a fixed number of bytes.
Stores keep those bytes as they are (``uint8`` arrays of shape ``(..., rows,
row_bytes)``) and `decode` turns them into floats inside the step that uses them.
Every multi-byte field is little-endian; "half" below is an IEEE float16 scale.

* ``F32``, ``F16``, ``BF16``: one value per "block", its 4 or 2 bytes.
* ``Q8_0`` (32 values, 34 bytes): a half ``d``, then 32 signed bytes ``q``; value
  ``i`` is ``q[i] * d``.
* ``Q4_0`` (32 values, 18 bytes): a half ``d``, then 16 bytes of 4-bit codes. Byte
  ``j`` holds value ``j`` in its low nibble and value ``j + 16`` in its high
  nibble; a code ``c`` in ``[0, 15]`` means ``(c - 8) * d``.
* ``Q4_1`` (32 values, 20 bytes): halves ``d`` and ``m``, then the 16 code bytes
  of ``Q4_0``; a code ``c`` means ``c * d + m`` (unsigned codes, an offset).
* ``Q4_K`` (256 values, 144 bytes): halves ``d`` and ``dmin``, 12 bytes of
  sub-block scales, then 128 code bytes. The block is 8 sub-blocks of 32 values,
  each with a 6-bit scale ``sc`` and a 6-bit minimum ``mn``, packed into the 12
  bytes as three rows of four: for sub-block ``k < 4``, ``sc`` is the low 6 bits
  of byte ``k`` and ``mn`` the low 6 bits of byte ``k + 4``; for ``k >= 4`` the
  low 4 bits of each come from byte ``k + 4`` (``sc`` its low nibble, ``mn`` its
  high one) and the top 2 bits from the spare top bits of bytes ``k - 4``
  (``sc``) and ``k`` (``mn``). The codes come in four runs of 32 bytes: run
  ``r`` holds sub-block ``2r`` in its low nibbles and ``2r + 1`` in its high
  ones. A code ``c`` means ``(d * sc) * c - dmin * mn``.
* ``Q2_K`` (256 values, 84 bytes): 16 scale bytes (sub-block ``k`` of 16 values: a
  4-bit scale ``sc`` in the low nibble of byte ``k``, a 4-bit minimum ``mn`` in the
  high one), 64 code bytes, then halves ``d`` and ``dmin``. Value ``128 h + 32 j + l``
  (``h`` in 0..1, ``j`` in 0..3, ``l`` in 0..31) is bits ``2j`` and ``2j + 1`` of code
  byte ``32 h + l``; a code ``c`` means ``(d * sc) * c - dmin * mn``.
* ``Q3_K`` (256 values, 110 bytes): 32 bytes ``hmask``, 64 code bytes, 12 scale bytes,
  a half ``d``. A value's low two bits come from the code bytes as in ``Q2_K``; value
  ``32 b + l`` (``b`` in 0..7) has ``4`` subtracted where bit ``b`` of ``hmask[l]`` is
  clear. Its sub-block's 6-bit scale ``sc`` (16 of them): the low nibble of scale byte
  ``k`` (scales 0-7) or its high nibble (8-15, of byte ``k - 8``), and as top two bits
  bits ``2s`` and ``2s + 1`` of byte ``8 + k % 4`` for scale ``4 s + k % 4``. A code
  ``c`` in ``[-4, 3]`` means ``(d * (sc - 32)) * c``.
* ``IQ4_NL`` (32 values, 18 bytes): ``Q4_0``'s layout, but a code ``c`` means
  ``d * K[c]``, ``K`` the 16 non-uniform levels `IQ4_LEVELS`.
* ``IQ4_XS`` (256 values, 136 bytes): a half ``d``, a 16-bit word ``sh``, 4 bytes
  ``sl``, then 128 code bytes. Sub-block ``k`` (32 values) has a 6-bit scale
  ``ls``: its low 4 bits the low (``k`` even) or high nibble of ``sl[k // 2]``, its
  top 2 bits bits ``2k`` and ``2k + 1`` of ``sh``; its values are the low, then the
  high nibbles of code bytes ``16k`` to ``16k + 15``. A code ``c`` means
  ``(d * (ls - 32)) * K[c]``.
* ``Q5_K`` (256 values, 176 bytes): ``Q4_K``'s halves and 12 scale bytes, then 32
  bytes ``qh`` of fifth bits, then ``Q4_K``'s 128 code bytes. Value ``l`` of
  sub-block ``k`` takes its low four bits as in ``Q4_K`` and its top bit from bit
  ``k`` of ``qh[l]``; a code ``c`` in ``[0, 31]`` means ``(d * sc) * c - dmin * mn``.
* ``Q6_K`` (256 values, 210 bytes): 128 bytes of low nibbles ``ql``, 64 bytes of
  high bit pairs ``qh``, 16 signed byte scales ``sc`` (one per 16 values), then a
  half ``d``. Each half-block of 128 values uses 64 bytes of ``ql`` and 32 of
  ``qh``: its value ``32 * k + l`` (``k`` in 0..3, ``l`` in 0..31) takes the low
  (``k < 2``) or high (``k >= 2``) nibble of ``ql[l + 32 * (k % 2)]`` and, as its
  top two bits, bits ``2k`` and ``2k + 1`` of ``qh[l]``. The 6-bit code ``c``
  means ``(d * sc) * (c - 32)``.

A layer stack whose layers have different types is decoded by `ggml_mixed`.

The arithmetic follows llama.cpp's reference dequantization (``ggml-quants.c``),
operation by operation, in float32. Every product there is exact in float32: a
half has at most 11 significant bits and the integers it is multiplied by (a
sub-block scale times a code, or an IQ4 level) at most 12 together, within
float32's 24, and no product leaves float32's normal range. So each decoded value
has at most one rounding, in the final add or subtract (Q4_1, Q5_1, Q2_K, Q4_K, Q5_K),
and the result is bit-identical to llama.cpp's whether or not XLA reorders the
products or contracts a multiply and an add into an FMA.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import InvalidPolicyValueError

#: Values per block of the K-quants.
QK_K = 256

#: The 16 levels an IQ4_NL or IQ4_XS code picks (llama.cpp's ``kvalues_iq4nl``).
IQ4_LEVELS = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GgmlType:
  """One GGML tensor type: its name, its id in GGUF files, and its block.

  Attributes:
    name: llama.cpp's name, e.g. ``"Q4_K"``.
    type_id: the number GGUF files store (``ggml_type`` in llama.cpp's ``ggml.h``).
    block_size: values per block (1 for the float types).
    block_bytes: bytes per block.

  Example:
    >>> ggml_type("Q4_K")
    GgmlType(name='Q4_K', type_id=12, block_size=256, block_bytes=144)
  """

  name: str
  type_id: int
  block_size: int
  block_bytes: int


#: The types `decode` reads, in GGML id order.
GGML_TYPES: tuple[GgmlType, ...] = (
  GgmlType(name="F32", type_id=0, block_size=1, block_bytes=4),
  GgmlType(name="F16", type_id=1, block_size=1, block_bytes=2),
  GgmlType(name="Q4_0", type_id=2, block_size=32, block_bytes=18),
  GgmlType(name="Q4_1", type_id=3, block_size=32, block_bytes=20),
  GgmlType(name="Q5_0", type_id=6, block_size=32, block_bytes=22),
  GgmlType(name="Q5_1", type_id=7, block_size=32, block_bytes=24),
  GgmlType(name="Q8_0", type_id=8, block_size=32, block_bytes=34),
  GgmlType(name="Q2_K", type_id=10, block_size=QK_K, block_bytes=84),
  GgmlType(name="Q3_K", type_id=11, block_size=QK_K, block_bytes=110),
  GgmlType(name="Q4_K", type_id=12, block_size=QK_K, block_bytes=144),
  GgmlType(name="Q5_K", type_id=13, block_size=QK_K, block_bytes=176),
  GgmlType(name="Q6_K", type_id=14, block_size=QK_K, block_bytes=210),
  GgmlType(name="IQ4_NL", type_id=20, block_size=32, block_bytes=18),
  GgmlType(name="IQ4_XS", type_id=23, block_size=QK_K, block_bytes=136),
  GgmlType(name="BF16", type_id=30, block_size=1, block_bytes=2),
)
_BY_NAME = {t.name: t for t in GGML_TYPES}
_BY_ID = {t.type_id: t for t in GGML_TYPES}
#: The names the jitted programs of `decode` and `ggml_mixed.decode_mixed` carry in a
#: jaxpr, which `quant.fused` follows inside like the decodes a step traces in place.
DECODE_JIT_NAMES = ("_ggml_decode", "_ggml_decode_mixed")


def ggml_type(name_or_id: str | int | GgmlType) -> GgmlType:
  """The supported type of a name (any case), a GGML type id, or itself.

  Raises:
    InvalidPolicyValueError: not a supported type; the message names the value and
      lists the supported types with their ids.

  Example:
    >>> ggml_type(8).name, ggml_type("bf16").type_id
    ('Q8_0', 30)
  """
  if isinstance(name_or_id, GgmlType):
    return name_or_id
  found = None
  if isinstance(name_or_id, str):
    found = _BY_NAME.get(name_or_id.upper())
  elif isinstance(name_or_id, int | np.integer) and not isinstance(name_or_id, bool):
    found = _BY_ID.get(int(name_or_id))
  if found is None:
    supported = ", ".join(f"{t.name} ({t.type_id})" for t in GGML_TYPES)
    raise InvalidPolicyValueError(
      f"GGML type {name_or_id!r} is not supported; use one of {supported} (by name or id)."
    )
  return found


def row_bytes(t: str | int | GgmlType, n: int) -> int:
  """Bytes of one row of ``n`` values of type ``t``.

  Raises:
    InvalidPolicyValueError: ``t`` is not supported, or ``n`` is not a positive
      multiple of its block size (the message names both).

  Example:
    >>> row_bytes("Q4_K", 4096), row_bytes("F16", 3)
    (2304, 6)
  """
  t = ggml_type(t)
  if isinstance(n, bool) or not isinstance(n, int | np.integer) or n <= 0 or n % t.block_size:
    raise InvalidPolicyValueError(
      f"n={n!r}: a row of {t.name} is whole blocks of {t.block_size} values; pass a "
      f"positive multiple of {t.block_size}."
    )
  return int(n) // t.block_size * t.block_bytes


def decode(
  raw: jax.typing.ArrayLike, t: str | int | GgmlType, *, dtype: Any = jnp.float32
) -> jax.Array:
  """The values of rows of GGML blocks, as llama.cpp's ``dequantize_row_*`` gives them.

  Traceable under `jax.jit`; the bytes are reinterpreted with
  `jax.lax.bitcast_convert_type`, so decoding runs where ``raw`` lives. Computed
  in float32 and then cast to ``dtype``. The order of operations is the C
  reference's: ``q * d`` (Q8_0, Q4_0, Q5_0), ``q * d + m`` (Q4_1, Q5_1), ``(d *
  sc) * q - dmin * mn`` (Q2_K, Q4_K, Q5_K), ``(d * (sc - 32)) * q`` (Q3_K), ``(d *
  sc) * q`` (Q6_K), ``d * K[q]`` (IQ4_NL) and ``(d * (ls - 32)) * K[q]`` (IQ4_XS).
  XLA may contract the multiply-adds of Q4_1, Q5_1, Q2_K, Q4_K and Q5_K into FMAs;
  since their products are exact in float32, the results are the same bits either way
  (see the module docstring).

  Args:
    raw: ``uint8``, shaped ``(..., rows, row_bytes)``: any leading axes (a stack
      of layers on axis 0), each row whole blocks of ``t``.
    t: the type, by name, id or `GgmlType`.
    dtype: the dtype of the result.

  Returns:
    ``(..., rows, n)`` values of ``dtype``, ``n = row_bytes / block_bytes *
    block_size``.

  Raises:
    InvalidPolicyValueError: ``t`` is not supported, ``raw`` is not ``uint8`` with
      at least one axis, or its rows are not whole blocks (the message names the
      row bytes and the block bytes).

  Example:
    >>> import numpy as np
    >>> block = np.float16(0.5).tobytes() + np.arange(-16, 16, dtype=np.int8).tobytes()
    >>> decode(np.frombuffer(block, np.uint8)[None], "Q8_0")[0, 14:18]
    Array([-1. , -0.5,  0. ,  0.5], dtype=float32)
  """
  t = ggml_type(t)
  raw = jnp.asarray(raw)
  if raw.dtype != jnp.uint8 or raw.ndim < 1:
    raise InvalidPolicyValueError(
      f"raw: {raw.dtype} of shape {raw.shape}; GGML blocks are uint8 arrays of shape "
      "(..., rows, row_bytes)."
    )
  nbytes = raw.shape[-1]
  if nbytes % t.block_bytes:
    raise InvalidPolicyValueError(
      f"row_bytes={nbytes} (raw shape {raw.shape}) is not a multiple of {t.name}'s "
      f"{t.block_bytes} bytes per block."
    )
  return _ggml_decode(raw, t.name, np.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(1, 2))
def _ggml_decode(raw: jax.Array, name: str, dtype: str) -> jax.Array:
  """`decode`'s arithmetic as one program (inlined in a jitted step; compiled once per
  shape and type when called eagerly, instead of dispatching each of its ops)."""
  return values(raw, name).astype(dtype)


def values(raw: jax.Array, name: str) -> jax.Array:
  """float32 values of rows of whole blocks of type ``name``, ``(..., rows, row_bytes)``
  to ``(..., rows, n)``: `decode`'s arithmetic, unchecked, traced in place."""
  t = _BY_NAME[name]
  blocks = raw.reshape(*raw.shape[:-1], raw.shape[-1] // t.block_bytes, t.block_bytes)
  return DECODERS[name](blocks).reshape(*raw.shape[:-1], -1)


def _uint(b: jax.Array, dtype: Any) -> jax.Array:
  """The little-endian unsigned integers of the bytes on the last axis of ``b``."""
  out = b[..., 0].astype(dtype)
  for i in range(1, b.shape[-1]):
    out = out | (b[..., i].astype(dtype) << (8 * i))
  return out


def _half(b: jax.Array) -> jax.Array:
  """float32 of the little-endian float16s in the (last-axis) byte pairs of ``b``."""
  bits = _uint(b, jnp.uint16)
  return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


def _f32(blocks: jax.Array) -> jax.Array:
  return jax.lax.bitcast_convert_type(_uint(blocks, jnp.uint32), jnp.float32)


def _bf16(blocks: jax.Array) -> jax.Array:
  bits = _uint(blocks, jnp.uint16)
  return jax.lax.bitcast_convert_type(bits, jnp.bfloat16).astype(jnp.float32)


def _nibbles(qs: jax.Array) -> jax.Array:
  """The low nibbles of ``qs`` (last axis), then the high ones, as int32."""
  return jnp.concatenate([qs & 0xF, qs >> 4], axis=-1).astype(jnp.int32)


def _q8_0(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  q = jax.lax.bitcast_convert_type(blocks[..., 2:34], jnp.int8).astype(jnp.float32)
  return q * d


def _q4_0(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  q = (_nibbles(blocks[..., 2:18]) - 8).astype(jnp.float32)
  return q * d


def _q4_1(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  m = _half(blocks[..., 2:4])[..., None]
  q = _nibbles(blocks[..., 4:20]).astype(jnp.float32)
  return q * d + m


def _fifth_bits(qh: jax.Array) -> jax.Array:
  """Bit ``i`` of the little-endian 32-bit word in ``qh`` (last axis, 4 bytes) at
  position 4 of value ``i``, for ``i`` in 0..31: the top bits of a Q5_0/Q5_1 block."""
  bits = _uint(qh, jnp.uint32)[..., None] >> jnp.arange(32, dtype=jnp.uint32)
  return ((bits & 1) << 4).astype(jnp.int32)


def _q5_0(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  q = (_nibbles(blocks[..., 6:22]) | _fifth_bits(blocks[..., 2:6])) - 16
  return q.astype(jnp.float32) * d


def _q5_1(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  m = _half(blocks[..., 2:4])[..., None]
  q = (_nibbles(blocks[..., 8:24]) | _fifth_bits(blocks[..., 4:8])).astype(jnp.float32)
  return q * d + m


def _levels(codes: jax.Array) -> jax.Array:
  """float32 `IQ4_LEVELS` picked by 4-bit ``codes`` (an elementwise select: no gather)."""
  cases = [jnp.full(codes.shape, v, jnp.float32) for v in IQ4_LEVELS]
  return jax.lax.select_n(codes, *cases)


def _iq4_nl(blocks: jax.Array) -> jax.Array:
  d = _half(blocks[..., 0:2])[..., None]
  return d * _levels(_nibbles(blocks[..., 2:18]))


def _iq4_xs(blocks: jax.Array) -> jax.Array:
  lead = blocks.shape[:-1]
  d = _half(blocks[..., 0:2])[..., None]
  k = jnp.arange(8, dtype=jnp.uint32)
  high = (_uint(blocks[..., 2:4], jnp.uint32)[..., None] >> (2 * k)) & 3  # (..., 8)
  low = _nibbles(blocks[..., 4:8])  # (..., 8): low nibbles of sl, then high ones
  low = low.reshape(*lead, 2, 4).swapaxes(-1, -2).reshape(*lead, 8)  # sub-block order
  ls = (low | (high.astype(jnp.int32) << 4)) - 32
  dl = (d * ls.astype(jnp.float32))[..., None]  # (..., 8, 1)
  runs = blocks[..., 8:136].reshape(*lead, 8, 16)
  codes = jnp.concatenate([runs & 0xF, runs >> 4], axis=-1).astype(jnp.int32)  # (..., 8, 32)
  return (dl * _levels(codes)).reshape(*lead, QK_K)


def _q4_k_scales(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The 8 six-bit scales and minimums of a Q4_K block from its 12 scale bytes."""
  a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
  sc = jnp.concatenate([a & 0x3F, (c & 0xF) | ((a >> 6) << 4)], axis=-1)
  mn = jnp.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
  return sc.astype(jnp.float32), mn.astype(jnp.float32)


def _k_codes(runs: jax.Array) -> jax.Array:
  """The 4-bit codes of a Q4_K/Q5_K block's 128 code bytes, as ``(..., 8, 32)`` int32:
  run ``r`` holds sub-block ``2r`` in its low nibbles and ``2r + 1`` in its high ones."""
  runs = runs.reshape(*runs.shape[:-1], 4, 32)
  q = jnp.stack([runs & 0xF, runs >> 4], axis=-2)  # (..., run, nibble, 32)
  return q.reshape(*runs.shape[:-2], 8, 32).astype(jnp.int32)


def _two_bits(qs: jax.Array) -> jax.Array:
  """The 2-bit codes of a Q2_K/Q3_K block's 64 code bytes as ``(..., 16, 16)`` (sub-block,
  value): value ``128 h + 32 j + l`` is bits ``2j``, ``2j + 1`` of byte ``32 h + l``."""
  runs = qs.reshape(*qs.shape[:-1], 2, 1, 32)
  codes = (runs >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 3  # (..., 2, 4, 32)
  return codes.reshape(*qs.shape[:-1], 16, 16).astype(jnp.int32)


def _q2_k(blocks: jax.Array) -> jax.Array:
  sc = blocks[..., 0:16]
  d = _half(blocks[..., 80:82])[..., None]
  dmin = _half(blocks[..., 82:84])[..., None]
  scale = (d * (sc & 0xF).astype(jnp.float32))[..., None]  # (..., 16, 1)
  low = (dmin * (sc >> 4).astype(jnp.float32))[..., None]
  q = _two_bits(blocks[..., 16:80]).astype(jnp.float32)
  return (scale * q - low).reshape(*blocks.shape[:-1], QK_K)


def _q3_k(blocks: jax.Array) -> jax.Array:
  lead = blocks.shape[:-1]
  d = _half(blocks[..., 108:110])[..., None]
  low, high = blocks[..., 96:104], blocks[..., 104:108]
  sc_low = jnp.concatenate([low & 0xF, low >> 4], axis=-1)  # scale 8s + k: nibble s, byte k
  shifts = jnp.array([0, 2, 4, 6], jnp.uint8)[:, None]
  sc_high = ((high[..., None, :] >> shifts) & 3).reshape(*lead, 16)  # scale 4s + k
  sc = (sc_low | (sc_high << 4)).astype(jnp.int32) - 32
  scale = (d * sc.astype(jnp.float32))[..., None]  # (..., 16, 1)
  bits = blocks[..., 0:32][..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]  # (..., 8, 32)
  clear = ((bits & 1) ^ 1).reshape(*lead, 16, 16).astype(jnp.int32)
  q = (_two_bits(blocks[..., 32:96]) - (clear << 2)).astype(jnp.float32)
  return (scale * q).reshape(*lead, QK_K)


def _q4_k(blocks: jax.Array) -> jax.Array:
  return _k_decode(blocks, _k_codes(blocks[..., 16:144]))


def _q5_k(blocks: jax.Array) -> jax.Array:
  # Bit k of qh[l] is the top bit of value l of sub-block k.
  qh = blocks[..., 16:48][..., None, :] >> jnp.arange(8, dtype=jnp.uint8)[:, None]
  top = ((qh & 1) << 4).astype(jnp.int32)  # (..., 8, 32)
  return _k_decode(blocks, _k_codes(blocks[..., 48:176]) | top)


def _k_decode(blocks: jax.Array, codes: jax.Array) -> jax.Array:
  """``(d * sc) * c - dmin * mn`` for the ``(..., 8, 32)`` codes of Q4_K/Q5_K blocks,
  whose first 16 bytes are ``d``, ``dmin`` and the packed scales."""
  d = _half(blocks[..., 0:2])[..., None]
  dmin = _half(blocks[..., 2:4])[..., None]
  sc, mn = _q4_k_scales(blocks[..., 4:16])
  q = codes.astype(jnp.float32)
  scale = (d * sc)[..., None]
  low = (dmin * mn)[..., None]
  return (scale * q - low).reshape(*blocks.shape[:-1], QK_K)


def _q6_k(blocks: jax.Array) -> jax.Array:
  lead = blocks.shape[:-1]
  ql = blocks[..., 0:128].reshape(*lead, 2, 1, 2, 32)  # (half, ·, part, l)
  qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)  # (half, ·, l)
  sc = jax.lax.bitcast_convert_type(blocks[..., 192:208], jnp.int8).astype(jnp.float32)
  d = _half(blocks[..., 208:210])[..., None]
  # Value 32 * k + l of a half: nibble k // 2 of ql[part k % 2, l], bits 2k.. of qh[l].
  shifts = jnp.array([0, 4], jnp.uint8).reshape(2, 1, 1)
  low = ((ql >> shifts) & 0xF).reshape(*lead, 2, 4, 32)
  high = (qh >> jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)) & 0x3
  q = (low | (high << 4)).astype(jnp.int32) - 32
  q = q.reshape(*lead, 16, 16).astype(jnp.float32)
  return ((d * sc)[..., None] * q).reshape(*lead, QK_K)


#: Each type's decode of ``(..., blocks, block_bytes)`` raw blocks to ``(..., blocks,
#: block_size)`` float32 values, by name.
DECODERS: dict[str, Callable[[jax.Array], jax.Array]] = {
  "F32": _f32,
  "F16": _half,
  "BF16": _bf16,
  "Q8_0": _q8_0,
  "Q4_0": _q4_0,
  "Q4_1": _q4_1,
  "Q5_0": _q5_0,
  "Q5_1": _q5_1,
  "Q2_K": _q2_k,
  "Q3_K": _q3_k,
  "Q4_K": _q4_k,
  "Q5_K": _q5_k,
  "Q6_K": _q6_k,
  "IQ4_NL": _iq4_nl,
  "IQ4_XS": _iq4_xs,
}
