"""Python processes that start without paying for their imports: forks of one that has them.

Every benchmark runs its measurements in child processes, and every child process of
``python`` pays about 2 s to import JAX, Flax and this library before it does anything.
A ``--quick`` run is the full run's code at toy size, where those imports are most of its
time. The test suite therefore starts one zygote per module
(``python benchmarks/_zygote.py SOCKET``): a process that imports the library, never
initializes a JAX backend, and answers each request on its Unix socket with a fork that
runs the requested script as ``python SCRIPT ARGS`` would (``runpy``, ``__name__ ==
"__main__"``, its ``sys.argv``, working directory and environment, the caller's stdout
and stderr, and a pipe of the caller's ``input`` as stdin). `run` sends a command there
when the environment names a zygote (`ZYGOTE_ENV`), so the benchmark a fork runs sends
its own children there too.

`run` starts a fresh interpreter as `subprocess.run` does (it then is `subprocess.run`)
without a zygote, for a command that is not ``python SCRIPT ...`` / ``python -m MODULE
...``, and where the environment differs from the zygote's in a variable JAX reads when
it is imported (``JAX_*``, ``XLA_*``). A full benchmark run never sets `ZYGOTE_ENV`: its
children are fresh processes, as its figures require.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Iterator, Sequence
from typing import Any

#: The environment variable naming a zygote's socket.
ZYGOTE_ENV = "JAX_RESIDENCY_BENCH_ZYGOTE"

#: What the zygote imports before it forks (each fork would import it anyway).
PRELOAD = ("numpy", "jax", "jax.numpy", "flax.nnx", "tensorstore", "jax_residency")


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
  """The variables JAX may read when it is imported (this library reads its own later)."""
  return {
    k: v
    for k, v in env.items()
    if k.startswith(("JAX_", "XLA_")) and not k.startswith("JAX_RESIDENCY_")
  }


def run(
  cmd: Sequence[str],
  *,
  capture_output: bool = False,
  stdout: int | None = None,
  text: bool = True,
  check: bool = False,
  env: dict[str, str] | None = None,
  cwd: str | os.PathLike | None = None,
  timeout: float | None = None,
  input: str | None = None,  # noqa: A002 - subprocess.run's name
) -> subprocess.CompletedProcess:
  """`subprocess.run` for ``cmd``, through the zygote that `ZYGOTE_ENV` names if any;
  ``input`` (text, at most a pipe's buffer through the zygote) is its stdin, a pipe."""
  env = dict(os.environ if env is None else env)
  path = env.get(ZYGOTE_ENV)

  def fresh() -> subprocess.CompletedProcess:
    return subprocess.run(
      list(cmd), capture_output=capture_output, stdout=stdout, text=text, check=check,
      env=env, cwd=cwd, timeout=timeout, input=input,
    )  # fmt: skip

  if not path or len(cmd) < 2 or cmd[0] != sys.executable:
    return fresh()
  captured = [capture_output or stdout == subprocess.PIPE, capture_output]
  with contextlib.ExitStack() as stack:
    files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(2)]
    fds = [f.fileno() if c else own for f, c, own in zip(files, captured, (1, 2), strict=True)]
    request = {"argv": list(cmd[1:]), "cwd": os.fspath(cwd or os.getcwd()), "env": env}
    if input is not None:  # the runner's stdin: a pipe holding all of it, closed after
      read, write = os.pipe()
      stack.callback(os.close, read)
      with os.fdopen(write, "wb") as f:
        f.write(input.encode())
      fds.append(read)
    code = _ask(path, request, fds, timeout, cmd)
    if code is None:  # the zygote's import-time environment differs: a fresh process
      return fresh()
    out: list[Any] = [None, None]
    for i, f in enumerate(files):
      if captured[i]:
        f.seek(0)
        data = f.read()
        out[i] = data.decode(errors="replace") if text else data
  done = subprocess.CompletedProcess(list(cmd), code, out[0], out[1])
  if check:
    done.check_returncode()
  return done


