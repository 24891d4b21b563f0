"""GGML block decoding (``quant/ggml.py``) against the ``gguf`` package's reference.

Every supported type decodes random blocks, and blocks that gguf's own quantizer
wrote, to the same float32 bits as ``gguf.quants.dequantize`` (which follows
llama.cpp's ``dequantize_row_*``): equality is exact, not within a tolerance,
eagerly and under `jax.jit`; so does every row of a mixed tensor (rows of several
types, as llama.cpp's Q4_K_M writes a layer stack), whole or by ranges of inputs.
Bad types and bad row lengths raise typed errors that name the value.
"""

from __future__ import annotations

import gguf  # the test extras install it
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402
from gguf.quants import quantize as gguf_quantize  # noqa: E402

from jax_residency._src.errors import InvalidPolicyValueError  # noqa: E402
from jax_residency._src.quant.encoding import MATVEC_CHUNK, Encoding  # noqa: E402
from jax_residency._src.quant.ggml import (  # noqa: E402
  GGML_TYPES,
  GgmlType,
  decode,
  ggml_type,
  row_bytes,
)
from jax_residency._src.quant.ggml_mixed import (  # noqa: E402
  decode_mixed,
  mixed_inputs,
  mixed_row_bytes,
)
from jax_residency._src.quant.schemes import Quantization  # noqa: E402

NAMES = [t.name for t in GGML_TYPES]

#: Byte offsets of each type's float16 scale fields in a block (random bytes there
#: would often be inf or nan).
SCALE_FIELDS: dict[str, tuple[int, ...]] = {
  "Q8_0": (0,),
  "Q4_0": (0,),
  "Q4_1": (0, 2),
  "Q5_0": (0,),
  "Q5_1": (0, 2),
  "Q2_K": (80, 82),
  "Q3_K": (108,),
  "Q4_K": (0, 2),
  "Q5_K": (0, 2),
  "Q6_K": (208,),
  "IQ4_NL": (0,),
  "IQ4_XS": (0,),
}

#: The types gguf's Python package can quantize to.
QUANTIZABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_jit_decode = jax.jit(decode, static_argnums=1)


