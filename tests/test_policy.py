"""Tests of the weight-residency policy types (docs/design.md, section 1)."""

from __future__ import annotations

import ast
import copy
import dataclasses
import json
import pathlib
import pickle

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jax_residency._src import errors
from jax_residency._src.errors import (
  HostDisabledControlsError,
  InvalidBudgetError,
  InvalidPolicyValueError,
  UnknownPolicyFieldError,
  WeightResidencyPolicyError,
  ZeroHostLookaheadError,
  ZeroMaxCachedShardsError,
  ZeroPrefetchDepthError,
  ZeroQueueCapacityError,
)
from jax_residency._src.policy.options import (
  DEFAULT_MAX_CACHED_SHARDS,
  CacheEvictionPolicy,
  DenseDiskStreamLoadOptions,
  LayerwiseLoadOptions,
  OffloadConfig,
)
from jax_residency._src.policy.types import (
  DENSE_TRANSFER_WINDOW,
  DenseDiskStream,
  ExecutionResidency,
  FullyResident,
  LayerWeightResidency,
  LayerwiseHost,
  OrdinaryWeightResidency,
)

GiB = 1024**3
MiB = 1024**2
LRU = CacheEvictionPolicy.LEAST_RECENTLY_USED
LFU = CacheEvictionPolicy.LEAST_FREQUENTLY_USED

_settings = settings(database=None, max_examples=300, deadline=None)

# Options with every field away from its default, so forwarding is observable.
CUSTOM_OFFLOAD = OffloadConfig(
  device_budget_bytes=3 * GiB, host_budget_bytes=9 * GiB, prefetch_depth=3, eviction_policy=LFU
)
CUSTOM_LAYERWISE = LayerwiseLoadOptions(
  offload=CUSTOM_OFFLOAD,
  max_cached_shards=7,
  strict_loading=False,
  sample_backend_memory=True,
  sample_process_memory=True,
)
CUSTOM_DENSE = DenseDiskStreamLoadOptions(
  device_budget_bytes=2 * GiB,
  host_budget_bytes=8 * GiB,
  host_lookahead=5,
  background_queue_capacity=3,
  eviction_policy=LFU,
  max_cached_shards=9,
  strict_loading=False,
  sample_backend_memory=True,
  sample_process_memory=False,
)
DIRECT_DENSE = DenseDiskStreamLoadOptions(
  host_budget_bytes=0, host_lookahead=0, background_queue_capacity=0
)

ALL_POLICIES = [
  FullyResident(),
  LayerwiseHost(),
  LayerwiseHost(CUSTOM_LAYERWISE),
  DenseDiskStream(),
  DenseDiskStream(CUSTOM_DENSE),
  DenseDiskStream(DIRECT_DENSE),
]


def _names_field_and_value(message: str, field: str, value: object) -> None:
  assert f"{field}={value!r}" in message, message


# --- module-level contract ---------------------------------------------------


def test_constants():
  assert DENSE_TRANSFER_WINDOW == 2
  assert DEFAULT_MAX_CACHED_SHARDS == 4


def test_enums():
  assert [m.name for m in CacheEvictionPolicy] == ["LEAST_RECENTLY_USED", "LEAST_FREQUENTLY_USED"]
  assert [m.name for m in ExecutionResidency] == [
    "FULLY_RESIDENT",
    "LAYERWISE_HOST",
    "DENSE_DISK_STREAM",
  ]
  assert repr(LFU) == "CacheEvictionPolicy.LEAST_FREQUENTLY_USED"


_PURE_PYTHON = sorted(
  str(p.relative_to(pathlib.Path(errors.__file__).parents[1]))
  for package in ("policy", "errors")
  for p in (pathlib.Path(errors.__file__).parents[1] / package).glob("*.py")
  if p.name != "__init__.py" or package == "errors"
)


@pytest.mark.parametrize("module", _PURE_PYTHON)
def test_policy_modules_do_not_import_jax(module):
  """The two bottom floors (docs/design.md, "Layers") are pure Python."""
  source = (pathlib.Path(errors.__file__).parents[1] / module).read_text()
  imported = []
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, ast.Import):
      imported += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module:
      imported.append(node.module)
  assert imported  # the walk saw the imports
  offenders = [m for m in imported if m.split(".")[0] in ("jax", "jaxlib", "flax", "numpy")]
  assert offenders == []


def test_errors_are_value_errors():
  for cls in (
    HostDisabledControlsError,
    InvalidBudgetError,
    InvalidPolicyValueError,
    UnknownPolicyFieldError,
    ZeroHostLookaheadError,
    ZeroMaxCachedShardsError,
    ZeroPrefetchDepthError,
    ZeroQueueCapacityError,
  ):
    assert issubclass(cls, WeightResidencyPolicyError)
    assert issubclass(cls, ValueError)


# --- OffloadConfig -------------------------------------------------------------


def test_offload_config_defaults():
  cfg = OffloadConfig()
  assert cfg.device_budget_bytes is None
  assert cfg.host_budget_bytes is None
  assert cfg.prefetch_depth == 1
  assert cfg.eviction_policy is LRU
  assert OffloadConfig.default() == cfg


def test_offload_config_zero_budgets_are_legal():
  cfg = OffloadConfig(device_budget_bytes=0, host_budget_bytes=0)
  assert (cfg.device_budget_bytes, cfg.host_budget_bytes) == (0, 0)


def test_offload_config_budget_strings_become_ints():
  cfg = OffloadConfig(device_budget_bytes="4 GiB", host_budget_bytes="100kB")
  assert cfg.device_budget_bytes == 4 * GiB
  assert cfg.host_budget_bytes == 100_000
  assert type(cfg.device_budget_bytes) is int
  assert OffloadConfig(host_budget_bytes="unbounded").host_budget_bytes is None
  assert cfg == OffloadConfig(device_budget_bytes=4 * GiB, host_budget_bytes=100_000)


def test_with_eviction_policy_returns_a_copy():
  cfg = OffloadConfig(device_budget_bytes=GiB, prefetch_depth=2)
  lfu = cfg.with_eviction_policy(LFU)
  assert lfu.eviction_policy is LFU
  assert cfg.eviction_policy is LRU  # the original is unchanged
  assert lfu == OffloadConfig(device_budget_bytes=GiB, prefetch_depth=2, eviction_policy=LFU)
  with pytest.raises(InvalidPolicyValueError, match="eviction_policy='lfu'"):
    cfg.with_eviction_policy("lfu")  # type: ignore[arg-type]


@pytest.mark.parametrize("depth", [0, -1, -100])
def test_prefetch_depth_below_one(depth):
  with pytest.raises(ZeroPrefetchDepthError) as excinfo:
    OffloadConfig(prefetch_depth=depth)
  _names_field_and_value(str(excinfo.value), "prefetch_depth", depth)
  assert "prefetch_depth=1" in str(excinfo.value)  # the fix


