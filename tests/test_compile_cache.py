"""The default persistent compilation cache (run/compile_cache.py) and the cache directory.

In this process the suite has opted out (tests/conftest.py) and compiles into its own
temporary cache instead, so the tests here change JAX's configuration only inside the
``jax_config`` fixture, which starts from JAX's defaults and puts the suite's settings
back; the end-to-end check runs in subprocesses with a temporary cache directory.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import textwrap
import time
from pathlib import Path

import jax
import pytest
from jax._src import compilation_cache
from user_env import run_script, user_env

from jax_residency._src.cache_dir import CACHE_DIR_ENV, library_cache_dir
from jax_residency._src.run import compile_cache

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = (
  "jax_compilation_cache_dir",
  "jax_persistent_cache_min_compile_time_secs",
  "jax_compilation_cache_max_size",
  "jax_enable_compilation_cache",
)


#: JAX's own values of SETTINGS (the suite's conftest.py sets the first three).
JAX_DEFAULTS = {
  "jax_compilation_cache_dir": None,
  "jax_persistent_cache_min_compile_time_secs": 1.0,
  "jax_compilation_cache_max_size": -1,
  "jax_enable_compilation_cache": True,
}


def read(name: str):
  return getattr(jax.config, name)


@pytest.fixture
def jax_config(monkeypatch, tmp_path):
  """JAX's cache settings and compile_cache's state, restored afterwards; opt-out lifted."""
  saved = {name: read(name) for name in SETTINGS}
  monkeypatch.setattr(compile_cache, "_enabled", None)
  monkeypatch.delenv(compile_cache.OPT_OUT_ENV)
  monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "jr"))
  for name in SETTINGS:
    monkeypatch.delenv(name.upper(), raising=False)
  for name, value in JAX_DEFAULTS.items():  # as a process that configured nothing starts
    jax.config.update(name, value)
  compilation_cache.reset_cache()
  try:
    yield tmp_path / "jr"
  finally:
    for name, value in saved.items():
      jax.config.update(name, value)
    # Anything compiled meanwhile may have opened the cache at tmp_path: forget it.
    compilation_cache.reset_cache()


def test_the_suite_has_opted_out():
  """The library's default cache is off; the suite compiles into its own temporary one."""
  assert compile_cache.opted_out()
  assert compile_cache.enable_default_cache() is None
  suite_cache = os.environ["JAX_RESIDENCY_TEST_XLA_CACHE"]
  assert read("jax_compilation_cache_dir") == suite_cache
  assert os.path.basename(suite_cache).startswith("jax-residency-tests-xla-")
  assert os.path.commonpath([suite_cache, library_cache_dir()]) != library_cache_dir()


@pytest.mark.parametrize(
  "value, off",
  [("0", True), ("false", True), (" OFF ", True), ("no", True), ("", False), ("1", False)],
)
def test_opt_out_values(monkeypatch, value, off):
  monkeypatch.setenv(compile_cache.OPT_OUT_ENV, value)
  assert compile_cache.opted_out() is off


def test_enables_the_cache_under_the_library_cache_dir(jax_config):
  path = compile_cache.enable_default_cache()
  assert path == str(jax_config / "xla") == os.path.join(library_cache_dir(), "xla")
  assert os.path.isdir(path)
  assert read("jax_compilation_cache_dir") == path
  assert read("jax_persistent_cache_min_compile_time_secs") == compile_cache.MIN_COMPILE_TIME_SECS
  assert read("jax_compilation_cache_max_size") == -1  # bounded by trim(), not by JAX


def _entries(path: Path, ages: dict[str, int]) -> None:
  """Cache entries of 100 bytes each, last used ``age`` seconds ago."""
  path.mkdir(parents=True, exist_ok=True)
  now = time.time()
  for name, age in ages.items():
    for suffix in ("-cache", "-atime"):
      f = path / f"{name}{suffix}"
      f.write_bytes(b"x" * (100 if suffix == "-cache" else 8))
      os.utime(f, (now - age, now - age))


