"""Shared test setup: eight fake CPU devices, small models, meshes, fixtures.

The device count must be fixed before JAX creates its CPU backend, so it is set
here, at conftest import, before any test module touches a device (optax
``_src/sharding_test.py``, equinox ``tests/conftest.py``). The library's default
persistent compilation cache is switched off here too, for the same reason: it
must be off before anything is placed; the session compiles into a temporary cache
of its own instead (below).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

N_DEVICES = 8
_FLAG = f"--xla_force_host_platform_device_count={N_DEVICES}"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()

# The suite never writes compiled programs into the user's cache directory: place()
# leaves JAX's persistent compilation cache off (tests/test_compile_cache.py turns it
# on in subprocesses, under temporary directories). Child processes inherit this, but for
# the scripts run as a user would (tests/user_env.py), whose cache is a temporary one.
os.environ["JAX_RESIDENCY_COMPILATION_CACHE"] = "0"

import jax  # noqa: E402 - must follow the XLA_FLAGS update above

try:
  from jax._src import xla_bridge as _xb

  if not _xb.backends_are_initialized():
    jax.config.update("jax_num_cpu_devices", N_DEVICES)
except (AttributeError, ImportError, RuntimeError):  # older jax, or a backend already up
  pass

# One persistent compilation cache for the test session, in a temporary directory that
# the xdist workers share (the controller, or a run without xdist, makes it and removes
# it at the end; workers inherit it through the environment). Many tests compile the same
# programs (the same toy, shapes and meshes, in new models or placements): the second
# compile of a program anywhere in the session loads it (≈ 2 ms) instead. Nothing outside
# the session reads it, and the user's cache directory is never written (see above).
# Eviction is on so that JAX locks the directory: the workers never read a half-written
# entry. Set in this process only: subprocesses the tests start compile as a user would.
XLA_CACHE_ENV = "JAX_RESIDENCY_TEST_XLA_CACHE"
_OWNS_XLA_CACHE = XLA_CACHE_ENV not in os.environ
if _OWNS_XLA_CACHE:
  os.environ[XLA_CACHE_ENV] = tempfile.mkdtemp(prefix="jax-residency-tests-xla-")
jax.config.update("jax_compilation_cache_dir", os.environ[XLA_CACHE_ENV])
# The native kernels for quantized products (jax_residency/_src/quant/native.py) are built
# once for the session, in that directory too, and the scripts the tests run as a user
# would (tests/user_env.py: each with its own library cache directory) load that build.
os.environ.setdefault(
  "JAX_RESIDENCY_KERNEL_DIR", os.path.join(os.environ[XLA_CACHE_ENV], "kernels")
)
# The library's cache directory (measurements a plan reads, the demo's stores) is the
# session's too, beside the compiled programs: a test that measures or plans without a
# directory of its own, and a script it runs with the suite's environment, never write
# into the user's (``~/.cache/jax_residency``). Tests of the default path set their own.
os.environ.setdefault("JAX_RESIDENCY_CACHE_DIR", os.path.join(os.environ[XLA_CACHE_ENV], "library"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_compilation_cache_max_size", 1 << 30)
# JAX's LRU cache finds what to evict by listing and reading every entry's size and access
# time on each write, so a compile costs more the more the session has cached (0.18 s a
# write at 3,500 entries). The session's entries never near the 1 GiB bound: the scan is
# skipped, and the directory lock it comes with (the reason eviction is on) stays.
try:
  from jax._src import lru_cache as _lru_cache

  _lru_cache.LRUCache._evict_if_needed = lambda self, additional_size=0: None  # type: ignore[method-assign]
except (AttributeError, ImportError):  # another JAX: its own eviction, only slower
  pass

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding  # noqa: E402

import jax_residency as jr  # noqa: E402
from jax_residency.toy import LinenToyTransformer, ToyConfig, ToyTransformer  # noqa: E402

# Helper modules beside this file (``hlo``) import by name; pytest runs with
# ``--import-mode=importlib``, which does not put ``tests/`` on ``sys.path`` itself.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmark_runs import run_quick  # noqa: E402
from hlo import Mlir  # noqa: E402
from store_files import store_digest  # noqa: E402 - after the sys.path entry above
from user_env import user_zygote  # noqa: E402

M = TypeVar("M")

#: The toy used across the placement, structure and budget tests (≈ 33 KiB per unit).
CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> Mesh:
  """A mesh of the first ``prod(shape)`` devices with Auto axes (sharding by propagation)."""
  n = int(np.prod(shape))
  devices = np.array(jax.devices()[:n]).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(names))


# --- small models the tests need besides the toy ---------------------------


class ReversedStack(nnx.Module):
  """Four tanh-Linear layers that ``scan_units`` runs last to first."""

  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  def __init__(self, rngs: nnx.Rngs) -> None:
    self.layers = nnx.vmap(lambda k: nnx.Linear(16, 16, rngs=nnx.Rngs(k)))(
      jax.random.split(rngs.params(), 4)
    )

  def __call__(self, x: jax.Array) -> jax.Array:
    return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers, reverse=True)


class FloatBlock(nnx.Module):
  """A pre-norm residual MLP block with float inputs (differentiable end to end)."""

  def __init__(self, d: int, *, rngs: nnx.Rngs) -> None:
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.up = nnx.Linear(d, 2 * d, rngs=rngs)
    self.down = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, h: jax.Array) -> jax.Array:
    return h + self.down(jnp.tanh(self.up(self.norm(h))))


class FloatNet(nnx.Module):
  """Float features ``(batch, d_in)`` → ``(batch, 1)``; layers stacked with ``nnx.vmap``.

  ``calls`` counts Python executions of ``__call__`` (under ``jit`` that is
  once per trace); ``block_calls`` the same for one block.
  """

  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  calls = 0
  block_calls = 0

  def __init__(self, d_in: int = 8, d: int = 16, n_layers: int = 4, *, rngs: nnx.Rngs) -> None:
    self.inp = nnx.Linear(d_in, d, rngs=rngs)

    @nnx.vmap
    def make(key: jax.Array) -> FloatBlock:
      return FloatBlock(d, rngs=nnx.Rngs(key))

    self.layers = make(jax.random.split(rngs.params(), n_layers))
    self.head = nnx.Linear(d, 1, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    type(self).calls += 1

    def step(h: jax.Array, block: FloatBlock) -> jax.Array:
      type(self).block_calls += 1
      return block(h)

    return self.head(jr.scan_units(step, self.inp(x), self.layers))


class ShardedLinenBlock(nn.Module):
  """:class:`jax_residency.toy.LinenBlock` with kernels sharded over ``model``.

  ``logical=True`` uses logical names (``embed``, ``heads``, ``mlp``) that
  need ``rules=`` to reach the mesh; otherwise the mesh axis is named directly.
  """

  cfg: ToyConfig
  logical: bool = False

  def _kernel(
    self, names: tuple[str | None, ...], logical: tuple[str, ...]
  ) -> nn.initializers.Initializer:
    init = nn.initializers.lecun_normal()
    if self.logical:
      return nn.with_logical_partitioning(init, logical)
    return nn.with_partitioning(init, names)

  @nn.compact
  def __call__(self, x: jax.Array, _: None = None) -> tuple[jax.Array, None]:
    cfg = self.cfg
    b, t, d = x.shape
    h = cfg.n_heads
    col = self._kernel((None, "model"), ("embed", "heads"))
    row = self._kernel(("model", None), ("heads", "embed"))
    qkv = nn.Dense(3 * d, kernel_init=col, name="qkv")(nn.LayerNorm(name="norm1")(x))
    q, k, v = (a.reshape(b, t, h, d // h) for a in jnp.split(qkv, 3, axis=-1))
    mask = jnp.tril(jnp.ones((t, t), dtype=bool))
    att = jax.nn.dot_product_attention(q, k, v, mask=mask[None, None])
    x = x + nn.Dense(d, kernel_init=row, name="out")(att.reshape(b, t, d))
    up_init = self._kernel((None, "model"), ("embed", "mlp"))
    down_init = self._kernel(("model", None), ("mlp", "embed"))
    y = nn.Dense(cfg.d_ff, kernel_init=up_init, name="up")(nn.LayerNorm(name="norm2")(x))
    return x + nn.Dense(d, kernel_init=down_init, name="down")(jax.nn.gelu(y)), None


class ShardedLinenToy(nn.Module):
  """:class:`jax_residency.toy.LinenToyTransformer` over :class:`ShardedLinenBlock`."""

  residency_stacks: ClassVar[tuple[str, ...]] = ("layers",)

  cfg: ToyConfig
  logical: bool = False

  @nn.compact
  def __call__(self, tokens: jax.Array) -> jax.Array:
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.d_model, name="embed")(tokens)
    stack = jr.linen.scan(
      ShardedLinenBlock,
      variable_axes={"params": 0},
      split_rngs={"params": True},
      length=cfg.n_layers,
      metadata_params={nn.PARTITION_NAME: None},
    )
    x, _ = stack(cfg, self.logical, name="layers")(x, None)
    return nn.Dense(cfg.vocab, name="head")(nn.LayerNorm(name="norm")(x))


#: Logical axis rules for ``ShardedLinenToy(logical=True)``.
LOGICAL_RULES = (("embed", None), ("heads", "model"), ("mlp", "model"))


# --- building models without compiling their initialisers --------------------
#
# Running a model's initialiser compiles an XLA program (≈ 1.5 s each on CPU).
# The tests only need *some* weights, so models are built abstractly and filled
# with seeded numpy values: the same values in every run, and no compile.


def _fill(tree: Any, seed: int, mesh: Mesh | None = None) -> Any:
  rng = np.random.default_rng(seed)

  def leaf(s: jax.ShapeDtypeStruct) -> jax.Array:
    value = (0.2 * rng.standard_normal(s.shape)).astype(s.dtype)
    sharding = getattr(s, "sharding", None)
    if mesh is not None and isinstance(sharding, NamedSharding):
      return jax.device_put(value, NamedSharding(mesh, sharding.spec))
    return jnp.asarray(value)

  return jax.tree.map(leaf, tree)


def build_nnx(make: Callable[[], M], *, seed: int = 0, mesh: Mesh | None = None) -> M:
  """``make()`` with seeded weights; under ``mesh`` its partitioning metadata is applied."""
  if mesh is None:
    abstract = nnx.eval_shape(make)
  else:
    with jax.set_mesh(mesh):
      abstract = nnx.eval_shape(make)
  graphdef, state = nnx.split(abstract)
  return nnx.merge(graphdef, _fill(state, seed, mesh))


def build_linen(model: nn.Module, *args: Any, seed: int = 0) -> Any:
  """Seeded variables for ``model`` called on ``args``, with their (boxed) partitioning
  metadata, built without compiling its initialiser."""
  return _fill(jax.eval_shape(model.init, jax.random.key(0), *args), seed)


# --- the order files run in ----------------------------------------------------
#
# pyproject.toml runs the suite with ``--dist loadfile --no-loadscope-reorder``: an xdist
# worker takes a whole file (its module fixtures built once, not once per worker) and
# the files go out in collection order. The slowest files go first, so that the two
# workers end together instead of one waiting on a long file picked up last; the rest
# keep pytest's order. Seconds: the file's tests summed over a `-n 2` run of the suite
# (--durations=0, 2026-12-07: beside the other worker); the two newest files estimated from
# their runs alone. test_speculative.py, test_native_kernels.py and test_stacks.py were
# missing here: going out late, they could leave one worker running them while the other idled.
SLOWEST_FIRST = (
  "tests/test_speculative.py",  # 135 s: drafts and trees, a streamed target, chi-square runs
  "tests/test_benchmarks_quantized.py",  # 126 s: the quantized benchmarks' --quick
  "tests/test_llama.py",  # 106 s
  "tests/test_benchmarks.py",  # 105 s: the streaming benchmarks' --quick, forks of one zygote
  "tests/test_quantized_stores.py",  # 103 s: every policy, scheme and mesh
  "tests/test_notebooks.py",  # 70 s: five notebook kernels
  "tests/test_native_kernels.py",  # 69 s
  "tests/test_gguf.py",  # 59 s
  "tests/test_generate_cli.py",  # 55 s: generate and chat, a process on each fixture
  "tests/test_placement.py",  # 51 s
  "tests/test_t5.py",  # 40 s
  "tests/test_stacks.py",  # 39 s
  "tests/test_stream.py",  # 37 s
  "tests/test_llama_batch.py",  # 35 s
  "tests/test_s3.py",  # 34 s: moto's server, three writers killed mid-save
  "tests/test_gpt.py",  # 32 s
  "tests/test_minilm.py",  # 31 s
  "tests/test_memory_plan.py",  # 31 s: a fresh process placing under each policy
  "tests/test_testing.py",  # 29 s: a pytest subprocess
  "tests/test_draft_from.py",  # 26 s
  "tests/test_faults.py",  # 25 s: broken stores, a reader as nobody, interrupted writes
  "tests/test_cli.py",  # 24 s
  "tests/test_lint.py",  # 17 s with mypy's cache cold, as on CI
  "tests/test_quantized_structure.py",  # 18 s
  "tests/test_expert_residency.py",  # 18 s: the Mixtral fixture, experts read apart
  "tests/test_examples.py",  # 17 s
  "tests/test_resident_units.py",  # 16 s
  "tests/test_remote.py",  # 16 s, mostly waiting on time-outs
  "tests/test_ggml.py",  # 13 s
  "tests/test_mapped.py",  # 13 s
  "tests/test_multiprocess.py",  # 11 s: two processes
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
  rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
  items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


# --- fixtures ----------------------------------------------------------------


def pytest_unconfigure(config: pytest.Config) -> None:
  """Removes the session's compilation cache (in the process that made it)."""
  if _OWNS_XLA_CACHE and not hasattr(config, "workerinput"):
    shutil.rmtree(os.environ.pop(XLA_CACHE_ENV), ignore_errors=True)


