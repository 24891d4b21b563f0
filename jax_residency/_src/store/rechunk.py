"""Copying a checkpoint into a streamable store: `rechunk_store`.

Any chunking or compression in, one uncompressed chunk per unit out (and per expert,
for a mixture of experts' expert tensors: docs/design.md, 5.6), one unit at a time,
through the same `StoreWriter` as `save_store` (atomic, bounded writes).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Sequence

import numpy as np
import tensorstore as ts

from jax_residency._src import errors
from jax_residency._src.store import commit, layout
from jax_residency._src.store.info import StackInfo, StoreInfo
from jax_residency._src.store.locations import locate
from jax_residency._src.store.stored_stack import per_expert
from jax_residency._src.store.unit_store import UnitStore
from jax_residency._src.store.writer import StoreWriter


def _read_unit_slice(handle: ts.TensorStore, i: int) -> np.ndarray:
  """Reads unit `i` of a stacked array (a seam for tests to observe)."""
  return handle[i].read().result()


def rechunk_store(
  src: str,
  dst: str,
  *,
  unit_prefix: tuple[str, ...] | None = None,
  progress: bool | None = None,
  overwrite: bool = False,
  stacks: Sequence[tuple[str, ...]] | None = None,
  experts: Sequence[str] | None = None,
) -> StoreInfo:
  """Copies a checkpoint into a streamable store: one uncompressed chunk per unit.

  Unit arrays are copied one unit at a time, array by array, so the whole model
  is never in memory: the peak is one source chunk kept decoded while its units
  are copied (for a whole-array-chunked source, one stacked tensor; its cache is
  sized 1.25x that), the chunk's stored bytes while it is decoded, and
  `WRITE_IN_FLIGHT_BYTES` of pending writes (measured: 685 MiB of growth for a
  171 MiB chunk stored in 164 MiB, `benchmarks/orbax_in_place.py`). Written into a temporary sibling
  and renamed into place, like `save_store`.

  Args:
    src: The checkpoint to convert (any chunking or compression).
    dst: Where to write the streamable store.
    unit_prefix: The unit subtree; defaults to the one in `src`'s sidecar.
    progress: As for `save_store`.
    overwrite: Replace an existing store at `dst`.
    stacks: Several unit subtrees (instead of ``unit_prefix``); both None take
      the stacks `src` records.
    experts: Paths, relative to a unit (``"mlp.experts"``), of the modules stacked
      per expert, written one chunk per expert of each unit (docs/design.md, 5.6).
      None keeps what `src` holds per expert; ``()`` writes every unit whole.
  """
  if locate(src) == locate(dst):
    raise errors.StoreError(f"rechunk_store needs a destination other than the source {src}.")
  source = UnitStore.open(
    src,
    unit_prefix=unit_prefix,
    stacks=stacks,
    max_cached_shards=1,
    require_unit_chunks=False,
    spare_unit_buffers=0,
    cache_largest_chunk=True,
  )
  info = source.info
  chosen = _experts(source, experts)
  with commit.terminations_raise():  # SIGTERM, as SIGINT, removes the temporary store
    writer = StoreWriter(
      dst,
      overwrite=overwrite,
      progress=progress,
      total=info.total_unit_bytes + info.static_nbytes,
      desc="rechunk_store",
    )
    try:
      for p, (shape, dtype) in source.static_specs.items():
        handle = writer.create(p, shape, dtype, shape)
        writer.write(handle, (), source.array_handle(p).read().result())
      for k, stack in enumerate(source.stacks):
        picked, _ = chosen.get(stack.prefix, (frozenset(), 0))
        for rel, (shape, dtype) in source.stack_specs(k).items():
          split = rel in picked
          path = stack.prefix + rel
          handle = writer.create_stacked(path, stack.count, shape, dtype, per_expert=split)
          src_handle = source.array_handle(path)
          for i in range(stack.count):
            writer.write_unit(handle, i, _read_unit_slice(src_handle, i), per_expert=split)
      writer.commit(
        stacks=[(st.prefix, st.count) for st in source.stacks],
        quantization=None if info.quantization is None else info.quantization.to_dict(),
        experts={
          p: ([list(m) for m in sorted({rel[:-1] for rel in picked})], n)
          for p, (picked, n) in chosen.items()
        },
      )
    except BaseException as e:
      if (disk_full := writer.fail(e)) is not None:
        raise disk_full from e
      raise
    finally:
      source.close()
  stacks_out = tuple(
    StackInfo(s.prefix, s.count, s.unit_nbytes, chosen.get(s.prefix, ((), 0))[1])
    for s in info.stacks
  )
  return dataclasses.replace(info, path=dst, stacks=stacks_out)


def _experts(
  source: UnitStore, experts: Sequence[str] | None
) -> dict[tuple[str, ...], tuple[frozenset[tuple[str, ...]], int]]:
  """Each stack's tensors to write per expert, and its expert count: those under
  ``experts``, or (None) those the source holds per expert."""
  if experts is None:
    held = {
      st.prefix: (frozenset(rel for rel, a in st.arrays.items() if per_expert(a)), st.experts)
      for st in source.stored_stacks
    }
    return {p: found for p, found in held.items() if found[0]}
  laid = []
  for k, st in enumerate(source.stacks):
    specs = source.stack_specs(k).items()
    arrays = {rel: types.SimpleNamespace(shape=(st.count, *shape)) for rel, (shape, _) in specs}
    laid.append((st.prefix, arrays, st.count))
  paths = [tuple(e.split(".")) for e in experts]
  chosen, counts = layout.expert_arrays(laid, paths, where="rechunk")
  return {p: (chosen[p], counts[p]) for p in chosen}