def test_turning_the_cache_on_trims_it_least_recently_used_first(jax_config, monkeypatch):
  _entries(jax_config / "xla", {"old": 300, "middle": 200, "new": 100, "newest": 0})
  (jax_config / "xla" / "stray-atime").write_bytes(b"")  # not an entry: left alone
  monkeypatch.setattr(compile_cache, "MAX_SIZE_BYTES", 250)
  compile_cache.enable_default_cache()
  assert sorted(p.name for p in (jax_config / "xla").iterdir()) == [
    "new-atime",
    "new-cache",
    "newest-atime",
    "newest-cache",
    "stray-atime",
  ]


def test_a_size_limit_the_user_set_leaves_the_cache_to_jax(jax_config, monkeypatch):
  _entries(jax_config / "xla", {"old": 300, "new": 0})
  monkeypatch.setattr(compile_cache, "MAX_SIZE_BYTES", 0)
  jax.config.update("jax_compilation_cache_max_size", 1 << 20)
  compile_cache.enable_default_cache()
  assert len(list((jax_config / "xla").iterdir())) == 4
  assert compile_cache.trim(str(jax_config / "xla"), 150) == 100  # the newest stays
  assert compile_cache.trim(str(jax_config / "missing"), 0) == 0


def test_is_idempotent(jax_config):
  first = compile_cache.enable_default_cache()
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 2.0)  # the user, afterwards
  assert compile_cache.enable_default_cache() == first
  assert read("jax_persistent_cache_min_compile_time_secs") == 2.0


def test_opting_out_leaves_jax_alone(jax_config, monkeypatch):
  monkeypatch.setenv(compile_cache.OPT_OUT_ENV, "0")
  assert compile_cache.enable_default_cache() is None
  assert read("jax_compilation_cache_dir") is None
  assert read("jax_persistent_cache_min_compile_time_secs") == 1.0
  assert not (jax_config / "xla").exists()


def test_a_cache_the_user_configured_is_kept(jax_config, tmp_path):
  jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
  assert compile_cache.enable_default_cache() is None
  assert read("jax_compilation_cache_dir") == str(tmp_path / "mine")
  assert read("jax_persistent_cache_min_compile_time_secs") == 1.0
  assert read("jax_compilation_cache_max_size") == -1


def test_a_disabled_jax_cache_stays_disabled(jax_config):
  jax.config.update("jax_enable_compilation_cache", False)
  assert compile_cache.enable_default_cache() is None
  assert read("jax_compilation_cache_dir") is None


def test_thresholds_the_user_set_are_kept(jax_config, monkeypatch):
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
  monkeypatch.setenv("JAX_COMPILATION_CACHE_MAX_SIZE", "-1")  # set, although to the default
  assert compile_cache.enable_default_cache() == str(jax_config / "xla")
  assert read("jax_persistent_cache_min_compile_time_secs") == 0.5
  assert read("jax_compilation_cache_max_size") == -1


def test_an_unwritable_cache_dir_leaves_jax_alone(jax_config, monkeypatch, tmp_path):
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  monkeypatch.setenv(CACHE_DIR_ENV, str(blocker / "below"))
  assert compile_cache.enable_default_cache() is None
  assert read("jax_compilation_cache_dir") is None


@pytest.mark.parametrize("where", ["the xla directory", "the cache directory above it"])
@pytest.mark.parametrize("how", ["mode 0777", "another user's"])
def test_a_cache_dir_others_can_write_is_not_loaded_from(jax_config, caplog, how, where):
  """A program planted in it, or an xla directory swapped for another through the cache
  directory above it, would run in this process: JAX is left alone, with one warning
  naming the directory and the fix."""
  shared = jax_config / compile_cache.SUBDIR if where == "the xla directory" else jax_config
  shared.mkdir(parents=True)
  if how == "mode 0777":
    shared.chmod(0o777)
  elif os.getuid() != 0:
    pytest.skip("handing a directory to another user needs root")
  else:
    os.chown(shared, 65534, 65534)
  with caplog.at_level(logging.WARNING, logger="jax_residency"):
    assert compile_cache.enable_default_cache() is None
    assert compile_cache.enable_default_cache() is None
  assert read("jax_compilation_cache_dir") is None
  warned = [r.getMessage() for r in caplog.records if str(shared) in r.getMessage()]
  assert len(warned) == 1 and "chmod 700" in warned[0] and CACHE_DIR_ENV in warned[0]


