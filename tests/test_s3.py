"""Stores on an S3-compatible server: moto's standalone server (``python -m moto.server``) on
127.0.0.1, reached through the AWS SDKs' endpoint variable (``AWS_ENDPOINT_URL_S3``,
`jax_residency._src.store.locations.s3_spec`). A store saved over another on ``s3://``
places under every policy bit for bit as the local store does, verifies, inspects and
rechunks; a save killed (SIGKILL) at several moments leaves the old store or the new one
(store/pointers.py), and the next save removes what it left.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from cli_call import call
from flax import nnx
from policies import REMOTE_POLICIES
from test_faults import _SPREAD, SPREAD, check_spread
from test_object_store_commits import _top_keys
from test_store_safety import WRITES, _save, _version, interrupt_at_write
from toy_fixtures import toy_fixtures
from user_env import run_script, user_env

import jax_residency as jr
from jax_residency._src.store import pointers
from jax_residency._src.store.rechunk import rechunk_store
from jax_residency._src.store.verify import verify_store
from jax_residency.toy import ToyConfig, ToyTransformer

pytest.importorskip("moto", reason="the S3 tests need moto, flask and flask-cors (test extras)")

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
POLICIES = REMOTE_POLICIES
BUCKET = "jr-bucket"

model, tokens, store = toy_fixtures(CFG, seeded=True)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3():
  """moto's S3 server on a free loopback port with one bucket, and the environment that
  points ``s3://`` stores at it; yields the endpoint."""
  port = _free_port()
  endpoint = f"http://127.0.0.1:{port}"
  server = subprocess.Popen(
    [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
  )
  try:
    for _ in range(300):  # up to 30 s for the server to answer
      try:
        urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT"))
        break
      except (urllib.error.URLError, ConnectionError):
        time.sleep(0.1)
    else:
      pytest.fail("moto's server did not start")
    with pytest.MonkeyPatch.context() as env:
      env.setenv("AWS_ENDPOINT_URL_S3", endpoint)
      env.setenv("AWS_ACCESS_KEY_ID", "testing")
      env.setenv("AWS_SECRET_ACCESS_KEY", "testing")
      env.setenv("AWS_REGION", "us-east-1")
      env.setenv("AWS_EC2_METADATA_DISABLED", "true")
      yield endpoint
  finally:
    server.terminate()
    server.wait(timeout=30)


@pytest.fixture(scope="module")
def s3_store(s3, model):
  """The toy model's store on the server, saved over another model's."""
  url = f"s3://{BUCKET}/toy"
  jr.save(ToyTransformer(CFG, rngs=nnx.Rngs(5)), url, progress=False)
  jr.save(model, url, progress=False, overwrite=True)
  return url


@pytest.mark.parametrize("policy", list(POLICIES))
def test_a_store_on_s3_places_bit_for_bit_as_the_local_one(s3_store, store, model, tokens, policy):
  with jr.place(model, POLICIES[policy], store=store, mesh=MESH1) as local:
    want = np.asarray(local(tokens))
  with jr.place(model, POLICIES[policy], store=s3_store, mesh=MESH1) as placed:
    got = np.asarray(placed(tokens))
    fetched = placed.report().fetched_bytes
  np.testing.assert_array_equal(got, want)
  assert fetched > 0  # read from the server, not from a local copy


def test_verify_and_inspect_read_a_store_on_s3(s3_store):
  keys = _top_keys(s3_store)  # the overwritten store's generation is gone
  assert len(keys) == 2 and pointers.POINTER_KEY in keys, keys
  assert verify_store(s3_store).damaged == ()
  code, out, err = call("inspect", s3_store)
  assert code == 0 and s3_store in out, err


def test_a_store_on_s3_is_overwritten_with_the_new_weights(s3, seeded_nnx, tokens):
  url = f"s3://{BUCKET}/overwritten"
  first, second = (
    seeded_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)), seed=seed) for seed in (1, 2)
  )
  jr.save(first, url, progress=False)
  with pytest.raises(jr.StoreError, match="overwrite"):
    jr.save(second, url, progress=False)
  jr.save(second, url, progress=False, overwrite=True)
  with jr.place(second, jr.DenseDiskStream(host_budget_bytes=0), store=url, mesh=MESH1) as p:
    np.testing.assert_array_equal(np.asarray(p(tokens)), np.asarray(second(tokens)))


def test_an_s3_url_without_a_bucket_is_a_store_error(s3, model):
  with pytest.raises(jr.StoreError, match="needs a bucket"):
    jr.save(model, "s3:///toy", progress=False)


def test_a_store_rechunks_to_and_from_s3(s3, store, model, tokens, tmp_path):
  there, back = f"s3://{BUCKET}/rechunked", str(tmp_path / "from-s3")
  code, out, err = call("rechunk", store, there)
  assert code == 0 and there in out, err
  rechunk_store(there, back, progress=False)
  want = np.asarray(model(tokens))
  for path in (there, back):
    with jr.place(model, jr.DenseDiskStream(host_budget_bytes=0), store=path, mesh=MESH1) as p:
      np.testing.assert_array_equal(np.asarray(p(tokens)), want)


