"""Faults injected the way they happen, and what the user gets (RELIABILITY.md's rows).

A damaged data file (truncated, deleted, unreadable), ``close()`` from another thread
during a pass, an interrupt (SIGINT) during a pass and during a save, and every broken
store kind given to the command line, which must answer on one line, never with a
traceback. The flipped bit, the crashed or full-disk save, malformed metadata and a
replaced store have their own files (``test_integrity.py``, ``test_store_safety.py``,
``test_bad_input.py``).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading

import jax
import numpy as np
import pytest
from damage import chunk_extent, delete_chunk_file, flip_bit, truncate_chunk_file
from flax import nnx
from policies import dense
from user_env import run_script

import jax_residency as jr
from jax_residency import testing
from jax_residency._src.cli import main as cli
from jax_residency._src.cli import stored_models as records
from jax_residency._src.store import unit_store as store_mod
from jax_residency._src.store import writer
from jax_residency._src.stream import prefetch
from jax_residency.toy import ToyConfig, ToyTransformer

# Kernels of 16-64 KiB: stored out of line in the OCDBT data files, one file per chunk.
CFG = ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=128, n_layers=4)
MESH1 = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("devices",))
KERNEL = "layers.up.kernel"  # (4, 64, 128) float32: 32 KiB per unit; unit 2 is damaged
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WAIT = 30.0  # seconds: a bound on waits that end at once unless something hangs


@pytest.fixture(scope="module")
def model(toy_model):
  return toy_model(CFG, seeded=True)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 6), 0, CFG.vocab)


@pytest.fixture(scope="module")
def expected(model, tokens):
  return np.asarray(model(tokens))  # eager: what a dense stream matches bit for bit


@pytest.fixture(scope="module")
def store(model, saved_store):
  """The model's store, with the record `jax-residency run` reads."""

  def write(path: str) -> jr.StoreInfo:
    info = jr.save(model, path, progress=False)
    records.write_model_record(path, CFG, 0)
    return info

  return saved_store(("toy", CFG, 0, None, True, "with its model record"), write=write).path


def worker_threads() -> int:
  return sum(t.name.startswith("jax-residency") for t in threading.enumerate())


# --- damaged data files --------------------------------------------------------------

POLICIES = {
  "dense-direct": lambda: dense(0),  # read on the calling thread
  "dense-cached": lambda: dense("4MiB"),  # read by the prefetch worker
  "resident": jr.FullyResident,  # every weight read at placement
}
DAMAGE = {"truncated": truncate_chunk_file, "deleted": delete_chunk_file}


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_truncated_or_deleted_data_file_is_a_store_error_naming_the_unit(
  model, tokens, store, tmp_path, damage, policy
):
  bad = str(tmp_path / "bad")
  shutil.copytree(store, bad)
  DAMAGE[damage](bad, KERNEL, 2)
  if policy == "resident":
    with pytest.raises(jr.StoreError) as info:
      jr.place(model, POLICIES[policy](), store=bad, mesh=MESH1)
    check_read_error(info.value, bad)
    return
  with jr.place(model, POLICIES[policy](), store=bad, mesh=MESH1) as placed:
    for _ in range(2):  # every pass needs unit 2: each fails the same way
      with pytest.raises(jr.StoreError) as info:
        placed(tokens)
      check_read_error(info.value, bad)
      del info  # its traceback holds the failed pass's read buffers
    assert placed.report().total.passes == 0  # the failed passes committed nothing


def check_read_error(error: BaseException, store: str) -> None:
  """A `StoreError` (whichever thread read) naming the store, the tensor and unit 2."""
  assert isinstance(error, jr.StoreError) and not isinstance(error, jr.errors.PrefetchError)
  message = str(error)
  assert f"unit 2 of tensor '{KERNEL}'" in message.lower() and store in message, message


# --- permission denied -----------------------------------------------------------------

#: The command lines the broken-store tests run (`{path}`: the store).
COMMANDS = {
  "inspect": ["inspect", "{path}"],
  "plan": ["plan", "{path}", "--platform", "cpu"],
  "verify": ["verify", "{path}"],
  "run": ["run", "{path}", "--policy", "dense_disk_stream", "--shape", "1,2"],
}