@pytest.mark.parametrize("depth", [True, 2.0, "2", None])
def test_prefetch_depth_wrong_type(depth):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    OffloadConfig(prefetch_depth=depth)
  _names_field_and_value(str(excinfo.value), "prefetch_depth", depth)


@pytest.mark.parametrize("field", ["device_budget_bytes", "host_budget_bytes"])
@pytest.mark.parametrize("value", [-1, True, 1.5, 2.0, "many", "1.5B", [4]])
def test_offload_config_bad_budgets(field, value):
  with pytest.raises(InvalidBudgetError) as excinfo:
    OffloadConfig(**{field: value})
  message = str(excinfo.value)
  _names_field_and_value(message, field, value)
  assert "OffloadConfig" in message
  assert "'512MiB'" in message  # the accepted forms


def test_offload_config_eviction_policy_wrong_type():
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    OffloadConfig(eviction_policy="least_recently_used")  # type: ignore[arg-type]
  message = str(excinfo.value)
  _names_field_and_value(message, "eviction_policy", "least_recently_used")
  assert "CacheEvictionPolicy.LEAST_FREQUENTLY_USED" in message


# --- LayerwiseLoadOptions ------------------------------------------------------


def test_layerwise_options_defaults():
  opts = LayerwiseLoadOptions()
  assert opts.offload == OffloadConfig()
  assert opts.max_cached_shards == 4
  assert opts.strict_loading is True
  assert opts.sample_backend_memory is False
  assert opts.sample_process_memory is False
  assert LayerwiseLoadOptions.default() == opts


@pytest.mark.parametrize("shards", [0, -3])
def test_layerwise_max_cached_shards_below_one(shards):
  with pytest.raises(ZeroMaxCachedShardsError) as excinfo:
    LayerwiseLoadOptions(max_cached_shards=shards)
  _names_field_and_value(str(excinfo.value), "max_cached_shards", shards)
  assert "max_cached_shards=4" in str(excinfo.value)


@pytest.mark.parametrize(
  "field", ["strict_loading", "sample_backend_memory", "sample_process_memory"]
)
@pytest.mark.parametrize("value", [1, 0, "yes", None])
def test_layerwise_flags_must_be_bools(field, value):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    LayerwiseLoadOptions(**{field: value})
  _names_field_and_value(str(excinfo.value), field, value)
  assert "True or False" in str(excinfo.value)


@pytest.mark.parametrize("offload", [None, {"prefetch_depth": 2}, DenseDiskStreamLoadOptions()])
def test_layerwise_offload_must_be_offload_config(offload):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    LayerwiseLoadOptions(offload=offload)
  assert f"offload={offload!r}" in str(excinfo.value)
  assert "OffloadConfig" in str(excinfo.value)


# --- DenseDiskStreamLoadOptions --------------------------------------------------


def test_dense_options_defaults():
  opts = DenseDiskStreamLoadOptions()
  assert opts.device_budget_bytes == 4 * GiB
  assert opts.host_budget_bytes == 16 * GiB
  assert opts.host_lookahead == 2
  assert opts.background_queue_capacity == 2
  assert opts.eviction_policy is LRU
  assert opts.max_cached_shards == 4
  assert opts.strict_loading is True
  assert opts.sample_backend_memory is False
  assert opts.sample_process_memory is False
  assert DenseDiskStreamLoadOptions.default() == opts


def test_dense_validate_passes_on_valid_options():
  for opts in (DenseDiskStreamLoadOptions(), CUSTOM_DENSE, DIRECT_DENSE):
    assert opts.validate() is None


@pytest.mark.parametrize(
  ("host", "lookahead", "queue", "error"),
  [
    # host budget 0 and (lookahead != 0 or queue != 0)
    (0, 1, 0, HostDisabledControlsError),
    (0, 0, 1, HostDisabledControlsError),
    (0, 2, 2, HostDisabledControlsError),
    (0, -1, 0, HostDisabledControlsError),
    # host budget > 0 (or unbounded) and lookahead 0
    (1, 0, 1, ZeroHostLookaheadError),
    (16 * GiB, 0, 2, ZeroHostLookaheadError),
    (None, 0, 2, ZeroHostLookaheadError),
    (GiB, -1, 2, ZeroHostLookaheadError),
    # host budget > 0 (or unbounded) and queue 0
    (1, 1, 0, ZeroQueueCapacityError),
    (None, 2, 0, ZeroQueueCapacityError),
    (GiB, 2, -4, ZeroQueueCapacityError),
    # precedence: the lookahead is reported before the queue
    (GiB, 0, 0, ZeroHostLookaheadError),
  ],
)
def test_dense_validation_table(host, lookahead, queue, error):
  with pytest.raises(error) as excinfo:
    DenseDiskStreamLoadOptions(
      host_budget_bytes=host, host_lookahead=lookahead, background_queue_capacity=queue
    )
  assert type(excinfo.value) is error
  message = str(excinfo.value)
  if error is HostDisabledControlsError:
    assert "host_budget_bytes=0" in message
    _names_field_and_value(message, "host_lookahead", lookahead)
    _names_field_and_value(message, "background_queue_capacity", queue)
    assert "set both to 0" in message
  elif error is ZeroHostLookaheadError:
    _names_field_and_value(message, "host_lookahead", lookahead)
    assert f"host_budget_bytes={host!r}" in message
    assert "set host_lookahead >= 1, or host_budget_bytes=0" in message
    assert "direct disk-to-device loading" in message
  else:
    _names_field_and_value(message, "background_queue_capacity", queue)
    assert "set background_queue_capacity >= 1, or host_budget_bytes=0" in message


@pytest.mark.parametrize(
  ("host", "lookahead", "queue"),
  [(0, 0, 0), (1, 1, 1), (None, 1, 1), (GiB, 7, 1), ("512MiB", 1, 9), ("0 GiB", 0, 0)],
)
def test_dense_valid_triples(host, lookahead, queue):
  opts = DenseDiskStreamLoadOptions(
    host_budget_bytes=host, host_lookahead=lookahead, background_queue_capacity=queue
  )
  assert opts.host_lookahead == lookahead
  assert opts.background_queue_capacity == queue


def test_dense_budget_strings_become_ints():
  opts = DenseDiskStreamLoadOptions(device_budget_bytes="1.5GB", host_budget_bytes="512MiB")
  assert opts.device_budget_bytes == 1_500_000_000
  assert opts.host_budget_bytes == 512 * MiB
  assert type(opts.host_budget_bytes) is int
  assert opts == DenseDiskStreamLoadOptions(
    device_budget_bytes=1_500_000_000, host_budget_bytes=512 * MiB
  )