#: A child that overwrites ``s3://BUCKET/<name>`` with the seed-2 toy model and SIGKILLs
#: itself at one moment of the save (argv: name, moment).
_KILLED_SAVE = """
import os, signal, sys
from flax import nnx
import jax_residency as jr
from jax_residency._src.store import pointers, writer
from jax_residency.toy import ToyConfig, ToyTransformer
sys.path.insert(0, {tests!r})
from conftest import build_nnx
name, moment = sys.argv[1:]
die = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
chunks = []
def write_chunk(*args):
  chunks.append(1)
  if moment == "mid-write" and len(chunks) == 4:
    die()
  return write_chunk.original(*args)
write_chunk.original = writer._write_chunk
writer._write_chunk = write_chunk
if moment == "before-switch":
  pointers.switch = die
if moment == "after-switch":
  pointers.remove_others = die
model = build_nnx(lambda: ToyTransformer(ToyConfig(**{cfg}), rngs=nnx.Rngs(0)), seed=2)
jr.save(model, f"s3://{bucket}/{{name}}", progress=False, overwrite=True)
"""
#: What the path holds after the kill: the old store (seed 1) or the new (seed 2).
_AFTER_KILL = {"mid-write": 1, "before-switch": 1, "after-switch": 2}


def test_a_save_killed_at_any_moment_leaves_the_old_store_or_the_new(
  s3, seeded_nnx, tokens, zygote, tmp_path
):
  models = {
    seed: seeded_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)), seed=seed) for seed in (1, 2)
  }
  for moment in _AFTER_KILL:
    jr.save(models[1], f"s3://{BUCKET}/killed-{moment}", progress=False)
  tests = os.path.dirname(os.path.abspath(__file__))
  script = _KILLED_SAVE.format(cfg=CFG.__dict__, bucket=BUCKET, tests=tests)
  env = user_env(tmp_path)  # the S3 settings; the script's conftest import sets the rest

  def kill_a_save(moment: str) -> int:  # forked from the zygote (no 2-3 s of imports each)
    cmd = [sys.executable, "-c", script, f"killed-{moment}", moment]
    return run_script(cmd, zygote, env=env, timeout=300).returncode

  with concurrent.futures.ThreadPoolExecutor(len(_AFTER_KILL)) as pool:  # the three at once
    codes = dict(zip(_AFTER_KILL, pool.map(kill_a_save, _AFTER_KILL), strict=True))
  assert codes == dict.fromkeys(_AFTER_KILL, -signal.SIGKILL), codes
  for moment, seed in _AFTER_KILL.items():
    url = f"s3://{BUCKET}/killed-{moment}"
    assert len(_top_keys(url)) == 3, moment  # the pointer, the old and the new generation
    with jr.place(
      models[seed], jr.DenseDiskStream(host_budget_bytes=0), store=url, mesh=MESH1
    ) as p:
      got = np.asarray(p(tokens))
    np.testing.assert_array_equal(got, np.asarray(models[seed](tokens)), err_msg=moment)
    jr.save(models[2], url, progress=False, overwrite=True)  # removes what the kill left
    assert len(_top_keys(url)) == 2, moment


@pytest.mark.parametrize("k", [1, WRITES // 2 + 1, WRITES])  # the first, a middle, the last
def test_an_interrupt_while_any_write_is_in_flight_leaves_the_old_store_on_s3(s3, monkeypatch, k):
  """Ctrl-C while the save waits for its `k`-th chunk write to the server, that write
  still in flight (test_store_safety.py's, on S3): the writer waits for every write it
  started before deleting its generation, so none lands afterwards; the pointer still
  names the old store, and the path holds nothing else."""
  url = f"s3://{BUCKET}/interrupted-{k}"
  _save(url, seed=0)
  before = _top_keys(url)
  late = interrupt_at_write(monkeypatch, k)
  removed, remove_generation = [], pointers.remove_generation

  def remove(kv, name):  # what is still in flight when the generation is deleted
    removed.append(late[0].landed.is_set())
    return remove_generation(kv, name)

  monkeypatch.setattr(pointers, "remove_generation", remove)
  with pytest.raises(KeyboardInterrupt):
    _save(url, seed=1, overwrite=True)
  late[0].settled()
  assert removed == [True]
  assert _top_keys(url) == before  # the pointer and the old generation: nothing of the new
  assert _version(url) == 0


def test_sigint_or_sigterm_at_a_spread_of_moments_leaves_one_store_on_s3(s3, zygote, tmp_path):
  """test_faults.py's real SIGINT or SIGTERM at a spread of moments of a save, on S3 (a
  6 MiB store, three moments): each save stops (or finishes), the pointer names the old
  store or the new, whole, and no generation but that one is left under the path."""
  url = f"s3://{BUCKET}/spread"
  done = run_script(
    [sys.executable, "-c", _SPREAD, url, "", json.dumps(SPREAD[::3]), "96"],
    zygote,
    capture_output=True,
    text=True,
    timeout=240,
    env=user_env(tmp_path),
  )
  check_spread(done)
