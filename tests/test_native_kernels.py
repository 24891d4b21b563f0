"""The native kernels for quantized matrices on CPU (quant/native.py, matvec.cc;
docs/quantization.md, "Reading codes once"): built here with the machine's compiler,
equal to the product of the decoded matrix to float32 rounding, called by a one-token
step for every unit matrix in place of XLA's fused decode (and, with int8 activations,
by passes of up to `native.MAX_ROWS` tokens), never by a longer prefill or a step on
several devices, and replaced by XLA's products where they cannot be built."""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from quantized_reference import dequantized_reference

import jax_residency as jr
from jax_residency._src.cache_dir import CACHE_DIR_ENV
from jax_residency._src.plan.quantized import plan_quantization
from jax_residency._src.plan.split import split_model
from jax_residency._src.quant import fused, ggml, ggml_mixed, native
from jax_residency._src.quant.encoding import Encoding
from jax_residency._src.quant.schemes import Quantization
from jax_residency.toy import ToyConfig, ToyTransformer

#: Small (the kernels' loops take any width the checks below allow), with one int4 group
#: of 64 inputs per row of the narrowest matrix.
CFG = ToyConfig(vocab=128, d_model=64, n_heads=4, d_ff=128, n_layers=2)
#: The unit matrices of the toy's layer (qkv, out, up, down) and its output head.
MATRICES = 4

#: The tests that build the kernels (the rest, of the paths without them, run anywhere).
needs_compiler = pytest.mark.skipif(
  native._compiler() is None, reason="no C++ compiler here to build the native kernels"
)


@pytest.fixture(scope="module")
def model() -> ToyTransformer:
  return ToyTransformer(CFG, rngs=nnx.Rngs(0))


@needs_compiler
def test_the_kernels_build_and_register_here():
  assert native.enabled() and native.available(), native.build_error()
  assert list(native.kernel_dir().glob("matvec-*.so"))


@needs_compiler
@pytest.mark.parametrize(
  "quant, shape",
  [
    ("int8", (64, 48)),
    ("int8", (4160, 96)),  # more inputs than a decoded block (encoding.MATVEC_CHUNK)
    ({"scheme": "int4", "group_size": 32}, (96, 64)),
    ({"scheme": "int4", "group_size": 64}, (4096, 34)),
    ({"scheme": "int4", "group_size": 128}, (256, 512)),
  ],
)
def test_a_kernel_is_the_product_of_the_decoded_matrix(quant, shape):
  """``x @ w`` for a kernel ``w`` (in, out) stored as rows: the kernel against float64
  products of the decoded matrix, within float32 rounding of the sum."""
  enc = Encoding(Quantization.of(quant), -2, "float32")
  rng = np.random.default_rng(0)
  parts = [jnp.asarray(p) for p in enc.encode(rng.standard_normal(shape).astype(np.float32))]
  w = np.asarray(jax.jit(enc.decode)(tuple(parts)), np.float64)
  x = jnp.asarray(rng.standard_normal(shape[0]), jnp.float32)
  assert native.supports(enc.quantization.scheme, parts, x)
  got = np.asarray(jax.jit(lambda x, p: native.matvec(enc.quantization.scheme, x, p))(x, parts))
  want = np.asarray(x, np.float64) @ w
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(w)  # the sum's magnitude, per output
  assert got.shape == want.shape
  assert np.all(np.abs(got - want) <= 1e-6 * scale), np.max(np.abs(got - want) / scale)


def test_shapes_the_kernels_do_not_take_are_refused():
  x = jnp.zeros(64, jnp.float32)
  int4 = Encoding(Quantization.of({"scheme": "int4", "group_size": 32}), -2, "float32")
  parts = [jnp.asarray(p) for p in int4.encode(np.ones((64, 8), np.float32))]
  assert native.supports("int4", parts, x)
  assert not native.supports("int4", parts, x.astype(jnp.bfloat16))  # a bfloat16 row
  assert not native.supports("int4", parts, jnp.zeros(32, jnp.float32))  # another width
  stacked = [p[None] for p in parts]  # a stack of units: one matrix at a time only
  assert not native.supports("int4", stacked, x)
  int8 = Encoding(Quantization.of("int8"), -2, "float32")
  parts = [jnp.asarray(p) for p in int8.encode(np.ones((40, 8), np.float32))]
  assert not native.supports("int8", parts, jnp.zeros(40, jnp.float32))  # 40 % 16 lanes


