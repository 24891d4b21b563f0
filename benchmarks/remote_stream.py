"""DenseDiskStream over HTTP with added latency, against a plain sequential fetch.

Builds (once, under --dir) a seeded toy transformer with --units units of about
--unit-mib MiB each and its store, serves the store read-only on 127.0.0.1 from
a child process (`jax_residency.testing.serve_store`, --latency-ms added to
every request, as a remote server's round trip would be), and measures in this
process:

* ``direct``: DenseDiskStream with ``host_budget_bytes=0`` (direct reads into
  the device window, no host cache, no read-ahead thread) over the server's
  URL: place, a first pass (it compiles the step), then --repeat timed passes,
  each after ``clear_caches()``, so that each reads every unit over HTTP again;
* ``stream``: the same with a host cache that holds every unit, for each
  --lookahead (``host_lookahead``, with a prefetch queue as deep);
* ``sequential fetch``: exactly the requests the server received during the
  last direct pass (each unit chunk's byte range), sent again one after another
  on one keep-alive connection (--repeat times): a plain client fetching the
  same bytes one request at a time.

For each it prints the median seconds, MB/s (1 MB = 1e6 bytes) of the bytes
fetched, the sequential fetch's time over the row's, the requests the server
answered in a pass, and the bytes fetched; then whether every pass's
``PassReport.fetched_bytes`` equals the bytes the server sent during it and
every placement's ``Report.fetched_bytes`` the bytes sent since ``place``.

Parity gates (``benchmarks/_result.py``; exit 1 when one fails): every pass's outputs
equal the plain model's on the same tokens (run eagerly, as the stream's per-unit
steps are, by the process that writes the store, and kept next to it), bit for bit on
a CPU backend (``PARITY_ATOL`` elsewhere), and the two byte counts above match in
every row. It has no performance targets.

    python benchmarks/remote_stream.py                      # 12 units x 32 MiB, 20 ms
    python benchmarks/remote_stream.py --latency-ms 50 --lookahead 1 4 16
    python benchmarks/remote_stream.py --quick              # 6 units x 4 MiB, 2 ms
    python benchmarks/remote_stream.py --json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

import _result
import _zygote

MiB = 1 << 20
HEADS = 12
#: Parity gate off a CPU backend: largest |stream - plain| allowed (on CPU: 0, bit for bit).
PARITY_ATOL = 1e-5


def shape(unit_mib: float) -> tuple[int, int]:
  """``(d_model, d_ff)`` of a toy whose units are near ``unit_mib`` (12 d^2 float32 params)."""
  d = max(HEADS, round((unit_mib * MiB / 48) ** 0.5 / HEADS) * HEADS)
  return d, 4 * d


def config(args: argparse.Namespace):
  from jax_residency.toy import ToyConfig

  d, ff = shape(args.unit_mib)
  return ToyConfig(vocab=512, d_model=d, n_heads=HEADS, d_ff=ff, n_layers=args.units)


def tokens(cfg, n: int):
  """The (1, ``n``) token ids every pass runs on."""
  import jax

  return jax.random.randint(jax.random.key(1), (1, n), 0, cfg.vocab)


def plain_path(store: str, n: int) -> str:
  """Where the plain model's outputs on :func:`tokens` ``(cfg, n)`` lie, next to the store."""
  return f"{store}.plain-{n}.npy"


def build_store(args: argparse.Namespace) -> str:
  """The store under ``--dir`` and the plain model's outputs on ``--tokens`` tokens,
  written together once (by a child process, so that this one never holds the model;
  under --quick, a few MiB, here), then reused."""
  cfg = config(args)
  path = os.path.join(args.dir, f"remote-{cfg.n_layers}x{cfg.d_model}x{cfg.d_ff}")
  have = [os.path.join(path, "jax_residency.json"), plain_path(path, args.tokens)]
  if not all(map(os.path.exists, have)):
    os.makedirs(args.dir, exist_ok=True)
    if args.quick:
      save(args, path)
    else:
      cmd = [sys.executable, __file__, "--save", path, "--units", str(args.units)]
      cmd += ["--unit-mib", str(args.unit_mib), "--tokens", str(args.tokens)]
      _zygote.run(cmd, check=True)
  return path


