"""Remote stores: placing from an ``http://`` store (a loopback server this module starts
and stops), ``memory://`` and ``file://`` URLs; retries, time-outs and their typed errors;
``Report.fetched_bytes`` against the bytes the server sent; the CLI over a URL."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import threading
import time

import jax
import numpy as np
import pytest
from cli_call import call
from flax import nnx
from policies import REMOTE_POLICIES
from toy_fixtures import toy_fixtures

import jax_residency as jr
from jax_residency._src import store_server
from jax_residency._src.models.decoding import jitted_plain
from jax_residency._src.store.mapped import ocdbt_extents
from jax_residency.testing import serve_store
from jax_residency.toy import ToyConfig, ToyTransformer

CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
POLICIES = REMOTE_POLICIES
#: Retries that back off for milliseconds, so failing reads fail fast.
QUICK = {"retry_delay_s": 0.005, "max_retry_delay_s": 0.01}

model, tokens, store = toy_fixtures(CFG, seeded=True)


def abstract():
  return nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))


@pytest.fixture(scope="module")
def expected(model, tokens):
  """The plain model's output, eager: what a dense stream matches bit for bit on CPU, where
  it runs a step per layer (docs/parity.md)."""
  return model(tokens)


@pytest.fixture(scope="module")
def jitted(model, tokens):
  """The plain model's output under ``jax.jit``: what FullyResident and LayerwiseHost match
  bit for bit, each running one program (docs/parity.md)."""
  return jitted_plain(model, tokens)


@pytest.fixture(scope="module")
def module_server(store):
  """The store served on 127.0.0.1 for the whole module."""
  with serve_store(store) as server:
    yield server


class Traffic:
  """What the loopback server is answering: requests per file, and how many are running."""

  def __init__(self) -> None:
    self.paths: collections.Counter[str] = collections.Counter()
    self.received = 0
    self.running = 0
    self.lock = threading.Lock()

  def drain(self) -> None:
    """Waits until the server has answered every request it received (also those whose
    reader gave up), so that none is still running when the next read starts."""
    for _ in range(3000):
      with self.lock:
        if not self.running:
          return
      time.sleep(0.01)
    raise AssertionError(f"the server still answers {self.running} requests after 30 s")

  def settle(self) -> None:
    """`drain`, then waits until no request has come for 0.2 s: a read that gave up
    after another one failed may still be retrying."""
    while True:
      self.drain()
      received = self.received
      time.sleep(0.2)
      with self.lock:
        if self.received == received and not self.running:
          return


@pytest.fixture
def traffic(monkeypatch):
  """Counts the requests the loopback server receives, per file, and those running."""
  seen = Traffic()
  answer = store_server._Handler._answer

  def counting(self, *, body):
    with seen.lock:
      seen.paths[self.path.split("?")[0].lstrip("/")] += 1
      seen.received += 1
      seen.running += 1
    try:
      return answer(self, body=body)
    finally:
      with seen.lock:
        seen.running -= 1

  monkeypatch.setattr(store_server._Handler, "_answer", counting)
  return seen


@pytest.fixture
def server(module_server, traffic):
  """The module's server, fast and healthy, with its counts at 0. After a test that
  made it slow or fail, waits for every request still coming, so that none lands in
  the next test's counts."""
  module_server.latency_s, module_server.fail = 0.0, None
  module_server.reset_counts()
  yield module_server
  troubled = module_server.fail is not None or module_server.latency_s or module_server.failed
  module_server.latency_s, module_server.fail = 0.0, None
  if troubled:
    traffic.settle()


# --- parity and bytes ----------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_parity_over_http_and_fetched_bytes_match_bytes_served(
  store, tokens, expected, jitted, server, traffic, name
):
  policy = POLICIES[name]
  dense = isinstance(policy, jr.DenseDiskStream)
  want = expected if dense else jitted
  with jr.place(abstract(), policy, store=server.url, mesh=MESH1) as placed:
    outs = [placed(tokens) for _ in range(2)]  # cold, then with whatever the caches kept
  report = placed.report()  # closed: no read-ahead still in flight
  traffic.drain()  # the server counts a chunk after sending it: the client may be done first
  served = server.bytes_served
  with jr.place(abstract(), policy, store=store, mesh=MESH1) as local:
    local_out = local(tokens)
  for out in outs:
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(out, local_out)  # the same as from the local store
  assert server.requests > 0 and server.failed == 0
  assert report.fetched_bytes == served > 0
  assert report.fetched_bytes >= report.total.bytes_read
  assert sum(p.fetched_bytes for p in report.passes) <= report.fetched_bytes
  if dense:  # the units came over HTTP, and each pass says what it fetched
    assert report.total.bytes_read >= CFG.n_layers * CFG.unit_bytes()
    assert report.passes[0].fetched_bytes > 0
    assert report.total.fetched_bytes == sum(p.fetched_bytes for p in report.passes)