#: Run in a child process, which reads the stores (the library, then each command) as a
#: user their modes keep out: as root, it first becomes nobody (root reads any file).
_READER = """
import contextlib, io, json, os, sys

from jax_residency._src.cli import main as cli
from jax_residency._src.store.unit_store import UnitStore

stores, commands, intact = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
# Each command once on the intact store first: whatever it imports or starts lazily is
# there before the reader may no longer read Python's own files (root's, 0o700, maybe).
for argv in commands.values():
  with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    assert cli.main([a.format(path=intact) for a in argv]) == 0, argv
if sys.argv[4] == "drop":
  try:
    os.setgroups([])
    os.setresgid(65534, 65534, 65534)
    os.setresuid(65534, 65534, 65534)
  except OSError as e:  # e.g. a container without CAP_SETUID
    print(json.dumps({"skip": f"cannot become nobody (uid 65534): {e}"}))
    sys.exit(0)
results = {}
for kind, path in stores.items():
  result = results[kind] = {}
  try:
    with UnitStore.open(path) as store:
      store.read_unit(2)
    result["library"] = None
  except Exception as e:
    result["library"] = [[c.__name__ for c in type(e).__mro__], str(e)]
  for name, argv in commands.items():
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
      code = cli.main([a.format(path=path) for a in argv])
    result[name] = [code, out.getvalue(), err.getvalue()]
print(json.dumps(results))
"""


def _reader_env() -> dict[str, str]:
  """The reader's environment: this one, on one device (the suite's eight cost seconds of
  compiling in a new process, and the command line uses one): the session's zygote's
  (conftest.py), so the reader is a fork of it."""
  return {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}


def _reachable(directory: str | None) -> bool:
  """Whether every user may enter ``directory`` (it and each directory above it)."""
  if not directory or not os.path.isdir(directory):
    return False
  path = os.path.realpath(directory)
  while True:
    if not os.stat(path).st_mode & 0o001:
      return False
    if path == os.path.dirname(path):
      return True
    path = os.path.dirname(path)


def _open_up(path: str) -> None:
  """Every directory under ``path`` 0o755, every file 0o644 (whatever the umask was)."""
  os.chmod(path, 0o755)
  for parent, dirs, files in os.walk(path):
    for name in dirs:
      os.chmod(os.path.join(parent, name), 0o755)
    for name in files:
      os.chmod(os.path.join(parent, name), 0o644)


@pytest.fixture(scope="module")
def unreadable(store, tmp_path_factory, zygote):
  """Reads two copies of the store that the reader may not read, in one child process:
  ``unreadable-file`` (the data file of unit 2 of `KERNEL`) and ``unreadable-dir`` (the
  store's directory). Returns {kind: {"path", "library": None or [error classes,
  message], command: [exit code, stdout, stderr]}}.

  As root, the copies are root's, readable by their owner only, and the child becomes
  nobody; otherwise they are chmod 000. Their modes are restored before returning."""
  as_root = os.geteuid() == 0
  base = None
  if as_root:  # nobody must reach the copies: not under pytest's temporary root (0o700)
    reachable = [d for d in (os.environ.get("TMPDIR"), "/tmp", "/var/tmp") if _reachable(d)]
    if not reachable:
      pytest.skip("no temporary directory that every user can reach")
    base = tempfile.mkdtemp(prefix="jax-residency-faults-", dir=reachable[0])
  parent = base or str(tmp_path_factory.mktemp("unreadable"))
  try:
    stores = {kind: os.path.join(parent, kind) for kind in ("unreadable-file", "unreadable-dir")}
    for path in stores.values():
      shutil.copytree(store, path)
      _open_up(path)
    if as_root:
      os.chmod(parent, 0o755)
    closed = {
      chunk_extent(stores["unreadable-file"], KERNEL, 2).file: 0o600 if as_root else 0,
      stores["unreadable-dir"]: 0o700 if as_root else 0,
    }
    for path, mode in closed.items():
      os.chmod(path, mode)
    try:
      done = run_script(
        [
          sys.executable,
          "-c",
          _READER,
          json.dumps(stores),
          json.dumps(COMMANDS),
          store,
          "drop" if as_root else "keep",
        ],
        zygote,
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
        env=_reader_env(),
      )
    finally:  # never leave a file pytest cannot remove
      for path in closed:
        os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.splitlines()[-1])
    if "skip" in results:
      pytest.skip(results["skip"])
    return {kind: {"path": path, **results[kind]} for kind, path in stores.items()}
  finally:
    if base is not None:
      shutil.rmtree(base, ignore_errors=True)


def test_an_unreadable_data_file_is_a_store_error_naming_the_unit_and_the_file(unreadable):
  result = unreadable["unreadable-file"]
  classes, message = result["library"]  # the store opens; reading unit 2 fails
  assert "StoreError" in classes and "PrefetchError" not in classes
  assert f"unit 2 of tensor '{KERNEL}'" in message.lower() and result["path"] in message
  assert "permission denied" in message.lower(), message
  assert "check the permissions" in message.lower(), message
  code, _, err = result["run"]  # a pass that needs unit 2, read by the prefetch worker
  assert code == 2 and "permission denied" in err.lower() and KERNEL in err, err


