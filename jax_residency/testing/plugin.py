"""A pytest plugin: eight CPU devices for a test session, and a mesh of them.

Add ``pytest_plugins = ["jax_residency.testing.plugin"]`` to the top-level
``conftest.py`` (or run ``pytest -p jax_residency.testing.plugin``). When pytest
configures itself, before any test imports a device, the plugin asks JAX's CPU
backend for ``--jax-cpu-devices`` devices (default 8), as ``XLA_FLAGS=
--xla_force_host_platform_device_count=8`` would; it does nothing if the
backend is already up or the count was set another way. The ``cpu_mesh8``
fixture is then a ``Mesh`` of eight CPU devices with axes ``("data", "model")``
shaped ``(2, 4)``, and ``cpu_devices`` the CPU devices themselves; a test that
needs eight is skipped where there are fewer.

Example:
  >>> import pytest
  >>> from jax_residency.testing import plugin
  >>> plugin.DEFAULT_DEVICES
  8
"""

from __future__ import annotations

import os
from typing import Any

import pytest

#: CPU devices the plugin asks for unless ``--jax-cpu-devices`` says otherwise.
DEFAULT_DEVICES = 8


def pytest_addoption(parser: pytest.Parser) -> None:
  parser.addoption(
    "--jax-cpu-devices",
    type=int,
    default=DEFAULT_DEVICES,
    help="CPU devices JAX creates for the session (jax_residency.testing.plugin; default 8)",
  )


def pytest_configure(config: pytest.Config) -> None:
  n = config.getoption("--jax-cpu-devices")
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  import jax  # noqa: PLC0415 - configured before any test touches a device

  try:
    from jax._src import xla_bridge  # noqa: PLC0415

    if xla_bridge.backends_are_initialized():
      return
  except (ImportError, AttributeError):  # pragma: no cover - a jax without the check
    pass
  jax.config.update("jax_num_cpu_devices", n)


@pytest.fixture(scope="session")
def cpu_devices() -> list[Any]:
  """The CPU devices of this session."""
  import jax  # noqa: PLC0415

  return jax.devices("cpu")


@pytest.fixture(scope="session")
def cpu_mesh8(cpu_devices: list[Any]) -> Any:
  """A ``(2, 4)`` mesh of eight CPU devices, axes ``("data", "model")``."""
  import numpy as np  # noqa: PLC0415
  from jax.sharding import Mesh  # noqa: PLC0415

  if len(cpu_devices) < 8:
    pytest.skip(f"needs 8 CPU devices, has {len(cpu_devices)} (--jax-cpu-devices 8)")
  return Mesh(np.array(cpu_devices[:8]).reshape(2, 4), ("data", "model"))
