"""The suite's one `DenseDiskStream` builder, and one of each policy for tests that place
a store from somewhere else (a server, a bucket). Imported by name (``conftest.py`` puts
this directory on ``sys.path``)::

  from policies import REMOTE_POLICIES, dense

  dense(0)  # direct disk to device: no host cache, no read-ahead thread
  dense(3 * UNIT, 2)  # a host cache of three units, two units read ahead
  dense(2000, device=None)  # an unbounded device budget
"""

from __future__ import annotations

import jax_residency as jr
from jax_residency._src.policy.options import DEFAULT_DENSE_DEVICE_BUDGET_BYTES


def dense(
  host: int | str | None,
  lookahead: int | None = None,
  *,
  device: int | str | None = DEFAULT_DENSE_DEVICE_BUDGET_BYTES,
  lfu: bool = False,
) -> jr.DenseDiskStream:
  """A `DenseDiskStream` with ``host_budget_bytes=host`` (``None``: unbounded).

  Args:
    host: bytes of the host unit cache; 0 reads from disk straight to the device.
    lookahead: units read ahead into the host cache. ``None`` follows the host budget
      as the library does: 2 with a host cache, 0 without; so does the read-ahead
      queue (``background_queue_capacity``), always.
    device: the device budget in bytes (``None``: unbounded); the library's default
      (4 GiB) if left out.
    lfu: evict the least frequently used unit first instead of the least recently used.
  """
  fields: dict = {"host_budget_bytes": host, "device_budget_bytes": device}
  if lookahead is not None:
    fields["host_lookahead"] = lookahead
  if lfu:
    fields["eviction_policy"] = jr.CacheEvictionPolicy.LEAST_FREQUENTLY_USED
  return jr.DenseDiskStream(**fields)


#: Each policy once, with the dense stream both cached and direct: what the remote-store
#: tests (`test_remote.py` over HTTP, `test_s3.py` on an S3 server) place a store under.
REMOTE_POLICIES = {
  "fully_resident": jr.FullyResident(),
  "layerwise_host": jr.LayerwiseHost(prefetch_depth=2),
  "dense_disk_stream": jr.DenseDiskStream(host_budget_bytes="64MiB"),
  "dense_direct": jr.DenseDiskStream(host_budget_bytes=0),
}


def one_program(placed: jr.PlacedModel) -> jr.PlacedModel:
  """``placed`` (FullyResident or LayerwiseHost, already placed) running its passes as the
  program accelerators run (the stacked units, indexed in the loop), instead of the one
  over each unit's views it runs on CPU (docs/design.md, 3.1): how the suite checks that
  program's outputs on CPU."""
  executor = placed._placed()  # noqa: SLF001 - the suite's switch, not an option
  executor._extra = executor._stacked_extra  # noqa: SLF001
  executor._compiled.clear()  # noqa: SLF001
  return placed


def compiled_text(placed: jr.PlacedModel) -> str:
  """The optimized HLO of the one program ``placed`` (FullyResident or LayerwiseHost, after
  a call) compiled for that call's input signature."""
  executor = placed._placed()  # noqa: SLF001 - what the suite inspects, not an API
  ((exe, _, _),) = executor._compiled.values()  # noqa: SLF001
  return exe.as_text()
