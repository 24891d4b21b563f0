"""Greedy decoding as the decode benchmarks time it: a prefill, then one-token steps.

`greedy` runs any model through a ``step`` function and times each call on its own;
`gpt_step` and `llama_step` make that function for this library's models (a placed
model or the plain one under ``jax.jit``). `prepare_regime` sets the page cache up for one
of the two regimes a decode benchmark times: the weights' files read into it first, or
dropped from it before every step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from _measure import drop_page_cache, io_bytes, read_files

#: "page-cache": the weights' files read into the page cache first, nothing dropped;
#: "disk": their pages dropped before the prefill and before every step (not timed).
REGIMES = ("page-cache", "disk")


def greedy(step, prompt, steps: int, *, cache=None, force=None, before=None) -> dict:
  """A prefill over ``prompt``, then ``steps`` one-token steps, each timed on its own.

  Args:
    step: ``step(tokens, cache, pos) -> (last-position logits as numpy, cache)``
      with ``tokens`` a numpy ``(1, t)`` int array; it returns once the logits
      are computed.
    prompt: ``(1, t)`` token ids.
    steps: decode steps after the prefill.
    cache: what the prefill's ``step`` gets as its cache (made before the timing).
    force: feed these tokens instead of the argmax (teacher forcing), so the
      logits can be compared step by step with another model's.
    before: called before the prefill and before every decode step, outside
      the timed region (the disk regime drops the weights' pages here).

  Returns:
    ``tokens`` ``(1 + steps,)`` (each step's argmax), ``logits``
    ``(1 + steps, vocab)``, ``prefill_s`` and ``step_s`` (one time per decode
    step), ``prefill_read_bytes`` and ``step_read_bytes`` (``/proc/self/io``
    read_bytes during the prefill and during each step).
  """
  import numpy as np

  def timed(tokens, cache, pos):
    if before is not None:
      before()
    io0 = io_bytes()[0]
    start = time.perf_counter()
    logits, cache = step(tokens, cache, pos)
    elapsed = time.perf_counter() - start
    return logits, cache, elapsed, io_bytes()[0] - io0

  logits, cache, prefill_s, prefill_read = timed(prompt, cache, 0)
  all_logits, step_s, step_read = [logits], [], []
  for i in range(steps):
    token = int(np.argmax(all_logits[-1])) if force is None else int(force[i])
    logits, cache, elapsed, read = timed(np.array([[token]], np.int32), cache, prompt.shape[1] + i)
    step_s.append(elapsed)
    step_read.append(read)
    all_logits.append(logits)
  stacked = np.stack(all_logits)
  return {
    "tokens": np.argmax(stacked, axis=-1).astype(np.int32),
    "logits": stacked,
    "prefill_s": prefill_s,
    "step_s": np.array(step_s),
    "prefill_read_bytes": prefill_read,
    "step_read_bytes": np.array(step_read),
  }


def summary(run: dict) -> dict:
  """A :func:`greedy` run's tokens (a list), prefill time and median decode step time."""
  import statistics

  return {
    "tokens": run["tokens"].tolist(),
    "prefill_s": run["prefill_s"],
    "step_s": statistics.median(run["step_s"].tolist()),
  }


def gpt_step(forward):
  """A :func:`greedy` step for a plain (jitted) or placed GPT ``forward(tokens, cache, pos)``."""
  import jax.numpy as jnp
  import numpy as np

  def step(tokens, cache, pos):
    # pos as an int32 array: every decode step shares one compiled program.
    logits, cache = forward(jnp.asarray(tokens), cache, jnp.asarray(pos, jnp.int32))
    return np.asarray(logits[0, -1]), cache

  return step


def llama_step(forward, cfg, length: int):
  """A :func:`greedy` step for a placed Llama ``forward(ids, mask, cache, pos)``: every
  token attended to; a first call without a cache makes one of ``length`` positions."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from jax_residency import models

  def step(ids, cache, pos):
    if cache is None:
      cache = models.LlamaCache.zeros(cfg, 1, length)
    mask = jnp.ones(ids.shape, jnp.int32)
    logits, cache = forward(jnp.asarray(ids), mask, cache, jnp.asarray(pos, jnp.int32))
    return np.asarray(jax.block_until_ready(logits)[0, -1]), cache

  return step


def prepare_regime(name: str, *paths: str) -> Callable[[], None]:
  """Sets the page cache up for regime ``name`` over the files under ``paths``; returns
  what runs before each step. ``"page-cache"``: reads them into it now, nothing before a
  step; ``"disk"``: drops them from it before each step."""
  if name == "page-cache":
    read_files(*paths)
    return lambda: None
  if name == "disk":
    return lambda: drop_page_cache(*paths)
  raise ValueError(f"regime {name!r}: expected one of {REGIMES}")


def llama_config(layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, **extra):
  """A random-weight benchmark's `LlamaConfig` from its shape (``extra``: other fields)."""
  from jax_residency import models

  return models.LlamaConfig(
    vocab_size=vocab,
    hidden_size=hidden,
    intermediate_size=inter,
    num_hidden_layers=layers,
    num_attention_heads=heads,
    num_key_value_heads=kv,
    **extra,
  )