@pytest.mark.parametrize(
  ("field", "value", "error"),
  [
    ("device_budget_bytes", -1, InvalidBudgetError),
    ("host_budget_bytes", 3.0, InvalidBudgetError),
    ("host_budget_bytes", False, InvalidBudgetError),
    ("device_budget_bytes", "4 XB", InvalidBudgetError),
    ("host_lookahead", 2.0, InvalidPolicyValueError),
    ("host_lookahead", True, InvalidPolicyValueError),
    ("background_queue_capacity", "2", InvalidPolicyValueError),
    ("eviction_policy", "least_recently_used", InvalidPolicyValueError),
    ("eviction_policy", 0, InvalidPolicyValueError),
    ("max_cached_shards", 0, ZeroMaxCachedShardsError),
    ("max_cached_shards", 4.0, InvalidPolicyValueError),
    ("strict_loading", "true", InvalidPolicyValueError),
    ("sample_backend_memory", 1, InvalidPolicyValueError),
    ("sample_process_memory", None, InvalidPolicyValueError),
  ],
)
def test_dense_field_errors(field, value, error):
  with pytest.raises(error) as excinfo:
    DenseDiskStreamLoadOptions(**{field: value})
  assert type(excinfo.value) is error
  message = str(excinfo.value)
  _names_field_and_value(message, field, value)
  assert message.startswith("DenseDiskStreamLoadOptions: ")


def test_dense_field_errors_come_before_the_host_cache_rules():
  # max_cached_shards=0 is reported (host_budget_bytes=0 alone now selects direct mode; the
  # test below adds an explicit host control so that the host-cache rules fail too).
  with pytest.raises(ZeroMaxCachedShardsError):
    DenseDiskStreamLoadOptions(host_budget_bytes=0, max_cached_shards=0)


def test_dense_validate_catches_tampering():
  opts = DenseDiskStreamLoadOptions()
  object.__setattr__(opts, "host_lookahead", 0)
  with pytest.raises(ZeroHostLookaheadError):
    opts.validate()


def test_dense_offload_revalidates():
  opts = DenseDiskStreamLoadOptions()
  policy = DenseDiskStream(opts)
  object.__setattr__(opts, "host_budget_bytes", 0)
  with pytest.raises(HostDisabledControlsError):
    policy.offload()


def test_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    DenseDiskStreamLoadOptions().host_lookahead = 3  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    OffloadConfig().prefetch_depth = 3  # type: ignore[misc]
  with pytest.raises(dataclasses.FrozenInstanceError):
    LayerwiseHost().options = LayerwiseLoadOptions()  # type: ignore[misc]


def test_keyword_only_options():
  with pytest.raises(TypeError):
    OffloadConfig(GiB)  # type: ignore[misc]
  with pytest.raises(TypeError):
    DenseDiskStreamLoadOptions(GiB)  # type: ignore[misc]


# --- dataclasses.replace revalidates ---------------------------------------------


def test_replace_revalidates():
  with pytest.raises(ZeroHostLookaheadError):
    dataclasses.replace(DenseDiskStreamLoadOptions(), host_lookahead=0)
  with pytest.raises(HostDisabledControlsError):
    dataclasses.replace(DenseDiskStreamLoadOptions(), host_budget_bytes=0)
  with pytest.raises(ZeroPrefetchDepthError):
    dataclasses.replace(OffloadConfig(), prefetch_depth=0)
  with pytest.raises(ZeroMaxCachedShardsError):
    dataclasses.replace(LayerwiseLoadOptions(), max_cached_shards=0)
  with pytest.raises(InvalidPolicyValueError):
    dataclasses.replace(LayerwiseHost(), options=DenseDiskStreamLoadOptions())
  replaced = dataclasses.replace(DenseDiskStreamLoadOptions(), host_budget_bytes="1GiB")
  assert replaced.host_budget_bytes == GiB


# --- policies: derived values ------------------------------------------------------


@pytest.mark.parametrize(
  ("policy", "expected"),
  [
    (
      FullyResident(),
      dict(
        name="fully_resident",
        max_cached_shards=4,
        strict_loading=True,
        sample_backend_memory=False,
        sample_process_memory=False,
        dense=None,
        is_fully_resident=True,
        execution_residency=ExecutionResidency.FULLY_RESIDENT,
      ),
    ),
    (
      LayerwiseHost(CUSTOM_LAYERWISE),
      dict(
        name="layerwise_host",
        max_cached_shards=7,
        strict_loading=False,
        sample_backend_memory=True,
        sample_process_memory=True,
        dense=None,
        is_fully_resident=False,
        execution_residency=ExecutionResidency.LAYERWISE_HOST,
      ),
    ),
    (
      LayerwiseHost(),
      dict(
        name="layerwise_host",
        max_cached_shards=4,
        strict_loading=True,
        sample_backend_memory=False,
        sample_process_memory=False,
        dense=None,
        is_fully_resident=False,
        execution_residency=ExecutionResidency.LAYERWISE_HOST,
      ),
    ),
    (
      DenseDiskStream(CUSTOM_DENSE),
      dict(
        name="dense_disk_stream",
        max_cached_shards=9,
        strict_loading=False,
        sample_backend_memory=True,
        sample_process_memory=False,
        dense=CUSTOM_DENSE,
        is_fully_resident=False,
        execution_residency=ExecutionResidency.DENSE_DISK_STREAM,
      ),
    ),
    (
      DenseDiskStream(DenseDiskStreamLoadOptions(sample_process_memory=True)),
      dict(
        name="dense_disk_stream",
        max_cached_shards=4,
        strict_loading=True,
        sample_backend_memory=False,
        sample_process_memory=True,
        dense=DenseDiskStreamLoadOptions(sample_process_memory=True),
        is_fully_resident=False,
        execution_residency=ExecutionResidency.DENSE_DISK_STREAM,
      ),
    ),
  ],
  ids=["fully_resident", "layerwise_custom", "layerwise_default", "dense_custom", "dense_rss"],
)
def test_policy_properties(policy, expected):
  actual = {key: getattr(policy, key) for key in expected}
  assert actual == expected
  for key in ("strict_loading", "sample_backend_memory", "sample_process_memory"):
    assert type(actual[key]) is bool


def test_dense_property_is_the_options_object():
  policy = DenseDiskStream(CUSTOM_DENSE)
  assert policy.dense is CUSTOM_DENSE


@pytest.mark.parametrize("units", [0, 1, 2, 3, 48])
def test_device_depth(units):
  assert FullyResident().device_depth(units) == units
  assert LayerwiseHost().device_depth(units) == 1
  assert LayerwiseHost(CUSTOM_LAYERWISE).device_depth(units) == 3
  assert DenseDiskStream().device_depth(units) == min(units, 2)
  assert DenseDiskStream(DIRECT_DENSE).device_depth(units) == min(units, 2)
  # The dense window does not grow with host_lookahead (5 here).
  assert DenseDiskStream(CUSTOM_DENSE).device_depth(units) == min(units, 2)


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
@pytest.mark.parametrize("units", [-1, 2.0, "3", True, None])
def test_device_depth_rejects_bad_unit_counts(policy, units):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    policy.device_depth(units)
  _names_field_and_value(str(excinfo.value), "unit_count", units)