@pytest.fixture(scope="session")
def zygote(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
  """A process with the library imported that forks each script a test runs as a user
  would (`user_env.run_script`; benchmarks/_zygote.py), started once per worker when a
  test first asks; the environment of a user (`user_env.user_env`) naming it."""
  with user_zygote(tmp_path_factory.mktemp("zygote")) as env:
    yield env


@pytest.fixture(scope="module")
def quick(
  tmp_path_factory: pytest.TempPathFactory, zygote: dict[str, str]
) -> Callable[[str], tuple[Any, dict]]:
  """Runs a benchmark's ``--quick --json`` once (`benchmark_runs.run_quick`; ``--dist
  loadfile`` keeps a module on one worker), forked from the session's zygote (a fork skips
  the 2 s of imports each fresh ``python`` pays); returns the process and the result
  file's object. A module's runs share one user's cache directory, as one user's runs of
  the benchmarks would: what one compiled, the next loads (compile_time.py times its cold
  and warm processes in caches of its own)."""
  user = tmp_path_factory.mktemp("quick-user")
  return lambda name: run_quick(name, zygote, user, tmp_path_factory)


@pytest.fixture(scope="session")
def cfg() -> ToyConfig:
  return CFG


@pytest.fixture(scope="session")
def tokens() -> jax.Array:
  return jax.random.randint(jax.random.key(1), (2, 8), 0, CFG.vocab)


@pytest.fixture(scope="session")
def mesh1() -> Mesh:
  """One device: per-device bytes are whole-array bytes."""
  return Mesh(np.array(jax.devices()[:1]), ("devices",))


@pytest.fixture(scope="session")
def mesh_2x4() -> Mesh:
  return auto_mesh((2, 4), ("data", "model"))


@pytest.fixture(scope="session")
def mesh_8() -> Mesh:
  return auto_mesh((8,), ("model",))


@pytest.fixture(scope="session")
def reversed_stack() -> ReversedStack:
  return ReversedStack(nnx.Rngs(0))


@pytest.fixture(scope="session")
def nnx_toy() -> ToyTransformer:
  return build_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="session")