def _ask(
  path: str, request: dict, fds: list[int], timeout: float | None, cmd: Sequence[str]
) -> int | None:
  """Sends one request; the fork's exit status (None: run it fresh instead, where the
  zygote's import-time environment differs or it cannot be reached)."""
  with contextlib.ExitStack() as stack:
    conn = stack.enter_context(socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
    try:
      conn.connect(path)
    except OSError:  # the zygote is gone: a fresh process does the same work
      return None
    socket.send_fds(conn, [json.dumps(request).encode() + b"\n"], fds)
    conn.shutdown(socket.SHUT_WR)
    reader = stack.enter_context(conn.makefile("r"))
    first = reader.readline().strip()
    if first == "fresh":
      return None
    pid = int(first)
    conn.settimeout(timeout)
    try:
      last = reader.readline().strip()
    except TimeoutError:
      with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
      raise subprocess.TimeoutExpired(list(cmd), timeout or 0) from None
    if not last:
      raise RuntimeError(f"the zygote at {path} closed without an exit status for {cmd}")
    return int(last)


def serve(path: str) -> None:
  """Imports `PRELOAD`, then forks once per connection on ``path`` until killed."""
  for name in PRELOAD:
    __import__(name)
  baseline = _import_time_env(dict(os.environ))
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forks are reaped as they end
  with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
    server.bind(path)
    server.listen(64)
    print("ready", flush=True)
    while True:
      conn, _ = server.accept()
      if os.fork() == 0:
        server.close()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os._exit(_supervise(conn, baseline))
      conn.close()


def _supervise(conn: socket.socket, baseline: dict[str, str]) -> int:
  """In a fork: reads a request, forks its runner, reports the runner's pid then status."""
  try:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    while not msg.endswith(b"\n"):  # the rest of a long request
      more = conn.recv(1 << 16)
      if not more:
        raise EOFError("the request ended early")
      msg += more
    request = json.loads(msg)
    if _import_time_env(request["env"]) != baseline:
      conn.sendall(b"fresh\n")
      return 0
    pid = os.fork()
    if pid == 0:
      conn.close()
      os._exit(_runner(request, fds))
    for fd in fds:
      os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
  except BrokenPipeError:  # the client left (its time-out killed the runner)
    return 1
  except BaseException:  # noqa: BLE001 - the client sees a closed socket
    traceback.print_exc()
    return 1
  return 0


def _runner(request: dict, fds: list[int]) -> int:
  """In the runner: the requested ``python ARGV`` in this process; its exit status."""
  os.setpgid(0, 0)
  stdin = fds[2] if len(fds) > 2 else os.open(os.devnull, os.O_RDONLY)
  os.dup2(stdin, 0)
  for fd, target in zip(fds[:2], (1, 2), strict=True):
    os.dup2(fd, target)
    os.close(fd)
  os.chdir(request["cwd"])
  os.environ.clear()
  os.environ.update(request["env"])
  argv = request["argv"]
  code: Any = 0
  try:
    if argv[0] == "-c":
      sys.argv = ["-c", *argv[2:]]
      sys.path[0] = ""
      exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102
    elif argv[0] == "-m":
      sys.argv = [argv[1], *argv[2:]]
      sys.path[0] = os.getcwd()
      runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
      script = os.path.abspath(argv[0])
      sys.argv = [argv[0], *argv[1:]]
      sys.path[0] = os.path.dirname(script)
      runpy.run_path(script, run_name="__main__")
  except SystemExit as stop:
    code = stop.code
  except BaseException:  # noqa: BLE001 - as the interpreter would: traceback, exit 1
    traceback.print_exc()
    code = 1
  if code is None:
    code = 0
  elif not isinstance(code, int):
    print(code, file=sys.stderr)
    code = 1
  with contextlib.suppress(Exception):
    atexit._run_exitfuncs()
  for stream in (sys.stdout, sys.stderr):
    with contextlib.suppress(Exception):
      stream.flush()
  return code


@contextlib.contextmanager
def started(env: dict[str, str], directory: str) -> Iterator[dict[str, str]]:
  """A zygote with environment ``env``; yields ``env`` with `ZYGOTE_ENV` naming it. Its
  socket is in ``directory``, or in a new short temporary one where that path would pass
  the 107 bytes a Unix socket's path may have."""
  path = os.path.join(directory, "zygote.sock")
  short = None
  if len(os.fsencode(path)) > 100:
    short = tempfile.mkdtemp(prefix="jr-zygote-")
    path = os.path.join(short, "zygote.sock")
  proc = subprocess.Popen(
    [sys.executable, __file__, path], env=env, stdout=subprocess.PIPE, text=True
  )
  try:
    assert proc.stdout is not None
    if proc.stdout.readline().strip() != "ready":
      raise RuntimeError(f"the zygote did not start (exit {proc.wait()})")
    yield {**env, ZYGOTE_ENV: path}
  finally:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
      proc.stdout.close()
    if short is not None:
      shutil.rmtree(short, ignore_errors=True)


if __name__ == "__main__":
  serve(sys.argv[1])