def save(args: argparse.Namespace, path: str) -> None:
  """Writes the store at ``path`` and, from the same model, the plain model's outputs
  (eager)."""
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency.toy import ToyTransformer

  cfg = config(args)
  # Initialised jitted: one compile, not one per initialiser (seconds at --quick's size).
  model = nnx.jit(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0)))()
  jr.save(model, path, overwrite=True)
  np.save(plain_path(path, args.tokens), np.asarray(model(tokens(cfg, args.tokens))))


def serve(args: argparse.Namespace) -> None:
  """The child that serves the store: prints its URL, then answers ``counts``,
  ``reset`` and ``log`` lines on stdin with a JSON line, until ``quit`` or end of
  input. ``log``: the requests (path, Range header) since the last ``reset``."""
  import threading

  from jax_residency._src import store_server
  from jax_residency.testing import serve_store

  log: list[tuple[str, str | None]] = []
  lock = threading.Lock()
  answer = store_server._Handler._answer

  def logged(self, *, body: bool) -> None:
    with lock:
      log.append((self.path, self.headers.get("Range")))
    answer(self, body=body)

  store_server._Handler._answer = logged

  with serve_store(args.serve, latency_s=args.latency_ms / 1e3) as server:
    print(json.dumps({"url": server.url}), flush=True)
    for line in sys.stdin:
      command = line.strip()
      if command == "quit":
        break
      if command == "reset":
        server.reset_counts()
        with lock:
          log.clear()
      if command == "log":
        with lock:
          print(json.dumps({"log": log}), flush=True)
        continue
      counts = {"bytes_served": server.bytes_served, "requests": server.requests}
      print(json.dumps(counts), flush=True)


class Server:
  """The serving child, seen from this process."""

  def __init__(self, store: str, latency_ms: float):
    cmd = [sys.executable, __file__, "--serve", store, "--latency-ms", str(latency_ms)]
    self._proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self.url = json.loads(self._proc.stdout.readline())["url"]

  def _ask(self, command: str) -> dict:
    self._proc.stdin.write(command + "\n")
    self._proc.stdin.flush()
    return json.loads(self._proc.stdout.readline())

  def counts(self) -> dict:
    return self._ask("counts")

  def log(self) -> list[tuple[str, str | None]]:
    return [tuple(r) for r in self._ask("log")["log"]]

  def reset(self) -> None:
    self._ask("reset")

  def close(self) -> None:
    self._proc.stdin.write("quit\n")
    self._proc.stdin.close()
    self._proc.wait(timeout=30)


def sequential_fetch(url: str, requests: list[tuple[str, str | None]]) -> dict:
  """Sends ``requests`` (path, Range header) again, one after another, on one
  keep-alive connection, reading each body into one reused buffer."""
  parts = urllib.parse.urlsplit(url)
  buf = memoryview(bytearray(16 * MiB))
  conn = http.client.HTTPConnection(parts.hostname, parts.port)
  total, start = 0, time.perf_counter()
  for path, byte_range in requests:
    conn.request("GET", path, headers={"Range": byte_range} if byte_range else {})
    response = conn.getresponse()
    if response.status not in (200, 206):
      raise SystemExit(f"GET {path} ({byte_range}): HTTP {response.status}")
    while n := response.readinto(buf):
      total += n
  seconds = time.perf_counter() - start
  conn.close()
  return {"requests": len(requests), "bytes": total, "seconds": seconds}