def nnx_toy_sharded(mesh_2x4: Mesh) -> ToyTransformer:
  """The toy with attention/MLP kernels sharded over ``model`` of a (data=2, model=4) mesh."""
  return build_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0), sharded=True), mesh=mesh_2x4)


@pytest.fixture(scope="session")
def linen_toy(tokens: jax.Array) -> tuple[LinenToyTransformer, Any]:
  model = LinenToyTransformer(CFG)
  return model, build_linen(model, tokens)


@pytest.fixture(scope="session")
def linen_sharded_toy(tokens: jax.Array) -> tuple[ShardedLinenToy, Any]:
  """Kernels sharded over the ``model`` mesh axis, named directly."""
  model = ShardedLinenToy(CFG)
  return model, build_linen(model, tokens)


@pytest.fixture(scope="session")
def linen_logical_toy(tokens: jax.Array) -> tuple[ShardedLinenToy, Any]:
  """Kernels with logical names; place with ``rules=logical_rules``."""
  model = ShardedLinenToy(CFG, logical=True)
  return model, build_linen(model, tokens)


@pytest.fixture(scope="session")
def logical_rules() -> tuple[tuple[str, str | None], ...]:
  return LOGICAL_RULES


@pytest.fixture(scope="session")
def float_net_cls() -> type[FloatNet]:
  return FloatNet


