"""Experts at rest (docs/design.md, 5.6): a mixture of experts' experts, one chunk each.

The Mixtral and Qwen2-MoE fixtures (``tests/fixtures``) saved and converted: the expert
arrays are chunked per expert and the rest per unit; every policy places the store bit
for bit as it does the plain model (``tests/test_llama.py`` runs each policy on one and
eight devices from such stores); the direct read path reads each expert's chunk into the
unit's buffer; ``verify`` reads and names each expert's chunk; ``inspect`` says so; a
quantized store and an in-memory store hold their experts the same way; a bad
``experts=`` path is refused with nothing written.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts
from cli_call import call
from policies import dense

import jax_residency as jr
from jax_residency import models
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.store.rechunk import rechunk_store
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.store.verify import verify_store

FIXTURES = Path(__file__).resolve().parent / "fixtures"
EXPERT_TENSORS = ("gate_proj", "up_proj", "down_proj")
IDS = jnp.asarray([[1, 5, 9, 3, 7]], jnp.int32)


@pytest.fixture(scope="module")
def mixtral():
  return models.load_llama(FIXTURES / "mixtral_tiny")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[str, jr.StoreInfo]:
  path = str(tmp_path_factory.mktemp("experts") / "mixtral")
  return path, models.convert_hf(FIXTURES / "mixtral_tiny", path, progress=False)


def _chunk(path: str, name: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(shape, read chunk) of the array ``name`` (dotted) of the store at ``path``."""
  spec = {
    "driver": "zarr3",
    "kvstore": {
      "driver": "ocdbt",
      "base": f"file://{path}/",
      "path": name + "/",
    },
  }
  array = ts.open(spec, open=True).result()
  return tuple(array.shape), tuple(array.chunk_layout.read_chunk.shape)


@pytest.mark.parametrize("name", ["mixtral_tiny", "qwen2_moe_tiny"])
def test_a_conversion_writes_each_expert_as_a_chunk_and_the_rest_per_unit(name, tmp_path):
  path = str(tmp_path / name)
  info = models.convert_hf(FIXTURES / name, path, progress=False)
  cfg = json.loads((FIXTURES / name / "config.json").read_text())
  experts = cfg.get("num_local_experts") or cfg["num_experts"]
  assert [(s.prefix, s.count, s.experts) for s in info.stacks] == [(("layers",), 3, experts)]
  with UnitStore.open(path) as store:
    assert [s.experts for s in store.stacks] == [experts]
    for rel in store.stack_specs(0):
      shape, chunk = _chunk(path, "layers." + ".".join(rel))
      if rel[:2] == ("mlp", "experts"):
        assert shape[1] == experts and chunk == (1, 1, *shape[2:]), rel
      else:
        assert chunk == (1, *shape[1:]), rel
  sidecar = json.loads((Path(path) / "jax_residency.json").read_text())
  assert sidecar["stacks"][0]["experts"] == {"paths": [["mlp", "experts"]], "count": experts}


def test_every_policy_places_a_store_of_expert_chunks_as_the_plain_model(mixtral, converted):
  path, _ = converted
  eager, jitted = np.asarray(mixtral(IDS)), np.asarray(jitted_plain(mixtral, IDS))
  for policy in (dense(0), dense(None), jr.FullyResident(), jr.LayerwiseHost(prefetch_depth=2)):
    want = eager if isinstance(policy, jr.DenseDiskStream) else jitted  # docs/parity.md
    with jr.place(mixtral, policy, store=path) as placed:
      np.testing.assert_array_equal(placed(IDS), want, err_msg=policy.name)


def test_the_direct_path_reads_each_experts_chunk_into_the_units_buffer(mixtral, converted):
  """A unit read of a local store goes straight to the data files, the per-expert
  tensors included (expert by expert), and gives the model's own values."""
  path, info = converted
  with UnitStore.open(path) as store:
    unit = store.read_unit(1)
    direct = sum(m.direct_bytes + m.total_bytes for m in store._mappers)  # noqa: SLF001
  layers = mixtral.layers
  for name in EXPERT_TENSORS:
    want = np.asarray(getattr(layers.mlp.experts, name)[...][1])
    np.testing.assert_array_equal(unit[("mlp", "experts", name)], want)
  experts = sum(getattr(layers.mlp.experts, n)[...][1].nbytes for n in EXPERT_TENSORS)
  # The expert tensors and every other tensor stored out of line (a tiny one sits in the
  # store's index), checksums on top.
  assert experts < direct <= info.stacks[0].unit_nbytes + 4 * 20


