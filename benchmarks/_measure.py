"""What the benchmark scripts share: the toy model's sizes, RSS and I/O readings, the page cache.

Imported by the scripts here (run as scripts, so this
directory is on ``sys.path``); Linux only (``/proc``, ``posix_fadvise``).
"""

from __future__ import annotations

import argparse
import os
import threading
import time

MiB = 1 << 20
#: The host and device budgets of the streamed passes.
BUDGET = 256 * MiB


def fmt_bytes(n: float) -> str:
  """Bytes in GiB from 1 GiB up, else in MiB."""
  return f"{n / (1 << 30):.2f} GiB" if abs(n) >= 1 << 30 else f"{n / MiB:,.0f} MiB"


def add_model_args(parser: argparse.ArgumentParser) -> None:
  """The toy transformer's size flags that :func:`config` reads (a 2.1 GiB, 20-unit default)."""
  parser.add_argument("--layers", type=int, default=20)
  parser.add_argument("--d-model", type=int, default=1536)
  parser.add_argument("--d-ff", type=int, default=6144)


def add_gpt_args(
  parser: argparse.ArgumentParser, *, layers: int, d_model: int, d_ff: int, heads: int, vocab: int
) -> None:
  """A GPT's size flags (``--layers``, ``--d-model``, ``--d-ff``, ``--heads``,
  ``--vocab``) with a benchmark's defaults; :func:`gpt_config` reads them."""
  parser.add_argument("--layers", type=int, default=layers)
  parser.add_argument("--d-model", type=int, default=d_model)
  parser.add_argument("--d-ff", type=int, default=d_ff)
  parser.add_argument("--heads", type=int, default=heads)
  parser.add_argument("--vocab", type=int, default=vocab)


def gpt_config(args: argparse.Namespace, max_len: int, *, tie_head: bool = False):
  """The :class:`jax_residency.models.GPTConfig` that :func:`add_gpt_args`' flags size."""
  from jax_residency import models

  return models.GPTConfig(
    vocab_size=args.vocab,
    d_model=args.d_model,
    n_heads=args.heads,
    d_ff=args.d_ff,
    n_layers=args.layers,
    max_len=max_len,
    tie_head=tie_head,
  )


def config(args: argparse.Namespace):
  """The benchmark's toy transformer, sized by :func:`add_model_args`' flags."""
  from jax_residency.toy import ToyConfig

  return ToyConfig(
    vocab=512, d_model=args.d_model, n_heads=12, d_ff=args.d_ff, n_layers=args.layers
  )


def toy_model(cfg, *, abstract: bool):
  """The toy transformer of ``cfg`` (seed 0); ``abstract``: its shapes only, no arrays."""
  from flax import nnx

  from jax_residency.toy import ToyTransformer

  make = lambda: ToyTransformer(cfg, rngs=nnx.Rngs(0))  # noqa: E731
  return nnx.eval_shape(make) if abstract else make()


def toy_tokens(n: int):
  """A (1, ``n``) batch of token ids below the benchmarks' vocabulary (512)."""
  import jax

  return jax.random.randint(jax.random.key(1), (1, n), 0, 512)


def plain_jitted(model):
  """The plain model as fast JAX code runs it, the anchor a policy's speed is held to:
  ``jax.jit`` of ``nnx.merge`` over the model's ``nnx.split`` state, split once, so a call
  is one compiled program and no Python walk of the model. (``nnx.jit`` also returns
  the model's state from its program: several times slower a decode step here.)"""
  import jax
  from flax import nnx

  graphdef, state = nnx.split(model)
  forward = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
  return lambda *args: forward(state, *args)


def dense_policy(host_budget: int):
  """DenseDiskStream with a ``BUDGET`` device window and the given host cache."""
  import jax_residency as jr

  return jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(
      device_budget_bytes=BUDGET,
      host_budget_bytes=host_budget,
      host_lookahead=2,
      background_queue_capacity=2,
    )
  )


def rss_bytes() -> int:
  with open("/proc/self/statm") as f:
    return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def status_bytes(*keys: str) -> dict[str, int]:
  """The fields ``keys`` of ``/proc/self/status`` that it has (sizes in kB there), in bytes."""
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      name, _, rest = line.partition(":")
      if name in keys:
        out[name] = int(rest.split()[0]) * 1024
  return out


def _status(key: str) -> int:
  found = status_bytes(key)
  if key not in found:
    raise RuntimeError(f"no {key} in /proc/self/status")
  return found[key]


def rss_anon_bytes() -> int:
  """Anonymous resident memory (``RssAnon``: heap, not mapped files) of this process."""
  return _status("RssAnon")


