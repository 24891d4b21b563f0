"""Module-scoped `model`, `tokens` and `store` fixtures for a toy config, shared by the
stream, mapped-read and integrity tests. Imported by name (``conftest.py`` puts this
directory on ``sys.path``)::

  model, tokens, store = toy_fixtures(CFG)
"""

from __future__ import annotations

import jax
import pytest
from flax import nnx

import jax_residency as jr
from jax_residency.toy import ToyConfig, ToyTransformer


def toy_fixtures(cfg: ToyConfig):
  """A toy model of ``cfg`` (seed 0), a (2, 6) batch of its tokens, and its saved store."""

  @pytest.fixture(scope="module")
  def model():
    return ToyTransformer(cfg, rngs=nnx.Rngs(0))

  @pytest.fixture(scope="module")
  def tokens():
    return jax.random.randint(jax.random.key(1), (2, 6), 0, cfg.vocab)

  @pytest.fixture(scope="module")
  def store(model, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("stores") / "toy")
    jr.save(model, path, progress=False)
    return path

  return model, tokens, store
