"""A store is never lost or half-written (store/commit.py, store/space.py, store/writer.py).

Crashes are injected at every step of a commit through the `commit.crash_point`
seam, both by snapshotting the directory at that step (what a crash there would
leave) and by really killing a child process; a full disk through `_write_chunk`
and a patched `shutil.disk_usage`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from jax_residency._src import errors
from jax_residency._src.store import commit, rechunk, space
from jax_residency._src.store import unit_store as st
from jax_residency._src.store import writer as wr

N = 3
PREFIX = ("layers",)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: What TensorStore 0.1.86 raises when the disk is full (found on a 64 KiB tmpfs).
ENOSPC_MESSAGE = (
  'RESOURCE_EXHAUSTED: Error writing "layers.w/c/0/0/0" in OCDBT database at local file '
  '"{tmp}/": Failed writing: "{tmp}/d/6c9a8d5277911ba76ad1bd31b361ee7c.__lock": Failed to '
  "write 991512 bytes to file 4: No space left on device [os_error_code='28']"
)


def _units(seed: int) -> dict[tuple[str, ...], np.ndarray]:
  rng = np.random.default_rng(seed)
  return {
    ("w",): rng.standard_normal((N, 4, 8)).astype(np.float32),
    ("b",): rng.standard_normal((N, 3)).astype(np.float16),
  }


def _static(seed: int) -> dict[tuple[str, ...], np.ndarray]:
  return {("embed",): np.random.default_rng(seed + 100).standard_normal((5, 4)).astype(np.float32)}


def _save(path: str, seed: int, **kwargs) -> st.StoreInfo:
  return wr.save_store(
    path, static=_static(seed), units=_units(seed), unit_prefix=PREFIX, progress=False, **kwargs
  )


def _version(path: str) -> int | None:
  """Which seed's store `path` (a directory or a kvstore URL) holds, complete (None when
  nothing is there)."""
  if "://" not in path and not os.path.lexists(path):
    return None
  try:
    store = st.UnitStore.open(path)
  except errors.StoreNotFoundError:
    if "://" not in path:  # a local directory there that is not a store: not nothing
      raise
    return None
  with store:
    units = [store.read_unit(i) for i in range(N)]
    static = store.read_static()
  for seed in range(4):
    want = _units(seed)
    if all(np.array_equal(static[k], v) for k, v in _static(seed).items()) and all(
      np.array_equal(units[i][k], v[i]) for k, v in want.items() for i in range(N)
    ):
      return seed
  raise AssertionError(f"{path} holds none of the saved versions")


def _dead_pid() -> int:
  """A pid no process has (above the kernel's pid_max)."""
  try:
    with open("/proc/sys/kernel/pid_max") as f:
      return int(f.read()) + 1
  except OSError:
    return (1 << 22) + 1


def _exchange_works(directory) -> bool:
  a, b = directory / "xa", directory / "xb"
  a.mkdir()
  b.mkdir()
  try:
    return commit.exchange(str(a), str(b))
  finally:
    a.rmdir()
    b.rmdir()


@pytest.fixture(params=["exchange", "fallback"])
def mode(request, monkeypatch, tmp_path) -> str:
  if request.param == "fallback":
    monkeypatch.setattr(commit, "exchange", lambda a, b: False)
  elif not _exchange_works(tmp_path):
    pytest.skip("this filesystem cannot exchange directories (renameat2)")
  return request.param


# Steps each commit passes, and the version the path holds if the writer dies there
# (0: the old store, 1: the new one, None: nothing), before and after `recover_store`.
STEPS = {
  ("exchange", True): {"written": (0, 0), "exchanged": (1, 1), "cleaned": (1, 1)},
  ("fallback", True): {
    "written": (0, 0),
    "moved-aside": (None, 0),
    "renamed": (1, 1),
    "cleaned": (1, 1),
  },
  ("exchange", False): {"written": (None, None), "renamed": (1, 1), "cleaned": (1, 1)},
  ("fallback", False): {"written": (None, None), "renamed": (1, 1), "cleaned": (1, 1)},
}


# --- crashes at each step of a commit ----------------------------------------------


@pytest.mark.parametrize("replacing", [True, False], ids=["overwrite", "fresh"])
def test_a_crash_at_any_commit_step_leaves_the_old_or_the_new_store(
  tmp_path, monkeypatch, mode, replacing
) -> None:
  root = tmp_path / "root"
  root.mkdir()
  path = str(root / "store")
  if replacing:
    _save(path, seed=0)
  snapshots = {}

  def snapshot(step: str) -> None:  # what a crash at `step` would leave on disk
    snapshots[step] = tmp_path / f"crash-{step}"
    shutil.copytree(root, snapshots[step], symlinks=True)

  monkeypatch.setattr(commit, "crash_point", snapshot)
  _save(path, seed=1, overwrite=True)
  steps = STEPS[mode, replacing]
  assert list(snapshots) == list(steps)
  assert os.listdir(root) == ["store"] and _version(path) == 1

  # In each snapshot the writer is dead: only this process's pid is, here.
  monkeypatch.setattr(commit, "_alive", lambda pid: pid != os.getpid())
  monkeypatch.setattr(commit, "crash_point", lambda step: None)
  for step, (at_crash, recovered) in steps.items():
    crashed = str(snapshots[step] / "store")
    assert _version(crashed) == at_crash, step
    assert commit.recover_store(crashed) == (at_crash != recovered), step
    assert _version(crashed) == recovered, step
    _save(crashed, seed=2, overwrite=True)  # removes what the crash left
    assert os.listdir(snapshots[step]) == ["store"], step
    assert _version(crashed) == 2, step


@pytest.mark.parametrize("step", ["written", "exchanged", "moved-aside", "renamed", "cleaned"])
def test_an_error_at_any_commit_step_leaves_one_store_and_nothing_else(
  tmp_path, monkeypatch, mode, step
) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)
  seen = []

  def fail(at: str) -> None:
    seen.append(at)
    if at == step:
      raise KeyboardInterrupt(f"interrupted at {at}")

  monkeypatch.setattr(commit, "crash_point", fail)
  if step not in STEPS[mode, True]:
    _save(path, seed=1, overwrite=True)
    assert step not in seen
    return
  with pytest.raises(KeyboardInterrupt):
    _save(path, seed=1, overwrite=True)
  assert os.listdir(tmp_path) == ["store"]
  # Before the new store is in place, the save is undone; after, it stands.
  assert _version(path) == (0 if step in ("written", "moved-aside") else 1)


