"""Quantization schemes (docs/design.md, "Layers": ``quant/``): what a code decodes to,
how far that is from the float it encodes, the bytes at rest, and bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_residency._src.errors import (
  InvalidPolicyValueError,
  QuantizationError,
  UnknownPolicyFieldError,
)
from jax_residency._src.quant.schemes import (
  INT4_MAX,
  INT8_MAX,
  Quantization,
  dequantize,
  quantize,
)

INT8 = Quantization(scheme="int8")
INT4 = Quantization(scheme="int4")


def weights(*shape: int, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


# --- the option -----------------------------------------------------------------------


def test_int4_defaults_to_groups_of_64_and_round_trips_through_its_dict():
  assert INT4.group_size == 64
  for q in (INT8, INT4, Quantization(scheme="int4", group_size=128)):
    assert Quantization.of(q.to_dict()) == q
    assert Quantization.of(q) is q
  assert Quantization.of("int8") == INT8
  assert hash(INT4) == hash(Quantization.of({"scheme": "int4", "group_size": 64}))


@pytest.mark.parametrize(
  ("value", "error", "fragment"),
  [
    ("int3", InvalidPolicyValueError, "'int3' is not a quantization scheme"),
    ({"scheme": "int8", "group_size": 64}, InvalidPolicyValueError, "int8 has one scale"),
    ({"scheme": "int4", "group_size": 48}, InvalidPolicyValueError, "group_size=48"),
    ({"scheme": "int4", "group_size": True}, InvalidPolicyValueError, "group_size=True"),
    ({"scheme": "int4", "groups": 64}, UnknownPolicyFieldError, "unknown fields ['groups']"),
    ({"group_size": 64}, InvalidPolicyValueError, "names no 'scheme'"),
    (8, InvalidPolicyValueError, "quantize=8 is not a quantization"),
  ],
)
def test_bad_options_raise_typed_errors_that_name_the_value(value, error, fragment):
  with pytest.raises(error) as info:
    Quantization.of(value)
  assert fragment in str(info.value)


# --- encoding and decoding ------------------------------------------------------------


@pytest.mark.parametrize("q", [INT8, INT4, Quantization(scheme="int4", group_size=32)])
def test_each_value_decodes_within_half_a_step_of_the_float(q):
  w = weights(256, 96)
  t = quantize(w, q, axis=0, name="w")
  got = np.asarray(dequantize(t, q, axis=0))
  assert got.shape == w.shape and got.dtype == np.float32
  # Half a quantization step, per value: the scale of its channel (int8) or group (int4).
  # The parts are rows along the input axis: (out, in) for this (in, out) kernel.
  step = (
    np.broadcast_to(t.scale.T, w.shape)
    if q.scheme == "int8"
    else np.repeat(t.scale.T, 64 if q.group_size == 64 else 32, axis=0)
  )
  assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-6) + 1e-7)


def test_int8_codes_are_symmetric_with_one_scale_per_output_channel():
  w = weights(64, 10)
  t = quantize(w, INT8, axis=0)
  # Rows along the input axis: one row of codes per output channel, (out, in).
  assert t.codes.dtype == np.int8 and t.codes.shape == (10, 64) and t.offset is None
  assert t.scale.shape == (10, 1) and t.scale.dtype == np.float32
  assert np.all(np.abs(t.codes).max(axis=1) == INT8_MAX)  # each channel's largest: the last code
  # A channel's largest magnitude / 127, rounded to 17 significant bits (see the next test).
  np.testing.assert_allclose(t.scale[:, 0], np.abs(w).max(axis=0) / INT8_MAX, rtol=2.0**-17, atol=0)


@pytest.mark.parametrize(("scheme", "code_bits"), [("int8", 7), ("int4", 4)])
def test_scales_make_every_code_times_scale_exact_in_float32(scheme, code_bits):
  # So `c * scale + offset` rounds once whether or not XLA fuses it into a multiply-add:
  # every program that decodes a tensor (a jitted step, an eager reference) gets its bits.
  t = quantize(weights(128, 16, seed=3), Quantization.of(scheme), axis=0)
  mantissa = t.scale.view(np.uint32) & np.uint32((1 << 23) - 1)
  assert not np.any(mantissa & np.uint32((1 << code_bits) - 1))
  codes = np.arange(-127, 128) if scheme == "int8" else np.arange(16)
  products = codes[:, None].astype(np.float64) * t.scale.reshape(1, -1).astype(np.float64)
  np.testing.assert_array_equal(products.astype(np.float32).astype(np.float64), products)


def test_int4_packs_two_output_channels_a_byte_in_groups_along_the_input_axis():
  w = weights(128, 6)
  t = quantize(w, INT4, axis=0)
  # Rows along the input axis, (out, in) = (6, 128); row r in the low nibbles, r + 3 high.
  assert t.codes.dtype == np.uint8 and t.codes.shape == (3, 128)
  assert t.scale.shape == t.offset.shape == (6, 2)  # 128 / 64 groups per output channel
  groups = w.T.reshape(6, 2, 64)
  np.testing.assert_array_equal(t.offset, groups.min(axis=2))  # a group's minimum, exactly
  codes = np.concatenate([t.codes & 0xF, t.codes >> 4])  # (6, 128)
  assert codes.max() <= INT4_MAX
  decoded = codes.reshape(6, 2, 64) * t.scale[..., None] + t.offset[..., None]
  np.testing.assert_allclose(decoded.reshape(6, 128).T, w, atol=t.scale.max() / 2 * 1.001)
  got = np.asarray(dequantize(t, INT4, axis=0)).T.reshape(6, 2, 64)
  np.testing.assert_array_equal(got.min(axis=2), groups.min(axis=2))  # code 0 is exact


def test_int4_needs_an_even_number_of_output_channels():
  with pytest.raises(QuantizationError, match="odd number") as info:
    quantize(weights(64, 7), INT4, axis=0, name="layers.proj.kernel")
  assert "layers.proj.kernel" in str(info.value) and "use int8" in str(info.value)


def test_zero_channels_and_constant_groups_decode_exactly():
  w = np.zeros((64, 4), np.float32)
  w[:, 1] = 3.5
  for q in (INT8, INT4):
    got = np.asarray(dequantize(quantize(w, q, axis=0), q, axis=0))
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got[:, 0], 0.0)
  np.testing.assert_array_equal(np.asarray(dequantize(quantize(w, INT4, axis=0), INT4, axis=0)), w)


@pytest.mark.parametrize("q", [INT8, INT4])
def test_a_stack_of_layers_is_each_layer_quantized_on_its_own(q):
  w = weights(3, 128, 8)  # (layer, in, out): the input axis is -2
  stacked = quantize(w, q, axis=-2)
  for i in range(3):
    alone = quantize(w[i], q, axis=0)
    for a, b in zip(stacked, alone, strict=True):
      if a is not None:
        np.testing.assert_array_equal(a[i], b)
  np.testing.assert_array_equal(
    np.asarray(dequantize(stacked, q, axis=-2))[1],
    np.asarray(dequantize(quantize(w[1], q, axis=0), q, axis=0)),
  )


@pytest.mark.parametrize("q", [INT8, INT4])
def test_an_embedding_table_is_quantized_along_its_rows(q):
  table = weights(10, 64)  # (vocab, d): a row is looked up whole, so it is one channel
  t = quantize(table, q, axis=1)
  got = np.asarray(dequantize(t, q, axis=1))
  assert got.shape == table.shape
  assert np.abs(got - table).max() < np.abs(table).max() / 4


@pytest.mark.parametrize("q", [INT8, INT4])
def test_decoding_under_jit_agrees_with_decoding_eagerly_and_takes_the_output_dtype(q):
  t = quantize(weights(64, 16), q, axis=0)
  eager = np.asarray(dequantize(t, q, axis=0))
  jitted = np.asarray(jax.jit(lambda t: dequantize(t, q, axis=0))(jax.tree.map(jnp.asarray, t)))
  if q.scheme == "int8":  # one multiply: the same float either way
    np.testing.assert_array_equal(eager, jitted)
  else:  # code * scale + offset: XLA may fuse it into one FMA in a jitted program
    np.testing.assert_allclose(jitted, eager, rtol=0, atol=np.spacing(np.abs(eager)).max())
  assert dequantize(t, q, axis=0, dtype=jnp.bfloat16).dtype == jnp.bfloat16


@pytest.mark.parametrize("q", [INT8, INT4])
def test_bfloat16_weights_encode_as_their_float32_values(q):
  w = weights(64, 8).astype(ml_dtypes.bfloat16)
  a = quantize(w, q, axis=0)
  b = quantize(w.astype(np.float32), q, axis=0)
  for x, y in zip(a, b, strict=True):
    if x is not None:
      np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("q", [INT8, INT4, Quantization(scheme="int4", group_size=128)])
def test_stored_bytes_are_the_bytes_of_the_encoded_arrays(q):
  for shape, axis in [((256, 48), 0), ((4, 128, 24), -2), ((12, 128), 1)]:
    t = quantize(weights(*shape), q, axis=axis)
    actual = sum(np.asarray(a).nbytes for a in t if a is not None)
    assert q.stored_nbytes(shape, axis) == actual
  # float32 -> int8 is a quarter of the bytes, plus one scale a column; int4 an eighth.
  assert INT8.stored_nbytes((4096, 4096), 0) == 4096 * 4096 + 4 * 4096
  assert INT4.stored_nbytes((4096, 4096), 0) == 4096 * 4096 // 2 + 8 * 64 * 4096


#: Stacks (layers, input, output) the property runs on: a few shapes, so that decoding
#: compiles a few programs while the values, scales and schemes vary.
SHAPES = [(1, 32, 2), (2, 64, 4), (3, 128, 6)]  # int4: an even number of outputs


@settings(max_examples=20, deadline=None)
@given(
  shape=st.sampled_from(SHAPES),
  scale=st.floats(1e-3, 1e3),
  scheme=st.sampled_from(["int8", "int4"]),
  seed=st.integers(0, 2**16),
)
def test_any_stack_decodes_within_its_scheme_error_bound(shape, scale, scheme, seed):
  layers, n, out = shape
  q = Quantization(scheme=scheme, group_size=32 if scheme == "int4" else None)
  w = weights(*shape, seed=seed) * np.float32(scale)
  got = np.asarray(dequantize(quantize(w, q, axis=1), q, axis=1))
  if scheme == "int8":  # symmetric: the step is a channel's largest magnitude / 127
    step = np.abs(w).max(axis=1, keepdims=True) / INT8_MAX
  else:  # asymmetric: the step is a group's range / 15
    groups = w.reshape(layers, n // 32, 32, out)
    step = np.repeat((groups.max(axis=2) - groups.min(axis=2)) / INT4_MAX, 32, axis=1)
  assert np.all(np.abs(got - w) <= step / 2 * (1 + 1e-5) + 1e-7 * scale)


# --- bad input ------------------------------------------------------------------------


def test_a_group_size_that_does_not_divide_the_input_dimension_names_the_tensor():
  with pytest.raises(QuantizationError) as info:
    quantize(weights(96, 8), INT4, axis=0, name="layers.mlp.kernel")
  message = str(info.value)
  assert "layers.mlp.kernel" in message and "group_size=64" in message and "96" in message


@pytest.mark.parametrize(
  ("w", "fragment"),
  [(np.ones((4, 4), np.int32), "is not floating"), (np.ones((64,), np.float32), "no input axis")],
)
def test_only_floating_matrices_are_quantized(w, fragment):
  with pytest.raises(QuantizationError, match=fragment) as info:
    quantize(w, INT8, axis=0, name="embed.bias")
  assert "embed.bias" in str(info.value)