def test_verify_reads_each_expert_chunk_and_names_a_damaged_one(converted, tmp_path):
  path, info = converted
  result = verify_store(path, progress=False)
  e = info.stacks[0].experts
  per_unit = 7 + len(EXPERT_TENSORS) * e  # 7 ordinary tensors a unit, then each expert
  assert result.ok and result.chunks == 3 + 3 * per_unit
  # Flip one byte of unit 2's expert 3 of down_proj, in place in its data file.
  copy = str(tmp_path / "damaged")
  jr.save(models.load_llama(FIXTURES / "mixtral_tiny"), copy, progress=False)
  with UnitStore.open(copy) as store:
    mapper = store._mappers[0]  # noqa: SLF001
    extents = mapper._piece_extents(("mlp", "experts", "down_proj"), 2)  # noqa: SLF001
  extent, _ = extents[3]
  with open(extent.file, "r+b") as f:
    f.seek(extent.offset + 5)
    byte = f.read(1)
    f.seek(extent.offset + 5)
    f.write(bytes([byte[0] ^ 0xFF]))
  damaged = verify_store(copy, progress=False).damaged
  assert [(d.tensor, d.unit, d.expert, d.corrupt) for d in damaged] == [
    ("layers.mlp.experts.down_proj", 2, 3, True)
  ]
  code, out, _ = call("verify", copy)
  assert code == 1 and "corrupt: layers.mlp.experts.down_proj (unit 2, expert 3)" in out
  with jr.place(models.load_llama(FIXTURES / "mixtral_tiny"), dense(0), store=copy) as placed:
    with pytest.raises(jr.errors.StoreCorruptionError, match="down_proj"):
      placed(IDS)


def test_inspect_says_how_many_experts_a_unit_holds(converted):
  path, _ = converted
  code, text, _ = call("inspect", path)
  assert code == 0 and "one chunk per unit (one per expert for the experts)" in text
  assert "4 per unit under 'layers', a chunk each (read alone)" in text
  code, out, _ = call("inspect", path, "--json")
  assert code == 0
  stacks = json.loads(out)["stacks"]
  assert [(s["prefix"], s["experts"]) for s in stacks] == [("layers", 4)]


@pytest.mark.parametrize("quantize", ["int8", {"scheme": "int4", "group_size": 32}])
def test_a_quantized_store_chunks_its_expert_parts_per_expert(mixtral, quantize, tmp_path):
  path = str(tmp_path / "q")
  info = jr.save(mixtral, path, quantize=quantize, progress=False)
  assert info.stacks[0].experts == 4
  with UnitStore.open(path) as store:
    parts = [rel for rel in store.stack_specs(0) if rel[:2] == ("mlp", "experts")]
  assert parts
  for rel in parts:
    shape, chunk = _chunk(path, "layers." + ".".join(rel))
    assert chunk == (1, 1, *shape[2:]), rel
  with jr.place(mixtral, dense(0), store=path) as a:
    streamed = np.asarray(a(IDS))
  with jr.place(mixtral, jr.FullyResident(), store=path) as b:
    # One program against per-unit steps: each decode is fused into its products, which
    # sum in their own order (docs/parity.md).
    np.testing.assert_allclose(b(IDS), streamed, rtol=1e-5, atol=1e-6)


def test_an_in_memory_store_holds_expert_chunks_and_places(mixtral):
  url = "memory://experts/mixtral"
  info = jr.save(mixtral, url, progress=False)
  assert info.stacks[0].experts == 4
  with jr.place(mixtral, dense(0), store=url) as placed:
    np.testing.assert_array_equal(placed(IDS), mixtral(IDS))


def test_an_experts_path_that_names_nothing_is_refused_and_nothing_is_written(mixtral, tmp_path):
  path = tmp_path / "bad"
  with pytest.raises(jr.errors.StoreError, match=r"experts=\['mlp.nope'\].*mlp.experts"):
    jr.save(mixtral, path, experts="mlp.nope", progress=False)
  assert not path.exists()
  with pytest.raises(jr.errors.StoreError, match="one expert count"):
    jr.save(mixtral, tmp_path / "bad2", experts="mlp", progress=False)
  assert not (tmp_path / "bad2").exists()


def test_rechunk_writes_experts_whole_or_a_chunk_each_or_as_they_were(converted, tmp_path):
  """``rechunk --experts none`` writes each unit whole, ``--experts mlp.experts`` one chunk
  per expert again, no option keeps what the source holds; a path naming nothing is
  refused (exit 2) with nothing written."""
  path, info = converted
  whole = rechunk_store(path, str(tmp_path / "whole"), experts=[], progress=False)
  assert whole.stacks[0].experts == 0
  assert _chunk(str(tmp_path / "whole"), "layers.mlp.experts.up_proj")[1][:2] == (1, 4)
  back = str(tmp_path / "back")
  assert call("rechunk", str(tmp_path / "whole"), back, "--experts", "mlp.experts")[0] == 0
  kept = rechunk_store(back, str(tmp_path / "kept"), progress=False)
  assert kept.stacks[0].experts == info.stacks[0].experts == 4
  for store in (back, str(tmp_path / "kept")):
    assert verify_store(store, progress=False).chunks == verify_store(path, progress=False).chunks
    shape, chunk = _chunk(store, "layers.mlp.experts.up_proj")
    assert chunk == (1, 1, *shape[2:])
  code, _, err = call("rechunk", back, str(tmp_path / "bad"), "--experts", "mlp.nope")
  assert code == 2 and "rechunk: experts=['mlp.nope'] names no parameters" in err
  assert not (tmp_path / "bad").exists()