def test_an_unreadable_store_directory_is_a_store_error_naming_it(unreadable):
  result = unreadable["unreadable-dir"]
  classes, message = result["library"]  # open fails
  assert "StoreError" in classes
  assert result["path"] in message and "permission denied" in message.lower(), message
  assert "check the permissions" in message.lower(), message


# --- the command line on broken stores ------------------------------------------------------


def _break(source: str, path: str, kind: str) -> None:
  """Makes ``path`` a store broken as ``kind`` says (from a copy of ``source``)."""
  if kind == "empty":
    os.mkdir(path)
  if kind in ("missing", "empty"):
    return
  shutil.copytree(source, path)
  _damage(path, kind)


def _damage(path: str, kind: str) -> None:
  """Breaks the store at ``path`` in place as ``kind`` says."""
  if kind == "truncated-file":
    truncate_chunk_file(path, KERNEL, 2)
  elif kind == "deleted-file":
    delete_chunk_file(path, KERNEL, 2)
  elif kind == "flipped-bit":
    flip_bit(path, KERNEL, 2)
  elif kind == "bad-metadata":
    with open(os.path.join(path, "_METADATA"), "w") as f:
      f.write("{not json")
  elif kind == "bad-sidecar":
    with open(os.path.join(path, "jax_residency.json"), "w") as f:
      json.dump(["layers"], f)
  elif kind == "flipped-manifest":  # one bit of the OCDBT manifest (it carries a CRC-32C)
    with open(os.path.join(path, "manifest.ocdbt"), "r+b") as f:
      data = bytearray(f.read())
      data[len(data) // 2] ^= 1
      f.seek(0)
      f.write(data)
  elif kind == "data-dir-gone":
    shutil.rmtree(os.path.join(path, "d"))
  elif kind.endswith("-gone"):  # one metadata file deleted
    os.remove(os.path.join(path, GONE[kind]))


#: The metadata files a store is broken by deleting, by kind.
GONE = {
  "manifest-gone": "manifest.ocdbt",
  "metadata-gone": "_METADATA",
  "sidecar-gone": "jax_residency.json",
}


#: For each broken store: the exit codes of inspect, plan, verify and run, and what the
#: one-line error names ({path}: the store), or verify's line for the damaged chunk.
#: inspect and plan read metadata only, so data damage is verify's and run's to find.
UNIT_2 = f"unit 2 of tensor '{KERNEL}'"  # a read error or a corruption, lower-cased
EXPECTED = {
  "missing": ((2, 2, 2, 2), ("{path}: no such file or directory",)),
  "empty": ((2, 2, 2, 2), ("no unit store at {path}",)),
  "truncated-file": ((0, 0, 1, 2), (UNIT_2, "{path}", f"unreadable: {KERNEL} (unit 2)")),
  "deleted-file": ((0, 0, 1, 2), (UNIT_2, "{path}", f"unreadable: {KERNEL} (unit 2)")),
  "flipped-bit": ((0, 0, 1, 2), (UNIT_2, "{path}", "checksum", f"corrupt: {KERNEL} (unit 2)")),
  "unreadable-file": (
    (0, 0, 1, 2),
    (UNIT_2, "{path}", "permission denied", f"unreadable: {KERNEL} (unit 2)"),
  ),
  "unreadable-dir": ((2, 2, 2, 2), ("{path}", "permission denied")),
  "bad-metadata": ((2, 2, 2, 2), ("{path}/_metadata is not valid json",)),
  "bad-sidecar": ((2, 2, 2, 2), ("{path}/jax_residency.json holds an array",)),
  # Faults met when the store opens (docs/design.md, 5.4 "Integrity").
  "flipped-manifest": ((2, 2, 2, 2), ("{path} is damaged", "{path}/manifest.ocdbt", "checksum")),
  "data-dir-gone": ((2, 2, 2, 2), ("{path} is incomplete or damaged", "{path}/d/")),
  "manifest-gone": ((2, 2, 2, 2), ("{path} lists arrays without zarr metadata",)),
  # Without _METADATA the manifest and the sidecar still describe the store.
  "metadata-gone": ((0, 0, 0, 0), ()),
  "sidecar-gone": ((2, 2, 2, 2), ("{path} has no jax_residency.json",)),
}

#: Stores broken where they open: the error `place` raises under every policy, and
#: what its message names.
AT_OPEN = {
  "flipped-manifest": (
    jr.errors.StoreCorruptionError,
    ("{path} is damaged", "{path}/manifest.ocdbt", "write it again"),
  ),
  "data-dir-gone": (jr.StoreError, ("{path} is incomplete or damaged", "{path}/d/", "restore")),
  "manifest-gone": (jr.StoreLayoutError, ("{path} lists arrays without zarr metadata",)),
}


@pytest.fixture(scope="module")
def broken(store, tmp_path_factory):
  """kind -> a store broken that way (the unreadable kinds are read in `unreadable`)."""
  base = tmp_path_factory.mktemp("broken")
  paths = {kind: str(base / kind) for kind in EXPECTED if not kind.startswith("unreadable")}
  for kind, path in paths.items():
    _break(store, path, kind)
  return paths


def _call(argv: list[str]) -> list:
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = cli.main(argv)
  return [code, out.getvalue(), err.getvalue()]


@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("kind", list(EXPECTED))
def test_the_cli_answers_every_broken_store_on_one_line_without_a_traceback(request, kind, command):
  if kind.startswith("unreadable"):
    result = request.getfixturevalue("unreadable")[kind]
    path, (code, out, err) = result["path"], result[command]
  else:
    path = request.getfixturevalue("broken")[kind]
    code, out, err = _call([a.format(path=path) for a in COMMANDS[command]])
  codes, names = EXPECTED[kind]
  assert code == codes[list(COMMANDS).index(command)], (code, out, err)
  assert "Traceback" not in out + err
  names = [n.format(path=path).lower() for n in names]
  if code == 2:
    assert out == "" and err.count("\n") == 1 and err.endswith("\n"), err
    assert err.startswith(f"jax-residency {command}: error: ")
    for name in names:
      if not name.startswith(("unreadable:", "corrupt:")):
        assert name in err.lower(), (name, err)
  elif code == 1:  # verify: one line per damaged chunk, a summary, the first error
    assert err == "" and names[-1] in out.lower().splitlines(), out
    assert "1 damaged chunk" in out
  else:
    assert err == "" and out


@pytest.mark.parametrize("policy", ["resident", "layerwise", "dense"])
@pytest.mark.parametrize("kind", list(AT_OPEN))
def test_a_store_damaged_where_it_opens_is_a_typed_error_under_every_policy(
  broken, model, kind, policy
):
  error, names = AT_OPEN[kind]
  path = broken[kind]
  chosen = {
    "resident": jr.FullyResident(),
    "layerwise": jr.LayerwiseHost(),
    "dense": dense(0),
  }[policy]
  with pytest.raises(error) as raised:
    jr.place(model, chosen, store=path, mesh=MESH1)
  message = str(raised.value).lower()
  for name in names:
    assert name.format(path=path).lower() in message, (name, message)
  if error is jr.errors.StoreCorruptionError:
    assert raised.value.store == path


@pytest.mark.parametrize("kind", list(AT_OPEN))
def test_a_store_damaged_under_a_live_stream_is_a_typed_error_at_the_next_read(
  store, model, tokens, expected, tmp_path, kind
):
  """The same damage done after a direct dense stream placed the store and ran a pass:
  the next pass, which reads every unit again, raises a `StoreError` naming the store
  (a manifest rewritten in place is a replaced store) and commits nothing."""
  path = str(tmp_path / "store")
  shutil.copytree(store, path)
  with jr.place(model, dense(0), store=path, mesh=MESH1) as placed:
    np.testing.assert_array_equal(np.asarray(placed(tokens)), expected)
    _damage(path, kind)
    with pytest.raises(jr.StoreError) as raised:
      placed(tokens)
    assert path in str(raised.value), raised.value
    assert not isinstance(raised.value, jr.errors.PrefetchError)
    assert placed.report().total.passes == 1


# --- close() during a pass -------------------------------------------------------------------


@pytest.mark.parametrize("host", [0, "4MiB"], ids=["direct", "cached"])
@pytest.mark.parametrize("unit", [1, 3])
def test_close_during_a_pass_fails_it_clearly_or_lets_it_finish(
  model, tokens, store, expected, monkeypatch, host, unit
):
  """`close()` from another thread while unit ``unit`` is being read: the pass either
  finishes with the right output or raises an error saying the placement was closed;
  nothing hangs, no thread is left, the report counts only the passes that finished,
  and the placement then refuses to run."""
  threads = worker_threads()
  placed = jr.place(model, dense(host), store=store, mesh=MESH1)
  np.testing.assert_array_equal(placed(tokens), expected)
  placed.clear_caches()  # the next pass reads every unit again
  real = store_mod.UnitStore.read_unit_async
  reading, closing = threading.Event(), threading.Event()

  def read_once_closing(self, i, **kwargs):
    if i == unit:
      reading.set()
      closing.wait(WAIT)
    return real(self, i, **kwargs)

  monkeypatch.setattr(store_mod.UnitStore, "read_unit_async", read_once_closing)
  outcome: dict = {}

  def run() -> None:
    try:
      outcome["output"] = np.asarray(placed(tokens))
    except Exception as e:  # noqa: BLE001 - what the pass raised is what is checked
      outcome["error"] = e

  thread = threading.Thread(target=run)
  thread.start()
  assert reading.wait(WAIT)
  closing.set()
  placed.close()
  thread.join(WAIT)
  assert not thread.is_alive(), "the pass hung after close()"
  assert worker_threads() == threads
  if "error" in outcome:
    error = outcome["error"]
    assert isinstance(error, jr.ClosedError), repr(error)  # never wrapped as a read failure
    assert "close" in str(error), str(error)
  else:
    np.testing.assert_array_equal(outcome["output"], expected)
  assert placed.report().total.passes == 1 + ("output" in outcome)
  with pytest.raises(jr.ClosedError):
    placed(tokens)


# --- an interrupt (SIGINT) during a pass or a save ---------------------------------------------


@contextlib.contextmanager
def sigint_raises_keyboard_interrupt():
  """Python's own SIGINT handler for the block; a real signal needs the main thread."""
  if threading.current_thread() is not threading.main_thread():
    pytest.skip("signals are handled on the main thread, and this test is not on it")
  previous = signal.signal(signal.SIGINT, signal.default_int_handler)
  try:
    yield
  finally:
    signal.signal(signal.SIGINT, previous)


def _interrupt_main_thread() -> None:
  """Ctrl-C: SIGINT to the main thread (from any thread); Python raises KeyboardInterrupt
  there, in whatever it is doing or waiting for."""
  signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)


