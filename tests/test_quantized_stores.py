"""Quantized stores under every policy (docs/design.md, section 2.4): a placed quantized
model equals the plain model whose weights are the dequantized values to 1e-5 relative
(each decode is fused into its product), on one device and on meshes, and policies that
run the same program give the same bits; budgets, bytes moved and reads count quantized bytes; the
float copy of a unit is a planned step temporary; bad input gets a typed error and
leaves nothing written."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from policies import dense
from quantized_reference import dequantized_reference

import jax_residency as jr
from jax_residency._src.quant import native
from jax_residency._src.quant.encoding import MIN_QUANTIZED_DIM
from jax_residency._src.store.discovery import FORMAT_VERSION, SIDECAR_KEY
from jax_residency.testing import serve_store

#: The suite's toy has d_model 32: int4 groups of 32 divide every input dimension.
SCHEMES = {"int8": "int8", "int4": {"scheme": "int4", "group_size": 32}}
POLICIES: dict[str, Callable[[], jr.LayerWeightResidency]] = {
  "fully_resident": jr.FullyResident,
  "layerwise_k1": lambda: jr.LayerwiseHost(prefetch_depth=1),
  "layerwise_k2": lambda: jr.LayerwiseHost(prefetch_depth=2),
  "dense_direct": lambda: dense(0, device=None),
  "dense_cached": lambda: dense(None, device=None),
}
VARIANTS = ("nnx", "linen", "nnx_sharded_data2_model4", "linen_sharded_model8")


@pytest.fixture(scope="module")
def case(request: pytest.FixtureRequest, tokens: jax.Array) -> Callable[[str], dict[str, Any]]:
  cache: dict[str, dict[str, Any]] = {}

  def build(variant: str) -> dict[str, Any]:
    fx = request.getfixturevalue
    if variant == "nnx":
      return dict(model=fx("nnx_toy"), kwargs={})
    if variant == "nnx_sharded_data2_model4":
      return dict(model=fx("nnx_toy_sharded"), kwargs=dict(mesh=fx("mesh_2x4")))
    model, variables = fx("linen_toy" if variant == "linen" else "linen_sharded_toy")
    mesh = fx("mesh_8") if variant == "linen_sharded_model8" else None
    if mesh is not None:
      variables = jax.device_put(variables, nn.get_sharding(variables, mesh))
    return dict(model=model, kwargs=dict(params=variables, mesh=mesh))

  def get(variant: str) -> dict[str, Any]:
    if variant not in cache:
      cache[variant] = build(variant)
    return cache[variant]

  return get


@pytest.fixture(scope="module")
def stores(tmp_path_factory, case) -> Callable[[str, str], tuple[str, Any]]:
  """``stores(variant, scheme)``: a quantized store of the variant's model, and its info."""
  cache: dict[tuple[str, str], tuple[str, Any]] = {}

  def get(variant: str, scheme: str) -> tuple[str, Any]:
    if (variant, scheme) not in cache:
      c = case(variant)
      path = str(tmp_path_factory.mktemp("quantized") / f"{variant}-{scheme}")
      info = jr.save(
        c["model"], path, params=c["kwargs"].get("params"), progress=False, quantize=SCHEMES[scheme]
      )
      cache[variant, scheme] = path, info
    return cache[variant, scheme]

  return get


@pytest.fixture(scope="module")
def reference(case, stores, tokens) -> Callable[[str, str, bool], jax.Array]:
  """``reference(variant, scheme, jit)``: the dequantized plain model's output."""
  cache: dict[tuple[str, str, bool], jax.Array] = {}

  def get(variant: str, scheme: str, jit: bool) -> jax.Array:
    if (variant, scheme, jit) not in cache:
      c = case(variant)
      _, info = stores(variant, scheme)
      mesh = c["kwargs"].get("mesh")
      with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
        cache[variant, scheme, jit] = dequantized_reference(
          c["model"], info.quantization, tokens, jit=jit, **c["kwargs"]
        )
    return cache[variant, scheme, jit]

  return get


@pytest.fixture(scope="module")
def placed_output(case, stores, tokens) -> Callable[[str, str, str], jax.Array]:
  """``placed_output(variant, policy, scheme)``: the placed quantized store's output."""
  cache: dict[tuple[str, str, str], jax.Array] = {}

  def get(variant: str, policy: str, scheme: str) -> jax.Array:
    if (variant, policy, scheme) not in cache:
      c = case(variant)
      path, _ = stores(variant, scheme)
      with jr.place(c["model"], POLICIES[policy](), store=path, **c["kwargs"]) as placed:
        cache[variant, policy, scheme] = placed(tokens)
    return cache[variant, policy, scheme]

  return get