def test_offload_fully_resident():
  cfg = FullyResident().offload()
  assert cfg == OffloadConfig()
  assert cfg.device_budget_bytes is None and cfg.host_budget_bytes is None
  assert cfg.prefetch_depth == 1


def test_offload_layerwise_is_its_config():
  assert LayerwiseHost(CUSTOM_LAYERWISE).offload() is CUSTOM_OFFLOAD
  assert LayerwiseHost().offload() == OffloadConfig()


@pytest.mark.parametrize(
  ("opts", "expected"),
  [
    (
      DenseDiskStreamLoadOptions(),
      OffloadConfig(device_budget_bytes=4 * GiB, host_budget_bytes=16 * GiB, prefetch_depth=2),
    ),
    (
      CUSTOM_DENSE,
      OffloadConfig(
        device_budget_bytes=2 * GiB,
        host_budget_bytes=8 * GiB,
        prefetch_depth=5,
        eviction_policy=LFU,
      ),
    ),
    (
      DenseDiskStreamLoadOptions(host_lookahead=1, device_budget_bytes=None),
      OffloadConfig(device_budget_bytes=None, host_budget_bytes=16 * GiB, prefetch_depth=2),
    ),
    (
      DIRECT_DENSE,
      OffloadConfig(device_budget_bytes=4 * GiB, host_budget_bytes=0, prefetch_depth=2),
    ),
    (
      DenseDiskStreamLoadOptions(host_budget_bytes=None, host_lookahead=3),
      OffloadConfig(device_budget_bytes=4 * GiB, host_budget_bytes=None, prefetch_depth=3),
    ),
  ],
)
def test_offload_dense(opts, expected):
  assert DenseDiskStream(opts).offload() == expected


# --- match, of(), default() ----------------------------------------------------------


def _describe(policy: LayerWeightResidency) -> tuple[str, object]:
  match policy:
    case FullyResident():
      return ("resident", None)
    case LayerwiseHost(opts):
      return ("layerwise", opts)
    case DenseDiskStream(opts):
      return ("dense", opts)
    case _:
      return ("other", None)


def test_match_on_variants():
  assert _describe(FullyResident()) == ("resident", None)
  kind, opts = _describe(LayerwiseHost(CUSTOM_LAYERWISE))
  assert kind == "layerwise" and opts is CUSTOM_LAYERWISE
  kind, opts = _describe(DenseDiskStream(CUSTOM_DENSE))
  assert kind == "dense" and opts is CUSTOM_DENSE
  assert FullyResident.__match_args__ == ()
  assert LayerwiseHost.__match_args__ == ("options",)
  assert DenseDiskStream.__match_args__ == ("options",)


def test_match_keyword_patterns():
  match DenseDiskStream(DIRECT_DENSE):
    case DenseDiskStream(options=DenseDiskStreamLoadOptions(host_budget_bytes=0)):
      direct = True
    case _:
      direct = False
  assert direct


def test_variants_take_options_positionally_or_by_keyword():
  assert LayerwiseHost(CUSTOM_LAYERWISE) == LayerwiseHost(options=CUSTOM_LAYERWISE)
  assert DenseDiskStream(CUSTOM_DENSE) == DenseDiskStream(options=CUSTOM_DENSE)
  assert LayerwiseHost().options == LayerwiseLoadOptions()
  assert DenseDiskStream().options == DenseDiskStreamLoadOptions.default()


@pytest.mark.parametrize(
  ("variant", "options"),
  [
    (LayerwiseHost, DenseDiskStreamLoadOptions()),
    (LayerwiseHost, OffloadConfig()),
    (LayerwiseHost, None),
    (DenseDiskStream, LayerwiseLoadOptions()),
    (DenseDiskStream, {"host_lookahead": 2}),
  ],
)
def test_variants_reject_wrong_options(variant, options):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    variant(options)
  _names_field_and_value(str(excinfo.value), "options", options)
  assert type(options).__name__ in str(excinfo.value)


def test_default_is_fully_resident():
  assert LayerWeightResidency.default() == FullyResident()
  assert type(LayerWeightResidency.default()) is FullyResident
  assert OrdinaryWeightResidency.default() == FullyResident()
  assert LayerwiseHost.default() == LayerwiseHost(LayerwiseLoadOptions())
  assert DenseDiskStream.default() == DenseDiskStream(DenseDiskStreamLoadOptions())


@pytest.mark.parametrize("base", [LayerWeightResidency, OrdinaryWeightResidency])
def test_of_converts(base):
  assert base.of(CUSTOM_LAYERWISE) == LayerwiseHost(CUSTOM_LAYERWISE)
  assert type(base.of(CUSTOM_LAYERWISE)) is LayerwiseHost
  assert base.of(CUSTOM_DENSE) == DenseDiskStream(CUSTOM_DENSE)
  assert type(base.of(CUSTOM_DENSE)) is DenseDiskStream
  for policy in ALL_POLICIES:
    assert base.of(policy) is policy


def test_of_accepts_ordinary_values():
  ordinary: OrdinaryWeightResidency = OrdinaryWeightResidency.of(CUSTOM_DENSE)
  assert LayerWeightResidency.of(ordinary) is ordinary


def test_ordinary_is_a_distinct_type_of_the_same_choice():
  assert OrdinaryWeightResidency is not LayerWeightResidency
  assert issubclass(OrdinaryWeightResidency, LayerWeightResidency)
  for policy in ALL_POLICIES:
    assert isinstance(policy, OrdinaryWeightResidency)
    assert isinstance(policy, LayerWeightResidency)
  with pytest.raises(TypeError):
    LayerWeightResidency()  # type: ignore[abstract]


@pytest.mark.parametrize("base", [LayerWeightResidency, OrdinaryWeightResidency])
@pytest.mark.parametrize(
  "value", [None, OffloadConfig(), "fully_resident", {"kind": "fully_resident"}, 3, FullyResident]
)
def test_of_rejects_other_types(base, value):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    base.of(value)
  message = str(excinfo.value)
  assert f"of type {type(value).__name__}" in message
  assert f"{base.__name__}.of()" in message
  assert "LayerwiseLoadOptions" in message and "DenseDiskStreamLoadOptions" in message


def test_variant_of_rejects_another_variant():
  with pytest.raises(InvalidPolicyValueError, match="LayerwiseHost.of"):
    LayerwiseHost.of(CUSTOM_DENSE)
  assert DenseDiskStream.of(CUSTOM_DENSE) == DenseDiskStream(CUSTOM_DENSE)