class SlowRead:
  """A read that completes once ``done`` is set (or after `WAIT`)."""

  def __init__(self, pending, done: threading.Event) -> None:
    self._pending, self._done = pending, done

  def result(self):
    self._done.wait(WAIT)
    return self._pending.result()


INTERRUPTS = {
  # where the interrupt lands: (host budget, how)
  "caller-reading": (0, "raise"),  # direct: the calling thread reads unit 2
  "waiting-for-worker": ("4MiB", "raise"),  # the caller waits for the worker's read
  "sigint-while-worker-reads": ("4MiB", "signal"),  # a real SIGINT, wherever the caller is
}


@pytest.mark.parametrize("where", list(INTERRUPTS))
def test_an_interrupted_pass_raises_keyboard_interrupt_and_the_placement_stays_usable(
  model, tokens, store, expected, monkeypatch, where
):
  host, how = INTERRUPTS[where]
  with jr.place(model, dense(host), store=store, mesh=MESH1) as placed:
    np.testing.assert_array_equal(placed(tokens), expected)
    placed.clear_caches()
    before = placed.report().total
    real_read, real_wait = store_mod.UnitStore.read_unit_async, prefetch.PrefetchWorker.wait
    waited = threading.Event()

    def read(self, i, **kwargs):
      if i != 2 or waited.is_set():
        return real_read(self, i, **kwargs)
      if where == "caller-reading":
        waited.set()
        raise KeyboardInterrupt
      if where == "sigint-while-worker-reads":
        waited.set()
        _interrupt_main_thread()
        return real_read(self, i, **kwargs)
      return SlowRead(real_read(self, i, **kwargs), waited)  # waiting-for-worker

    def wait(self, unit, timeout=None):
      if unit == 2 and where == "waiting-for-worker" and not waited.is_set():
        waited.set()
        raise KeyboardInterrupt
      return real_wait(self, unit, timeout)

    monkeypatch.setattr(store_mod.UnitStore, "read_unit_async", read)
    monkeypatch.setattr(prefetch.PrefetchWorker, "wait", wait)
    with sigint_raises_keyboard_interrupt(), pytest.raises(KeyboardInterrupt):
      placed(tokens)
    assert waited.is_set()
    monkeypatch.undo()
    assert placed.report().total == before  # the interrupted pass committed nothing
    for _ in range(2):  # and left no reservation, lease or queued read behind
      np.testing.assert_array_equal(placed(tokens), expected)
    report = placed.report()
    assert report.total.passes == before.passes + 2
    testing.assert_within_budgets(placed)  # every pass's peaks within the window and host cache


