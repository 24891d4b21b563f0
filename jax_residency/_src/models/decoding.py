"""The token loop shared by the generators (Llama's, T5's): a prefill, then one decode
step per token over a cache, with stop tokens, padding and optional timing.

A generator runs a plain model jitted (`jitted_plain`) or a placed one as it is
(`plain_or_placed`); its prefill gives the first logits and the cache, and
`decode` does the rest: pick a token, pad a finished row, stop once every row has
finished, feed the token back through the generator's step.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

#: One decode step: ``(last tokens (batch,), step index, cache) -> (logits, cache)``.
Step = Callable[[jax.Array, int, Any], tuple[jax.Array, Any]]
#: The token of each row from the logits of a step: ``(logits, step index) -> (batch,)``.
Pick = Callable[[jax.Array, int], jax.Array]
#: Told each step's tokens as they are produced: ``(batch,)`` int32, one per row.
OnToken = Callable[[np.ndarray], None]


@functools.partial(jax.jit, static_argnums=0)
def _call_split(graphdef: Any, state: Any, *args: Any) -> Any:
  return nnx.merge(graphdef, state)(*args)


def jitted_plain(model: nnx.Module, *args: Any) -> Any:
  """``model(*args)`` compiled once per input signature: ``jax.jit`` over the model's
  ``nnx.split`` state, the form fast JAX code runs (for inference: the forward changes no
  state). ``nnx.jit`` also returns the model's state from the program, which on the
  benchmarks' decoders made a decode step several times slower (docs/benchmarks.md).
  """
  graphdef, state = nnx.split(model)
  return _call_split(graphdef, state, *args)


@runtime_checkable
class Configured(Protocol):
  """A placed model that carries its config (`models.Draft`): generators take it
  without ``config=``."""

  config: Any

  def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


def plain_or_placed(
  model: Any, model_type: type[Any], config: Any, what: str
) -> tuple[Any, Callable[..., Any]]:
  """``(config, forward)`` of a generator's model: a ``model_type`` runs jitted with its
  own config; anything else (a placed model) runs as it is, with ``config`` (default: a
  `Configured` model's own).

  Raises:
    ValueError: a placed model and no ``config``; the message names ``what`` to pass.
  """
  if isinstance(model, model_type):
    return model.config, functools.partial(jitted_plain, model)
  if config is None and isinstance(model, Configured):
    return model.config, model
  if config is None:
    raise ValueError(f"generate with a placed model needs config=<the model's {what}>")
  return config, model


def check_max_new_tokens(max_new_tokens: int) -> None:
  """Raises ``ValueError`` unless at least one token is asked for."""
  if max_new_tokens < 1:
    raise ValueError(f"max_new_tokens={max_new_tokens}: generate at least one token")


def prompt(input_ids: Any, attention_mask: Any) -> tuple[jax.Array, jax.Array]:
  """``(ids, mask)``, int32 ``(batch, length)``: a 1-D prompt gets a batch of one, and
  the mask defaults to all ones.

  Example:
    >>> ids, mask = prompt([5, 6, 7], None)
    >>> ids.shape, mask.tolist()
    ((1, 3), [[1, 1, 1]])
  """
  ids = jnp.asarray(input_ids, jnp.int32)
  if ids.ndim == 1:
    ids = ids[None]
  mask = jnp.ones_like(ids) if attention_mask is None else jnp.asarray(attention_mask, jnp.int32)
  return ids, mask


class Timer:
  """The prefill time and the decode rate of one generation of ``batch`` rows after a
  prompt of ``length`` tokens, printed by `report`.

  Started when made; `mark` notes the time of the first two tokens (the
  prefill's, and the first step's, which compiles).
  """

  def __init__(self, batch: int, length: int) -> None:
    self._start = time.perf_counter()
    self._marks: list[float] = []
    self._batch, self._length = batch, length

  def mark(self, token: jax.Array, i: int) -> None:
    """Notes when token ``i`` is ready, for the first two."""
    if i < 2:
      jax.block_until_ready(token)
      self._marks.append(time.perf_counter() - self._start)

  def report(self, new: int) -> None:
    """Prints the prefill time and the decode rate after the first step, ``new``
    tokens computed."""
    total_s, marks = time.perf_counter() - self._start, self._marks
    batch, length = self._batch, self._length
    line = f"generated {batch} x {new} tokens in {total_s:.2f} s: prefill {marks[0]:.2f} s "
    line += f"({batch} x {length} prompt tokens)"
    if new > 2:
      rate = batch * (new - 2) / max(total_s - marks[1], 1e-9)
      line += f", decode {rate:.1f} tokens/s after the first step ({marks[1] - marks[0]:.2f} s)"
    print(line)


def decode(
  logits: jax.Array,
  cache: Any,
  step: Step,
  pick: Pick,
  max_new_tokens: int,
  *,
  stops: Sequence[int],
  pad: Any,
  timer: Timer | None = None,
  on_token: OnToken | None = None,
) -> jax.Array:
  """The tokens after a prefill.

  Token ``i`` is ``pick(logits, i)``; from the second on, ``logits`` come from
  ``step(previous token, i, cache)``. A row that emits one of ``stops`` is
  finished: its later tokens are ``pad`` (fed back as such); once every row has
  finished the rest is ``pad`` without running a step. A ``timer`` reports when
  done. ``on_token`` is called with each step's tokens (a NumPy ``(batch,)`` array,
  a finished row's ``pad``) once they are ready, before the next step runs; the
  steps left out after every row has finished are not told.

  Returns:
    The tokens, ``(batch, max_new_tokens)`` int32, ready.
  """
  stop_ids = jnp.asarray(tuple(stops), jnp.int32)
  done = jnp.zeros((logits.shape[0],), bool)
  out: list[jax.Array] = []
  for i in range(max_new_tokens):
    if out:
      logits, cache = step(out[-1], i, cache)
    token = pick(logits, i)
    if stops:
      token = jnp.where(done, pad, token)
      done = done | jnp.isin(token, stop_ids)
    out.append(token)
    if timer is not None:
      timer.mark(token, i)
    if on_token is not None:
      on_token(np.asarray(token))
    if stops and bool(done.all()):
      out += [jnp.full(done.shape, pad, jnp.int32)] * (max_new_tokens - 1 - i)
      break
  tokens = jax.block_until_ready(jnp.stack(out, axis=1))
  if timer is not None:
    timer.report(new=i + 1)
  return tokens