@pytest.fixture(scope="session")
def float_net() -> FloatNet:
  return build_nnx(lambda: FloatNet(rngs=nnx.Rngs(0)))


@pytest.fixture(scope="session")
def mlir() -> type[Mlir]:
  """``mlir(text)`` parses lowered StableHLO text (see :class:`hlo.Mlir`)."""
  return Mlir


@pytest.fixture(scope="session")
def seeded_linen() -> Callable[..., Any]:
  """:func:`build_linen`: ``seeded_linen(model, *args, seed=0)``."""
  return build_linen


@pytest.fixture(scope="session")
def seeded_nnx() -> Callable[..., Any]:
  """:func:`build_nnx`: ``seeded_nnx(make, seed=0)`` is ``make()`` with seeded weights,
  built without compiling the model's initialiser."""
  return build_nnx


# --- shared models and stores: built once per session, read by many tests --------------
#
# A worker builds each toy model and writes each store once, however many test files use
# it. Shared objects are read, never changed: a test that damages, rewrites or overwrites
# a store copies it first (``shutil.copytree(store, tmp_path / ...)``), and no test
# updates a shared model's variables or donates its arrays. Both are checked when the
# session ends: a model must hold the values it was built with, no array deleted, and a
# store the same files with the same bytes.


def _unchanged_model(model: Any, values: list[np.ndarray]) -> bool:
  """Whether ``model`` holds ``values`` (a copy taken when it was built), none deleted.
  (``nnx.jit`` puts new arrays with the same values back into a module it was given.)"""
  now = jax.tree.leaves(nnx.state(model))
  return len(now) == len(values) and all(
    not a.is_deleted() and a.dtype == b.dtype and np.array_equal(a, b)
    for a, b in zip(now, values, strict=True)
  )