def test_exchange_falls_back_where_the_filesystem_refuses(tmp_path, monkeypatch) -> None:
  def refusing(*args) -> int:
    ctypes.set_errno(errno.EINVAL)
    return -1

  monkeypatch.setattr(commit, "_renameat2", lambda: refusing)
  assert not commit.exchange(str(tmp_path), str(tmp_path))
  steps: list[str] = []
  monkeypatch.setattr(commit, "crash_point", steps.append)
  path = str(tmp_path / "store")
  _save(path, seed=0)
  _save(path, seed=1, overwrite=True)
  assert steps == ["written", "renamed", "cleaned", "written", "moved-aside", "renamed", "cleaned"]
  assert os.listdir(tmp_path) == ["store"] and _version(path) == 1


def test_recover_store_restores_only_what_a_dead_writer_left_aside(tmp_path) -> None:
  path = str(tmp_path / "store")
  assert not commit.recover_store(path) and not commit.recover_store("memory://x/store")
  _save(path, seed=0)
  live = commit.sibling_name(path, commit.OLD_TAG)  # this process's: about to finish
  os.rename(path, live)
  assert not commit.recover_store(path) and _version(path) is None
  legacy = str(tmp_path / ".store.jax-residency-old-0123abcd")  # no writer in the name
  os.rename(live, legacy)
  assert commit.recover_store(path) and _version(path) == 0
  assert os.listdir(tmp_path) == ["store"]
  assert not commit.recover_store(path)  # one lstat when the store is there


def test_opening_a_store_puts_back_what_a_dead_writer_left_aside(tmp_path) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)
  os.rename(path, str(tmp_path / ".store.jax-residency-old-0123abcd"))
  with st.UnitStore.open(path) as store:  # recovers first, then opens
    assert store.unit_count == N
  assert _version(path) == 0 and os.listdir(tmp_path) == ["store"]


# --- stale temporaries ------------------------------------------------------------------


