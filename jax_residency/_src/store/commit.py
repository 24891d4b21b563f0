"""Putting a finished store in place, and cleaning up after writers that died.

A local store is written into a temporary sibling of its destination and put in
place when complete (`put_in_place`). On Linux the two directories are swapped
in one step (`renameat2(..., RENAME_EXCHANGE)`), so the destination holds the
old store or the new one, complete, at every instant. Where that is unavailable
(another OS, or a filesystem that answers `EINVAL`), the old store is renamed
aside to an `-old-` sibling first; a crash between that rename and the next one
leaves the destination missing, and `recover_store` (run by the next save to
the path, and by the store opener) renames the `-old-` sibling back.

Sibling names say who wrote them: ``.NAME.jax-residency-tmp-HOST.PID.RAND`` and
``.NAME.jax-residency-old-HOST.PID.RAND``, where HOST is the host name plus, on
Linux, the PID namespace (so two containers sharing a host name never mistake
each other's processes). A sibling is *stale* when it is of this HOST and
``os.kill(PID, 0)`` finds no process; the next save to the same destination
removes stale siblings (`remove_stale`). A sibling of another host, or of a live
process, is never deleted: nothing here can tell whether another machine's
writer is alive. A reused PID only makes a dead writer look alive (its sibling
is kept), never the reverse.

Names in the older format, without a writer (``.NAME.jax-residency-tmp-XXXXXXXX``,
from versions before these names), are never deleted either: a writer of that
version may still be running, and a temporary deleted under it would be renamed
into place half gone; they stay until removed by hand. Restoring an `-old-`
sibling (of any format or host, unless it belongs to a live process of this
host) when the destination is missing is always safe: a writer still between its
two renames then fails its second rename (the destination is no longer empty)
and the path keeps the complete old store.

A writer removes its own temporary when it fails, and when it is interrupted:
SIGINT raises ``KeyboardInterrupt`` in Python, and while a store is being written
SIGTERM raises ``SystemExit(143)`` (`terminations_raise`), so the cleanup runs
before the process exits. The steps an interrupt must not cut in two (starting a
write and recording it, putting the store in place, the cleanup itself) run
`held`: a SIGINT or SIGTERM that arrives during one is raised when it ends. SIGKILL
cannot be caught: its temporary is the next save's to remove.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import re
import shutil
import signal
import socket
import sys
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from jax_residency._src import errors
from jax_residency._src.store.locations import locate

TMP_TAG = ".jax-residency-tmp-"
OLD_TAG = ".jax-residency-old-"
_NAME = re.compile(r"(?P<host>[A-Za-z0-9_+-]+)\.(?P<pid>[0-9]+)\.[0-9a-f]{8}")
_LEGACY_NAME = re.compile(r"[0-9a-f]{8}")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
#: What `renameat2` answers where the OS or filesystem cannot exchange.
_NO_EXCHANGE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP})


#: The signals a writer turns into exceptions, and the handler each must have for it to do
#: so (Python's own for SIGINT, the default action for SIGTERM): a handler the program
#: installed is kept.
_INTERRUPTS: dict[int, Any] = {
  signal.SIGINT: signal.default_int_handler,
  signal.SIGTERM: signal.SIG_DFL,
}
#: Writers now inside `terminations_raise`, and the handlers they replaced.
_guarded = 0
_replaced: dict[int, Any] = {}
_guard_lock = threading.Lock()
#: Main-thread steps now `held`, and the signals that arrived during them.
_held = 0
_deferred: list[int] = []


def _raise(signum: int) -> None:
  if signum == signal.SIGINT:
    raise KeyboardInterrupt
  raise SystemExit(128 + signum)


def _interrupted(signum: int, frame: Any) -> None:
  if _held:
    _deferred.append(signum)  # raised when the held step ends
    return
  _raise(signum)


def _on_main_thread() -> bool:
  return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def terminations_raise() -> Iterator[None]:
  """While the block runs, SIGTERM raises ``SystemExit(143)`` in the main thread (the
  exit status a shell reports for a process killed by SIGTERM) and SIGINT raises
  ``KeyboardInterrupt`` as it does anyway, except during a `held` step, whose end
  raises them; so a writer's cleanup runs, whole, and removes its temporary store.
  Only for a signal whose handler is Python's default (SIGINT) or the default action
  (SIGTERM), and on the main thread: a handler the program installed is kept.

  Example (a real SIGTERM in a fresh process: `tests/test_faults.py`):
    >>> import signal
    >>> before = signal.getsignal(signal.SIGTERM)
    >>> with terminations_raise():
    ...   inside = signal.getsignal(signal.SIGTERM)
    >>> (inside is _interrupted) == (before is signal.SIG_DFL)  # only the default is replaced
    True
    >>> signal.getsignal(signal.SIGTERM) is before  # and put back after
    True
  """
  global _guarded
  installed = False
  with _guard_lock:
    if _on_main_thread():
      if not _guarded:
        for signum, default in _INTERRUPTS.items():
          if signal.getsignal(signum) is default:
            _replaced[signum] = signal.signal(signum, _interrupted)
      _guarded += 1
      installed = True
  try:
    yield
  finally:
    if installed:
      with _guard_lock:
        _guarded -= 1
        if not _guarded:
          for signum, previous in _replaced.items():
            signal.signal(signum, previous)
          _replaced.clear()


@contextlib.contextmanager
def held() -> Iterator[None]:
  """A step an interrupt must not cut in two: inside `terminations_raise`, a SIGINT or
  SIGTERM that arrives while the block runs on the main thread is raised when it ends
  (the first one, once). Elsewhere it does nothing. Blocks nest.

  Example:
    >>> import os, signal
    >>> with terminations_raise():
    ...   try:
    ...     with held():
    ...       os.kill(os.getpid(), signal.SIGINT)
    ...       steps = ["finished"]  # the step is not cut
    ...   except KeyboardInterrupt:
    ...     steps.append("then interrupted")
    >>> steps
    ['finished', 'then interrupted']
  """
  global _held
  if not _on_main_thread():
    yield
    return
  _held += 1
  try:
    yield
  finally:
    _held -= 1
    if not _held and _deferred:
      signum = _deferred[0]
      _deferred.clear()
      _raise(signum)


def crash_point(step: str) -> None:
  """Called between the steps of a commit; does nothing.

  A seam: tests replace it to fail, snapshot the directory, or kill the process
  at `step` (``"written"``, ``"exchanged"``, ``"moved-aside"``, ``"renamed"``,
  ``"cleaned"``).
  """


@functools.cache
def _host() -> str:
  """This host's name as it appears in sibling names (and its PID namespace)."""
  name = re.sub(r"[^A-Za-z0-9-]", "_", socket.gethostname())[:48] or "host"
  try:
    return f"{name}+{os.stat('/proc/self/ns/pid').st_ino:x}"
  except OSError:
    return name