def _holds(path: str, model: ToyTransformer) -> bool:
  """Whether the store at ``path`` holds ``model``'s unit weights, all of them."""
  layers = {
    tuple(str(k) for k in p): np.asarray(v[...])
    for p, v in nnx.to_flat_state(nnx.state(model.layers))  # type: ignore[attr-defined]
  }
  with store_mod.UnitStore.open(path) as opened:
    units = [opened.read_unit(i) for i in range(opened.unit_count)]
  return all(
    np.array_equal(units[i][p], v[i]) for p, v in layers.items() for i in range(len(units))
  )


@pytest.mark.parametrize("signalled", [False, True], ids=["raised", "sigint"])
@pytest.mark.parametrize("replacing", [True, False], ids=["overwrite", "fresh"])
def test_an_interrupted_save_leaves_the_old_store_and_nothing_else(
  model, seeded_nnx, tmp_path, monkeypatch, replacing, signalled
):
  """Ctrl-C after a few chunks are written: the save stops with KeyboardInterrupt, the
  temporary store is removed, and the path holds the old store, whole (or nothing).
  An interrupt at each step of the commit is tests/test_store_safety.py's."""
  path = str(tmp_path / "store")
  if replacing:
    jr.save(model, path, progress=False)
  other = seeded_nnx(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)), seed=7)
  real, written = writer._write_chunk, []

  def chunk(handle, index, value):
    written.append(index)
    if len(written) == 4:
      if signalled:
        _interrupt_main_thread()
      else:
        raise KeyboardInterrupt
    return real(handle, index, value)

  monkeypatch.setattr(writer, "_write_chunk", chunk)
  with sigint_raises_keyboard_interrupt(), pytest.raises(KeyboardInterrupt):
    jr.save(other, path, progress=False, overwrite=True)
  monkeypatch.undo()
  assert os.listdir(tmp_path) == (["store"] if replacing else [])
  if replacing:
    assert _holds(path, model)
  jr.save(other, path, progress=False, overwrite=True)  # the next save just works
  assert os.listdir(tmp_path) == ["store"] and _holds(path, other)