def ggml_rows(types: tuple[str, ...], rows: int, n: int, seed: int) -> np.ndarray:
  """Random rows of GGML blocks, row ``r`` of ``types[r % len(types)]`` (a mixed tensor's
  layout where there are several: padded rows, then the type byte): random codes with
  float16 scales finite, of both signs, down to subnormals; float types' rows hold
  normal values."""
  rng = np.random.default_rng(seed)
  width = ggml_mixed.mixed_row_bytes(types, n) if len(types) > 1 else ggml.row_bytes(types[0], n)
  raw = np.zeros((rows, width), np.uint8)
  scales = {"Q4_1": (0, 2), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2)}
  scales |= {"Q5_K": (0, 2), "Q6_K": (208,)}
  floats = {"F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16}
  for r in range(rows):
    k = r % len(types)
    t = ggml.ggml_type(types[k])
    if t.name in floats:
      blocks = rng.standard_normal(n).astype(floats[t.name]).view(np.uint8)
    else:
      blocks = rng.integers(0, 256, (n // t.block_size, t.block_bytes), dtype=np.uint8)
      for at in scales.get(t.name, (0,)):
        d = rng.choice([-1.0, 1.0], len(blocks)) * np.exp2(rng.uniform(-20, 2, len(blocks)))
        blocks[:, at : at + 2] = d.astype(np.float16)[:, None].view(np.uint8)
    raw[r, : blocks.size] = blocks.reshape(-1)
    raw[r, -1] = k if len(types) > 1 else raw[r, -1]
  return raw


@needs_compiler
@pytest.mark.parametrize(
  "types, shape",
  [
    *[((t,), (4352, 40)) for t in native.GGML_TYPES],  # over a decoded block of inputs
    (("Q4_K", "Q6_K"), (2048, 48)),  # llama.cpp's Q4_K_M mix
    (("Q4_0", "Q4_1", "Q8_0", "Q5_K"), (512, 64)),
    (("F16", "IQ4_XS", "Q5_0"), (512, 48)),
  ],
  ids=lambda v: "+".join(v) if isinstance(v[0], str) else "x".join(map(str, v)),
)
def test_a_ggml_kernel_is_the_product_of_the_decoded_matrix(types, shape):
  """The GGML kernel (``jr_ggml_matvec``) for a GGUF kernel (in, out) of each type it
  takes, and of mixed stacks (each row by its own type), against float64 products of
  the matrix `quant.ggml` decodes (the gguf package's bits), within float32 rounding."""
  n, rows = shape
  raw = jnp.asarray(ggml_rows(types, rows, n, seed=len(types)))
  enc = Encoding(Quantization.of({"scheme": "gguf"}), -2, "float32", "+".join(types), True)
  w = np.asarray(jax.jit(enc.decode)((raw,)), np.float64)
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal(n), jnp.float32)
  scheme = f"ggml:{enc.ggml_type}"
  assert native.supports(scheme, [raw], x)
  got = np.asarray(jax.jit(lambda x, p: native.matvec(scheme, x, p))(x, [raw]))
  want = np.asarray(x, np.float64) @ w
  scale = np.abs(np.asarray(x, np.float64)) @ np.abs(w)
  assert got.shape == want.shape == (rows,)
  assert np.all(np.abs(got - want) <= 1e-6 * scale), np.max(np.abs(got - want) / scale)


def test_ggml_rows_the_kernel_does_not_take_are_refused():
  x = jnp.zeros(256, jnp.float32)
  q4k = jnp.asarray(ggml_rows(("Q4_K",), 4, 256, seed=0))
  assert native.supports("ggml:Q4_K", [q4k], x)
  assert not native.supports("ggml:Q4_K", [q4k], jnp.zeros(512, jnp.float32))  # a width
  assert not native.supports("ggml:Q4_K", [q4k[None]], x)  # a stack of units
  assert not native.supports("ggml:Q6_K", [q4k], x)  # another type's rows
  f16 = jnp.zeros((4, ggml.row_bytes("F16", 40)), jnp.uint8)
  assert not native.supports("ggml:F16", [f16], jnp.zeros(40, jnp.float32))  # 40 % 16
  mixed = jnp.asarray(ggml_rows(("Q4_K", "Q6_K"), 4, 256, seed=0))
  assert native.supports("ggml:Q4_K+Q6_K", [mixed], x)
  assert not native.supports("ggml:Q4_K+Q6_K", [mixed[:, :-1]], x)  # no type byte


#: The parts of each scheme the integer kernels take: every quantized GGML type (blocks
#: of 32 or 256 inputs), int8, and int4 with groups of 32 and 128 inputs.
INTEGER_CASES = [
  *[(f"ggml:{t}", (512, 24)) for t in native.GGML_TYPES if t not in ("F32", "F16", "BF16")],
  ("ggml:Q4_K+Q6_K", (512, 24)),
  ("int8", (512, 24)),
  ("int4:32", (512, 24)),
  ("int4:128", (512, 24)),
]


def _integer_case(case: str, shape: tuple[int, int]) -> tuple[str, list[jax.Array], np.ndarray]:
  """A matrix of ``case`` as the kernels take it: (scheme, parts, decoded w (in, out))."""
  n, rows = shape
  if case.startswith("ggml:"):
    types = tuple(case.removeprefix("ggml:").split("+"))
    raw = jnp.asarray(ggml_rows(types, rows, n, seed=len(case)))
    enc = Encoding(Quantization.of({"scheme": "gguf"}), -2, "float32", "+".join(types), True)
    return case, [raw], np.asarray(jax.jit(enc.decode)((raw,)), np.float64)
  quant = "int8" if case == "int8" else {"scheme": "int4", "group_size": int(case[5:])}
  enc = Encoding(Quantization.of(quant), -2, "float32")
  rng = np.random.default_rng(len(case))
  parts = [jnp.asarray(p) for p in enc.encode(rng.standard_normal(shape).astype(np.float32))]
  return enc.quantization.scheme, parts, np.asarray(jax.jit(enc.decode)(tuple(parts)), np.float64)


def _products(scheme: str, x: jax.Array, parts: list[jax.Array]) -> tuple[np.ndarray, np.ndarray]:
  """The kernel's exact and integer products of ``x`` by the parts."""
  assert native.supports(scheme, parts, x) and native.rounds(scheme, parts, x)
  return tuple(
    np.asarray(jax.jit(lambda x, p, a=a: native.matvec(scheme, x, p, a))(x, parts))
    for a in native.ACTIVATIONS
  )


@needs_compiler
@pytest.mark.parametrize("case, shape", INTEGER_CASES)
def test_an_integer_kernel_is_exact_where_the_row_rounds_exactly(case, shape):
  """A row whose every block of 32 is a power of two times integers of at most 127 in
  size, one of them 127, rounds to itself: the integer product is then the product of
  the decoded matrix to float32 rounding, as the exact kernel is (a check of every
  type's layout and scales in the integer loops)."""
  scheme, parts, w = _integer_case(case, shape)
  rng = np.random.default_rng(2)
  k = rng.integers(-127, 128, (shape[0] // 32, 32))
  k[:, 0] = rng.choice([-127, 127], len(k))
  x = (k * np.exp2(rng.integers(-8, 4, (len(k), 1)))).reshape(-1).astype(np.float32)
  exact, rounded = _products(scheme, jnp.asarray(x), parts)
  want = x.astype(np.float64) @ w
  scale = np.abs(x.astype(np.float64)) @ np.abs(w)
  for got in (exact, rounded):
    assert np.all(np.abs(got - want) <= 1e-6 * scale), np.max(np.abs(got - want) / scale)


def _rounded(x: np.ndarray) -> np.ndarray:
  """``x`` rounded as the kernels round it: blocks of 32, ``dx = max |x| / 127``, each
  value to the nearest multiple of ``dx`` (ties to even), in float32."""
  blocks = x.reshape(-1, 32)
  amax = np.abs(blocks).max(1)
  dx, inv = amax / np.float32(127), np.float32(127) / amax
  return (np.clip(np.rint(blocks * inv[:, None]), -127, 127) * dx[:, None]).reshape(-1)


@needs_compiler
@pytest.mark.parametrize("case, shape", INTEGER_CASES)
def test_an_integer_kernel_is_the_product_of_the_rounded_row(case, shape):
  """For a row of normal values with outliers (one value in 37 twenty times larger, as a
  trained model's activations have): the integer product is the decoded matrix's
  product with the rounded row, to float32 rounding (offsets and minima times the
  rounded inputs' sums too: w . xr, whose error w . (x - xr) is at most
  sum_i |w[i]| * dx[i] / 2), and differs from the exact product (the row was rounded),
  which stays within float32 rounding; repeated calls give the same bits."""
  scheme, parts, w = _integer_case(case, shape)
  x = np.random.default_rng(3).standard_normal(shape[0]).astype(np.float32)
  x[::37] *= 20
  exact, rounded = _products(scheme, jnp.asarray(x), parts)
  xr = _rounded(x).astype(np.float64)
  want, scale = xr @ w, np.abs(xr) @ np.abs(w)
  assert np.all(np.abs(rounded - want) <= 1e-6 * scale), np.max(np.abs(rounded - want) / scale)
  x64 = x.astype(np.float64)
  assert np.max(np.abs(rounded - x64 @ w) / (np.abs(x64) @ np.abs(w))) > 1e-5
  assert np.all(np.abs(exact - x64 @ w) <= 1e-6 * (np.abs(x64) @ np.abs(w)))
  # The same bits on every call, whichever thread takes which rows.
  again = jax.jit(lambda x, p: native.matvec(scheme, x, p, "int8"))
  for _ in range(8):
    np.testing.assert_array_equal(again(jnp.asarray(x.copy()), parts), rounded)


@needs_compiler
@pytest.mark.parametrize("case, shape", INTEGER_CASES[-4:] + INTEGER_CASES[:2])
def test_several_rows_are_each_the_one_row_product(case, shape):
  """``x`` of ``(m, n)``, m up to `native.MAX_ROWS`: each row of the result is the one-row
  call's on that row, bit for bit, exact and rounded; more rows are refused."""
  scheme, parts, _ = _integer_case(case, shape)
  x = jnp.asarray(
    np.random.default_rng(1).standard_normal((native.MAX_ROWS, shape[0])), jnp.float32
  )
  assert native.supports(scheme, parts, x)
  assert not native.supports(scheme, parts, jnp.concatenate([x, x[:1]]))
  for a in native.ACTIVATIONS:
    call = jax.jit(lambda x, p, a=a: native.matvec(scheme, x, p, a))
    many = np.asarray(call(x, parts))
    assert many.shape == (native.MAX_ROWS, shape[1])
    for m in (0, 5, native.MAX_ROWS - 1):
      np.testing.assert_array_equal(many[m], np.asarray(call(x[m], parts)), err_msg=f"{a} {m}")


@needs_compiler
def test_rows_or_groups_that_do_not_round_keep_the_exact_product():
  """int8 rows of 48 inputs (a block of 32 would run past the row): the kernel takes
  them, and ``"int8"`` gives the exact product."""
  rng = np.random.default_rng(4)
  for quant, n in (("int8", 48),):
    enc = Encoding(Quantization.of(quant), -2, "float32")
    parts = [jnp.asarray(p) for p in enc.encode(rng.standard_normal((n, 8)).astype(np.float32))]
    x = jnp.asarray(rng.standard_normal(n), jnp.float32)
    scheme = enc.quantization.scheme
    assert native.supports(scheme, parts, x) and not native.rounds(scheme, parts, x)
    products = [
      jax.jit(lambda x, p, a=a, s=scheme: native.matvec(s, x, p, a))(x, parts)
      for a in native.ACTIVATIONS
    ]
    np.testing.assert_array_equal(*products)


def _custom_calls(hlo: str) -> list[str]:
  return re.findall(r'custom_call_target="(jax_residency_\w+)"', hlo)


@needs_compiler
@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.parametrize("policy", ["fully_resident", "dense"])
def test_a_one_token_step_calls_a_kernel_for_each_unit_matrix(model, scheme, policy, tmp_path):
  """The compiled one-token step calls the kernel for every unit matrix and reads no
  codes outside it (no fusion converts them); a prefill's step decodes and runs XLA's
  matmul; both equal the placement with the kernels off to float32 rounding, and on this
  fixture both policies' outputs are bit for bit the same."""
  token = jnp.zeros((1, 1), jnp.int32)
  prompt = jnp.arange(8, dtype=jnp.int32)[None] % CFG.vocab
  path = str(tmp_path / "store")
  jr.save(model, path, quantize=scheme)
  make = {
    "fully_resident": jr.FullyResident,
    "dense": lambda: jr.DenseDiskStream(host_budget_bytes=0),
  }[policy]
  codes = "s8" if scheme == "int8" else "u8"
  with jr.place(model, make(), store=path) as placed:
    one, many = placed(token), placed(prompt)
    if policy == "fully_resident":
      hlo = placed.lower(token).compile().as_text()
      calls = _custom_calls(hlo)
      assert calls.count(f"jax_residency_{scheme}_matvec") >= MATRICES, calls
      for line in hlo.splitlines():  # the codes go into the kernels, and nowhere else
        assert not re.search(rf"convert\({codes}\[", line), line
      assert not _custom_calls(placed.lower(prompt).compile().as_text())
  if policy != "fully_resident":
    with jr.place(model, jr.FullyResident(), store=path) as resident:
      assert np.array_equal(resident(token), one) and np.array_equal(resident(prompt), many)
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv(native.ENV, "0")
    with jr.place(model, make(), store=path) as xla:
      np.testing.assert_allclose(one, xla(token), rtol=1e-5, atol=1e-5)
      np.testing.assert_array_equal(many, xla(prompt))


@needs_compiler
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_int8_activations_round_passes_of_few_tokens_alone(model, scheme, tmp_path):
  """``place(..., activations="int8")``: the one-token step's kernels are told to round
  (their ``activations`` attribute is 1), its logits stay within 5e-2 of the exact
  placement's (relative to their largest; random weights, so a looser bound than the
  1e-2 that benchmarks/int8_activations.py holds a trained model to) and differ from
  them; a pass of 4 tokens (a speculative round) calls the kernels too and rounds; a
  pass of more than `native.MAX_ROWS` tokens (a prefill) is the exact placement's bit
  for bit; ``DenseDiskStream`` gives ``FullyResident``'s outputs."""
  token = jnp.zeros((1, 1), jnp.int32)
  prompt = jnp.arange(native.MAX_ROWS + 8, dtype=jnp.int32)[None] % CFG.vocab
  few = prompt[:, :4]
  path = str(tmp_path / "store")
  jr.save(model, path, quantize=scheme)
  with jr.place(model, jr.FullyResident(), store=path) as exact:
    want_one, want_many = np.asarray(exact(token)), np.asarray(exact(prompt))
    want_few = np.asarray(exact(few))
  with jr.place(model, jr.FullyResident(), store=path, activations="int8") as placed:
    one, many, got_few = np.asarray(placed(token)), np.asarray(placed(prompt)), placed(few)
    for call in (token, few):
      hlo = placed.lower(call).compile().as_text()
      rounding = re.findall(
        r'custom_call_target="jax_residency_\w+_matvec".*activations = (\d)', hlo
      )
      assert len(rounding) >= MATRICES and set(rounding) == {"1"}, rounding
    assert not _custom_calls(placed.lower(prompt).compile().as_text())
  for got, want in ((one, want_one), (got_few, want_few)):
    rel = np.max(np.abs(got - want)) / np.max(np.abs(want))
    assert 0 < rel <= 5e-2, rel
  np.testing.assert_array_equal(many, want_many)
  dense = jr.DenseDiskStream(host_budget_bytes=0)
  with jr.place(model, dense, store=path, activations="int8") as streamed:
    np.testing.assert_array_equal(streamed(token), one)


def test_int8_activations_are_refused_where_nothing_rounds(model):
  """Float weights (nothing is a quantized product), a value that is not an option, and a
  mesh of several devices (the kernels serve one CPU device): typed errors that name the
  value, the backend and the fix."""
  token = jnp.zeros((1, 1), jnp.int32)
  with pytest.raises(jr.errors.QuantizationError, match="holds float weights.*quantize="):
    jr.place(model, jr.FullyResident(), activations="int8")(token)
  with pytest.raises(jr.PlacementError, match="activations='fp8': pass one of 'exact', 'int8'"):
    jr.place(model, jr.FullyResident(), quantize="int8", activations="fp8")
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
  with pytest.raises(
    jr.PlacementError, match="2 device\\(s\\) on backend 'cpu'.*activations='exact'"
  ):
    jr.place(model, jr.FullyResident(), mesh=mesh, quantize="int8", activations="int8")


def test_a_step_on_several_devices_keeps_xla_products():
  """A custom call has no sharding rule: XLA would gather its operands on every device.
  A step on a mesh of several devices keeps XLA's products."""
  devices = jax.devices()
  assert len(devices) > 1
  assert fused.kernels_for(devices[:1]) == ("exact" if native.available() else None)
  assert fused.kernels_for(devices[:2]) is None


def _falls_back_to_xla(model: ToyTransformer) -> None:
  """With the kernels unavailable: a quantized placement's one-token and prompt outputs
  are the plain model's with the decoded weights (to 1e-5, as every quantized placement,
  docs/quantization.md), no step calls a kernel, and int8 activations asked for give
  XLA's exact products, the same outputs."""
  token = jnp.zeros((1, 1), jnp.int32)
  prompt = jnp.arange(8, dtype=jnp.int32)[None] % CFG.vocab
  plan = plan_quantization(split_model(model), "int8")
  for x in (token, prompt):
    want = np.asarray(dequantized_reference(model, plan, x))
    with jr.place(model, jr.FullyResident(), quantize="int8") as placed:
      assert not _custom_calls(placed.lower(x).compile().as_text())
      got = np.asarray(placed(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    with jr.place(model, jr.FullyResident(), quantize="int8", activations="int8") as placed:
      assert not _custom_calls(placed.lower(x).compile().as_text())
      np.testing.assert_array_equal(placed(x), got)


def test_without_a_compiler_products_stay_xla_s_and_say_so(model, monkeypatch, caplog):
  monkeypatch.setattr(native, "_state", {})
  monkeypatch.setattr(native, "_compiler", lambda: None)
  with caplog.at_level(logging.WARNING, logger="jax_residency"):
    assert not native.available()
  assert "no C++ compiler" in native.build_error()
  assert "native quantized kernels unavailable" in caplog.text
  _falls_back_to_xla(model)


def _broken_compiler(tmp_path: Path) -> Path:
  """A compiler that runs but fails on any source: a script that prints a version and
  exits 1 on anything else."""
  broken = tmp_path / "broken-c++"
  broken.write_text(
    '#!/bin/sh\nif [ "$1" = --version ]; then echo broken 1.0; exit 0; fi\n'
    'echo "error: this compiler is broken" >&2\nexit 1\n'
  )
  broken.chmod(0o755)
  return broken


def test_a_compiler_that_fails_to_build_leaves_xla_s_products(model, monkeypatch, caplog, tmp_path):
  """``$CXX`` names a compiler that fails on the source: one warning, carrying its exit
  status and error output; nothing left in the kernel directory; the products are
  XLA's, the decoded-weights model's outputs to float32 rounding."""
  kernels = tmp_path / "kernels"
  monkeypatch.setenv(native.KERNEL_DIR_ENV, str(kernels))
  monkeypatch.setattr(native, "_state", {})
  monkeypatch.setenv("CXX", str(_broken_compiler(tmp_path)))
  with caplog.at_level(logging.WARNING, logger="jax_residency"):
    assert not native.available()
    _falls_back_to_xla(model)
  assert "failed (1)" in native.build_error() and "this compiler is broken" in native.build_error()
  warned = [r for r in caplog.records if "native quantized kernels unavailable" in r.getMessage()]
  assert len(warned) == 1, caplog.text
  assert not list(kernels.iterdir())  # no library, no temporary file


@needs_compiler
def test_a_damaged_build_in_the_kernel_directory_is_built_again(monkeypatch, tmp_path):
  """(A file this process has loaded is never rewritten in place: a build replaces it.
  XLA takes one registration of a target per process: this test's is not passed on.)"""
  monkeypatch.setenv(native.KERNEL_DIR_ENV, str(tmp_path))
  monkeypatch.setattr(native, "_state", {})
  registered = []
  monkeypatch.setattr(jax.ffi, "register_ffi_target", lambda name, *a, **k: registered.append(name))
  path = native.library_path(native._compiler())
  path.write_bytes(b"not a shared library")
  assert native.available(), native.build_error()
  assert path.read_bytes()[:4] == b"\x7fELF"
  assert sorted(registered) == sorted(native.TARGETS.values())


def test_the_environment_variable_turns_them_off(monkeypatch):
  monkeypatch.setenv(native.ENV, "0")
  assert not native.enabled() and not native.available()
  assert not fused.kernels_for(jax.devices()[:1])


def _not_private(tmp_path: Path, how: str) -> Path:
  """A kernel or cache directory another user could plant a file in: mode 0777, or owned
  by another user (``nobody``; needs root to hand it over)."""
  path = tmp_path / f"shared-{how}"
  path.mkdir()
  if how == "mode 0777":
    path.chmod(0o777)
  else:
    if os.getuid() != 0:
      pytest.skip("handing a directory to another user needs root")
    os.chown(path, 65534, 65534)
  return path


@pytest.mark.parametrize("where", ["the kernel directory", "the cache directory above it"])
@pytest.mark.parametrize("how", ["mode 0777", "another user's"])
def test_a_kernel_directory_others_can_write_is_neither_built_into_nor_loaded_from(
  monkeypatch, tmp_path, caplog, how, where
):
  """A library planted there, or a kernel directory swapped for another through the cache
  directory above it, would run in this process: no build, no load, XLA's products,
  and a warning naming the directory and the fix (docs/quantization.md)."""
  shared = _not_private(tmp_path, how)
  if where == "the kernel directory":
    monkeypatch.setenv(native.KERNEL_DIR_ENV, str(shared))
  else:
    monkeypatch.delenv(native.KERNEL_DIR_ENV, raising=False)
    monkeypatch.setenv(CACHE_DIR_ENV, str(shared))
  monkeypatch.setattr(native, "_state", {})
  loaded = []
  monkeypatch.setattr(native.ctypes.cdll, "LoadLibrary", lambda p: loaded.append(p))
  with caplog.at_level(logging.WARNING, logger="jax_residency"):
    assert not native.available()
  assert loaded == [] and list(shared.iterdir()) == []
  why = native.build_error()
  assert str(shared) in why and "chmod 700" in why and native.KERNEL_DIR_ENV in why
  assert ("mode 0o777" in why) if how == "mode 0777" else ("owned by user id 65534" in why)
  assert len(caplog.records) == 1 and str(shared) in caplog.text


@pytest.mark.parametrize("how", ["mode 0777", "another user's"])
def test_a_kernel_library_others_can_write_is_not_loaded(monkeypatch, tmp_path, caplog, how):
  """A library file in a private kernel directory, but of another user or writable by
  others (left from when the directory was shared, say): not loaded, XLA's products, and
  a warning naming the file and the fix."""
  kernels = tmp_path / "kernels"
  kernels.mkdir(mode=0o700)
  monkeypatch.setenv(native.KERNEL_DIR_ENV, str(kernels))
  monkeypatch.setattr(native, "_state", {})
  monkeypatch.setenv("CXX", str(_broken_compiler(tmp_path)))
  planted = native.library_path(native._compiler())
  planted.write_bytes(b"\x7fELF planted")
  if how == "mode 0777":
    planted.chmod(0o666)
  elif os.getuid() != 0:
    pytest.skip("handing a file to another user needs root")
  else:
    os.chown(planted, 65534, 65534)
  loaded = []
  monkeypatch.setattr(native.ctypes.cdll, "LoadLibrary", lambda p: loaded.append(p))
  with caplog.at_level(logging.WARNING, logger="jax_residency"):
    assert not native.available()
  assert loaded == []
  why = native.build_error()
  assert str(planted) in why and "remove it" in why and native.KERNEL_DIR_ENV in why
  assert ("mode 0o666" in why) if how == "mode 0777" else ("owned by user id 65534" in why)
  assert len(caplog.records) == 1 and str(planted) in caplog.text
