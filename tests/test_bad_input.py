"""Bad input gets a typed `ResidencyError` naming the argument, file or field and the value,
never a raw Python exception (docs/design.md, section 9): `save` and `place` arguments of the
wrong type, stores whose metadata is malformed JSON or JSON of the wrong shape, and the
command line, which reports each of them on one line with exit code 2."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil

import pytest
import tensorstore as ts
from cli_call import call
from flax import nnx
from store_files import store_digest

import jax_residency as jr
from jax_residency._src import errors
from jax_residency._src.cli import demo as demo_mod
from jax_residency._src.cli import stored_models as records
from jax_residency._src.plan.arguments import check_place_arguments
from jax_residency._src.store.discovery import SIDECAR_KEY
from jax_residency._src.store.unit_store import UnitStore
from jax_residency.toy import ToyConfig, ToyTransformer

TINY = ToyConfig(vocab=16, d_model=8, n_heads=2, d_ff=16, n_layers=2)


@pytest.fixture(scope="module")
def model(toy_model) -> ToyTransformer:
  return toy_model(TINY, seeded=True)  # its values play no part here


@pytest.fixture(scope="module")
def template(model, saved_store) -> str:
  """A tiny store written by `jr.save`, with the model record `run` reads; copy, then break."""

  def write(path: str) -> jr.StoreInfo:
    info = jr.save(model, path, progress=False)
    records.write_model_record(path, TINY, 0)
    return info

  return saved_store(("toy", TINY, 0, None, True, "with its model record"), write=write).path


@pytest.fixture
def store(template, tmp_path) -> str:
  path = str(tmp_path / "store")
  shutil.copytree(template, path)
  return path


def _assert_one_line_error(code: int, err: str, *fragments: str) -> None:
  assert code == 2, err
  lines = err.strip("\n").splitlines()
  assert len(lines) == 1, err
  assert "error:" in lines[0] and "Traceback" not in err
  for fragment in fragments:
    assert fragment in lines[0], (fragment, lines[0])


# --- save ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
  ("kwargs", "fragments"),
  [
    (dict(overwrite="no"), ("save: overwrite='no' (str) is not a bool", "True or False")),
    (dict(overwrite=1), ("save: overwrite=1 (int) is not a bool",)),
    (dict(overwrite=None), ("save: overwrite=None (NoneType) is not a bool",)),
    (dict(progress="yes", overwrite=True), ("save: progress='yes' (str)", "True, False or None")),
    (dict(progress=0, overwrite=True), ("save: progress=0 (int) is not a bool",)),
  ],
)
def test_save_refuses_a_flag_that_is_not_a_bool_and_leaves_the_store_alone(
  model, store, kwargs, fragments
):
  before = store_digest(store)
  with pytest.raises(errors.StoreError) as e:
    jr.save(model, store, **kwargs)
  for fragment in fragments:
    assert fragment in str(e.value)
  assert "nothing was written" in str(e.value)
  assert store_digest(store) == before


@pytest.mark.parametrize(
  ("path", "fragment"), [(5, "path=5 (int)"), ("", "path='' (str)"), (b"x", "path=b'x' (bytes)")]
)
def test_save_refuses_a_path_that_is_not_a_path(model, path, fragment):
  with pytest.raises(errors.StoreError, match="is not a store path") as e:
    jr.save(model, path, progress=False)
  assert f"save: {fragment}" in str(e.value) and "pathlib.Path" in str(e.value)


def test_save_and_open_take_a_pathlib_path(model, tmp_path):
  path = tmp_path / "store"
  info = jr.save(model, path, progress=False)
  assert info.path == str(path) and info.unit_count == TINY.n_layers
  with UnitStore.open(path) as opened:  # type: ignore[arg-type]
    assert opened.path == str(path) and opened.unit_count == TINY.n_layers


@pytest.mark.parametrize(
  ("units", "shown"),
  [(5, "units=5 (int)"), (("layers", 5), "units=('layers', 5) (tuple)"), ((), "units=() (tuple)")],
)
def test_save_refuses_units_that_are_not_a_path(model, tmp_path, units, shown):
  with pytest.raises(errors.UnitSelectionError, match="is not a path of the stacked layer") as e:
    jr.save(model, str(tmp_path / "s"), units=units, progress=False)
  assert f"save: {shown}" in str(e.value)
  assert os.listdir(tmp_path) == []


# --- place ---------------------------------------------------------------------------------

_GOOD = dict(params=None, mesh=None, units=None, rules=None, store=None, sequence_axis=1)


@pytest.mark.parametrize(
  ("bad", "error", "fragments"),
  [
    (dict(units=5), errors.UnitSelectionError, ("place: units=5 (int)", "'decoder.layers'")),
    (dict(units=("a", 5)), errors.UnitSelectionError, ("units=('a', 5) (tuple)",)),
    (dict(units=["a", ""]), errors.UnitSelectionError, ("units=['a', ''] (list)",)),
    (dict(units="a..b"), errors.UnitSelectionError, ("units='a..b' (str)",)),
    (dict(params=5), errors.UnitSelectionError, ("place: params=5 (int)", "model.init")),
    (dict(mesh="x"), errors.PlacementError, ("place: mesh='x' (str)", "jax.sharding.Mesh")),
    (dict(rules=5), errors.PlacementError, ("place: rules=5 (int)", "(logical_name, mesh_axes)")),
    (dict(rules="embed"), errors.PlacementError, ("place: rules='embed' (str)",)),
    (
      dict(rules=[("embed", None), ("mlp",), (1, "model"), ("heads", ("model", 2))]),
      errors.PlacementError,
      ("rules[1] = ('mlp',)", "rules[2] = (1, 'model')", "rules[3] = ('heads', ('model', 2))"),
    ),
    (dict(store=5), errors.StoreError, ("place: store=5 (int)", "or None")),
    (dict(store=""), errors.StoreError, ("place: store='' (str)",)),
    (dict(sequence_axis="1"), errors.PlacementError, ("place: sequence_axis='1' (str)",)),
    (dict(sequence_axis=True), errors.PlacementError, ("sequence_axis=True (bool)",)),
    (dict(sequence_axis=1.0), errors.PlacementError, ("sequence_axis=1.0 (float)",)),
  ],
)
def test_place_arguments_of_the_wrong_type_raise_typed_errors(bad, error, fragments):
  with pytest.raises(error) as e:
    check_place_arguments(**{**_GOOD, **bad})
  for fragment in fragments:
    assert fragment in str(e.value)


def test_place_arguments_of_the_right_types_pass(mesh1, logical_rules, linen_toy, tmp_path):
  for good in (
    dict(units="layers"),
    dict(units=("decoder", "layers")),
    dict(units=["layers"]),
    dict(params=linen_toy[1]),
    dict(mesh=mesh1),
    dict(rules=logical_rules),
    dict(rules={"embed": None, "mlp": "model", "heads": ("data", "model")}),
    dict(rules=[]),
    dict(store=str(tmp_path)),
    dict(store=tmp_path),
    dict(store="memory://x"),
    dict(sequence_axis=-1),
  ):
    check_place_arguments(**{**_GOOD, **good})


@pytest.mark.parametrize(
  ("bad", "error"),
  [
    (dict(units=5), errors.UnitSelectionError),
    (dict(units=("layers", 5)), errors.UnitSelectionError),
    (dict(mesh="x"), errors.PlacementError),
    (dict(rules=5), errors.PlacementError),
    (dict(store=5), errors.StoreError),
    (dict(sequence_axis="1"), errors.PlacementError),
  ],
)
def test_place_raises_typed_errors_for_arguments_of_the_wrong_type(model, bad, error):
  with pytest.raises(error, match=f"^place: {next(iter(bad))}="):
    jr.place(model, **bad)


# --- malformed store metadata --------------------------------------------------------------


def _metadata(store: str) -> dict:
  with open(os.path.join(store, "_METADATA")) as f:
    return json.load(f)


def _first_entry_without_key_metadata(store: str) -> dict:
  meta = _metadata(store)
  name = next(iter(meta["tree_metadata"]))
  del meta["tree_metadata"][name]["key_metadata"]
  return meta


def _sidecar(**fields: object) -> dict:
  return {"format": "jax_residency.unit_store", "format_version": 1, "unit_prefix": ["layers"],
          "unit_count": TINY.n_layers, **fields}  # fmt: skip


#: (file, new content: JSON-able, bytes, or a function of the store; fragments of the message)
CASES = {
  "metadata-list": ("_METADATA", [1, 2], ("_METADATA holds an array ([1, 2]), not a JSON object",)),
  "metadata-not-json": ("_METADATA", b"{not json", ("_METADATA is not valid JSON",)),
  "metadata-not-utf8": ("_METADATA", b'{"a": "\xff"}', ("_METADATA is not UTF-8 text",)),
  "metadata-huge-number": ("_METADATA", b"1" * 5000, ("_METADATA is not valid JSON",)),
  "metadata-entry-string": (
    "_METADATA",
    lambda s: {**_metadata(s), "tree_metadata": {"('x',)": "oops"}},
    ("field tree_metadata[\"('x',)\"] is a string ('oops')", "must be an object"),
  ),
  "metadata-no-key-metadata": (
    "_METADATA",
    _first_entry_without_key_metadata,
    (".key_metadata is missing", 'each with a "key"'),
  ),
  "metadata-tree-list": (
    "_METADATA",
    lambda s: {**_metadata(s), "tree_metadata": [1]},
    ("field tree_metadata is an array ([1])",),
  ),
  "metadata-use-ocdbt-string": (
    "_METADATA",
    lambda s: {**_metadata(s), "use_ocdbt": "yes"},
    ("field use_ocdbt is a string ('yes'); it must be true or false",),
  ),
  "sidecar-list": (SIDECAR_KEY, ["layers"], (f"{SIDECAR_KEY} holds an array",)),
  "sidecar-null": (SIDECAR_KEY, None, (f"{SIDECAR_KEY} holds null, not a JSON object",)),
  "sidecar-not-json": (SIDECAR_KEY, b"", (f"{SIDECAR_KEY} is not valid JSON",)),
  "sidecar-not-utf8": (SIDECAR_KEY, b"\xfe\xff", (f"{SIDECAR_KEY} is not UTF-8 text",)),
  "sidecar-format-version-string": (
    SIDECAR_KEY,
    _sidecar(format_version="1"),
    ("field format_version is a string ('1'); it must be an int",),
  ),
  "sidecar-unit-count-string": (
    SIDECAR_KEY,
    _sidecar(unit_count=str(TINY.n_layers)),
    (f"field unit_count is a string ('{TINY.n_layers}'); it must be an int >= 0",),
  ),
  "sidecar-unit-prefix-string": (
    SIDECAR_KEY,
    _sidecar(unit_prefix="layers"),
    ("field unit_prefix is a string ('layers')",),
  ),
}


def _break(store: str, case: str) -> tuple[str, tuple[str, ...]]:
  """Overwrites one metadata file of ``store``; returns its path and the message fragments."""
  name, content, fragments = CASES[case]
  content = content(store) if callable(content) else content
  raw = content if isinstance(content, bytes) else json.dumps(content).encode()
  with open(os.path.join(store, name), "wb") as f:
    f.write(raw)
  return os.path.join(store, name), fragments


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_metadata_is_a_store_layout_error_naming_file_and_field(store, case):
  file, fragments = _break(store, case)
  with pytest.raises(errors.StoreLayoutError) as e:
    UnitStore.open(store)
  message = str(e.value)
  assert message.startswith(file), message
  for fragment in fragments:
    assert fragment in message
  assert "write the store again" in message


def test_a_string_unit_count_is_a_type_error_not_a_count_mismatch(store):
  _break(store, "sidecar-unit-count-string")
  with pytest.raises(errors.StoreLayoutError) as e:
    UnitStore.open(store)
  assert "but the arrays hold" not in str(e.value)


def test_place_on_a_store_with_malformed_metadata_raises_the_same_error(model, store):
  file, fragments = _break(store, "metadata-entry-string")
  with pytest.raises(errors.StoreLayoutError, match=f"^{re.escape(file)}: field tree_metadata"):
    jr.place(model, jr.DenseDiskStream(), store=store)


_ZARR = {
  "zarr_format": 3,
  "node_type": "array",
  "shape": [TINY.n_layers, TINY.d_model],
  "data_type": "float32",
  "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, TINY.d_model]}},
  "chunk_key_encoding": {"name": "default"},
  "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
  "fill_value": 0.0,
}


@pytest.mark.parametrize(
  ("meta", "fragment"),
  [
    ([1], "zarr.json holds an array ([1]), not a JSON object"),
    ({**_ZARR, "shape": "2,8"}, "field shape is a string ('2,8'); it must be an array of ints"),
    ({**_ZARR, "chunk_grid": []}, "field chunk_grid is an array ([])"),
    ({**_ZARR, "chunk_grid": {"configuration": {}}}, "chunk_grid.configuration.chunk_shape is m"),
    ({**_ZARR, "codecs": ["bytes"]}, "field codecs is an array (['bytes'])"),
    ({**_ZARR, "data_type": "float99"}, "field data_type is a string ('float99'), not a data type"),
    ({k: v for k, v in _ZARR.items() if k != "data_type"}, "field data_type is missing"),
    (
      {**_ZARR, "codecs": [{"name": "sharding_indexed", "configuration": {"chunk_shape": 1}}]},
      "field codecs[0].configuration.chunk_shape is a number (1)",
    ),
    (
      {**_ZARR, "chunk_grid": {"configuration": {"chunk_shape": [1]}}},
      "the chunk shape [1] and the shape [2, 8] differ in their number of dimensions",
    ),
  ],
)
def test_malformed_array_metadata_names_the_array_file_and_field(store, meta, fragment):
  # A unit array of shape (n_layers, d_model), as _ZARR describes it; zarr.json files live
  # inside the OCDBT database.
  name = "layers.norm1.scale/zarr.json"
  kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{store}/"}).result()
  assert kv.read(name).result().state == "value"
  kv.write(name, json.dumps(meta).encode()).result()
  with pytest.raises(errors.StoreLayoutError) as e:
    UnitStore.open(store)
  assert str(e.value).startswith(os.path.join(store, name)), str(e.value)
  assert fragment in str(e.value)


# --- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize("case", sorted(CASES))
def test_inspect_reports_malformed_metadata_on_one_line(store, case):
  file, fragments = _break(store, case)
  code, out, err = call("inspect", store)
  _assert_one_line_error(code, err, "jax-residency inspect: error:", file, fragments[0])
  assert out == ""


@pytest.mark.parametrize(
  "argv",
  [
    ("plan", "{store}", "--platform", "cpu"),
    ("run", "{store}", "--policy", "fully_resident", "--shape", "1,2"),
    ("rechunk", "{store}", "{store}-copy"),
  ],
)
@pytest.mark.parametrize("case", ["metadata-entry-string", "sidecar-unit-count-string"])
def test_every_command_reports_malformed_metadata_on_one_line(store, argv, case):
  file, fragments = _break(store, case)
  code, _, err = call(*(a.format(store=store) for a in argv))
  _assert_one_line_error(code, err, f"jax-residency {argv[0]}: error:", file, fragments[0])


@pytest.mark.parametrize(
  ("record", "fragment"),
  [
    (b"\xff\xfe", "UnicodeDecodeError"),
    (b"[" * 100_000, "RecursionError"),
    (json.dumps({"model": "toy", "config": [1], "seed": 0}).encode(), "config must be an object"),
    (json.dumps({"model": "toy", "config": {}, "seed": "0"}).encode(), "seed='0'"),
    (
      json.dumps(
        {"model": "toy", "config": {**dataclasses.asdict(TINY), "n_layers": "2"}}
      ).encode(),
      "n_layers='2' (wrong types)",
    ),
  ],
)
def test_run_reports_a_malformed_model_record_on_one_line(store, record, fragment):
  with open(os.path.join(store, records.MODEL_FILE), "wb") as f:
    f.write(record)
  code, _, err = call("run", store, "--policy", "fully_resident", "--shape", "1,2")
  _assert_one_line_error(code, err, "jax-residency run: error:", fragment)


def test_demo_rebuilds_a_cached_store_with_malformed_metadata(store):
  assert demo_mod.demo_store_ready(store, TINY)
  _break(store, "metadata-no-key-metadata")
  assert not demo_mod.demo_store_ready(store, TINY)


# --- partitioning annotations (docs/design.md, "Shardings and memory kinds") ------------


class _Annotated(nnx.Module):
  """One plain Linear and one whose kernel carries ``names`` as its partitioning."""

  def __init__(self, names, *, rngs):
    self.plain = nnx.Linear(4, 8, rngs=rngs)
    meta = {"out_sharding": names, "eager_sharding": False}
    self.odd = nnx.Linear(4, 8, rngs=rngs, kernel_metadata=meta)

  def __call__(self, x):
    return self.odd(self.plain(x)[..., :4])


@pytest.mark.parametrize(
  ("names", "shown"),
  [(5, "odd.kernel: 5"), (("model", 3), "odd.kernel: P('model', 3)")],
  ids=["not-a-sequence", "not-an-axis-name"],
)
def test_a_bad_partitioning_annotation_names_the_parameter_and_the_annotation(names, shown):
  model = _Annotated(names, rngs=nnx.Rngs(0))
  with pytest.raises(jr.PlacementError) as info:
    jr.place(model, jr.FullyResident())
  message = str(info.value)
  assert "partitioning annotations that are not mesh axis names" in message
  assert shown in message, message
  assert "plain" not in message  # only the bad parameter is named


def test_a_bad_linen_partitioning_annotation_names_the_parameter():
  import jax
  import jax.numpy as jnp
  from flax import linen as nn

  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      init = nn.with_partitioning(nn.initializers.lecun_normal(), ("model", 3))
      return nn.Dense(8, kernel_init=init, name="odd")(x)

  variables = Dense().init(jax.random.key(0), jnp.ones((1, 4)))
  with pytest.raises(jr.PlacementError, match=r"params\.odd\.kernel: P\('model', 3\)"):
    jr.place(Dense(), jr.FullyResident(), params=variables)