def test_a_later_save_removes_only_dead_writers_leftovers(tmp_path) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)
  here, dead = commit._host(), _dead_pid()
  names = {
    "dead tmp": f".store.jax-residency-tmp-{here}.{dead}.0123abcd",
    "dead old": f".store.jax-residency-old-{here}.{dead}.4567cdef",
    "live tmp": os.path.basename(commit.sibling_name(path, commit.TMP_TAG)),
    "parent's tmp": f".store.jax-residency-tmp-{here}.{os.getppid()}.89abcdef",
    "other host's tmp": f".store.jax-residency-tmp-elsewhere.{dead}.0123abcd",
    "legacy tmp": ".store.jax-residency-tmp-0123abcd",
    "another store's tmp": f".other.jax-residency-tmp-{here}.{dead}.0123abcd",
  }
  for name in names.values():
    (tmp_path / name).mkdir()
    (tmp_path / name / "manifest.ocdbt").write_bytes(b"partial")
  _save(path, seed=1, overwrite=True)
  kept = {k for k, name in names.items() if (tmp_path / name).exists()}
  assert kept == set(names) - {"dead tmp", "dead old"}
  assert _version(path) == 1


# --- a really killed writer -------------------------------------------------------------

_CHILD = """
import os, signal, sys
import numpy as np
from jax_residency._src.store import commit, writer

path, how, data = sys.argv[1:]
arrays = np.load(data)
def tree(kind):
  return {tuple(k.split("/")[1:]): arrays[k] for k in arrays.files if k.startswith(kind + "/")}
def die(*_):
  os.kill(os.getpid(), signal.SIGKILL)
if how == "mid-write":  # killed after a few chunk writes
  real, calls = writer._write_chunk, []
  def chunk(handle, index, value):
    calls.append(index)
    if len(calls) > 3:
      die()
    return real(handle, index, value)
  writer._write_chunk = chunk
else:  # killed between renaming the old store aside and the new one in
  commit.exchange = lambda a, b: False
  commit.crash_point = lambda step: die() if step == how else None
writer.save_store(path, static=tree("static"), units=tree("units"), unit_prefix=("layers",),
                  progress=False, overwrite=True)
"""


@pytest.fixture(scope="module")
def killed_saves(
  tmp_path_factory,
) -> Iterator[dict[str, tuple[str, Callable[[], tuple[str, int]]]]]:
  """Overwrites store 0 with store 1 in child processes SIGKILLed mid-save (run at once).

  Yields, per child, the store's path and a function that waits for the child and
  returns its stderr and exit status."""
  base = tmp_path_factory.mktemp("killed")
  data = str(base / "v1.npz")
  flat = {"static/" + "/".join(k): v for k, v in _static(1).items()}
  flat |= {"units/" + "/".join(k): v for k, v in _units(1).items()}
  np.savez(data, **flat)
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
  runs = {}
  for how in ("mid-write", "moved-aside"):
    path = str(base / how / "store")
    _save(path, seed=0)
    child = subprocess.Popen(
      [sys.executable, "-c", _CHILD, path, how, data], env=env, stderr=subprocess.PIPE
    )
    runs[how] = (path, child)
  yield {
    how: (path, lambda child=child: (child.communicate(timeout=120)[1].decode(), child.returncode))
    for how, (path, child) in runs.items()
  }
  for _, child in runs.values():  # children a failed test did not wait for
    if child.returncode is None:
      child.kill()
      child.communicate()


def test_a_writer_killed_mid_write_leaves_the_old_store(killed_saves) -> None:
  path, wait = killed_saves["mid-write"]
  stderr, status = wait()
  assert status == -signal.SIGKILL, stderr
  parent = os.path.dirname(path)
  assert [n for n in os.listdir(parent) if "jax-residency-tmp" in n]  # the dead writer's
  assert _version(path) == 0
  _save(path, seed=2, overwrite=True)
  assert os.listdir(parent) == ["store"] and _version(path) == 2


def test_a_writer_killed_with_the_old_store_aside_is_undone_by_the_next_save(
  killed_saves,
) -> None:
  path, wait = killed_saves["moved-aside"]
  stderr, status = wait()
  assert status == -signal.SIGKILL, stderr
  parent = os.path.dirname(path)
  assert not os.path.lexists(path)
  assert len([n for n in os.listdir(parent) if "jax-residency-old" in n]) == 1
  with pytest.raises(errors.StoreError, match="already exists"):
    _save(path, seed=2)  # puts the old store back first, so there is one now
  assert os.listdir(parent) == ["store"] and _version(path) == 0