# --- hashing, equality, static jit arguments ---------------------------------------


def test_equal_policies_hash_equal():
  a = DenseDiskStream(DenseDiskStreamLoadOptions(host_budget_bytes="512MiB"))
  b = DenseDiskStream(DenseDiskStreamLoadOptions(host_budget_bytes=512 * MiB))
  assert a == b and hash(a) == hash(b)
  assert FullyResident() == FullyResident() and hash(FullyResident()) == hash(FullyResident())
  assert LayerwiseHost() == LayerwiseHost(LayerwiseLoadOptions())


def test_distinct_policies_are_unequal():
  policies = ALL_POLICIES + [
    DenseDiskStream(DenseDiskStreamLoadOptions(host_lookahead=3)),
    LayerwiseHost(LayerwiseLoadOptions(offload=OffloadConfig(eviction_policy=LFU))),
  ]
  for i, p in enumerate(policies):
    for j, q in enumerate(policies):
      assert (p == q) == (i == j), (p, q)
  table = {p: i for i, p in enumerate(policies)}
  assert len(table) == len(policies)
  assert table[DenseDiskStream(CUSTOM_DENSE)] == 4


def test_options_are_hashable_dict_keys():
  table = {OffloadConfig(): "a", LayerwiseLoadOptions(): "b", DenseDiskStreamLoadOptions(): "c"}
  assert table[OffloadConfig(prefetch_depth=1)] == "a"
  assert table[DenseDiskStreamLoadOptions(host_budget_bytes="16GiB")] == "c"


def test_policies_are_static_jit_arguments():
  traces = []

  def scale(x, policy):
    traces.append(policy)
    return x * policy.device_depth(4)

  jitted = jax.jit(scale, static_argnums=1)
  x = jnp.ones(3)
  assert float(jitted(x, FullyResident())[0]) == 4.0
  assert float(jitted(x, FullyResident())[0]) == 4.0
  assert len(traces) == 1  # an equal policy hits the cache
  assert float(jitted(x, DenseDiskStream())[0]) == 2.0
  dense_again = DenseDiskStream(DenseDiskStreamLoadOptions(device_budget_bytes="4GiB"))
  assert float(jitted(x, dense_again)[0]) == 2.0
  assert len(traces) == 2


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
def test_pickle_and_copy(policy):
  assert pickle.loads(pickle.dumps(policy)) == policy
  assert copy.deepcopy(policy) == policy


# --- to_dict / from_dict ----------------------------------------------------------


def test_dense_policy_dict():
  assert DenseDiskStream().to_dict() == {
    "kind": "dense_disk_stream",
    "options": {
      "device_budget_bytes": 4 * GiB,
      "host_budget_bytes": 16 * GiB,
      "host_lookahead": 2,
      "background_queue_capacity": 2,
      "device_resident_units": 0,
      "host_resident_units": 0,
      "eviction_policy": "least_recently_used",
      "max_cached_shards": 4,
      "strict_loading": True,
      "sample_backend_memory": False,
      "sample_process_memory": False,
      "experts": None,
    },
  }


def test_layerwise_and_resident_policy_dicts():
  assert FullyResident().to_dict() == {"kind": "fully_resident"}
  assert LayerwiseHost(CUSTOM_LAYERWISE).to_dict() == {
    "kind": "layerwise_host",
    "options": {
      "offload": {
        "device_budget_bytes": 3 * GiB,
        "host_budget_bytes": 9 * GiB,
        "prefetch_depth": 3,
        "eviction_policy": "least_frequently_used",
      },
      "device_resident_units": 0,
      "max_cached_shards": 7,
      "strict_loading": False,
      "sample_backend_memory": True,
      "sample_process_memory": True,
    },
  }


@pytest.mark.parametrize("policy", ALL_POLICIES, ids=repr)
@pytest.mark.parametrize("base", [LayerWeightResidency, OrdinaryWeightResidency])
def test_policy_json_round_trip(policy, base):
  text = json.dumps(policy.to_dict())
  restored = base.from_dict(json.loads(text))
  assert restored == policy
  assert type(restored) is type(policy)
  assert json.dumps(restored.to_dict()) == text
  assert type(policy).from_dict(policy.to_dict()) == policy


@pytest.mark.parametrize(
  "opts",
  [
    OffloadConfig(),
    CUSTOM_OFFLOAD,
    LayerwiseLoadOptions(),
    CUSTOM_LAYERWISE,
    DenseDiskStreamLoadOptions(),
    CUSTOM_DENSE,
    DIRECT_DENSE,
  ],
  ids=repr,
)
def test_options_json_round_trip(opts):
  restored = type(opts).from_dict(json.loads(json.dumps(opts.to_dict())))
  assert restored == opts
  assert type(restored) is type(opts)


def test_from_dict_accepts_size_strings_and_enum_names():
  policy = LayerWeightResidency.from_dict(
    {
      "kind": "dense_disk_stream",
      "options": {
        "device_budget_bytes": "2 GiB",
        "host_budget_bytes": "512MiB",
        "eviction_policy": "LEAST_FREQUENTLY_USED",
      },
    }
  )
  assert policy == DenseDiskStream(
    DenseDiskStreamLoadOptions(
      device_budget_bytes=2 * GiB, host_budget_bytes=512 * MiB, eviction_policy=LFU
    )
  )
  assert policy.to_dict()["options"]["host_budget_bytes"] == 512 * MiB
  layerwise = LayerwiseHost.from_dict(
    {"kind": "layerwise_host", "options": {"offload": {"host_budget_bytes": "none"}}}
  )
  assert layerwise.offload().host_budget_bytes is None


def test_from_dict_missing_keys_take_defaults():
  assert LayerWeightResidency.from_dict({"kind": "dense_disk_stream"}) == DenseDiskStream()
  assert (
    LayerWeightResidency.from_dict({"kind": "layerwise_host", "options": {}}) == LayerwiseHost()
  )
  assert DenseDiskStreamLoadOptions.from_dict({"host_lookahead": 3}) == DenseDiskStreamLoadOptions(
    host_lookahead=3
  )


def test_from_dict_validates():
  with pytest.raises(ZeroHostLookaheadError):
    LayerWeightResidency.from_dict({"kind": "dense_disk_stream", "options": {"host_lookahead": 0}})
  with pytest.raises(ZeroPrefetchDepthError):
    LayerwiseLoadOptions.from_dict({"offload": {"prefetch_depth": 0}})