def stream_passes(server: Server, abstract, x, policy, repeat: int, plain) -> tuple[dict, list]:
  """Place, a first pass (compiles the step, fills the caches), then ``repeat`` timed
  passes, each after ``clear_caches()`` so that it reads every unit over HTTP again.
  Returns the figures (median seconds; every pass's largest |output - plain|) and the
  requests the server saw in the last."""
  import jax
  import numpy as np

  import jax_residency as jr

  server.reset()
  served, seconds, matched = 0, [], True
  with jr.place(abstract, policy, store=server.url) as placed:
    diffs = [float(np.max(np.abs(np.asarray(jax.block_until_ready(placed(x))) - plain)))]
    for _ in range(repeat):
      placed.clear_caches()
      time.sleep(0.2)  # anything clear_caches set off would show in the counts below
      served += server.counts()["bytes_served"]
      server.reset()
      start = time.perf_counter()
      out = jax.block_until_ready(placed(x))
      seconds.append(time.perf_counter() - start)
      diffs.append(float(np.max(np.abs(np.asarray(out) - plain))))
      during = server.counts()
      last = placed.report().last
      matched &= last.fetched_bytes == during["bytes_served"]
    requests = server.log()
  report = placed.report()
  return {
    "seconds": statistics.median(seconds),
    "seconds_all": seconds,
    "bytes_read": last.bytes_read,
    "pass_fetched_bytes": last.fetched_bytes,
    "requests": during["requests"],
    "plain_max_abs_diff": max(diffs),
    "pass_fetched_equals_served": matched,
    "report_fetched_equals_served": report.fetched_bytes
    == served + server.counts()["bytes_served"],
  }, requests


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawTextHelpFormatter
  )
  parser.add_argument("--dir", default=os.path.join(tempfile.gettempdir(), "jax_residency_bench"))
  parser.add_argument("--units", type=int, default=12, help="units (layers); default 12")
  parser.add_argument("--unit-mib", type=float, default=32.0, help="MiB per unit; default 32")
  parser.add_argument("--latency-ms", type=float, default=20.0, help="added per request")
  parser.add_argument("--lookahead", type=int, nargs="+", default=[1, 2, 4, 8])
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument("--repeat", type=int, default=3, help="timed passes per row (median)")
  _result.add_args(parser)
  parser.add_argument("--save", help=argparse.SUPPRESS)
  parser.add_argument("--serve", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.save:
    save(args, args.save)
    return 0
  if args.serve:
    serve(args)
    return 0
  if args.quick:  # 6 units of 4 MiB, lookahead 1 and 4, 2 ms per request
    args.units, args.unit_mib, args.lookahead, args.latency_ms = 6, 4.0, [1, 4], 2.0

  import jax
  import numpy as np
  from flax import nnx

  import jax_residency as jr
  from jax_residency.toy import ToyTransformer

  cfg = config(args)
  store = build_store(args)
  plain = np.load(plain_path(store, args.tokens))
  unit_bytes = cfg.n_layers * cfg.unit_bytes()
  abstract = nnx.eval_shape(lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0)))
  x = tokens(cfg, args.tokens)
  every_unit = unit_bytes + 64 * MiB
  server = Server(store, args.latency_ms)
  try:
    rows, passes = {}, {}
    direct = "direct (host_budget_bytes=0)"
    rows[direct], passes[direct] = stream_passes(
      server, abstract, x, jr.DenseDiskStream(host_budget_bytes=0), args.repeat, plain
    )
    for depth in args.lookahead:
      policy = jr.DenseDiskStream(
        jr.DenseDiskStreamLoadOptions(
          host_budget_bytes=every_unit, host_lookahead=depth, background_queue_capacity=depth
        )
      )
      name = f"stream, lookahead {depth}"
      rows[name], passes[name] = stream_passes(server, abstract, x, policy, args.repeat, plain)
    server.reset()
    fetches = [sequential_fetch(server.url, passes[direct]) for _ in range(args.repeat)]
    seq = fetches[0] | {"seconds": statistics.median(f["seconds"] for f in fetches)}
    seq["seconds_all"] = [f["seconds"] for f in fetches]
  finally:
    server.close()

  for row in rows.values():
    row["mb_per_s"] = row["pass_fetched_bytes"] / row["seconds"] / 1e6
    row["speedup_over_sequential"] = seq["seconds"] / row["seconds"]
  seq["mb_per_s"] = seq["bytes"] / seq["seconds"] / 1e6
  result = _result.stamp("remote_stream", argv, args.quick)
  result.update(
    units=cfg.n_layers,
    unit_bytes=cfg.unit_bytes(),
    unit_bytes_total=unit_bytes,
    latency_ms=args.latency_ms,
    tokens=args.tokens,
    repeat=args.repeat,
    sequential_fetch=seq,
    passes=rows,
  )
  checks = result["checks"] = []
  atol = 0.0 if jax.default_backend() == "cpu" else PARITY_ATOL
  for name, row in rows.items():
    diff = row["plain_max_abs_diff"]
    _result.check(
      checks,
      f"{name}: every pass's outputs == the plain model's (eager), max |diff| <= {atol:g}",
      diff <= atol,
      diff,
      _result.PARITY,
    )
  for key, what in (
    ("pass_fetched_equals_served", "PassReport.fetched_bytes == bytes served during the pass"),
    ("report_fetched_equals_served", "Report.fetched_bytes == bytes served since place"),
  ):
    held = {name: row[key] for name, row in rows.items()}
    _result.check(checks, f"{what}, every row", all(held.values()), held, _result.PARITY)
  return _result.finish(result, args, render)