def test_flaky_server_keeps_parity_through_retries(tokens, expected, server, traffic):
  server.fail = lambda n: n % 3 == 0  # every third request answers 503
  reads = jr.ReadOptions(retries=3, **QUICK)
  policy = POLICIES["dense_direct"]
  with jr.place(abstract(), policy, store=server.url, mesh=MESH1, read_options=reads) as placed:
    for _ in range(2):
      placed.clear_caches()  # every pass reads every unit over HTTP
      np.testing.assert_array_equal(placed(tokens), expected)
  assert server.failed > 0
  traffic.drain()  # every chunk sent is counted
  assert placed.report().fetched_bytes == server.bytes_served  # a 503 carries no body


# --- a server that is down -------------------------------------------------------


@pytest.mark.parametrize("retries", [0, 2])
def test_failing_server_raises_unavailable_after_retries_plus_one_tries(server, traffic, retries):
  server.fail = lambda n: True
  reads = jr.ReadOptions(retries=retries, **QUICK)
  with pytest.raises(jr.errors.StoreUnavailableError) as caught:
    jr.place(abstract(), POLICIES["dense_direct"], store=server.url, read_options=reads)
  error = caught.value
  assert not isinstance(error, jr.errors.StoreTimeoutError)
  assert isinstance(error, jr.StoreError)
  assert error.store == server.url and error.attempts == retries + 1 == reads.attempts
  assert "503" in str(error) and "retries" in str(error)
  assert server.failed == server.requests == sum(traffic.paths.values()) > 0
  # The read that failed first (its key) was tried exactly retries + 1 times, none more often.
  assert max(traffic.paths.values()) == retries + 1, dict(traffic.paths)


@pytest.mark.parametrize("retries", [0, 2])
def test_failing_server_raises_unavailable_with_its_attempts(server, retries):
  server.fail = lambda n: True
  reads = jr.ReadOptions(retries=retries, **QUICK)
  with pytest.raises(jr.errors.StoreUnavailableError) as caught:
    jr.place(abstract(), POLICIES["dense_direct"], store=server.url, read_options=reads)
  assert caught.value.attempts == retries + 1
  assert caught.value.store == server.url and server.failed == server.requests > 0


@pytest.mark.parametrize("name", ["dense_disk_stream", "dense_direct"])
def test_server_failing_mid_stream_raises_unavailable_then_recovers(tokens, expected, server, name):
  """With a host cache the prefetch thread reads the units: its error reaches the call."""
  reads = jr.ReadOptions(retries=1, **QUICK)
  policy = POLICIES[name]
  with jr.place(abstract(), policy, store=server.url, mesh=MESH1, read_options=reads) as placed:
    np.testing.assert_array_equal(placed(tokens), expected)
    server.fail = lambda n: True
    placed.clear_caches()
    with pytest.raises(jr.errors.StoreUnavailableError) as caught:
      placed(tokens)
    assert not isinstance(caught.value, jr.errors.StoreTimeoutError)
    assert caught.value.store == server.url and caught.value.attempts == 2
    assert placed.report().total.passes == 1  # the failed pass is not committed
    server.fail = None
    np.testing.assert_array_equal(placed(tokens), expected)
    assert placed.report().total.passes == 2


def test_nothing_listening_raises_unavailable():
  reads = jr.ReadOptions(retries=1, **QUICK)
  with pytest.raises(jr.errors.StoreUnavailableError) as caught:
    jr.place(abstract(), store="http://127.0.0.1:9/toy", read_options=reads)
  assert caught.value.store == "http://127.0.0.1:9/toy"


# --- a slow server ---------------------------------------------------------------


def test_slow_server_times_out_at_placement(server):
  server.latency_s = 0.5  # every answer takes five times the time-out
  reads = jr.ReadOptions(timeout_s=0.1)
  with pytest.raises(jr.errors.StoreTimeoutError) as caught:
    jr.place(abstract(), POLICIES["dense_direct"], store=server.url, read_options=reads)
  error = caught.value
  assert isinstance(error, jr.errors.StoreUnavailableError) and isinstance(error, jr.StoreError)
  assert (error.store, error.timeout_s, error.what) == (server.url, 0.1, "metadata")
  assert "timeout_s" in str(error)


def test_slow_server_times_out_mid_stream_and_the_pass_is_not_committed(
  tokens, expected, server, traffic
):
  reads = jr.ReadOptions(retries=0, timeout_s=1.0)
  policy = POLICIES["dense_direct"]
  with jr.place(abstract(), policy, store=server.url, mesh=MESH1, read_options=reads) as placed:
    np.testing.assert_array_equal(placed(tokens), expected)  # fast: compiles, reads
    assert placed.report().total.passes == 1
    server.latency_s = 2.0  # every answer takes twice the time-out
    placed.clear_caches()  # so the next pass reads its units
    with pytest.raises(jr.errors.StoreTimeoutError) as caught:
      placed(tokens)
    error = caught.value
    assert isinstance(error, jr.errors.StoreUnavailableError)
    assert (error.store, error.timeout_s) == (server.url, 1.0)
    assert error.what.startswith("unit ") and int(error.what.split()[1]) in range(CFG.n_layers)
    assert placed.report().total.passes == 1  # the failed pass is not committed
    server.latency_s = 0.0
    traffic.drain()  # a new read of a chunk joins TensorStore's abandoned one: let it end
    placed.clear_caches()
    np.testing.assert_array_equal(placed(tokens), expected)
    report = placed.report()
    assert report.total.passes == 2 and report.last.bytes_read > 0