class AnonPeak:
  """The peak of ``RssAnon`` while the context is open, sampled by a thread.

  The kernel keeps no high-water mark of anonymous memory, so a thread reads it
  every ``interval`` seconds (and once at entry and exit); a peak shorter than
  the interval can be missed.
  """

  def __init__(self, interval: float = 0.005) -> None:
    self.interval = interval
    self.peak = 0
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None

  def _sample(self) -> None:
    while not self._stop.wait(self.interval):
      self.peak = max(self.peak, rss_anon_bytes())

  def __enter__(self) -> AnonPeak:
    self.peak = rss_anon_bytes()
    self._stop.clear()
    self._thread = threading.Thread(target=self._sample, name="anon-peak", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc: object) -> None:
    self._stop.set()
    assert self._thread is not None
    self._thread.join()
    self.peak = max(self.peak, rss_anon_bytes())


def peak_rss_bytes() -> int:
  """This process's peak RSS (``VmHWM``) since it started or `reset_peak_rss`."""
  return _status("VmHWM")


def reset_peak_rss() -> None:
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")


class Peaks:
  """Peak RSS over a process whose VmHWM is reset between phases."""

  def __init__(self) -> None:
    self.process = 0

  def reset(self) -> None:
    self.process = max(self.process, peak_rss_bytes())
    reset_peak_rss()

  def read(self) -> int:
    peak = peak_rss_bytes()
    self.process = max(self.process, peak)
    return peak


def io_bytes() -> tuple[int, int]:
  """(read_bytes, write_bytes) this process caused at the storage layer (``/proc/self/io``)."""
  fields = {}
  with open("/proc/self/io") as f:
    for line in f:
      key, _, value = line.partition(":")
      fields[key] = int(value)
  return fields["read_bytes"], fields["write_bytes"]


def timed_load(load, peaks: Peaks) -> tuple:
  """``load()``'s result and the figures of a load: its time and the bytes it read, the
  RSS before it (the baseline) and at its peak (``peaks`` reset at its start)."""
  baseline = rss_bytes()
  peaks.reset()
  io0 = io_bytes()
  start = time.perf_counter()
  loaded = load()
  return loaded, {
    "load_s": time.perf_counter() - start,
    "load_read_bytes": io_bytes()[0] - io0[0],
    "baseline_rss_bytes": baseline,
    "load_peak_rss_bytes": peaks.read(),
  }


def files_under(path: str) -> list[str]:
  """``path`` itself if it is a file, else every file below it, sorted."""
  if os.path.isfile(path):
    return [path]
  out = []
  for root, _, files in os.walk(path):
    out += [os.path.join(root, f) for f in files]
  return sorted(out)


def drop_page_cache(*paths: str) -> None:
  """Writes back and evicts every file under ``paths`` from the page cache."""
  for path in paths:
    for name in files_under(path):
      fd = os.open(name, os.O_RDONLY)
      try:
        os.fsync(fd)  # dirty pages are not dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
      finally:
        os.close(fd)


def read_files(*paths: str, buffer: bytearray | memoryview | None = None) -> int:
  """Reads every file under ``paths`` once, in order, into ``buffer`` (default: a new
  16 MiB one); returns the bytes read. Unbuffered reads: the page cache, or the disk."""
  view = memoryview(bytearray(16 * MiB) if buffer is None else buffer)
  total = 0
  for path in paths:
    for name in files_under(path):
      with open(name, "rb", buffering=0) as f:
        while n := f.readinto(view):
          total += n
  return total


def parallel_read(files: list[str], *, threads: int) -> int:
  """Reads every file in 16 MiB ranges with ``threads`` readers; returns bytes read."""
  from concurrent.futures import ThreadPoolExecutor

  chunk = 16 * MiB
  ranges = [(name, off) for name in files for off in range(0, max(os.path.getsize(name), 1), chunk)]
  local = threading.local()

  def read(item: tuple[str, int]) -> int:
    name, off = item
    buf = getattr(local, "buf", None)
    if buf is None:
      buf = local.buf = bytearray(chunk)
    fd = os.open(name, os.O_RDONLY)
    try:
      return os.preadv(fd, [buf], off)
    finally:
      os.close(fd)

  with ThreadPoolExecutor(threads) as pool:
    return sum(pool.map(read, ranges))


def mapped_bytes(*paths: str) -> int:
  """Resident bytes of this process's mappings of the files under ``paths``.

  ``posix_fadvise(..., POSIX_FADV_DONTNEED)`` leaves such pages in the page
  cache (the kernel drops no page a process has mapped), so after
  :func:`drop_page_cache` they are what the next reads find without the disk.
  """
  names = {os.path.realpath(f) for path in paths for f in files_under(path)}
  total, current = 0, False
  with open("/proc/self/smaps") as f:
    for line in f:
      head = line.split(maxsplit=5)
      if head and "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line
        current = len(head) == 6 and os.path.realpath(head[5].strip()) in names
      elif current and head[0] == "Rss:":
        total += int(head[1]) * 1024
  return total
