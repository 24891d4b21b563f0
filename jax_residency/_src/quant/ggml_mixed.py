"""Mixed GGUF tensors: a layer stack whose layers have different GGML types.

llama.cpp's ``_S`` / ``_M`` / ``_L`` presets give ``attn_v`` and ``ffn_down`` a larger
type in some layers (Q4_K_M: Q6_K in the first and last eighth of the layers and every
third between). A layer stack is one array, so such a tensor's rows hold their own
type's blocks (`ggml`), zero-padded to the widest type's row, then one byte: the index
of the row's type in the tensor's list of types (`mixed_row_bytes`). `decode_mixed`
decodes every type from its own leading bytes of each row and keeps the row's.
"""

from __future__ import annotations

import fractions
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jax_residency._src.errors import InvalidPolicyValueError
from jax_residency._src.quant.ggml import GgmlType, ggml_type, row_bytes, values


def _widest(types: Sequence[str | int | GgmlType]) -> GgmlType:
  """The type of ``types`` with the most bytes per value (the first of equals)."""
  found = [ggml_type(t) for t in types]
  return max(found, key=lambda t: fractions.Fraction(t.block_bytes, t.block_size))


def mixed_row_bytes(types: Sequence[str | int | GgmlType], n: int) -> int:
  """Bytes of one row of ``n`` values of a mixed tensor of ``types``: the widest type's
  row, then the byte that names the row's type.

  Raises:
    InvalidPolicyValueError: a type is not supported, or ``n`` is not whole blocks of
      every one of them.

  Example:
    >>> row_bytes("Q4_K", 4096), row_bytes("Q6_K", 4096), mixed_row_bytes(["Q4_K", "Q6_K"], 4096)
    (2304, 3360, 3361)
  """
  return max(row_bytes(t, n) for t in types) + 1


def mixed_inputs(types: Sequence[str | int | GgmlType], nbytes: int) -> int:
  """Values per row of a mixed tensor of ``types`` whose rows are ``nbytes`` long (the
  inverse of `mixed_row_bytes`).

  Raises:
    InvalidPolicyValueError: no row length gives ``nbytes``.

  Example:
    >>> mixed_inputs(["Q4_K", "Q6_K"], 3361)
    4096
  """
  wide = _widest(types)
  n = (int(nbytes) - 1) // wide.block_bytes * wide.block_size
  if (
    n <= 0
    or any(n % ggml_type(t).block_size for t in types)
    or (mixed_row_bytes(types, n) != nbytes)
  ):
    names = "+".join(ggml_type(t).name for t in types)
    raise InvalidPolicyValueError(
      f"row_bytes={nbytes} is not the length of a row of a {names} tensor: its rows are "
      "the widest type's blocks and one type byte."
    )
  return n


def decode_mixed(
  raw: jax.typing.ArrayLike,
  types: Sequence[str | int | GgmlType],
  *,
  start: int = 0,
  stop: int | None = None,
  dtype: Any = jnp.float32,
) -> jax.Array:
  """Values ``start:stop`` of the rows of a mixed tensor: rows of several GGML types,
  each as `decode` gives its own type's values.

  A row (``mixed_row_bytes(types, n)`` bytes) holds its type's blocks from byte 0,
  padding, and in its last byte the index in ``types`` of that type. Each type's
  values are computed from its own leading bytes of every row and the row's type
  byte picks one (an elementwise select: a row of another type gives values that are
  discarded, NaN or not). So a row's values are bit-identical to `decode`'s of its
  own blocks, and the program holds only elementwise ops, which XLA keeps inside a
  product it fuses.

  Args:
    raw: ``uint8``, shaped ``(..., rows, row_bytes)``.
    types: the tensor's types, at least two, in the order its type bytes index.
    start, stop: the range of values of each row to decode (multiples of every type's
      block size; default the whole row).
    dtype: the dtype of the result.

  Returns:
    ``(..., rows, stop - start)`` values of ``dtype``.

  Raises:
    InvalidPolicyValueError: fewer than two types, an unsupported one, ``raw`` not
      ``uint8`` rows of a mixed tensor of ``types``, or a range that is not whole
      blocks of every type.

  Example:
    >>> import numpy as np
    >>> q8 = np.float16(0.5).tobytes() + np.arange(-16, 16, dtype=np.int8).tobytes()
    >>> q4 = np.float16(2).tobytes() + bytes([0x98] * 16)  # values 0 (code 8), then 2 (9)
    >>> rows = np.frombuffer(q8 + bytes([0]) + q4 + bytes(16) + bytes([1]), np.uint8)
    >>> decode_mixed(rows.reshape(2, 35), ["Q8_0", "Q4_0"])[:, 14:18]
    Array([[-1. , -0.5,  0. ,  0.5],
           [ 0. ,  0. ,  2. ,  2. ]], dtype=float32)
  """
  names = tuple(ggml_type(t).name for t in types)
  raw = jnp.asarray(raw)
  if len(names) < 2 or raw.dtype != jnp.uint8 or raw.ndim < 1:
    raise InvalidPolicyValueError(
      f"decode_mixed: {len(names)} types and raw {raw.dtype} of shape {raw.shape}; a mixed "
      "tensor has at least two types and uint8 rows of shape (..., rows, row_bytes)."
    )
  n = mixed_inputs(names, raw.shape[-1])
  stop = n if stop is None else stop
  if not 0 <= start < stop <= n or any(
    (start % ggml_type(t).block_size) or (stop % ggml_type(t).block_size) for t in names
  ):
    raise InvalidPolicyValueError(
      f"start={start}, stop={stop}: a range of a {'+'.join(names)} row of {n} values must "
      "lie in it and be whole blocks of every type."
    )
  return _ggml_decode_mixed(raw, names, start, stop, np.dtype(dtype).name)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _ggml_decode_mixed(
  raw: jax.Array, names: tuple[str, ...], start: int, stop: int, dtype: str
) -> jax.Array:
  """`decode_mixed`'s arithmetic as one program."""
  decoded = []
  for name in names:  # each type from its own bytes of the range
    t = ggml_type(name)
    first, last = start // t.block_size * t.block_bytes, stop // t.block_size * t.block_bytes
    decoded.append(values(raw[..., first:last], name))
  which = jnp.broadcast_to(raw[..., -1:].astype(jnp.int32), decoded[0].shape)
  return jax.lax.select_n(which, *decoded).astype(dtype)
