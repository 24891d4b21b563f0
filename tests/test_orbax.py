"""Orbax checkpoints placed in place: no rewrite, under every policy.

A checkpoint that ``orbax.checkpoint.StandardCheckpointer`` (or a
``CheckpointManager``) wrote from ``nnx.state(model)``, with Orbax's default
chunking (one chunk per array: every unit of a stacked layer parameter in one
zstd chunk), is placed as it is. The dense stream decodes each chunk once per
unit in it, says so (``metadata.bytes_read_per_byte_used``, a warning naming
``jax-residency rechunk``) and plans the decode's memory; the other policies read
each array once. A ``CheckpointManager`` root stands for its latest complete step.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import jax_residency as jr
from conftest import CFG, auto_mesh, build_nnx
from jax_residency._src.cli.main import main as cli_main
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.store.locations import OCDBT_INLINE_BYTES
from jax_residency._src.store.unit_store import UnitStore
from jax_residency.testing import assert_memory_kinds, assert_within_budgets
from jax_residency.toy import LinenToyTransformer, ToyTransformer

TOKENS = jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab)
POLICIES = {
  "fully_resident": lambda: jr.FullyResident(),
  "layerwise_k2": lambda: jr.LayerwiseHost(prefetch_depth=2),
  "dense_cached": lambda: jr.DenseDiskStream(host_budget_bytes="1MiB"),
  "dense_direct": lambda: jr.DenseDiskStream(host_budget_bytes=0),
}
DENSE = ("dense_cached", "dense_direct")
UNIT_TENSORS = 12  # the toy layer's parameters: qkv, out, up, down kernels and biases, 2 norms


@functools.cache
def model(seed: int = 0) -> ToyTransformer:
  """The toy with seeded weights (no initialiser compiled), built once per module: read
  it, never change it."""
  return build_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)), seed=seed)


def abstract() -> Any:
  return nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))


def save_standard(path: str, tree: Any) -> str:
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(path, tree)
  return path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
  """``nnx.state`` of the seed-0 toy, as StandardCheckpointer writes it by default."""
  return save_standard(str(tmp_path_factory.mktemp("orbax") / "state"), nnx.state(model()))


def reference(policy: str, seed: int = 0) -> jax.Array:
  """What ``policy`` must match bit for bit on CPU (docs/parity.md): the eager plain model
  for a dense stream, which runs a step per layer; the plain model under ``jax.jit`` for
  the one program of the others."""
  plain = model(seed)
  return plain(TOKENS) if policy in DENSE else jitted_plain(plain, TOKENS)


def place_quietly(store: str, policy: Any, **kwargs: Any) -> jr.PlacedModel:
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    return jr.place(abstract(), policy, store=store, **kwargs)


def test_orbax_writes_what_this_module_is_about(checkpoint):
  """Orbax's default layout here: NNX Variables saved as ``<path>.value``, each stacked
  layer parameter one chunk of all its units; no jax_residency sidecar."""
  names = os.listdir(checkpoint)
  assert "_METADATA" in names and "jax_residency.json" not in names
  with pytest.raises(jr.errors.StoreLayoutError, match="several units per chunk"):
    UnitStore.open(checkpoint, unit_prefix=("layers",))  # asked for one unit per chunk
  with UnitStore.open(checkpoint, unit_prefix=("layers",), require_unit_chunks=False) as store:
    assert ("layers", "qkv", "kernel") in {store.unit_prefix + p for p in store.unit_specs}
    assert store.bytes_read_per_byte_used == CFG.n_layers
    assert store.compressed


@pytest.mark.parametrize("devices", [1, 8], ids=["1dev", "8dev"])
@pytest.mark.parametrize("policy", list(POLICIES))
def test_checkpoint_places_under_every_policy(checkpoint, policy: str, devices: int):
  mesh = auto_mesh((devices,), ("data",)) if devices > 1 else None
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    with jr.place(abstract(), POLICIES[policy](), store=checkpoint, mesh=mesh) as placed:
      out = placed(TOKENS)
      out2 = placed(TOKENS)
      np.testing.assert_array_equal(np.asarray(out), np.asarray(reference(policy)))
      np.testing.assert_array_equal(np.asarray(out2), np.asarray(out))
      assert_memory_kinds(placed)
      assert_within_budgets(placed)
      meta, report = placed.metadata, placed.report()
  told = [str(w.message) for w in caught if "jax-residency rechunk" in str(w.message)]
  if policy in DENSE:
    # Every chunk holds all 4 units, so each unit read decodes 4 units' bytes.
    assert meta.bytes_read_per_byte_used == CFG.n_layers
    assert len(told) == 1 and f"decodes {CFG.n_layers:.1f} bytes for each byte" in told[0]
    assert f"rechunk {checkpoint} DST --units layers" in told[0]
    largest = CFG.n_layers * CFG.d_model * 3 * CFG.d_model * 4  # the stacked qkv kernel
    assert meta.item_bytes("chunk decode") == 2 * largest
    passes_read = 1 if policy == "dense_cached" else 2  # the host cache holds every unit
    assert report.total.bytes_read == passes_read * meta.total_unit_bytes
    # Compressed chunks, decoded once per unit: more fetched than used, less than 4x.
    assert report.total.bytes_read < report.total.fetched_bytes <= report.fetched_bytes
  else:  # each stored array is read whole, once: every chunk's stored bytes, once
    assert meta.bytes_read_per_byte_used == 1.0 and not told
    assert meta.item_bytes("chunk decode") == 0
    # The data files (Orbax's per-process databases' too; they hold index nodes besides),
    # and the arrays small enough to live inside the index, counted at their own size.
    data = sum(f.stat().st_size for f in pathlib.Path(checkpoint).rglob("d/*"))
    leaves = jax.tree.leaves(nnx.state(model()))
    inline = sum(x.nbytes for x in leaves if x.nbytes <= OCDBT_INLINE_BYTES)
    assert 0.5 * data < report.fetched_bytes <= data + inline
    assert report.total.fetched_bytes == 0


def test_pure_dict_state_places_too(tmp_path):
  """``nnx.to_pure_dict(nnx.state(model))`` saves the arrays without ``.value``."""
  path = save_standard(str(tmp_path / "pure"), nnx.to_pure_dict(nnx.state(model())))
  with place_quietly(path, jr.DenseDiskStream(host_budget_bytes=0)) as placed:
    np.testing.assert_array_equal(np.asarray(placed(TOKENS)), np.asarray(model()(TOKENS)))


def test_rechunk_makes_it_stream_once_per_byte(checkpoint, tmp_path, capsys):
  dst = str(tmp_path / "streamable")
  assert cli_main(["rechunk", checkpoint, dst, "--units", "layers"]) == 0
  assert "4 units" in capsys.readouterr().out
  with warnings.catch_warnings():
    warnings.simplefilter("error", UserWarning)  # nothing to warn about now
    with jr.place(abstract(), jr.DenseDiskStream(host_budget_bytes=0), store=dst) as placed:
      out = placed(TOKENS)
      meta, report = placed.metadata, placed.report()
  np.testing.assert_array_equal(np.asarray(out), np.asarray(model()(TOKENS)))
  assert meta.bytes_read_per_byte_used == 1.0 and meta.item_bytes("chunk decode") == 0
  assert report.total.bytes_read == meta.total_unit_bytes


def _manager(root: str, steps: dict[int, int], **kwargs: Any) -> None:
  """A CheckpointManager directory: ``steps`` maps each step to the seed of its model."""
  with ocp.CheckpointManager(root, **kwargs) as manager:
    for step, seed in steps.items():
      manager.save(step, args=ocp.args.StandardSave(nnx.state(model(seed))))
    manager.wait_until_finished()


def test_checkpoint_manager_root_takes_the_latest_step(tmp_path):
  root = str(tmp_path / "run")
  _manager(root, {1: 0, 5: 1})
  # Steps Orbax has not finished are not steps: a temporary directory, and a step
  # directory without its commit marker.
  shutil.copytree(f"{root}/5", f"{root}/9.orbax-checkpoint-tmp-123")
  shutil.copytree(f"{root}/5/default", f"{root}/12/default")
  policy = jr.DenseDiskStream(host_budget_bytes=0)
  for store, seed in ((root, 1), (f"{root}/1", 0), (f"{root}/5/default", 1)):
    with place_quietly(store, policy) as placed:
      np.testing.assert_array_equal(np.asarray(placed(TOKENS)), np.asarray(model(seed)(TOKENS)))
  with place_quietly(root, jr.FullyResident()) as placed:
    out = placed(TOKENS)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(reference("fully_resident", 1)))


def test_step_items_are_chosen_or_named(tmp_path):
  root = str(tmp_path / "composite")
  with ocp.CheckpointManager(root, item_names=("params", "extra")) as manager:
    manager.save(
      3,
      args=ocp.args.Composite(
        params=ocp.args.StandardSave(nnx.state(model())), extra=ocp.args.JsonSave({"lr": 1})
      ),
    )
    manager.wait_until_finished()
  with place_quietly(root, jr.DenseDiskStream(host_budget_bytes=0)) as placed:  # the one array item
    np.testing.assert_array_equal(np.asarray(placed(TOKENS)), np.asarray(model()(TOKENS)))
  shutil.copytree(f"{root}/3/params", f"{root}/3/ema")
  with pytest.raises(jr.StoreError, match="checkpoint items ema, params") as e:
    jr.place(abstract(), jr.FullyResident(), store=root)
  assert f"{root}/3/params" in str(e.value) and f"{root}/3/ema" in str(e.value)


def test_linen_params_checkpoint_places(tmp_path, seeded_linen):
  linen = LinenToyTransformer(CFG)
  variables = seeded_linen(linen, TOKENS)
  path = save_standard(str(tmp_path / "linen"), variables)
  want = linen.apply(variables, TOKENS)
  for policy in (jr.DenseDiskStream(host_budget_bytes=0), jr.FullyResident()):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore", UserWarning)
      with jr.place(linen, policy, params=variables, store=path) as placed:
        got = placed(TOKENS)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