_INTERRUPTER = r"""
import json, os, shutil, signal, sys, threading
import numpy as np
from flax import nnx
import jax_residency as jr
from jax_residency import models
from jax_residency._src.models.toy import ToyConfig, ToyTransformer
from jax_residency._src.store import commit, writer
from jax_residency._src.store.rechunk import rechunk_store
from jax_residency._src.store.unit_store import UnitStore

base, hf, moments = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = ToyConfig(vocab=64, d_model=64, n_heads=4, d_ff=128, n_layers=4)
old, new = (ToyTransformer(cfg, rngs=nnx.Rngs(seed)) for seed in (0, 7))
source, before = os.path.join(base, "source"), os.path.join(base, "before")
jr.save(new, source, progress=False)
jr.save(old, before, progress=False)
ops = {
  "save": lambda dest: jr.save(new, dest, progress=False, overwrite=True),
  "convert_hf": lambda dest: models.convert_hf(hf, dest, progress=False, overwrite=True),
  "rechunk": lambda dest: rechunk_store(source, dest, progress=False, overwrite=True),
}
real_chunk, real_point = writer._write_chunk, commit.crash_point
results = []
for op, run in ops.items():
  for name in ("SIGINT", "SIGTERM"):
    for moment in moments[op]:
      folder = os.path.join(base, f"{op}-{name}-{moment}".replace(" ", "_"))
      os.mkdir(folder)
      dest = os.path.join(folder, "store")
      shutil.copytree(before, dest)  # the store being replaced
      count = []

      def fire():
        signal.pthread_kill(threading.main_thread().ident, getattr(signal, name))

      def chunk(handle, index, value, moment=moment, count=count):
        count.append(1)
        if moment == f"chunk {len(count)}":
          fire()
        return real_chunk(handle, index, value)

      def point(step, moment=moment):
        if moment == f"commit {step}":
          fire()
        return real_point(step)

      writer._write_chunk, commit.crash_point = chunk, point
      try:
        run(dest)
        got = "finished"
      except KeyboardInterrupt:
        got = "KeyboardInterrupt"
      except SystemExit as e:
        got = f"SystemExit({e.code})"
      finally:
        writer._write_chunk, commit.crash_point = real_chunk, real_point
      with UnitStore.open(dest):
        pass  # the path holds a whole store
      results.append({
        "case": [op, name, moment], "got": got, "left": sorted(os.listdir(folder)),
        "term_handler_restored": signal.getsignal(signal.SIGTERM) is signal.SIG_DFL,
      })
print(json.dumps(results))
"""