# --- end to end: a second process's first pass loads what the first compiled -----

CHILD = textwrap.dedent(
  """
  import json, os, sys
  import jax, jax.numpy as jnp
  from jax import monitoring
  from flax import nnx
  import jax_residency as jr
  from jax_residency._src.run import compile_cache

  counts = {"requests": 0, "hits": 0}
  def on_event(event, **_):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
      counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
      counts["hits"] += 1
  monitoring.register_event_listener(on_event)

  if sys.argv[1] == "explicit":
    compile_cache.enable_default_cache()

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.layers = nnx.vmap(lambda k: nnx.Linear(8, 8, rngs=nnx.Rngs(k)))(
        jax.random.split(rngs.params(), 3))
    def __call__(self, x):
      return jr.scan_units(lambda h, layer: jnp.tanh(layer(h)), x, self.layers)

  net = Net(nnx.Rngs(0))
  store = os.path.join(os.environ["JAX_RESIDENCY_CACHE_DIR"], "store")
  if not os.path.exists(store):
    jr.save(net, store, units="layers", progress=False)
  out = {}
  for policy in (jr.FullyResident(), jr.DenseDiskStream()):
    with jr.place(net, policy, store=store) as placed:
      before = dict(counts)
      placed(jnp.ones((2, 5, 8)))
      first = placed.report().last
      out[policy.name] = {
        "requests": counts["requests"] - before["requests"],
        "hits": counts["hits"] - before["hits"],
        "seconds": first.seconds,
        "compile_seconds": first.compile_seconds,
      }
  out["cache_dir"] = jax.config.jax_compilation_cache_dir
  print("RESULT", json.dumps(out))
  """
)


def run_child(cache: Path, mode: str, zygote: dict[str, str]) -> dict:
  """``CHILD`` as a user's process (one device, the library's defaults) with the library
  cache directory ``cache``, forked from the session's zygote (no backend, nothing
  compiled: JAX's cache starts unset there, as in a fresh ``python``)."""
  env = user_env(cache)
  env[CACHE_DIR_ENV] = str(cache)
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  done = run_script(
    [sys.executable, "-c", CHILD, mode],
    zygote,
    cwd=ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
  )
  assert done.returncode == 0, done.stdout + done.stderr
  line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
  return json.loads(line.removeprefix("RESULT "))


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory, zygote) -> tuple[Path, dict, dict]:
  """Two processes, one after the other, with one cache directory: the first leaves the
  cache to place() (as a user does), the second turns it on itself before compiling."""
  cache = tmp_path_factory.mktemp("compile_cache")
  return cache, run_child(cache, "via-place", zygote), run_child(cache, "explicit", zygote)


def test_place_turns_the_cache_on(two_processes):
  cache, first, _ = two_processes
  assert first["cache_dir"] == str(cache / "xla")


def test_a_second_process_loads_the_first_pass_from_the_cache(two_processes):
  cache, first, second = two_processes
  assert first["cache_dir"] == second["cache_dir"] == str(cache / "xla")
  assert any((cache / "xla").iterdir())
  for policy in ("fully_resident", "dense_disk_stream"):
    cold, warm = first[policy], second[policy]
    assert cold["requests"] > 0 and cold["hits"] == 0, cold  # compiled, written
    assert warm["hits"] == warm["requests"] > 0, warm  # every program loaded, none compiled
    assert 0 < warm["compile_seconds"] <= warm["seconds"]  # loading counts as compile time
