"""Type aliases shared across jax_residency."""

from __future__ import annotations

from typing import TypeAlias

import numpy as np

#: A parameter's path in the model's parameter tree, e.g. ``("layers", "attn", "kernel")``.
ParamPath: TypeAlias = tuple[str, ...]

#: Shape and dtype of one stored or expected tensor.
TensorSpec: TypeAlias = tuple[tuple[int, ...], np.dtype]