def test_the_call_after_a_time_out_asks_the_server_anew(tokens, expected, server, traffic):
  reads = jr.ReadOptions(retries=0, timeout_s=1.0)
  policy = POLICIES["dense_direct"]
  with jr.place(abstract(), policy, store=server.url, mesh=MESH1, read_options=reads) as placed:
    placed(tokens)
    server.latency_s = 3.0  # the call after a time-out would wait 2 s more
    placed.clear_caches()
    with pytest.raises(jr.errors.StoreTimeoutError):
      placed(tokens)
    server.latency_s = 0.0  # the server is fast again, for every new request
    placed.clear_caches()
    try:
      np.testing.assert_array_equal(placed(tokens), expected)
    finally:
      traffic.drain()


# --- ReadOptions ------------------------------------------------------------------


def test_read_options_defaults_and_attempts():
  reads = jr.ReadOptions()
  assert (reads.retries, reads.attempts) == (4, 5)
  assert reads.timeout_s is not None and reads.timeout_s > 0
  assert jr.ReadOptions(retries=0).attempts == 1
  assert jr.ReadOptions(timeout_s=None).timeout_s is None  # no limit


@pytest.mark.parametrize(
  "kwargs, field",
  [
    ({"retries": -1}, "retries"),
    ({"retries": True}, "retries"),
    ({"retries": 1.5}, "retries"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"timeout_s": -1.0}, "timeout_s"),
    ({"timeout_s": True}, "timeout_s"),
    ({"timeout_s": float("nan")}, "timeout_s"),
    ({"retry_delay_s": -0.1}, "retry_delay_s"),
    ({"max_retry_delay_s": float("inf")}, "max_retry_delay_s"),
    ({"max_retry_delay_s": "2s"}, "max_retry_delay_s"),
  ],
)
def test_invalid_read_options_name_the_field(kwargs, field):
  with pytest.raises(jr.errors.InvalidPolicyValueError) as caught:
    jr.ReadOptions(**kwargs)
  assert f"{field}=" in str(caught.value)


# --- other URLs -------------------------------------------------------------------


def test_memory_url_save_and_place(model, tokens, jitted):
  url = "memory://test-remote/toy"
  info = jr.save(model, url, progress=False)
  assert info.unit_count == CFG.n_layers
  with jr.place(abstract(), POLICIES["layerwise_host"], store=url, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), jitted)


def test_file_url_save_and_place(model, tokens, expected, tmp_path):
  path = str(tmp_path / "toy")
  url = "file://" + path
  info = jr.save(model, url, progress=False)
  assert info.unit_count == CFG.n_layers and os.path.isdir(os.path.join(path, "d"))
  with jr.place(abstract(), POLICIES["dense_direct"], store=url, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), expected)
  assert placed.report().fetched_bytes >= placed.report().total.bytes_read > 0


@pytest.mark.parametrize("where", ["served", "new"])
def test_save_to_http_says_read_only(model, server, where):
  url = server.url if where == "served" else server.url + "new/"
  with pytest.raises(jr.StoreError, match="read-only"):
    jr.save(model, url, progress=False, overwrite=where == "new")


# --- the CLI over HTTP ----------------------------------------------------------


def test_cli_inspect_plan_and_verify_over_http(store, server, traffic):
  urls = (server.url, store)
  code, out, err = call("inspect", server.url, "--json")
  assert code == 0, err
  remote = json.loads(out)
  code, out, _ = call("inspect", store, "--json")
  local = json.loads(out)
  assert remote["unit_count"] == CFG.n_layers and remote["streamable"] is True
  assert {k: v for k, v in remote.items() if v != server.url} == {
    k: v for k, v in local.items() if v != store
  }
  plans = [call("plan", where, "--device-budget", "1MiB", "--json") for where in urls]
  assert [code for code, _, _ in plans] == [0, 0], plans
  remote, local = (json.loads(out) for _, out, _ in plans)
  assert remote["path"] == server.url and remote["units"] == CFG.n_layers
  assert {k: v for k, v in remote.items() if k != "path"} == {
    k: v for k, v in local.items() if k != "path"
  }
  server.reset_counts()
  code, out, err = call("verify", server.url, "--json")
  assert code == 0, err
  result = json.loads(out)
  assert result["ok"] is True and result["damaged"] == []
  assert result["nbytes"] >= CFG.n_layers * CFG.unit_bytes()
  # Every chunk came over HTTP: each value stored out of line (values of up to 1 KiB
  # live in the index nodes, compressed), and no more than the data files hold.
  values = sum(e.length for e in ocdbt_extents(store).values())
  data = sum(f.stat().st_size for f in pathlib.Path(store).rglob("d/*"))
  traffic.drain()  # every chunk sent is counted
  assert values <= server.bytes_served <= data
  code, out, err = call("verify", server.url)
  assert code == 0 and "no damage found" in out, err
