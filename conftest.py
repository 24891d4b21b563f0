"""Settings for every test pytest collects, the doctests in `jax_residency/` included."""

from __future__ import annotations

import tempfile

import pytest


@pytest.fixture(autouse=True)
def _temporary_files_in_tmp_path(tmp_path, monkeypatch):
  """Docstring examples make stores with `tempfile.mkdtemp()`, as a user would; under
  pytest those land in the test's own `tmp_path`, which pytest cleans up."""
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