@pytest.mark.parametrize(
  ("cls", "data", "key", "valid"),
  [
    (DenseDiskStreamLoadOptions, {"host_lookahed": 2}, "host_lookahed", "host_lookahead"),
    (OffloadConfig, {"budget": 1}, "budget", "prefetch_depth"),
    (LayerwiseLoadOptions, {"prefetch_depth": 2}, "prefetch_depth", "offload"),
    (LayerwiseLoadOptions, {"offload": {"depth": 2}}, "depth", "prefetch_depth"),
    (LayerWeightResidency, {"kind": "fully_resident", "extra": 1}, "extra", "options"),
    (LayerWeightResidency, {"kind": "fully_resident", "options": {}}, "options", "kind"),
    (
      LayerWeightResidency,
      {"kind": "dense_disk_stream", "options": {"lookahead": 1}},
      "lookahead",
      "host_lookahead",
    ),
  ],
)
def test_from_dict_unknown_key(cls, data, key, valid):
  with pytest.raises(UnknownPolicyFieldError) as excinfo:
    cls.from_dict(data)
  message = str(excinfo.value)
  assert f"unknown key {key!r}" in message
  assert "valid keys are" in message and repr(valid) in message


@pytest.mark.parametrize("kind", ["disk", "FullyResident", "", 3, None])
def test_from_dict_unknown_kind(kind):
  with pytest.raises(UnknownPolicyFieldError) as excinfo:
    LayerWeightResidency.from_dict({"kind": kind})
  message = str(excinfo.value)
  assert f"kind={kind!r}" in message
  for valid in ("'fully_resident'", "'layerwise_host'", "'dense_disk_stream'"):
    assert valid in message


def test_from_dict_unknown_eviction_policy():
  with pytest.raises(UnknownPolicyFieldError) as excinfo:
    OffloadConfig.from_dict({"eviction_policy": "fifo"})
  message = str(excinfo.value)
  _names_field_and_value(message, "eviction_policy", "fifo")
  assert "'least_recently_used'" in message and "'least_frequently_used'" in message


def test_from_dict_rejects_bad_shapes():
  with pytest.raises(InvalidPolicyValueError, match="missing key 'kind'"):
    LayerWeightResidency.from_dict({"options": {}})
  with pytest.raises(InvalidPolicyValueError, match="pass a dict"):
    LayerWeightResidency.from_dict([("kind", "fully_resident")])  # type: ignore[arg-type]
  with pytest.raises(InvalidPolicyValueError, match="pass a dict"):
    LayerWeightResidency.from_dict({"kind": "dense_disk_stream", "options": "fast"})
  with pytest.raises(InvalidPolicyValueError, match="is not a LayerwiseHost"):
    LayerwiseHost.from_dict({"kind": "dense_disk_stream"})


# --- repr --------------------------------------------------------------------------


def test_repr_shows_budgets_in_human_units():
  opts = DenseDiskStreamLoadOptions(host_budget_bytes="512MiB", device_budget_bytes=None)
  text = repr(opts)
  assert text.startswith(
    "DenseDiskStreamLoadOptions(device_budget_bytes=unbounded, host_budget_bytes=512.0 MiB, "
    "host_lookahead=2, background_queue_capacity=2, device_resident_units=0, "
    "host_resident_units=0, eviction_policy=CacheEvictionPolicy.LEAST_RECENTLY_USED, "
    "max_cached_shards=4, "
  )
  assert type(opts.host_budget_bytes) is int  # the field stays an int
  assert repr(DenseDiskStreamLoadOptions()).startswith(
    "DenseDiskStreamLoadOptions(device_budget_bytes=4.0 GiB, host_budget_bytes=16.0 GiB, "
  )
  assert "host_budget_bytes=0 B," in repr(DIRECT_DENSE)


def test_repr_keeps_inexact_budgets_exact():
  cfg = OffloadConfig(device_budget_bytes=1500, host_budget_bytes=1536)
  assert "device_budget_bytes=1.5 KiB (1500 B)" in repr(cfg)
  assert "host_budget_bytes=1.5 KiB," in repr(cfg)


def test_policy_reprs():
  assert repr(FullyResident()) == "FullyResident()"
  assert repr(LayerwiseHost()).startswith(
    "LayerwiseHost(options=LayerwiseLoadOptions(offload=OffloadConfig("
    "device_budget_bytes=unbounded, host_budget_bytes=unbounded, prefetch_depth=1, "
  )
  assert repr(DenseDiskStream(CUSTOM_DENSE)).startswith(
    "DenseDiskStream(options=DenseDiskStreamLoadOptions(device_budget_bytes=2.0 GiB, "
  )


# --- properties -----------------------------------------------------------------


_positive_budget = st.one_of(st.none(), st.integers(min_value=1, max_value=2**50))
_any_budget = st.one_of(st.none(), st.integers(min_value=0, max_value=2**50))


@st.composite
def _valid_dense_kwargs(draw):
  host = draw(st.one_of(st.just(0), _positive_budget))
  if host == 0:
    lookahead, queue = 0, 0
  else:
    lookahead = draw(st.integers(min_value=1, max_value=64))
    queue = draw(st.integers(min_value=1, max_value=64))
  return dict(
    device_budget_bytes=draw(_any_budget),
    host_budget_bytes=host,
    host_lookahead=lookahead,
    background_queue_capacity=queue,
    eviction_policy=draw(st.sampled_from(CacheEvictionPolicy)),
    max_cached_shards=draw(st.integers(min_value=1, max_value=64)),
    strict_loading=draw(st.booleans()),
    sample_backend_memory=draw(st.booleans()),
    sample_process_memory=draw(st.booleans()),
  )


@_settings
@given(_valid_dense_kwargs(), st.integers(min_value=0, max_value=1000))
def test_valid_dense_options_resolve_as_specified(kwargs, units):
  opts = DenseDiskStreamLoadOptions(**kwargs)
  policy = DenseDiskStream(opts)
  cfg = policy.offload()
  assert cfg.prefetch_depth == max(kwargs["host_lookahead"], 2)
  assert cfg.device_budget_bytes == kwargs["device_budget_bytes"]
  assert cfg.host_budget_bytes == kwargs["host_budget_bytes"]
  assert cfg.eviction_policy is kwargs["eviction_policy"]
  assert policy.device_depth(units) == min(units, 2)
  assert policy.max_cached_shards == kwargs["max_cached_shards"]
  assert policy.strict_loading is kwargs["strict_loading"]
  assert policy.sample_backend_memory is kwargs["sample_backend_memory"]
  assert policy.sample_process_memory is kwargs["sample_process_memory"]
  assert LayerWeightResidency.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


def _spec_error(host, lookahead, queue):
  """The defaults table of docs/design.md, section 1, with the documented precedence:
  host==0, then lookahead, then queue."""
  if host == 0:
    return HostDisabledControlsError if (lookahead, queue) != (0, 0) else None
  if lookahead < 1:
    return ZeroHostLookaheadError
  if queue < 1:
    return ZeroQueueCapacityError
  return None