# --- a full disk -------------------------------------------------------------------------


class _Failed:
  def __init__(self, error: Exception) -> None:
    self.error = error

  def result(self):
    raise self.error


def _nbytes(seed: int = 1) -> int:
  return sum(v.nbytes for v in _static(seed).values()) + sum(
    v.nbytes for v in _units(seed).values()
  )


@pytest.mark.parametrize("where", ["chunk", "chunk-future", "array-metadata", "store-metadata"])
def test_a_full_disk_is_a_store_error_with_the_bytes_needed(tmp_path, monkeypatch, where) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)

  def enospc() -> ValueError:
    tmps = [n for n in os.listdir(tmp_path) if "jax-residency-tmp" in n]
    return ValueError(ENOSPC_MESSAGE.format(tmp=tmp_path / tmps[0]))

  def chunk(handle, index, value):
    if where == "chunk-future":
      return _Failed(enospc())
    raise enospc()

  def metadata(*args, **kwargs):
    raise enospc()

  with monkeypatch.context() as patch, pytest.raises(errors.StoreError) as e:
    if where.startswith("chunk"):
      patch.setattr(wr, "_write_chunk", chunk)
    elif where == "array-metadata":
      patch.setattr(wr.ts, "open", metadata)  # the array's zarr.json
    else:
      patch.setattr(wr, "_orbax_metadata", metadata)  # Orbax's _METADATA
    _save(path, seed=1, overwrite=True)
  message = str(e.value)
  assert message.startswith(f"The disk filled up while writing the store at {path}:")
  assert f"({_nbytes()} bytes)" in message and "was free when the save began" in message
  assert "the old store there is unchanged" in message and "jax-residency-tmp" not in message
  assert space.is_disk_full(e.value.__cause__)
  assert os.listdir(tmp_path) == ["store"] and _version(path) == 0


def test_rechunk_reports_a_full_disk_too(tmp_path, monkeypatch) -> None:
  src, dst = str(tmp_path / "src"), str(tmp_path / "dst")
  _save(src, seed=0)

  def chunk(handle, index, value):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  monkeypatch.setattr(wr, "_write_chunk", chunk)
  with pytest.raises(
    errors.StoreError, match=f"The disk filled up while writing the store at {dst}"
  ):
    rechunk.rechunk_store(src, dst, progress=False)
  assert os.listdir(tmp_path) == ["src"]


@pytest.mark.parametrize("replacing", [True, False], ids=["overwrite", "fresh"])
def test_a_store_larger_than_the_free_space_is_refused_before_writing(
  tmp_path, monkeypatch, replacing
) -> None:
  path = str(tmp_path / "store")
  if replacing:
    _save(path, seed=0)
  free = _nbytes() - 1
  real = shutil.disk_usage
  monkeypatch.setattr(space.shutil, "disk_usage", lambda p: real(p)._replace(free=free))
  monkeypatch.setattr(wr, "_write_chunk", lambda *a: pytest.fail("wrote a chunk"))
  with pytest.raises(errors.StoreError) as e:
    _save(path, seed=1, overwrite=True)
  message = str(e.value)
  assert message.startswith(f"Not enough disk space to write the store at {path}")
  assert f"({_nbytes()} bytes)" in message and f"({free} bytes) free" in message
  assert ("old store there is kept" in message) == replacing
  assert os.listdir(tmp_path) == (["store"] if replacing else [])
  if replacing:
    assert _version(path) == 0


def test_is_disk_full_knows_only_a_full_disk() -> None:
  assert space.is_disk_full(ValueError(ENOSPC_MESSAGE.format(tmp="/t")))
  assert space.is_disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)))
  wrapped = errors.StoreError("Cannot create array 'w'")
  wrapped.__cause__ = ValueError(ENOSPC_MESSAGE.format(tmp="/t"))
  assert space.is_disk_full(wrapped)
  assert not space.is_disk_full(ValueError("RESOURCE_EXHAUSTED: Out of memory"))
  assert not space.is_disk_full(OSError(errno.EACCES, "Permission denied"))


# --- destinations ------------------------------------------------------------------------


