"""Where a GGML block keeps its float16 scales, for benchmarks that write random blocks.

Random codes make a valid block of any GGML type; its float16 scale fields are what must
be set, so that the decoded values have a chosen size. `SCALE_FIELDS` says where they
are in each type's block, as ``jax_residency._src.quant.ggml`` lays the blocks out
(its `GgmlType` records a block's size, not its fields).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: Byte offsets of each type's float16 scale fields in its block: ``d``, then ``dmin``
#: (or ``m``) where the type has one.
SCALE_FIELDS = {
  "Q4_0": (0,),
  "Q4_1": (0, 2),
  "Q5_0": (0,),
  "Q5_1": (0, 2),
  "Q8_0": (0,),
  "Q2_K": (80, 82),
  "Q3_K": (108,),
  "Q4_K": (0, 2),
  "Q5_K": (0, 2),
  "Q6_K": (208,),
  "IQ4_NL": (0,),
  "IQ4_XS": (0,),
}


def set_scales(blocks: Any, name: str, draw: Callable[[], Any]) -> None:
  """Sets every scale field of ``blocks`` (``uint8``, ``(..., blocks, block_bytes)``) of
  type ``name``: each field, in `SCALE_FIELDS` order, to a new ``draw()`` (values of shape
  ``blocks.shape[:-1]``, cast to float16)."""
  import numpy as np

  for at in SCALE_FIELDS[name]:
    blocks[..., at : at + 2] = np.asarray(draw()).astype(np.float16)[..., None].view(np.uint8)
