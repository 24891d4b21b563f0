"""Type aliases shared across jax_residency."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias

import numpy as np

#: A parameter's path in the model's parameter tree, e.g. ``("layers", "attn", "kernel")``.
ParamPath: TypeAlias = tuple[str, ...]

#: A byte count; ``None`` means unbounded where a budget is expected.
Bytes: TypeAlias = int

#: Shape and dtype of one stored or expected tensor.
TensorSpec: TypeAlias = tuple[tuple[int, ...], np.dtype]

#: Flat parameters keyed by path.
FlatParams: TypeAlias = Mapping[ParamPath, Any]