@_settings
@given(
  host=st.one_of(st.just(0), _positive_budget),
  lookahead=st.integers(min_value=-3, max_value=4),
  queue=st.integers(min_value=-3, max_value=4),
)
def test_every_host_triple_raises_exactly_the_spec_error(host, lookahead, queue):
  expected = _spec_error(host, lookahead, queue)
  kwargs = dict(host_budget_bytes=host, host_lookahead=lookahead, background_queue_capacity=queue)
  if expected is None:
    assert DenseDiskStreamLoadOptions(**kwargs).validate() is None
    return
  with pytest.raises(WeightResidencyPolicyError) as excinfo:
    DenseDiskStreamLoadOptions(**kwargs)
  assert type(excinfo.value) is expected


@_settings
@given(
  device=_any_budget,
  host=_any_budget,
  depth=st.integers(min_value=1, max_value=64),
  eviction=st.sampled_from(CacheEvictionPolicy),
  shards=st.integers(min_value=1, max_value=64),
  flags=st.tuples(st.booleans(), st.booleans(), st.booleans()),
)
def test_layerwise_policies_forward_their_options(device, host, depth, eviction, shards, flags):
  cfg = OffloadConfig(
    device_budget_bytes=device,
    host_budget_bytes=host,
    prefetch_depth=depth,
    eviction_policy=eviction,
  )
  opts = LayerwiseLoadOptions(
    offload=cfg,
    max_cached_shards=shards,
    strict_loading=flags[0],
    sample_backend_memory=flags[1],
    sample_process_memory=flags[2],
  )
  policy = LayerWeightResidency.of(opts)
  assert policy.offload() == cfg
  assert policy.device_depth(1000) == depth
  assert (policy.max_cached_shards, policy.strict_loading) == (shards, flags[0])
  assert (policy.sample_backend_memory, policy.sample_process_memory) == flags[1:]
  assert LayerWeightResidency.from_dict(json.loads(json.dumps(policy.to_dict()))) == policy


# --- flat keyword constructors -------------------------------------------------------


def test_flat_constructors_equal_the_nested_form():
  assert LayerwiseHost(prefetch_depth=2) == LayerwiseHost(
    LayerwiseLoadOptions(offload=OffloadConfig(prefetch_depth=2))
  )
  flat = LayerwiseHost(
    device_budget_bytes="3GiB",
    host_budget_bytes=9 * GiB,
    prefetch_depth=3,
    eviction_policy=LFU,
    max_cached_shards=7,
    strict_loading=False,
    sample_backend_memory=True,
    sample_process_memory=True,
  )
  assert flat == LayerwiseHost(CUSTOM_LAYERWISE)
  assert hash(flat) == hash(LayerwiseHost(CUSTOM_LAYERWISE))
  assert LayerwiseHost(offload=CUSTOM_OFFLOAD, max_cached_shards=3) == LayerwiseHost(
    LayerwiseLoadOptions(offload=CUSTOM_OFFLOAD, max_cached_shards=3)
  )
  dense = DenseDiskStream(
    device_budget_bytes=2 * GiB,
    host_budget_bytes="8GiB",
    host_lookahead=5,
    background_queue_capacity=3,
    eviction_policy=LFU,
    max_cached_shards=9,
    strict_loading=False,
    sample_backend_memory=True,
    sample_process_memory=False,
  )
  assert dense == DenseDiskStream(CUSTOM_DENSE)
  assert hash(dense) == hash(DenseDiskStream(CUSTOM_DENSE))
  assert DenseDiskStream(host_lookahead=3) == DenseDiskStream(
    DenseDiskStreamLoadOptions(host_lookahead=3)
  )
  # No keywords at all is the default options object, as before.
  assert LayerwiseHost() == LayerwiseHost(LayerwiseLoadOptions())
  assert DenseDiskStream() == DenseDiskStream(DenseDiskStreamLoadOptions())


def test_dense_zero_host_budget_alone_is_direct_mode():
  policy = DenseDiskStream(host_budget_bytes=0)
  assert policy.options.host_lookahead == 0
  assert policy.options.background_queue_capacity == 0
  assert policy.options == DIRECT_DENSE
  assert policy == DenseDiskStream(DIRECT_DENSE)
  assert policy.offload() == OffloadConfig(
    device_budget_bytes=4 * GiB, host_budget_bytes=0, prefetch_depth=2
  )
  # The options type follows the same rule, also from a size string and from a dict.
  assert DenseDiskStreamLoadOptions(host_budget_bytes=0) == DIRECT_DENSE
  assert DenseDiskStreamLoadOptions(host_budget_bytes="0 GiB") == DIRECT_DENSE
  assert DenseDiskStreamLoadOptions.from_dict({"host_budget_bytes": 0}) == DIRECT_DENSE
  assert LayerWeightResidency.from_dict(
    {"kind": "dense_disk_stream", "options": {"host_budget_bytes": 0}}
  ) == DenseDiskStream(DIRECT_DENSE)
  # Only the unset control follows; an explicit 0 is accepted too.
  assert DenseDiskStream(host_budget_bytes=0, host_lookahead=0).options == DIRECT_DENSE
  # With a host cache, unset controls keep their default of 2.
  opts = DenseDiskStream(host_budget_bytes="1GiB").options
  assert (opts.host_lookahead, opts.background_queue_capacity) == (2, 2)
  opts = DenseDiskStream(host_budget_bytes=None).options
  assert (opts.host_lookahead, opts.background_queue_capacity) == (2, 2)


@pytest.mark.parametrize(
  "controls",
  [
    dict(host_lookahead=2),
    dict(background_queue_capacity=1),
    dict(host_lookahead=2, background_queue_capacity=2),
    dict(host_lookahead=0, background_queue_capacity=3),
  ],
)
@pytest.mark.parametrize("build", ["flat", "nested"])
def test_dense_zero_host_budget_with_explicit_controls_still_raises(controls, build):
  with pytest.raises(HostDisabledControlsError) as excinfo:
    if build == "flat":
      DenseDiskStream(host_budget_bytes=0, **controls)
    else:
      DenseDiskStream(DenseDiskStreamLoadOptions(host_budget_bytes=0, **controls))
  message = str(excinfo.value)
  assert "host_budget_bytes=0" in message
  for field, value in controls.items():
    _names_field_and_value(message, field, value)
  assert "set both to 0" in message


def test_dense_field_errors_come_before_the_host_cache_rules_with_explicit_controls():
  with pytest.raises(ZeroMaxCachedShardsError):
    DenseDiskStreamLoadOptions(host_budget_bytes=0, host_lookahead=2, max_cached_shards=0)


