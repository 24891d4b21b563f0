"""The Linen transform that stands in for ``nn.scan`` over a layer stack.

``jax_residency.linen.scan(Block, variable_axes={"params": 0}, ...)`` takes the
arguments of ``nn.scan`` and returns the same module class, so parameter trees
and outputs are unchanged. While a placed model runs, the stacked block is run
through the policy's layer loop instead: each step applies one layer's
parameters to an unbound copy of ``Block``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from flax import linen as nn

from jax_residency._src.errors import PlacementError
from jax_residency._src.loop.unit_loop import current_loop


def scan(target: type[nn.Module], **scan_kwargs: Any) -> type[nn.Module]:
  """``nn.scan`` for a layer stack that a placement can stream.

  Args:
    target: the block module class; its ``__call__(carry, *xs)`` returns
      ``(carry, y)`` as ``nn.scan`` requires.
    **scan_kwargs: passed to ``nn.scan`` (``variable_axes={"params": 0}``,
      ``split_rngs``, ``length``, ``reverse``...). Placed runs need the default
      ``in_axes=0`` and ``out_axes=0``.

  Returns:
    A module class: ``nn.scan(target, **scan_kwargs)`` outside a placement.

  Example:
    >>> import jax, jax.numpy as jnp, jax_residency as jr
    >>> from flax import linen as nn
    >>> class Block(nn.Module):  # a carry in, a carry and one output per layer out
    ...   @nn.compact
    ...   def __call__(self, h, _):
    ...     h = jax.nn.relu(nn.Dense(4)(h))
    ...     return h, h.mean()
    >>> Stack = jr.linen.scan(Block, variable_axes={"params": 0},
    ...                       split_rngs={"params": True}, length=3)
    >>> variables = Stack().init(jax.random.key(0), jnp.ones((2, 4)), None)
    >>> _, means = Stack().apply(variables, jnp.ones((2, 4)), None)
    >>> variables["params"]["Dense_0"]["kernel"].shape, means.shape  # stacked: axis 0 = layer
    ((3, 4, 4), (3,))
  """
  scanned: Any = nn.scan(target, **scan_kwargs)
  in_axes = scan_kwargs.get("in_axes", 0)
  out_axes = scan_kwargs.get("out_axes", 0)
  reverse = bool(scan_kwargs.get("reverse", False))
  init_fields = [
    f.name for f in dataclasses.fields(target) if f.init and f.name not in ("parent", "name")
  ]

  class ResidencyScan(scanned):  # type: ignore[misc, valid-type]
    def __call__(self, carry: Any, *xs: Any) -> Any:
      ctx = current_loop()
      path = tuple(self.scope.path) if self.scope is not None else ()
      loop = None if ctx is None or self.is_initializing() else ctx.claim(path)
      if loop is None:
        if ctx is None:
          return super().__call__(carry, *xs)
        with ctx.plain():
          return super().__call__(carry, *xs)
      if in_axes != 0 or out_axes != 0:
        raise PlacementError(
          f"jax_residency.linen.scan at {'/'.join(path)!r}: placed runs scan every input "
          f"and output along axis 0, but in_axes={in_axes!r}, out_axes={out_axes!r}; close "
          "over broadcast inputs and move output axes after the loop instead"
        )
      block = target(**{name: getattr(self, name) for name in init_fields}, parent=None)
      params = self.variables["params"]

      def step(c: Any, unit_params: Any, x: Any) -> tuple[Any, Any]:
        return block.apply({"params": unit_params}, c, *x)

      assert ctx is not None
      return ctx.run(loop, step, carry, params, xs, reverse=reverse)

  ResidencyScan.__name__ = scanned.__name__
  ResidencyScan.__qualname__ = scanned.__qualname__
  return ResidencyScan