#: When the interrupt comes, by operation: at the first or fourth chunk written, and at
#: steps of the commit (`commit.crash_point`) reached by a local overwrite on Linux. The
#: three share the writer; a save is interrupted at every moment.
MOMENTS = {
  "save": ["chunk 1", "chunk 4", "commit exchanged", "commit cleaned"],
  "convert_hf": ["chunk 4", "commit exchanged"],
  "rechunk": ["chunk 4", "commit exchanged"],
}


def test_sigint_or_sigterm_during_a_write_removes_its_temporary_store(tmp_path, zygote):
  """`jr.save`, `models.convert_hf` and `rechunk` over an existing store, interrupted by
  SIGINT or SIGTERM at several moments, in a fresh process (where SIGTERM has its
  default action): each stops (KeyboardInterrupt; SystemExit(143) for SIGTERM), leaves
  no temporary beside the store, and the path holds a store that places."""
  hf = os.path.join(ROOT, "tests", "fixtures", "llama_tiny_untied")
  done = run_script(  # a fork of the zygote: SIGINT and SIGTERM as in a fresh `python`
    [sys.executable, "-c", _INTERRUPTER, str(tmp_path), hf, json.dumps(MOMENTS)],
    zygote,
    capture_output=True,
    text=True,
    timeout=240,
    cwd=ROOT,
    env=_reader_env(),
  )
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(done.stdout.splitlines()[-1])
  assert len(results) == 2 * sum(map(len, MOMENTS.values()))
  for r in results:
    op, name, moment = r["case"]
    if moment == "commit cleaned":  # the new store is in place; the old one being removed
      assert r["got"] in ("finished", "KeyboardInterrupt", "SystemExit(143)"), r
    else:
      assert r["got"] == ("KeyboardInterrupt" if name == "SIGINT" else "SystemExit(143)"), r
    assert r["left"] == ["store"], r  # no temporary, no old store aside
    assert r["term_handler_restored"], r


#: A child that overwrites a store of 16 x 4 KiB x ROWS and is sent SIGINT or SIGTERM at a
#: spread of moments of the write (argv: the destination; a local copy of the old store to
#: put there first, or "" to save it there; the cases as JSON: [signal, fraction of the
#: write's time]; ROWS). The write is what runs inside `commit.terminations_raise`, timed on
#: two saves; the signal comes from another thread, only while the write runs (after
#: it, SIGTERM's default action would end the child).
_SPREAD = r"""
import contextlib, json, os, shutil, signal, sys, threading, time
import numpy as np
import tensorstore as ts
from jax_residency._src.store import commit, pointers, writer
from jax_residency._src.store.locations import locate
from jax_residency._src.store.handles import store_context
from jax_residency._src.store.unit_store import UnitStore

dest, scratch, cases, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
UNITS = {(k,): (4, rows, 1024) for k in ("a", "b", "c", "d")}  # rows=384: 1.5 MiB a chunk, 24 MiB

def save(version, path):  # a model's weights as jr.save hands them to the writer
  units = {k: np.full(shape, version + i, np.float32) for i, (k, shape) in enumerate(UNITS.items())}
  static = {("embed",): np.full((256, 512), version, np.float32)}
  writer.save_store(
    path, static=static, units=units, unit_prefix=("layers",), progress=False, overwrite=True
  )

# The write, from its start to its end, is what runs inside `commit.terminations_raise`.
state, lock, entered = {"inside": False, "took": []}, threading.Lock(), threading.Event()
real = commit.terminations_raise

@contextlib.contextmanager
def watched():
  with real():
    with lock:
      state["inside"], start = True, time.perf_counter()
    entered.set()
    try:
      yield
    finally:
      with lock:
        state["inside"] = False
        state["took"].append(time.perf_counter() - start)

commit.terminations_raise = watched
save(0, scratch or dest)  # the store being replaced
for _ in range(3):  # the first pays for more than the later ones
  save(7, dest + "-timed")
took = min(state["took"][1:])

def holds(path):  # which version the path holds, whole
  with UnitStore.open(path) as store:
    static = store.read_static()[("embed",)]
    units = [store.read_unit(i) for i in range(store.unit_count)]
  whole = lambda v: all((u[k] == v + i).all() for u in units for i, k in enumerate(UNITS))
  return [v for v in (0, 7) if (static == v).all() and whole(v)]

def beside(path):  # a temporary, or a generation the pointer does not name
  if "://" not in path:
    parent, name = os.path.split(path)
    return sorted(set(os.listdir(parent)) - {name, name + "-timed"})
  kv = ts.KvStore.open(locate(path).base, context=store_context()).result()
  keys = {k.decode().split("/")[0] for k in kv.list().result()}
  pointer = json.loads(kv.read(pointers.POINTER_KEY).result().value)["generation"]
  return sorted(keys - {pointers.POINTER_KEY, pointer})

def attempt(name, fraction):  # one save of version 7 over version 0, signalled at a moment
  if scratch:
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(scratch, dest)
  else:
    save(0, dest)
  sent = []
  entered.clear()

  def fire(delay=fraction * took):
    entered.wait()
    time.sleep(delay)
    with lock:  # only while the write runs: SIGTERM's default action ends a process
      if state["inside"]:
        os.kill(os.getpid(), getattr(signal, name))
        sent.append(1)

  thread = threading.Thread(target=fire)
  thread.start()
  try:
    save(7, dest)
    got = "finished"
  except KeyboardInterrupt:
    got = "KeyboardInterrupt"
  except SystemExit as e:
    got = f"SystemExit({e.code})"
  thread.join()
  return {
    "case": [name, fraction], "got": got, "sent": bool(sent), "holds": holds(dest),
    "beside": beside(dest),
  }

# A save that outran its signal (a busy machine timed the write slower than it ran) is
# tried again with the moment re-timed from that save, at most twice; every try is checked.
results = []
for name, fraction in cases:
  for _ in range(3):
    results.append(attempt(name, fraction))
    if results[-1]["sent"]:
      break
    took = min(took, state["took"][-1])
print(json.dumps({"took": took, "results": results}))
"""

