"""The programs a quantized store runs (docs/quantization.md, "Reading codes once"): on
CPU with XLA's own products (the native kernels off; tests/test_native_kernels.py checks the
programs that call them), a one-token step decodes each unit matrix inside the fusion of the
matmul that uses it, so the codes are read once and no float copy of the unit is written;
lowered for ``cuda`` (no GPU needed), the layer loop moves int8/uint8 codes to the device and
the decode (convert, scale, transpose) feeds the matmul directly."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer

#: Big enough that XLA emits the matmuls it would for a real model's decode step.
CFG = ToyConfig(vocab=256, d_model=256, n_heads=4, d_ff=512, n_layers=2)
#: The unit matrices of the toy's layer: qkv, out, up, down.
MATRICES = 4


@pytest.fixture(scope="module")
def model() -> ToyTransformer:
  return ToyTransformer(CFG, rngs=nnx.Rngs(0))


@pytest.fixture
def xla_products(monkeypatch):
  """XLA's own products: the native one-row kernels off (`quant.native`), as where no
  compiler builds them, and as every accelerator's program is (tests/test_native_kernels.py
  checks the CPU programs that call them)."""
  monkeypatch.setenv("JAX_RESIDENCY_NATIVE_KERNELS", "0")


def _computations(hlo: str) -> dict[str, str]:
  """Each computation of compiled HLO text, by name."""
  out = {}
  for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) \(.*?\{\n(.*?)\n\}", hlo, re.M | re.S):
    out[m.group(1)] = m.group(2)
  return out


def _codes_and_matmuls(body: str) -> tuple[int, int]:
  """In one function's body: int8 tensors placed on the device, and matmuls whose weight
  is transpose(multiply(convert(such placed codes), scale))."""
  defs = {}
  for line in body.splitlines():
    m = re.match(r"\s*(%[\w#]+) = stablehlo\.(\w+) ([^:{]*)", line)
    if m:
      defs[m.group(1)] = (m.group(2), re.findall(r"%[\w#]+", m.group(3)), line)
  moved = {
    v
    for v, (op, _, line) in defs.items()
    if op == "custom_call" and "annotate_device_placement" in line and "xi8>) ->" in line
  }

  def decoded_from_codes(v: str) -> bool:
    for op in ("transpose", "multiply", "convert"):
      if v not in defs or defs[v][0] != op:
        return False
      v = defs[v][1][0]
    return v in moved

  matmuls = [args for op, args, _ in defs.values() if op == "dot_general"]
  return len(moved), sum(1 for args in matmuls if decoded_from_codes(args[1]))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_one_token_cpu_step_decodes_inside_each_matmul_fusion(model, scheme, xla_products):
  token = jnp.zeros((1, 1), jnp.int32)
  with jr.place(model, jr.FullyResident(), quantize=scheme) as placed:
    hlo = placed.lower(token).compile().as_text()
  codes = "s8" if scheme == "int8" else "u8"
  stacked = re.compile(rf"= {codes}\[{CFG.n_layers},\d+,\d+\]\S* parameter\(")  # unit codes
  fused_dots = []
  for name, body in _computations(hlo).items():
    if name.startswith(("wide.", "region_")) or "fused" not in name and "wrapped" not in name:
      continue  # loop bodies and conditions pass the stacks through; fusions compute
    takes_codes = any(stacked.search(line) for line in body.splitlines())
    if not takes_codes:
      continue
    # Whatever reads a unit's codes is a matmul's fusion: the decode (convert, scale,
    # transpose) and the product in one loop; no fusion writes the decoded floats out.
    assert " dot(" in body, f"{name} reads {codes} codes but holds no matmul:\n{body}"
    assert " convert(" in body and " multiply(" in body, name
    fused_dots.append(name)
  assert len(fused_dots) == MATRICES


def test_lowered_for_cuda_the_loop_moves_codes_and_decodes_beside_the_matmul(
  model, mlir, xla_products
):
  token = jnp.zeros((1, 1), jnp.int32)
  with jr.place(model, jr.LayerwiseHost(prefetch_depth=1), quantize="int8") as placed:
    text = placed.lower(token, platforms=("cuda",)).as_text()
  module = mlir(text)
  _, loops = module.split_loops(module.funcs["main"])
  assert len(loops) == 1  # the layer loop; its step is a function it calls
  moved, beside = 0, 0
  for name, body in module.funcs.items():
    if name != "main":
      found = _codes_and_matmuls(body)
      moved, beside = moved + found[0], beside + found[1]
  assert moved == MATRICES  # each unit matrix crosses to the device as int8 codes
  assert beside == MATRICES  # and is decoded right beside the matmul that uses it
  assert jax.devices()[0].platform == "cpu"  # lowered, not run: no GPU needed


class WideBlock(nnx.Module):
  """A block whose second matmul takes 4160 inputs: over the 2048-input blocks a kernel
  is decoded in, and over the 16 KiB activation vector XLA fuses a decode into."""

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.up = nnx.Linear(64, 4160, rngs=rngs)
    self.down = nnx.Linear(4160, 64, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return h + self.down(jnp.tanh(self.up(h)))


class Wide(nnx.Module):
  def __init__(self, rngs: nnx.Rngs) -> None:
    self.layers = nnx.vmap(lambda k: WideBlock(nnx.Rngs(k)))(jax.random.split(rngs.params(), 2))

  def __call__(self, x: jax.Array) -> jax.Array:
    return jr.scan_units(lambda h, block: block(h), x, self.layers)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_wide_kernel_is_multiplied_block_by_block_each_block_fused(scheme, xla_products):
  from jax_residency._src.plan.quantized import plan_quantization
  from jax_residency._src.plan.split import split_model

  model = Wide(nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (1, 64))
  with jr.place(model, jr.FullyResident(), quantize=scheme) as placed:
    hlo = placed.lower(x).compile().as_text()
    out = placed(x)
  codes = "s8" if scheme == "int8" else "u8"
  down = re.compile(rf"= {codes}\[2,(64|32),4160\]\S* parameter\(")  # (layer, out, in)
  fused = [
    body
    for name, body in _computations(hlo).items()
    if ("fused" in name or "wrapped" in name) and down.search(body)
  ]
  # Blocks of 2048, 2048 and 64 inputs: each a product fused with its own decode.
  assert len(fused) == 3 and all(" dot(" in body for body in fused)
  # The same values as the plain model holding the decoded weights.
  split = split_model(model, units="layers")
  tensors = plan_quantization(split, scheme).by_path()
  values = []
  for leaf, value in zip(split.leaves, split.values, strict=True):
    t = tensors.get(leaf.path)
    if t is not None:
      value = jax.jit(t.encoding.decode)(tuple(map(jnp.asarray, t.encoding.encode(value))))
    values.append(value)
  plain = split.bind_stacks(values, ()).call
  np.testing.assert_allclose(out, nnx.jit(lambda m, x: m(x))(plain, x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_a_prefill_decodes_one_matrix_at_a_time_and_a_wide_one_in_slices(scheme, monkeypatch):
  """quant/fused.py, _rows_product: a product of several rows decodes its matrix inside a
  conditional, so a step holds one decoded matrix at a time; a matrix over
  ROWS_CHUNK_BYTES as floats is decoded and multiplied in slices of its outputs."""
  from jax_residency._src.quant import fused
  from jax_residency._src.quant.encoding import Encoding, QuantizedTensor, decode_tree
  from jax_residency._src.quant.schemes import Quantization

  rng = np.random.default_rng(0)
  quant = {"scheme": "int4", "group_size": 32} if scheme == "int4" else "int8"
  enc = Encoding(Quantization.of(quant), -2, "float32")
  ws = [rng.standard_normal((256, 1024)).astype(np.float32) for _ in range(3)]
  ts = [QuantizedTensor(tuple(map(jnp.asarray, enc.encode(w))), enc) for w in ws]
  x = jnp.asarray(rng.standard_normal((16, 256)), jnp.float32)
  decoded = 256 * 1024 * 4  # one matrix as floats

  def step(ts: list[QuantizedTensor], x: jax.Array) -> jax.Array:
    return sum(x @ w for w in decode_tree(ts))

  want = sum(x @ jax.jit(enc.decode)(t.parts) for t in ts)

  def temp_and_value() -> tuple[int, jax.Array]:
    run = jax.jit(lambda ts, x: fused.fenced(step, ts, x))
    compiled = run.lower(ts, x).compile()
    return compiled.memory_analysis().temp_size_in_bytes, compiled(ts, x)

  temp, out = temp_and_value()
  assert decoded <= temp < 2 * decoded  # one decoded matrix at a time, not three
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)
  monkeypatch.setattr(fused, "ROWS_CHUNK_BYTES", decoded // 4)
  temp, out = temp_and_value()
  assert temp < decoded  # slices of a quarter of the outputs
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("types", [("Q4_K",), ("Q8_0",), ("Q4_K", "Q6_K")], ids="+".join)
def test_a_wide_ggml_kernel_is_multiplied_block_by_block_each_block_fused(types):
  """A GGUF tensor's decode (`quant.ggml`, one type or a mixed stack's several) is
  followed like an int8 one: a one-token product over 4352 inputs is three products
  (2048, 2048 and 256 inputs), each fused with its block's decode, and no float copy of
  the matrix is written."""
  from jax_residency._src.quant import fused, ggml
  from jax_residency._src.quant.encoding import Encoding, QuantizedTensor, decode_tree
  from jax_residency._src.quant.schemes import Quantization

  n_in, n_out = 4352, 64
  rng = np.random.default_rng(0)
  raw = np.zeros((n_out, max(ggml.row_bytes(t, n_in) for t in types) + (len(types) > 1)), np.uint8)
  for r in range(n_out):  # each row one type's random blocks, a finite float16 scale
    k = r % len(types)
    t = ggml.ggml_type(types[k])
    blocks = rng.integers(0, 256, (n_in // t.block_size, t.block_bytes), dtype=np.uint8)
    for at in {"Q6_K": (208,), "Q4_K": (0, 2)}.get(t.name, (0,)):  # d (and dmin)
      blocks[:, at : at + 2] = np.full((len(blocks), 1), 0.01, np.float16).view(np.uint8)
    raw[r, : ggml.row_bytes(t, n_in)] = blocks.reshape(-1)
    raw[r, -1] = k if len(types) > 1 else raw[r, -1]
  enc = Encoding(Quantization.of({"scheme": "gguf"}), -2, "float32", "+".join(types), True)
  t = QuantizedTensor((jnp.asarray(raw),), enc)
  x = jnp.asarray(rng.standard_normal((1, n_in)), jnp.float32)
  run = jax.jit(lambda t, x: fused.fenced(lambda t, x: x @ decode_tree(t), t, x))
  compiled = run.lower(t, x).compile()
  assert compiled.memory_analysis().temp_size_in_bytes < 4 * 256 * n_out  # not one block
  codes = re.compile(rf"= u8\[{n_out},{raw.shape[1]}\]\S* parameter\(")
  fused_bodies = [
    body
    for name, body in _computations(compiled.as_text()).items()
    if ("fused" in name or "wrapped" in name) and codes.search(body)
  ]
  assert len(fused_bodies) == 3 and all(" dot(" in body for body in fused_bodies)
  w = jax.jit(enc.decode)(t.parts)
  scale = np.abs(np.asarray(x)) @ np.abs(np.asarray(w))  # the sum's size, term by term
  assert (np.abs(np.asarray(compiled(t, x) - x @ w)) <= 1e-5 * scale).all()  # rounding