@pytest.mark.parametrize(
  ("variant", "options", "fields"),
  [
    (LayerwiseHost, LayerwiseLoadOptions(), {"prefetch_depth": 2}),
    (LayerwiseHost, CUSTOM_LAYERWISE, {"max_cached_shards": 3}),
    (DenseDiskStream, DenseDiskStreamLoadOptions(), {"host_budget_bytes": 0}),
    (DenseDiskStream, CUSTOM_DENSE, {"host_lookahead": 3, "strict_loading": False}),
  ],
)
@pytest.mark.parametrize("by_keyword", [False, True])
def test_mixing_options_and_keyword_fields_raises(variant, options, fields, by_keyword):
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    if by_keyword:
      variant(options=options, **fields)
    else:
      variant(options, **fields)
  message = str(excinfo.value)
  assert message.startswith(f"{variant.__name__}: ")
  _names_field_and_value(message, "options", options)
  for field, value in fields.items():
    _names_field_and_value(message, field, value)
  assert "not both" in message


def test_mixing_offload_and_its_fields_raises():
  with pytest.raises(InvalidPolicyValueError) as excinfo:
    LayerwiseHost(offload=CUSTOM_OFFLOAD, prefetch_depth=2)
  message = str(excinfo.value)
  _names_field_and_value(message, "offload", CUSTOM_OFFLOAD)
  _names_field_and_value(message, "prefetch_depth", 2)
  assert "not both" in message


@pytest.mark.parametrize(
  ("variant", "field", "close", "valid"),
  [
    (LayerwiseHost, "prefetch_dept", "prefetch_depth", "max_cached_shards"),
    (LayerwiseHost, "host_lookahead", None, "prefetch_depth"),
    (DenseDiskStream, "prefetch_depth", None, "host_lookahead"),
    (DenseDiskStream, "host_budget", "host_budget_bytes", "background_queue_capacity"),
    (FullyResident, "prefetch_depth", None, "device_budget_bytes"),
    (FullyResident, "options", None, "device_budget_bytes"),
  ],
)
def test_unknown_keyword_field_raises(variant, field, close, valid):
  with pytest.raises(UnknownPolicyFieldError) as excinfo:
    variant(**{field: 1})
  message = str(excinfo.value)
  assert message.startswith(f"{variant.__name__}: unknown field {field!r}")
  assert "valid fields are" in message and repr(valid) in message
  if close is not None:
    assert f"did you mean {close!r}?" in message


def test_unknown_keyword_field_is_reported_even_with_options():
  with pytest.raises(UnknownPolicyFieldError, match="unknown field 'depth'"):
    LayerwiseHost(LayerwiseLoadOptions(), depth=2)  # type: ignore[call-arg]


@pytest.mark.parametrize(
  ("kwargs", "error"),
  [
    (dict(prefetch_depth=0), ZeroPrefetchDepthError),
    (dict(device_budget_bytes="lots"), InvalidBudgetError),
    (dict(max_cached_shards=0), ZeroMaxCachedShardsError),
    (dict(strict_loading="yes"), InvalidPolicyValueError),
  ],
)
def test_flat_layerwise_fields_are_validated(kwargs, error):
  with pytest.raises(error) as excinfo:
    LayerwiseHost(**kwargs)
  ((field, value),) = kwargs.items()
  _names_field_and_value(str(excinfo.value), field, value)


def test_flat_dense_fields_are_validated():
  with pytest.raises(ZeroHostLookaheadError):
    DenseDiskStream(host_lookahead=0)
  with pytest.raises(InvalidBudgetError, match="host_budget_bytes=-1"):
    DenseDiskStream(host_budget_bytes=-1)


def test_fully_resident_device_budget():
  policy = FullyResident(device_budget_bytes="8GiB")
  assert policy.device_budget_bytes == 8 * GiB
  assert type(policy.device_budget_bytes) is int
  assert policy.offload() == OffloadConfig(device_budget_bytes=8 * GiB)
  assert policy.device_depth(5) == 5
  assert policy == FullyResident(device_budget_bytes=8 * GiB)
  assert hash(policy) == hash(FullyResident(device_budget_bytes=8 * GiB))
  assert policy != FullyResident()
  assert FullyResident(device_budget_bytes=None) == FullyResident()
  assert repr(policy) == "FullyResident(device_budget_bytes=8.0 GiB)"
  assert policy.to_dict() == {"kind": "fully_resident", "device_budget_bytes": 8 * GiB}
  assert FullyResident().to_dict() == {"kind": "fully_resident"}
  with pytest.raises(InvalidBudgetError, match="FullyResident: .*device_budget_bytes=-2"):
    FullyResident(device_budget_bytes=-2)
  with pytest.raises(TypeError):
    FullyResident(8 * GiB)  # type: ignore[misc]
  match policy:
    case FullyResident(device_budget_bytes=budget):
      assert budget == 8 * GiB
  assert dataclasses.replace(policy, device_budget_bytes="1GiB").device_budget_bytes == GiB


FLAT_POLICIES = [
  FullyResident(device_budget_bytes="2GiB"),
  LayerwiseHost(prefetch_depth=2, device_budget_bytes="2GiB"),
  LayerwiseHost(host_budget_bytes=0, eviction_policy=LFU, sample_process_memory=True),
  DenseDiskStream(host_budget_bytes=0),
  DenseDiskStream(host_budget_bytes="512MiB", host_lookahead=3, device_budget_bytes=None),
]


@pytest.mark.parametrize("policy", FLAT_POLICIES, ids=repr)
@pytest.mark.parametrize("base", [LayerWeightResidency, OrdinaryWeightResidency])
def test_flat_policy_round_trips(policy, base):
  text = json.dumps(policy.to_dict())
  restored = base.from_dict(json.loads(text))
  assert restored == policy and hash(restored) == hash(policy)
  assert type(restored) is type(policy)
  assert json.dumps(restored.to_dict()) == text
  assert type(policy).from_dict(policy.to_dict()) == policy
  assert pickle.loads(pickle.dumps(policy)) == policy
  assert copy.deepcopy(policy) == policy
  assert LayerWeightResidency.of(policy) is policy
  with pytest.raises(dataclasses.FrozenInstanceError):
    policy.options = None  # type: ignore[misc,union-attr]


def test_fully_resident_from_dict_rejects_unknown_keys():
  with pytest.raises(UnknownPolicyFieldError) as excinfo:
    LayerWeightResidency.from_dict({"kind": "fully_resident", "prefetch_depth": 2})
  assert "'device_budget_bytes'" in str(excinfo.value)


def test_of_keeps_converting_options():
  assert LayerWeightResidency.of(LayerwiseLoadOptions(max_cached_shards=2)) == LayerwiseHost(
    max_cached_shards=2
  )
  assert LayerWeightResidency.of(
    DenseDiskStreamLoadOptions(host_budget_bytes=0)
  ) == DenseDiskStream(host_budget_bytes=0)
