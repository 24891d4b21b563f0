"""A read-only HTTP server for a store directory on 127.0.0.1 (`serve_store`).

It is what a test (or a benchmark) needs to read a store the way a remote one
is read, with no network: ``http://127.0.0.1:<port>/`` serves the directory's
files, honours ``Range`` requests (TensorStore reads OCDBT data files by byte
range), and counts what it serves. It can add latency to every request and
fail chosen requests, to see how reads behave when a server is slow or flaky.
Only files under the served directory are reachable; nothing can be written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any

_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")


@dataclasses.dataclass
class ServedStore:
  """A store served over loopback HTTP (see `serve_store`).

  Attributes:
    url: the store's URL, ``http://127.0.0.1:<port>/``; pass it as ``store=``.
    root: the directory served.
    latency_s: seconds each request waits before it is answered; may be changed
      while serving.
    fail: ``fail(n)`` is called with each request's number (1, 2, ...); a true
      result answers that request with HTTP 503. None: no failures.
    bytes_served: response body bytes sent so far.
    requests: requests received so far (failed ones included).
    failed: requests answered with 503 so far.
  """

  url: str
  root: str
  latency_s: float = 0.0
  fail: Callable[[int], bool] | None = None
  bytes_served: int = 0
  requests: int = 0
  failed: int = 0
  _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

  def reset_counts(self) -> None:
    """Starts `bytes_served`, `requests` and `failed` over from 0."""
    with self._lock:
      self.bytes_served = self.requests = self.failed = 0


class _Handler(http.server.BaseHTTPRequestHandler):
  protocol_version = "HTTP/1.1"
  # Answers go out at once: with Nagle on, a small body waits for the client's
  # delayed ACK (~40 ms a request).
  disable_nagle_algorithm = True
  server: Any  # a ThreadingHTTPServer with a `store` attribute

  def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
    pass  # quiet: tests and benchmarks print their own figures

  def do_HEAD(self) -> None:  # noqa: N802 - http.server's naming
    self._answer(body=False)

  def do_GET(self) -> None:  # noqa: N802
    self._answer(body=True)

  def _empty(self, status: int) -> None:
    self.send_response(status)
    self.send_header("Content-Length", "0")
    self.end_headers()

  def _answer(self, *, body: bool) -> None:
    store: ServedStore = self.server.store
    with store._lock:
      store.requests += 1
      number = store.requests
    if store.latency_s:
      time.sleep(store.latency_s)
    if store.fail is not None and store.fail(number):
      with store._lock:
        store.failed += 1
      self._empty(503)
      return
    rel = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path).lstrip("/")
    path = os.path.realpath(os.path.join(store.root, rel))
    if not path.startswith(store.root + os.sep) or not os.path.isfile(path):
      self._empty(404)
      return
    size = os.path.getsize(path)
    start, end, status = 0, size - 1, 200
    match = _RANGE.match(self.headers.get("Range", ""))
    if match:
      first, last = match.groups()
      if first:
        start, end = int(first), min(int(last), size - 1) if last else size - 1
      else:  # a suffix: the last N bytes
        start = max(0, size - int(last or 0))
      if start > end:
        self.send_response(416)
        self.send_header("Content-Range", f"bytes */{size}")
        self.send_header("Content-Length", "0")
        self.end_headers()
        return
      status = 206
    length = end - start + 1
    self.send_response(status)
    self.send_header("Content-Length", str(length))
    self.send_header("Accept-Ranges", "bytes")
    if status == 206:
      self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
    stat = os.stat(path)
    self.send_header("ETag", f'"{stat.st_ino:x}-{stat.st_mtime_ns:x}-{size:x}"')
    self.end_headers()
    if not body:
      return
    with open(path, "rb") as f:
      f.seek(start)
      left = length
      while left:
        chunk = f.read(min(left, 1 << 20))
        if not chunk:
          break
        self.wfile.write(chunk)
        left -= len(chunk)
        with store._lock:
          store.bytes_served += len(chunk)


class _Server(http.server.ThreadingHTTPServer):
  # A reader opens many connections at once; socketserver's backlog of 5 drops
  # the rest, which the client resends only after a second.
  request_queue_size = 128


@contextlib.contextmanager
def serve_store(
  path: str | os.PathLike[str],
  *,
  latency_s: float = 0.0,
  fail: Callable[[int], bool] | None = None,
) -> Iterator[ServedStore]:
  """Serves the store directory ``path`` read-only on ``http://127.0.0.1:<port>/``.

  The server runs on background threads until the ``with`` block ends.

  Args:
    path: a local store directory (what `jax_residency.save` wrote).
    latency_s: seconds each request waits before it is answered.
    fail: called with each request's number (from 1); true answers it with 503.

  Example:
    >>> import tempfile, jax.numpy as jnp, flax.nnx as nnx, jax_residency as jr
    >>> from jax_residency.testing import serve_store
    >>> from jax_residency.toy import ToyConfig, ToyTransformer
    >>> model = ToyTransformer(ToyConfig(n_layers=2), rngs=nnx.Rngs(0))
    >>> path, tokens = tempfile.mkdtemp() + "/toy", jnp.zeros((1, 4), jnp.int32)
    >>> _ = jr.save(model, path, progress=False)
    >>> with serve_store(path) as server:
    ...   with jr.place(model, jr.DenseDiskStream(), store=server.url) as placed:
    ...     same = bool((placed(tokens) == model(tokens)).all())
    ...   same, server.bytes_served == placed.report().fetched_bytes
    (True, True)
  """
  root = os.path.realpath(os.fspath(path))
  if not os.path.isdir(root):
    raise FileNotFoundError(f"serve_store: {path!r} is not a directory; pass a store directory.")
  httpd = _Server(("127.0.0.1", 0), _Handler)
  httpd.daemon_threads = True
  store = ServedStore(f"http://127.0.0.1:{httpd.server_address[1]}/", root, latency_s, fail)
  httpd.store = store  # type: ignore[attr-defined]
  thread = threading.Thread(target=httpd.serve_forever, name="jax-residency-serve", daemon=True)
  thread.start()
  try:
    yield store
  finally:
    httpd.shutdown()
    httpd.server_close()
    thread.join()