def _alive(pid: int) -> bool:
  """Whether process `pid` exists; True whenever that cannot be told."""
  if os.name == "nt" or pid <= 0:  # os.kill(pid, 0) would terminate it on Windows.
    return True
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except (OSError, OverflowError):  # PermissionError: alive, another user's.
    return True
  return True


def sibling_name(dest: str, tag: str) -> str:
  """A fresh sibling path of `dest` for this process (`tag`: `TMP_TAG` or `OLD_TAG`)."""
  parent, base = os.path.split(dest)
  return os.path.join(parent, f".{base}{tag}{_host()}.{os.getpid()}.{uuid.uuid4().hex[:8]}")


def _siblings(dest: str, tag: str) -> Iterator[tuple[str, tuple[str, int] | None]]:
  """`(path, (host, pid))` of each `tag` sibling of `dest`; `None` for a legacy name."""
  parent, base = os.path.split(dest)
  prefix = f".{base}{tag}"
  try:
    names = sorted(os.listdir(parent))
  except OSError:
    return
  for name in names:
    if not name.startswith(prefix):
      continue
    rest = name[len(prefix) :]
    if match := _NAME.fullmatch(rest):
      yield os.path.join(parent, name), (match["host"], int(match["pid"]))
    elif _LEGACY_NAME.fullmatch(rest):
      yield os.path.join(parent, name), None


def _dead(writer: tuple[str, int] | None) -> bool:
  return writer is not None and writer[0] == _host() and not _alive(writer[1])


def _live_here(writer: tuple[str, int] | None) -> bool:
  return writer is not None and writer[0] == _host() and _alive(writer[1])


def existing_ancestor(dest: str, path: str) -> str:
  """The nearest existing directory at or above `dest`'s parent.

  Raises:
    StoreError: that nearest existing path is a file (or anything but a
      directory), so the store's directory cannot be made.
  """
  ancestor = os.path.dirname(dest)
  while not os.path.lexists(ancestor):
    ancestor = os.path.dirname(ancestor)
  if not os.path.isdir(ancestor):
    raise errors.StoreError(
      f"Cannot write a store at {path}: {ancestor} is in the way, a file and not a "
      "directory. Choose a path outside it, or move that file."
    )
  return ancestor