#: The moments of `_SPREAD`'s signals: fractions of the write's time (its first chunk
#: writes, the waits for them, the commit), SIGINT and SIGTERM taking turns.
SPREAD = [
  ["SIGINT" if i % 2 == 0 else "SIGTERM", f]
  for i, f in enumerate((0.0, 0.15, 0.3, 0.45, 0.6, 0.75, 0.9))
]


def check_spread(done) -> None:
  """What `_SPREAD` reported: a save that got the signal stopped, and one that did not
  (the signal would have come after it) finished; the path holds the old store (or, for
  a signal that came as the store went in place, the new one), whole, and nothing is
  left beside it; most cases' signals came during a try of their save."""
  assert done.returncode == 0, done.stderr[-3000:]
  results = json.loads(done.stdout.splitlines()[-1])["results"]
  for r in results:
    name, _ = r["case"]
    stopped = "KeyboardInterrupt" if name == "SIGINT" else "SystemExit(143)"
    assert r["got"] == (stopped if r["sent"] else "finished"), r
    assert r["holds"] in ([0], [7]) if r["sent"] else r["holds"] == [7], r
    assert r["beside"] == [], r
  sent = {tuple(r["case"]) for r in results if r["sent"]}
  assert len(sent) >= len({tuple(r["case"]) for r in results}) - 2, results


def test_sigint_or_sigterm_at_a_spread_of_moments_leaves_one_store_and_no_temporary(
  tmp_path, zygote
):
  """A real SIGINT or SIGTERM at moments spread over a 24 MiB save (its writes, their
  waits, the commit), in a fresh process: each save stops (or finishes, when the signal
  came as the store went in place), the path holds the old store or the new, whole, and
  no temporary is left beside it. On S3: tests/test_s3.py."""
  dest = tmp_path / "saves" / "store"
  dest.parent.mkdir()
  done = run_script(
    [sys.executable, "-c", _SPREAD, str(dest), str(tmp_path / "old"), json.dumps(SPREAD), "384"],
    zygote,
    capture_output=True,
    text=True,
    timeout=240,
    cwd=ROOT,
    env=_reader_env(),
  )
  check_spread(done)


# --- RELIABILITY.md --------------------------------------------------------------------------


def test_reliability_md_cites_tests_that_exist():
  """Every test RELIABILITY.md names exists, runs in the default suite (not ``slow``), and
  is in the file list of its command for the fault tests."""
  with open(os.path.join(ROOT, "RELIABILITY.md"), encoding="utf-8") as f:
    text = f.read()
  table = [line for line in text.splitlines() if line.startswith("| ") and "::" in line]
  assert len(table) >= 18
  command = text[text.index("## Running the fault tests") :]
  for row in table:
    cited = re.findall(r"`(tests/test_\w+\.py)::(test_\w+)`", row.split(" | ")[-1])
    assert cited, row
    for file, name in cited:
      with open(os.path.join(ROOT, file), encoding="utf-8") as f:
        source = f.read()
      found = re.search(rf"((?:^@.*\n)*)^def {name}\(", source, re.M)
      assert found, f"{file}::{name} does not exist"
      assert "mark.slow" not in found.group(1), f"{file}::{name} is marked slow"
      assert not re.search(r"^pytestmark = .*slow", source, re.M), f"{file} is marked slow"
      assert file in command, f"{file} is missing from the command that runs the fault tests"