@pytest.mark.parametrize("below", ["store", "a/b/store"])
def test_a_file_in_the_way_is_a_store_error(tmp_path, below) -> None:
  (tmp_path / "file.txt").write_text("keep me")
  path = str(tmp_path / "file.txt" / below)
  with pytest.raises(errors.StoreError) as e:
    _save(path, seed=0)
  assert str(e.value).startswith(f"Cannot write a store at {path}: {tmp_path / 'file.txt'} is")
  assert (tmp_path / "file.txt").read_text() == "keep me"
  assert os.listdir(tmp_path) == ["file.txt"]


def test_an_interrupt_while_the_writer_starts_leaves_no_temporary(tmp_path, monkeypatch) -> None:
  path = str(tmp_path / "store")
  _save(path, seed=0)

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(wr, "progress_bar", interrupted)  # as the writer starts
  with pytest.raises(KeyboardInterrupt):
    _save(path, seed=1, overwrite=True)
  assert os.listdir(tmp_path) == ["store"] and _version(path) == 0


# --- an interrupt while a write is in flight ----------------------------------------------

#: The chunk writes of `_save`: the static array's, and one per unit of each unit array.
WRITES = 1 + 2 * N


class LateWrite:
  """A chunk write whose wait is interrupted (KeyboardInterrupt, as TensorStore raises it
  when SIGINT comes while it waits), and that starts only `DELAY` seconds after: a write
  still in flight when the interrupted writer cleans up."""

  DELAY = 0.1

  def __init__(self, start: Callable[[], object]) -> None:
    self._start, self._future = start, None
    self.landed = threading.Event()  # the write has landed or failed
    self._timer: threading.Timer | None = None

  def _begin(self) -> None:
    try:
      self._future = self._start()
      self._future.add_done_callback(lambda _: self.landed.set())
    except BaseException:
      self.landed.set()
      raise

  def result(self) -> object:
    if self._timer is None:  # the first wait: Ctrl-C now, while the write is pending
      self._timer = threading.Timer(self.DELAY, self._begin)
      self._timer.start()
      raise KeyboardInterrupt("interrupted while waiting for a write")
    self._timer.join()
    try:  # landed once its wait returns: the done callback may run later, on another thread
      return self._future.result()
    finally:
      self.landed.set()

  def settled(self) -> None:
    """Waits until the write has landed or failed (for the test to look after it)."""
    assert self._timer is not None, "the writer never waited for this write"
    self._timer.join()
    self.landed.wait()


def interrupt_at_write(monkeypatch, k: int) -> list[LateWrite]:
  """Makes the `k`-th chunk write (from 1) of the next save a `LateWrite`; returns a list
  that holds it once started."""
  real, started, late = wr._write_chunk, [], []

  def chunk(handle, index, value):
    started.append(index)
    if len(started) != k:
      return real(handle, index, value)
    late.append(LateWrite(lambda: real(handle, index, value)))
    return late[0]

  monkeypatch.setattr(wr, "_write_chunk", chunk)
  return late


@pytest.mark.parametrize("k", range(1, WRITES + 1))
def test_an_interrupt_while_any_write_is_in_flight_leaves_the_old_store_alone(
  tmp_path, monkeypatch, k
) -> None:
  """Ctrl-C while the save waits for its `k`-th chunk write, that write still in flight:
  the writer waits for every write it started before removing its temporary, so nothing
  lands in it afterwards; the path keeps the old store, whole."""
  path = str(tmp_path / "store")
  _save(path, seed=0)
  late = interrupt_at_write(monkeypatch, k)
  removed, rmtree = [], shutil.rmtree

  def remove(p, *args, **kwargs):  # what is still in flight when a directory is removed
    removed.append((os.path.basename(p), late[0].landed.is_set()))
    return rmtree(p, *args, **kwargs)

  monkeypatch.setattr(shutil, "rmtree", remove)
  with pytest.raises(KeyboardInterrupt):
    _save(path, seed=1, overwrite=True)
  late[0].settled()
  assert removed and all(landed for _, landed in removed), removed
  assert removed[-1][0].startswith(".store" + commit.TMP_TAG), removed
  assert os.listdir(tmp_path) == ["store"] and _version(path) == 0
  monkeypatch.undo()
  _save(path, seed=2, overwrite=True)
  assert os.listdir(tmp_path) == ["store"] and _version(path) == 2