def recover_local(dest: str) -> bool:
  """`recover_store` for an absolute local directory."""
  if os.path.lexists(dest):
    return False
  found = [p for p, writer in _siblings(dest, OLD_TAG) if not _live_here(writer)]
  if not found:
    return False

  def renamed_at(p: str) -> float:
    try:
      return os.stat(p).st_ctime  # a rename updates the directory's ctime
    except OSError:
      return float("-inf")

  try:
    os.rename(max(found, key=renamed_at), dest)
  except OSError:  # another process restored it first, or `dest` appeared
    return False
  _fsync_dir(os.path.dirname(dest))
  return True


def recover_store(path: str) -> bool:
  """Puts a store back at `path` when a writer died with it renamed aside.

  A save that replaces a store where the directories cannot be exchanged
  atomically renames the old store to ``.NAME.jax-residency-old-*`` before
  renaming the new one in; a crash between the two leaves `path` missing. This
  renames the newest such sibling back (not one of a live process on this host,
  which is about to finish). Costs one `lstat` when `path` exists; does nothing
  for non-local stores. Safe to call concurrently.

  Returns:
    Whether a store was put back.
  """
  local = locate(path).local
  return local is not None and recover_local(local)


def remove_stale(dest: str) -> list[str]:
  """Removes temporaries of `dest` (and `-old-` siblings, if `dest` exists) whose
  writer is gone; returns the paths removed. See the module docstring."""
  removed = []
  tags = (TMP_TAG, OLD_TAG) if os.path.lexists(dest) else (TMP_TAG,)
  for tag in tags:
    for path, writer in _siblings(dest, tag):
      if _dead(writer):
        _remove(path)
        removed.append(path)
  return removed


@functools.cache
def _renameat2() -> Any:
  if not sys.platform.startswith("linux"):
    return None
  try:
    fn = ctypes.CDLL(None, use_errno=True).renameat2
  except (AttributeError, OSError):  # a libc without it (glibc < 2.28)
    return None
  fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
  fn.restype = ctypes.c_int
  return fn


def exchange(a: str, b: str) -> bool:
  """Atomically swaps two existing paths; False where the OS or filesystem cannot."""
  fn = _renameat2()
  if fn is None:
    return False
  if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
    return True
  err = ctypes.get_errno()
  if err in _NO_EXCHANGE:
    return False
  raise OSError(err, os.strerror(err), a, None, b)


def put_in_place(tmp: str, dest: str) -> None:
  """Renames the finished store `tmp` to `dest`, replacing what is there.

  With an exchange, `dest` holds the old or the new store at every instant. In
  the fallback, the old store is renamed aside first, and renamed back if this
  process fails before the new one is in (a crash there is undone by
  `recover_store`). The old store is removed once the new one is in place. Runs
  `held`: a SIGINT or SIGTERM that arrives meanwhile is raised once it is done.
  """
  with held():  # an interrupt between the renames would leave `dest` missing
    _put_in_place(tmp, dest)


def _put_in_place(tmp: str, dest: str) -> None:
  parent = os.path.dirname(dest)
  crash_point("written")
  if os.path.lexists(dest) and exchange(tmp, dest):
    try:  # `dest` holds the new store, `tmp` the old one.
      crash_point("exchanged")
      _fsync_dir(parent)
    finally:
      _remove(tmp)
    crash_point("cleaned")
    return
  old = None
  if os.path.lexists(dest):
    old = sibling_name(dest, OLD_TAG)
    os.rename(dest, old)
  try:
    if old is not None:
      crash_point("moved-aside")
    os.rename(tmp, dest)
  except BaseException:
    if old is not None:
      os.rename(old, dest)
    raise
  try:
    crash_point("renamed")
    _fsync_dir(parent)
  finally:
    if old is not None:
      _remove(old)
  crash_point("cleaned")


def _remove(path: str) -> None:
  """Removes a directory tree, or just the link if `path` is a symlink (e.g. the
  store that was replaced, when it was a link to a directory elsewhere)."""
  if os.path.islink(path):
    try:
      os.unlink(path)
    except OSError:
      pass
  else:
    shutil.rmtree(path, ignore_errors=True)


def _fsync_dir(path: str) -> None:
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return
  try:
    os.fsync(fd)
  except OSError:
    pass
  finally:
    os.close(fd)