def _cases() -> list[Any]:
  """(variant, policy, scheme): every policy and scheme on one device and, for int8, on
  the meshes; int4 on the meshes with one jitted policy and the dense stream (the
  sharding of int4's parts is int8's; the suite's time goes where the code differs)."""
  return [
    pytest.param(v, p, s, id=f"{v}-{p}-{s}")
    for v in VARIANTS
    for p in POLICIES
    for s in SCHEMES
    if s == "int8" or v in ("nnx", "linen") or p in ("fully_resident", "dense_direct")
  ]


@pytest.mark.parametrize(("variant", "policy", "scheme"), _cases())
def test_placed_quantized_store_is_the_dequantized_plain_model(
  reference, placed_output, variant, policy, scheme
):
  """To float32 rounding. Not bit for bit: the step decodes a tensor inside the op that
  uses it, and XLA fuses the two (docs/quantization.md, "Reading codes once"), so the
  product sums in the fused loop's order, not the plain model's matmul's."""
  out = placed_output(variant, policy, scheme)
  np.testing.assert_allclose(out, reference(variant, scheme, True), rtol=1e-5, atol=1e-6)
  if variant in ("nnx", "linen"):
    np.testing.assert_allclose(out, reference(variant, scheme, False), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
  ("variant", "scheme"),
  [(v, s) for v in VARIANTS for s in SCHEMES if s == "int8" or v in ("nnx", "linen")],
)
def test_policies_that_run_the_same_step_agree_bit_for_bit(placed_output, variant, scheme):
  """FullyResident and LayerwiseHost run one program shape on CPU (each unit's step over
  its views, docs/design.md, section 3.1); the dense stream another (the same step, one
  unit at a time): each group gives the same bits, and the two groups agree to 1e-5."""
  one_program = [
    placed_output(variant, p, scheme) for p in ("fully_resident", "layerwise_k1", "layerwise_k2")
  ]
  for out in one_program[1:]:
    np.testing.assert_array_equal(out, one_program[0])
  direct, cached = (placed_output(variant, p, scheme) for p in ("dense_direct", "dense_cached"))
  np.testing.assert_array_equal(cached, direct)
  np.testing.assert_allclose(one_program[0], direct, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(native._compiler() is None, reason="no C++ compiler to build the kernels")
@pytest.mark.parametrize("activations", native.ACTIVATIONS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_with_the_native_kernels_policies_that_run_the_same_step_agree_bit_for_bit(
  stores, case, scheme, activations
):
  """A one-token step on one CPU device multiplies by the native kernels
  (docs/quantization.md, "Native kernels on CPU"; with ``activations="int8"``, rounding
  the row first): FullyResident and LayerwiseHost (depths 1 and 2) give the same bits,
  and so do a dense stream with and without a host cache. The two groups run different
  programs around the kernels, and agree to 1e-5 (on this toy they differ by an ulp or
  two)."""
  path, _ = stores("nnx", scheme)
  model, token = case("nnx")["model"], jnp.zeros((1, 1), jnp.int32)
  outs = {}
  for name, make in POLICIES.items():
    with jr.place(model, make(), store=path, activations=activations) as placed:
      if name == "fully_resident":  # the kernels are what runs, not XLA's fused decode
        assert f"jax_residency_{scheme}_matvec" in placed.lower(token).compile().as_text()
      outs[name] = np.asarray(placed(token))
  for name in ("layerwise_k1", "layerwise_k2"):
    np.testing.assert_array_equal(outs[name], outs["fully_resident"], err_msg=name)
  np.testing.assert_array_equal(outs["dense_cached"], outs["dense_direct"])
  np.testing.assert_allclose(outs["dense_direct"], outs["fully_resident"], rtol=1e-5, atol=1e-6)


# --- a mixture of experts: each expert's kernels quantized as matrices of their own -------

MOE_FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
MOE_SCHEMES = {"int8": "int8", "int4": {"scheme": "int4", "group_size": 32}}


@pytest.mark.parametrize(
  ("name", "scheme", "policy", "devices"),
  [
    *[("mixtral_tiny", s, p, 1) for s in MOE_SCHEMES for p in ("fully_resident", "dense_direct")],
    ("mixtral_tiny", "int4", "layerwise_k2", 1),
    ("qwen2_moe_tiny", "int8", "dense_cached", 8),
    ("mixtral_tiny", "int4", "fully_resident", 8),
  ],
)
def test_expert_kernels_are_quantized_per_expert_and_place_as_the_dequantized_model(
  name, scheme, policy, devices, tmp_path
):
  """``mlp.experts`` kernels, ``(experts, in, out)`` a layer, are quantized as one matrix
  per expert (quant/encoding.py), their parts stored one chunk per expert; the placed
  store gives the plain model with the decoded values to 1e-5, on one device and eight."""
  from jax_residency import models

  mesh = None
  if devices == 8:
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    model = models.load_llama(os.path.join(MOE_FIXTURES, name))
  path = str(tmp_path / "store")
  info = jr.save(model, path, quantize=MOE_SCHEMES[scheme], progress=False)
  experts = [t for t in info.quantization.tensors if "experts" in t.path]
  assert {t.path[-1] for t in experts} == {"gate_proj", "up_proj", "down_proj"}
  assert all(len(t.shape) == 4 and t.encoding.axis == -2 for t in experts)
  assert info.stacks[0].experts == model.config.num_experts
  ids = jnp.asarray([[1, 5, 9, 3, 7]], jnp.int32)
  kwargs = {"mesh": mesh} if mesh is not None else {}
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    want = dequantized_reference(model, info.quantization, ids, jit=False)
  with jr.place(model, POLICIES[policy](), store=path, **kwargs) as placed:
    np.testing.assert_allclose(placed(ids), want, rtol=1e-5, atol=1e-5)


# --- bytes: what the store holds, what moves, what is planned ---------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_the_store_and_every_budget_count_quantized_bytes(stores, case, tokens, scheme):
  path, info = stores("nnx", scheme)
  plan = info.quantization
  assert info.format_version == FORMAT_VERSION == 2
  assert plan.stored_nbytes < plan.float_nbytes / (3 if scheme == "int8" else 5)
  model = case("nnx")["model"]
  with jr.place(model, jr.LayerwiseHost(prefetch_depth=1), store=path) as placed:
    placed(tokens)
    meta, last = placed.metadata, placed.report().last
  assert list(meta.unit_bytes) == [info.unit_nbytes] * info.unit_count
  assert last.host_to_device_bytes == info.unit_count * info.unit_nbytes  # codes moved, not floats
  with jr.place(model, dense(0, device=None), store=path) as placed:
    placed(tokens)
    last = placed.report().last
  assert last.disk_to_device_bytes == info.unit_count * info.unit_nbytes
  assert last.mapped_bytes > 0  # coded chunks are mapped in place, as float ones are
  # The float copies are planned: one unit's, and the static tensors', in the device budget.
  items = {m.name: m for m in meta.memory}
  # Each is decoded inside the op that uses it, one at a time: the largest is planned.
  per_unit = [t.float_nbytes // info.unit_count for t in plan.tensors if t.path[0] == "layers"]
  largest = max(per_unit)
  assert items["decoded unit"].nbytes == largest
  assert items["decoded unit"].counted_in == "device budget"
  statics = [t.float_nbytes for t in plan.tensors if t.path[0] != "layers"]
  assert items["decoded static"].nbytes == max(statics)
  # A several-token step decodes one matrix at a time, right before its product
  # (quant/fused.py, _rows_product): its temporaries hold the largest decoded matrix,
  # and less than the whole decoded unit.
  assert largest <= last.step_temp_bytes < sum(per_unit)


def test_a_device_budget_without_room_for_the_decoded_unit_is_refused(stores, case):
  path, info = stores("nnx", "int8")
  with jr.place(case("nnx")["model"], jr.FullyResident(), store=path) as placed:
    meta = placed.metadata
  decoded = sum(m.nbytes for m in meta.memory if m.name.startswith("decoded"))
  need = meta.static_device_bytes + meta.device_window_bytes + decoded
  with jr.place(case("nnx")["model"], jr.FullyResident(device_budget_bytes=need), store=path):
    pass
  with pytest.raises(jr.DeviceBudgetTooSmallError) as e:
    jr.place(case("nnx")["model"], jr.FullyResident(device_budget_bytes=need - 1), store=path)
  assert e.value.decoded == decoded and e.value.required == need and "decoded=" in str(e.value)


def test_quantize_on_place_encodes_the_models_own_weights(case, placed_output, tokens):
  """``place(..., quantize=)`` without a store gives the same bits as the store."""
  with jr.place(case("nnx")["model"], jr.FullyResident(), quantize=SCHEMES["int4"]) as placed:
    want = placed_output("nnx", "fully_resident", "int4")
    np.testing.assert_array_equal(placed(tokens), want)
    assert placed.arrays()["layers.up.kernel.codes"].dtype == jnp.uint8


def test_tensors_that_stay_float_are_the_rule_of_the_docs(stores):
  _, info = stores("nnx", "int8")
  quantized = {".".join(t.path) for t in info.quantization.tensors}
  assert "embed.embedding" in quantized and "layers.qkv.kernel" in quantized
  assert not any(p.endswith(("bias", "scale")) for p in quantized)  # vectors stay float
  axes = {".".join(t.path): t.encoding.axis for t in info.quantization.tensors}
  assert axes["embed.embedding"] == -1 and axes["layers.qkv.kernel"] == -2
  assert MIN_QUANTIZED_DIM == 32


# --- integrity, rewrites and remote reads work on coded chunks -------------------------


def test_verify_rechunk_and_http_reads_of_a_quantized_store(
  stores, case, placed_output, tokens, tmp_path
):
  from damage import damaged_copy

  from jax_residency._src.store.rechunk import rechunk_store
  from jax_residency._src.store.verify import verify_store

  path, info = stores("nnx", "int4")
  assert verify_store(path, progress=False).ok
  bad = damaged_copy(path, str(tmp_path / "bad"), ("layers.up.kernel.codes", 1))
  result = verify_store(bad, progress=False)
  assert not result.ok and "layers.up.kernel.codes" in str(result.damaged)
  copy = rechunk_store(path, str(tmp_path / "copy"), progress=False)
  assert copy.quantization == info.quantization
  model, want = case("nnx")["model"], placed_output("nnx", "dense_direct", "int4")
  with serve_store(path) as server:
    with jr.place(model, dense(0, device=None), store=server.url) as placed:
      np.testing.assert_array_equal(placed(tokens), want)


# --- bad input ---------------------------------------------------------------------


def _nothing_written(path: str) -> bool:
  parent = os.path.dirname(path)
  return not os.path.exists(path) and not [n for n in os.listdir(parent) if "tmp" in n]


def test_a_model_with_nothing_to_quantize_is_refused_and_nothing_is_written(tmp_path):
  net = nnx.Dict(layers=nnx.Dict(w=nnx.Param(jnp.zeros((2, 8, 8)))), norm=nnx.Param(jnp.ones(8)))
  path = str(tmp_path / "store")
  with pytest.raises(jr.errors.QuantizationError, match="no floating matrix to quantize") as e:
    jr.save(net, path, units="layers", progress=False, quantize="int8")
  assert "Leave quantize= out" in str(e.value)
  assert _nothing_written(path)


@pytest.mark.parametrize(
  ("quantize", "error", "fragment"),
  [
    ("int3", jr.errors.InvalidPolicyValueError, "'int3' is not a quantization scheme"),
    ({"scheme": "int4", "group_size": 48}, jr.errors.InvalidPolicyValueError, "group_size=48"),
    ({"scheme": "int8", "bits": 8}, jr.errors.UnknownPolicyFieldError, "unknown fields ['bits']"),
    ("int4", jr.errors.QuantizationError, "layers.qkv.kernel"),  # groups of 64 > d_model 32
  ],
)
def test_bad_quantize_options_name_the_value_and_write_nothing(
  case, tmp_path, quantize, error, fragment
):
  path = str(tmp_path / "store")
  with pytest.raises(error) as e:
    jr.save(case("nnx")["model"], path, progress=False, quantize=quantize)
  assert fragment in str(e.value)
  assert _nothing_written(path)


def test_a_quantized_store_placed_with_another_model_names_each_tensor(stores):
  from jax_residency.toy import ToyConfig, ToyTransformer

  path, _ = stores("nnx", "int8")
  other = nnx.eval_shape(
    lambda: ToyTransformer(
      ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=64, n_layers=4), rngs=nnx.Rngs(0)
    )
  )
  with pytest.raises(jr.errors.CheckpointShapeMismatchError) as e:
    jr.place(other, jr.FullyResident(), store=path)
  message = str(e.value)
  assert path in message and "layers.qkv.kernel: the model has (4, 64, 192) float32" in message


def test_quantize_that_disagrees_with_the_store_is_refused(stores, case):
  path, _ = stores("nnx", "int8")
  with pytest.raises(jr.errors.QuantizationError, match="holds weights quantized as"):
    jr.place(case("nnx")["model"], jr.FullyResident(), store=path, quantize="int4")


def test_a_damaged_quantization_record_is_a_store_layout_error(stores, case, tmp_path):
  import shutil

  path, _ = stores("nnx", "int8")
  copy = str(tmp_path / "copy")
  shutil.copytree(path, copy)
  sidecar = os.path.join(copy, SIDECAR_KEY)
  with open(sidecar) as f:
    record = json.load(f)
  record["quantization"]["tensors"][0]["axis"] = "rows"
  with open(sidecar, "w") as f:
    json.dump(record, f)
  with pytest.raises(jr.errors.StoreLayoutError, match=r"quantization.tensors\[0\].axis"):
    jr.place(case("nnx")["model"], jr.FullyResident(), store=copy)


# --- planning: a config.json planned as it would be stored ---------------------------


def test_plan_of_a_config_with_quantize_is_the_plan_of_its_quantized_store(tmp_path, capfd):
  """``plan config.json --quantize int4`` (no weights) plans what the converted store
  holds, and both agree with what ``place`` plans for that store."""
  from pathlib import Path

  from jax_residency import models
  from jax_residency._src.cli import main as cli

  src = Path(__file__).parent / "fixtures" / "llama_tiny_untied"
  flags = ["--json", "--platform", "cpu", "--device-budget", "200KiB"]
  assert (
    cli.main(["plan", str(src / "config.json"), "--quantize", "int4", "--group-size", "32", *flags])
    == 0
  )
  from_config = json.loads(capfd.readouterr().out)
  store = str(tmp_path / "store")
  info = models.convert_hf(
    src, store, progress=False, quantize={"scheme": "int4", "group_size": 32}
  )
  assert cli.main(["plan", store, *flags]) == 0
  from_store = json.loads(capfd.readouterr().out)
  for key in ("units", "unit_bytes", "static_bytes", "decoded_bytes", "quantization", "fits"):
    assert from_config[key] == from_store[key], key
  # Decoded one at a time: the largest static tensor's floats, and a unit's largest.
  layers = [t for t in info.quantization.tensors if t.path[0] == "layers"]
  static = [t for t in info.quantization.tensors if t.path[0] != "layers"]
  assert from_store["decoded_bytes"] == [
    max(t.float_nbytes for t in static),
    max(t.float_nbytes // t.shape[0] for t in layers),
  ]
  resident = next(p for p in from_store["plans"] if p["policy"] == "fully_resident")
  with jr.place(models.load(store), jr.FullyResident(), store=store) as placed:
    meta = placed.metadata
  decoded = [m.nbytes for m in meta.memory if m.name.startswith("decoded")]
  assert decoded == list(from_store["decoded_bytes"])
  assert resident["tiers"][0]["required_bytes"] == meta.planned_device_bytes
  assert cli.main(["plan", store, "--quantize", "int8", *flags]) == 2  # a store is as stored


def test_a_lazy_tensor_is_read_and_encoded_one_unit_at_a_time():
  """What keeps ``convert_hf(..., quantize=)`` to about one tensor of host memory: each
  unit of a stacked tensor is read once (its codes, scales and offsets share the
  encoding) and the stacked tensor is never read whole."""
  from jax_residency._src.plan.quantized import quantize_arrays
  from jax_residency._src.store.writer import save_store

  class Lazy:
    def __init__(self, shape):
      self.shape, self.dtype, self.reads = shape, np.dtype(np.float32), []

    def __getitem__(self, i):
      self.reads.append(i)
      return np.random.default_rng(i).normal(size=self.shape[1:]).astype(np.float32)

    def __array__(self, dtype=None, copy=None):
      raise AssertionError("read whole")

  kernel, bias = Lazy((3, 64, 32)), Lazy((3, 32))
  plan, static, stacks = quantize_arrays({}, {("layers",): {("w",): kernel, ("b",): bias}}, "int4")
  assert [".".join(t.path) for t in plan.tensors] == ["layers.w"]
  assert sorted(stacks[("layers",)]) == [("b",), ("w", "codes"), ("w", "offset"), ("w", "scale")]
  save_store("memory://lazy/store", static=static, stacks=stacks, quantization=plan, progress=False)
  assert kernel.reads == [0, 1, 2] and bias.reads == [0, 1, 2]
