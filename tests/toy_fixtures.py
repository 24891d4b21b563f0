"""Module-scoped `model`, `tokens` and `store` fixtures for a toy config, shared by the
stream, mapped-read, integrity and remote tests. Imported by name (``conftest.py`` puts
this directory on ``sys.path``)::

  model, tokens, store = toy_fixtures(CFG)

The model and its store come from the session's ``toy_model`` and ``toy_store``
(``conftest.py``): built and written once per session, whichever files ask, so read
them and copy the store before damaging it.
"""

from __future__ import annotations

import jax
import pytest

from jax_residency.toy import ToyConfig


def toy_fixtures(cfg: ToyConfig, *, seeded: bool = False):
  """A toy model of ``cfg`` (``nnx.Rngs(0)``; seeded numpy weights with ``seeded=True``,
  which compiles no initialiser), a (2, 6) batch of its tokens, and its saved store."""

  @pytest.fixture(scope="module")
  def model(toy_model):
    return toy_model(cfg, seeded=seeded)

  @pytest.fixture(scope="module")
  def tokens():
    return jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab)

  @pytest.fixture(scope="module")
  def store(toy_store):
    return toy_store(cfg, seeded=seeded)

  return model, tokens, store