@pytest.fixture(scope="session")
def toy_model() -> Iterator[Callable[..., ToyTransformer]]:
  """``toy_model(cfg, seed=0, mesh=None, seeded=False)``: ``ToyTransformer(cfg,
  rngs=nnx.Rngs(seed))``, built once per session; with ``mesh``, the ``sharded=True``
  toy built under ``jax.set_mesh(mesh)``. ``seeded=True``: the same module with seeded
  numpy weights instead (:func:`build_nnx`: no initialiser compiled). Shared: never
  update its variables or donate its arrays."""
  built: dict[tuple[Any, ...], tuple[ToyTransformer, list[np.ndarray]]] = {}

  def make(
    cfg: ToyConfig, seed: int = 0, *, mesh: Mesh | None = None, seeded: bool = False
  ) -> ToyTransformer:
    key = (cfg, seed, mesh, seeded)
    if key not in built:
      sharded = mesh is not None
      if seeded:
        model = build_nnx(
          lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0), sharded=sharded), seed=seed, mesh=mesh
        )
      elif mesh is None:
        model = ToyTransformer(cfg, rngs=nnx.Rngs(seed))
      else:
        with jax.set_mesh(mesh):
          model = ToyTransformer(cfg, rngs=nnx.Rngs(seed), sharded=True)
      built[key] = (model, [np.array(a) for a in jax.tree.leaves(nnx.state(model))])
    return built[key][0]

  yield make
  changed = [key for key, (model, leaves) in built.items() if not _unchanged_model(model, leaves)]
  assert not changed, f"a test changed a shared toy model (conftest.toy_model): {changed}"


@pytest.fixture(scope="session")
def saved_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., Any]]:
  """``saved_store(key, model, **save_kwargs)``: ``jr.save(model, path, progress=False,
  **save_kwargs)`` into a new directory the first time ``key`` is asked for; every call
  with ``key`` returns what that save returned (a :class:`jax_residency.StoreInfo`; its
  ``path`` is the store). ``saved_store(key, write=fn)`` writes with ``fn(path)`` instead
  and returns what ``fn`` returns (a converter's ``StoreInfo``, say).

  ``key`` names what is saved (the model and its weights, and how it is written), so two
  tests asking for the same key get the same store. Shared: read it; copy it
  (``shutil.copytree``) before damaging or rewriting it."""
  saved: dict[Any, tuple[Any, str, dict[str, str]]] = {}

  def save(
    key: Any,
    model: Any = None,
    *,
    write: Callable[[str], Any] | None = None,
    **save_kwargs: Any,
  ) -> Any:
    if key not in saved:
      path = str(tmp_path_factory.mktemp("saved") / "store")
      if write is None:
        info = jr.save(model, path, progress=False, **save_kwargs)
      else:
        info = write(path)
      saved[key] = (info, path, store_digest(path))
    return saved[key][0]

  yield save
  changed = [key for key, (_, path, digest) in saved.items() if store_digest(path) != digest]
  assert not changed, f"a test wrote to a shared store (conftest.saved_store): {changed}"


@pytest.fixture(scope="session")
def toy_store(
  toy_model: Callable[..., ToyTransformer], saved_store: Callable[..., Any]
) -> Callable[..., str]:
  """``toy_store(cfg, seed=0, mesh=None, seeded=False)``: the path of that
  ``toy_model``'s store (``jr.save`` with its defaults), written once per session."""

  def path(cfg: ToyConfig, seed: int = 0, *, mesh: Mesh | None = None, seeded: bool = False) -> str:
    model = toy_model(cfg, seed, mesh=mesh, seeded=seeded)
    return saved_store(("toy", cfg, seed, mesh, seeded), model).path

  return path
