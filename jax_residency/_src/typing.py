"""Type aliases shared across jax_residency, and the one helper of each: a path's
name (`path_str`) and a tensor's bytes (`tensor_nbytes`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypeAlias

import numpy as np

#: A parameter's path in the model's parameter tree, e.g. ``("layers", "attn", "kernel")``.
ParamPath: TypeAlias = tuple[str, ...]

#: Shape and dtype of one stored or expected tensor.
TensorSpec: TypeAlias = tuple[tuple[int, ...], np.dtype]


def path_str(path: ParamPath) -> str:
  """The name of a parameter path: its keys joined by dots (also a store's array name).

  Example:
    >>> path_str(("layers", "attn", "kernel"))
    'layers.attn.kernel'
  """
  return ".".join(path)


def tensor_nbytes(shape: Sequence[int], dtype: Any) -> int:
  """Bytes of a C-contiguous tensor of ``shape`` and ``dtype``.

  Example:
    >>> tensor_nbytes((3, 5), "float32"), tensor_nbytes((), np.int8)
    (60, 1)
  """
  # math.prod, not np.prod: called per tensor per unit visit on the read path, where
  # NumPy's reduction costs about 10 us a call.
  return math.prod(int(d) for d in shape) * np.dtype(dtype).itemsize