def random_rows(t: GgmlType, *shape: int, blocks: int, seed: int) -> np.ndarray:
  """Random raw rows of ``t`` (``(*shape, blocks * block_bytes)`` uint8), their
  float16 scales finite, of both signs, from 2**-20 (subnormal) to 2**4."""
  rng = np.random.default_rng(seed)
  raw = rng.integers(0, 256, (*shape, blocks, t.block_bytes), dtype=np.uint8)
  for offset in SCALE_FIELDS.get(t.name, ()):
    size = raw.shape[:-1]
    scale = rng.choice([-1.0, 1.0], size) * np.exp2(rng.uniform(-20, 4, size))
    raw[..., offset : offset + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
  return raw.reshape(*shape, blocks * t.block_bytes)


def assert_same_bits(got, want: np.ndarray) -> None:
  """``got`` and ``want`` are float32 arrays of one shape, equal bit for bit (nan
  only where the other has nan, whatever its payload)."""
  got = np.asarray(got)
  assert got.dtype == want.dtype == np.float32 and got.shape == want.shape
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


# --- the table ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_the_table_agrees_with_gguf(name):
  t = ggml_type(name)
  reference = GGMLQuantizationType[name]
  assert t.type_id == reference.value
  assert (t.block_size, t.block_bytes) == GGML_QUANT_SIZES[reference]
  assert ggml_type(t.type_id) is ggml_type(name.lower()) is ggml_type(reference) is t
  assert ggml_type(t) is t
  n = 4 * t.block_size
  assert row_bytes(t, n) == gguf.quants.quant_shape_to_byte_shape((n,), reference)[0]


# --- decoding -------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_random_blocks_decode_to_ggufs_bits_eagerly_and_under_jit(name):
  t = ggml_type(name)
  blocks = 2 if t.block_size == 256 else 5
  raw = random_rows(t, 2, 3, blocks=blocks, seed=t.type_id)  # 2 stacked layers of 3 rows
  with np.errstate(all="ignore"):  # F32/F16/BF16 bytes may be inf or nan
    want = gguf_dequantize(raw, GGMLQuantizationType[name])
  assert want.shape == (2, 3, blocks * t.block_size)
  assert_same_bits(decode(raw, t), want)
  assert_same_bits(_jit_decode(jnp.asarray(raw), name), want)
  assert_same_bits(decode(raw[1, 2], t), want[1, 2])  # one row, no leading axes


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_blocks_ggufs_quantizer_wrote_decode_to_ggufs_bits(name):
  reference = GGMLQuantizationType[name]
  rng = np.random.default_rng(7)
  x = (rng.standard_normal((2, 4, 256)) * np.exp2(rng.integers(-6, 6, (2, 4, 1)))).astype(
    np.float32
  )
  x[0, 0, :32] = 0.0  # an all-zero block
  raw = np.ascontiguousarray(gguf_quantize(x, reference)).view(np.uint8)  # F16: a float16 array
  assert raw.shape == (2, 4, row_bytes(name, 256))
  want = gguf_dequantize(raw, reference)
  assert_same_bits(decode(raw, name), want)
  assert_same_bits(_jit_decode(jnp.asarray(raw), name), want)
  if name == "F32":
    assert_same_bits(decode(raw, name), x)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_dtype_casts_the_float32_values(dtype):
  t = ggml_type("Q4_K")
  raw = random_rows(t, 3, blocks=1, seed=1)
  got = decode(raw, t, dtype=dtype)
  assert got.dtype == dtype
  np.testing.assert_array_equal(np.asarray(got), np.asarray(decode(raw, t).astype(dtype)))


def test_decoding_compiles_once_per_shape():
  traces = []
  step = jax.jit(lambda raw: (traces.append(1), decode(raw, "Q6_K"))[1])
  t = ggml_type("Q6_K")
  for seed in range(3):
    step(jnp.asarray(random_rows(t, 2, 1, blocks=1, seed=seed))).block_until_ready()
  assert len(traces) == 1


# --- mixed tensors --------------------------------------------------------------------

#: Mixes: llama.cpp's Q4_K_M and Q5_K_M pairs, a 32-value type beside a K-quant (its
#: fallback for rows that are not whole 256-value blocks), float types, three at once.
MIXES = [
  ("Q4_K", "Q6_K"),
  ("Q5_K", "Q6_K"),
  ("Q5_0", "Q6_K"),
  ("IQ4_NL", "IQ4_XS"),
  ("F32", "Q8_0"),
  ("BF16", "Q4_K", "Q4_1"),
]


def mixed_rows(types: tuple[str, ...], which: np.ndarray, n: int, seed: int):
  """A mixed tensor's raw rows (row ``r`` of type ``types[which[r]]``, padded, then
  its type byte) and gguf's values of each row's own blocks."""
  raw = np.zeros((*which.shape, mixed_row_bytes(types, n)), np.uint8)
  want = np.zeros((*which.shape, n), np.float32)
  for k, name in enumerate(types):
    t = ggml_type(name)
    rows = random_rows(t, *which.shape, blocks=n // t.block_size, seed=seed + k)
    with np.errstate(all="ignore"):  # F32/BF16 bytes may be inf or nan
      values = gguf_dequantize(rows, GGMLQuantizationType[name])
    mine = which == k
    raw[mine, : rows.shape[-1]] = rows[mine]
    raw[mine, -1] = k
    want[mine] = values[mine]
  return raw, want


@pytest.mark.parametrize("types", MIXES, ids="+".join)
def test_mixed_rows_decode_to_each_types_bits_whole_and_by_range(types):
  n = 512
  which = np.random.default_rng(3).integers(0, len(types), (2, 5))  # layers of rows
  which[0, :] = 0  # a layer of one type, as llama.cpp's files have
  which[1, : len(types)] = np.arange(len(types))  # and every type in one layer
  raw, want = mixed_rows(types, which, n, seed=len(types))
  assert mixed_inputs(types, raw.shape[-1]) == n
  assert_same_bits(decode_mixed(raw, types), want)
  jitted = jax.jit(decode_mixed, static_argnums=1, static_argnames=("start", "stop"))
  assert_same_bits(jitted(jnp.asarray(raw), types), want)
  assert_same_bits(decode_mixed(raw, types, start=256, stop=512), want[..., 256:])
  assert_same_bits(decode_mixed(raw[1, 2], types), want[1, 2])  # one row


def test_a_mixed_kernel_decodes_by_blocks_of_inputs_as_whole():
  """A kernel of more than `MATVEC_CHUNK` inputs is decoded a block of inputs at a time
  (each type from its own bytes of the block), to the same bits as at once."""
  types = ("Q4_K", "Q6_K")
  n_in, n_out = 3 * MATVEC_CHUNK, 4
  which = np.array([[0] * n_out, [1] * n_out])  # per layer, as a Q4_K_M ffn_down
  raw, want = mixed_rows(types, which, n_in, seed=9)
  enc = Encoding(Quantization.of({"scheme": "gguf"}), -2, "float32", "Q4_K+Q6_K", True)
  assert enc.ggml_types == types
  ((shape, _),) = enc.part_shapes((2, n_in, n_out))
  assert shape == raw.shape == (2, n_out, row_bytes("Q6_K", n_in) + 1)
  assert_same_bits(jax.jit(enc.decode)((jnp.asarray(raw),)), want.swapaxes(-1, -2))
  assert Encoding.from_dict(enc.to_dict()) == enc
  with pytest.raises(InvalidPolicyValueError, match="GGML type 'IQ2_XXS' is not supported"):
    Encoding.from_dict({**enc.to_dict(), "ggml_type": "Q4_K+IQ2_XXS"})


@pytest.mark.parametrize(
  ("call", "fragment"),
  [
    (lambda: decode_mixed(np.zeros((2, 35), np.uint8), ["Q8_0"]), "1 types"),
    (lambda: decode_mixed(np.zeros((2, 35), np.int8), ["Q8_0", "Q4_0"]), "raw int8"),
    (lambda: decode_mixed(np.zeros((2, 36), np.uint8), ["Q8_0", "Q4_0"]), "row_bytes=36"),
    (lambda: mixed_inputs(["Q4_K", "Q8_0"], 34), "row_bytes=34 is not the length of a row"),
    (
      lambda: decode_mixed(np.zeros((1, 273), np.uint8), ["Q6_K", "Q8_0"], start=32),
      "start=32, stop=256: a range of a Q6_K+Q8_0 row of 256 values",
    ),
    (lambda: mixed_row_bytes(["Q4_K", "Q8_0"], 96), "n=96: a row of Q4_K"),
  ],
)
def test_bad_mixed_rows_raise(call, fragment):
  with pytest.raises(InvalidPolicyValueError) as info:
    call()
  assert fragment in str(info.value)


# --- bad input ------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("value", "fragment"),
  [
    ("IQ2_XXS", "GGML type 'IQ2_XXS' is not supported"),
    (9, "GGML type 9 is not supported"),  # Q8_1
    (99, "GGML type 99 is not supported"),
    (True, "GGML type True is not supported"),
    (None, "GGML type None is not supported"),
  ],
)
def test_unknown_types_raise_a_typed_error_listing_the_supported_ones(value, fragment):
  with pytest.raises(InvalidPolicyValueError) as info:
    ggml_type(value)
  message = str(info.value)
  assert fragment in message
  assert all(f"{t.name} ({t.type_id})" in message for t in GGML_TYPES)
  with pytest.raises(InvalidPolicyValueError):
    decode(np.zeros((1, 34), np.uint8), value)


@pytest.mark.parametrize(
  ("name", "n", "fragment"),
  [
    ("Q4_K", 100, "n=100: a row of Q4_K is whole blocks of 256 values"),
    ("Q8_0", 48, "n=48: a row of Q8_0 is whole blocks of 32 values"),
    ("F16", 0, "n=0: a row of F16"),
    ("F32", -4, "n=-4"),
    ("Q4_0", 32.0, "n=32.0"),
  ],
)
def test_row_lengths_that_are_not_whole_blocks_raise(name, n, fragment):
  with pytest.raises(InvalidPolicyValueError) as info:
    row_bytes(name, n)
  assert fragment in str(info.value)


@pytest.mark.parametrize(
  ("raw", "name", "fragment"),
  [
    (np.zeros((2, 145), np.uint8), "Q4_K", "row_bytes=145 (raw shape (2, 145))"),
    (np.zeros((3, 35), np.uint8), "Q8_0", "not a multiple of Q8_0's 34 bytes per block"),
    (np.zeros((3, 6), np.uint8), "F32", "row_bytes=6"),
    (np.zeros((2, 34), np.int8), "Q8_0", "raw: int8 of shape (2, 34)"),
    (np.zeros((2, 4), np.float32), "F32", "raw: float32 of shape (2, 4)"),
    (np.uint8(0), "F16", "raw: uint8 of shape ()"),
  ],
)
def test_raw_that_is_not_uint8_blocks_raises(raw, name, fragment):
  with pytest.raises(InvalidPolicyValueError) as info:
    decode(raw, name)
  assert fragment in str(info.value)