def render(result: dict) -> str:
  """The rows as a table: seconds, MB/s, speed-up over the sequential fetch, requests."""
  seq, rows = result["sequential_fetch"], result["passes"]
  out = [
    f"{result['units']} units x {result['unit_bytes'] / MiB:.1f} MiB = "
    f"{result['unit_bytes_total'] / MiB:,.0f} MiB of unit weights, served on 127.0.0.1 with "
    f"{result['latency_ms']:g} ms added per request",
    f"{'':<30}{'seconds':>8}{'best':>7}{'MB/s':>7}{'x seq':>7}{'requests':>9}{'fetched MB':>11}",
    f"{'sequential fetch':<30}{seq['seconds']:>8.2f}{min(seq['seconds_all']):>7.2f}"
    f"{seq['mb_per_s']:>7.0f}{1.0:>7.2f}{seq['requests']:>9}{seq['bytes'] / 1e6:>11.1f}",
  ]
  for name, row in rows.items():
    out.append(
      f"{name:<30}{row['seconds']:>8.2f}{min(row['seconds_all']):>7.2f}{row['mb_per_s']:>7.0f}"
      f"{row['speedup_over_sequential']:>7.2f}{row['requests']:>9}"
      f"{row['pass_fetched_bytes'] / 1e6:>11.1f}"
    )
  out.append(
    f"seconds: median of {result['repeat']} timed passes (fetches), best: the fastest; MB/s"
    " and x seq (the sequential fetch's seconds over the row's) from the medians. sequential"
    " fetch: the direct pass's requests (byte ranges of the unit chunks) sent again one"
    " after another on one connection."
  )
  return "\n".join(out)


def markdown(result: dict) -> str:
  """The rows as the Markdown table ``benchmarks/report.py`` renders."""
  seq, rows = result["sequential_fetch"], result["passes"]
  out = [
    f"{result['units']} units × {result['unit_bytes'] / MiB:.1f} MiB, "
    f"{result['latency_ms']:g} ms added per request; seconds: the median of "
    f"{result['repeat']} passes.",
    "",
    "| | seconds | MB/s | vs sequential | requests |",
    "|---|---|---|---|---|",
    f"| sequential fetch | {seq['seconds']:.2f} | {seq['mb_per_s']:.0f} | 1.0× "
    f"| {seq['requests']} |",
  ]
  for name, row in rows.items():
    out.append(
      f"| {name} | {row['seconds']:.2f} | {row['mb_per_s']:.0f} "
      f"| {row['speedup_over_sequential']:.1f}× | {row['requests']} |"
    )
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(main())
