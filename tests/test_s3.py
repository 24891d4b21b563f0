"""Stores on an S3-compatible server: moto's standalone server (``python -m moto.server``) on
127.0.0.1, reached through the AWS SDKs' endpoint variable (``AWS_ENDPOINT_URL_S3``,
`jax_residency._src.store.discovery.s3_spec`). A save to ``s3://`` places under every
policy bit for bit as the local store does, verifies, inspects and is overwritten.
"""

from __future__ import annotations

import contextlib
import io
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
from flax import nnx
from policies import REMOTE_POLICIES
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src.cli import main as cli
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
  url = f"s3://{BUCKET}/toy"
  jr.save(model, url, progress=False)
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
  assert verify_store(s3_store).damaged == ()
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(["inspect", s3_store])
  assert code == 0 and s3_store in out.getvalue(), err.getvalue()


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
