"""The public surface: ``jr.__all__``, ``jr.errors``, and the report docs.

Every public name exists and is documented, with a doctest example that
``--doctest-modules`` runs; ``jr.errors`` holds every error type
the library defines, in the hierarchy its docstring draws; budget errors carry
their arithmetic as attributes; and the example in ``docs/reports.md`` runs and
names every field of the report types.
"""

from __future__ import annotations

import dataclasses
import doctest
import inspect
import pathlib
import re
import types

import pytest
from flax import nnx
from md_blocks import python_blocks

import jax_residency as jr
from jax_residency._src import errors as src_errors
from jax_residency.toy import ToyConfig, ToyTransformer

REPORTS_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "reports.md"

#: What `place`, `save` and `placed.report()` hand back; docs/reports.md documents each field.
RETURNED = (
  jr.Report,
  jr.PassReport,
  jr.Totals,
  jr.TierMetrics,
  jr.WorkerMetrics,
  jr.ExpertMetrics,
  jr.SpeculationTotals,
  jr.TimelinePoint,
  jr.ModelMetadata,
  jr.MemoryItem,
  jr.StoreInfo,
  jr.Measurement,
  jr.Candidate,
)

#: The errors a user catches most: the only ones the top level lists in `__all__`.
TOP_LEVEL_ERRORS = {
  "ResidencyError",
  "BudgetTooSmallError",
  "DeviceBudgetTooSmallError",
  "HostBudgetTooSmallError",
  "StoreError",
  "PlacementError",
  "ClosedError",
}


def defined_errors() -> dict[str, type[BaseException]]:
  """Every `ResidencyError` subclass defined in the library's error modules (the
  `errors` package, which re-exports each of its modules' types)."""
  return {
    name: obj
    for name, obj in vars(src_errors).items()
    if inspect.isclass(obj)
    and issubclass(obj, src_errors.ResidencyError)
    and obj.__module__.startswith("jax_residency._src.errors.")
  }


def is_documented(obj: object) -> bool:
  """A module, class or function with its own docstring (not a dataclass's generated one)."""
  doc = inspect.getdoc(obj)
  if not doc:
    return False
  name = getattr(obj, "__name__", "")
  return not (dataclasses.is_dataclass(obj) and doc.startswith(f"{name}("))


# --- names -------------------------------------------------------------------


@pytest.mark.parametrize("module", [jr, jr.errors], ids=["jr", "jr.errors"])
def test_every_public_name_exists_and_is_documented(module):
  assert len(module.__all__) == len(set(module.__all__)), "duplicates in __all__"
  for name in module.__all__:
    assert hasattr(module, name), f"{module.__name__}.{name} is in __all__ but missing"
    obj = getattr(module, name)
    if isinstance(obj, types.ModuleType) or inspect.isclass(obj) or callable(obj):
      assert is_documented(obj), f"{module.__name__}.{name} has no docstring"
    else:  # a constant: the package docstring says what it is
      assert name in (module.__doc__ or ""), f"{module.__name__}.{name} is not documented"


def public_objects() -> dict[str, object]:
  """Every public module, class and function by the name it is exported as (first one wins).

  ``jr.__all__``, ``jr.errors.__all__``, ``jr.linen.__all__`` and ``jr.linen``
  itself; constants are exempt (the package docstring describes them).
  """
  found: dict[str, object] = {"jr.linen": jr.linen}
  for prefix, module in (("jr", jr), ("jr.errors", jr.errors), ("jr.linen", jr.linen)):
    for name in module.__all__:
      obj = getattr(module, name)
      is_new = all(obj is not seen for seen in found.values())
      if is_new and (isinstance(obj, types.ModuleType) or callable(obj)):  # classes are callable
        found[f"{prefix}.{name}"] = obj
  return found


def test_every_public_name_has_a_doctest_example_that_pytest_runs():
  """Each docstring holds an example, in a module ``--doctest-modules`` collects."""
  finder = doctest.DocTestFinder(recurse=False)
  objects = public_objects()
  assert {"jr.place", "jr.linen", "jr.linen.scan", "jr.errors.StoreLayoutError"} <= set(objects)
  missing = [
    name for name, obj in objects.items() if not any(t.examples for t in finder.find(obj, name))
  ]
  assert not missing, f"public names whose docstring has no doctest example: {missing}"
  outside = {}
  for name, obj in objects.items():
    module = inspect.getmodule(obj)
    if module is None or not module.__name__.startswith("jax_residency"):
      outside[name] = getattr(module, "__name__", None)
  assert not outside, f"docstrings outside jax_residency, so pytest does not run them: {outside}"


def test_what_users_get_back_is_exported():
  for cls in RETURNED:
    assert cls.__name__ in jr.__all__
    assert dataclasses.is_dataclass(cls)


def test_errors_module_holds_every_error_type():
  defined = defined_errors()
  assert "StoreLayoutError" in defined and len(defined) > 20  # the walk found them
  assert set(jr.errors.__all__) == set(defined)
  for name, cls in defined.items():
    assert getattr(jr.errors, name) is cls
  assert jr.errors.StoreLayoutError is src_errors.StoreLayoutError


def test_top_level_lists_the_main_errors_and_keeps_the_rest_importable():
  listed = {name for name in jr.__all__ if name.endswith("Error")}
  assert listed == TOP_LEVEL_ERRORS
  for name, cls in defined_errors().items():
    assert getattr(jr, name) is cls  # earlier code importing jr.<AnyError> still works


def test_errors_docstring_draws_the_real_hierarchy():
  """Each class in the docstring's tree has its parent, and the builtin in parentheses, as bases."""
  doc = jr.errors.__doc__ or ""
  block = doc.split("::\n\n", 1)[1].split("\n\n", 1)[0]
  stack: list[tuple[int, type]] = []
  seen = set()
  for line in block.splitlines():
    m = re.fullmatch(r"( *)(\w+)(?: \((\w+)\))?", line)
    assert m, f"unexpected line in the hierarchy: {line!r}"
    indent, name, builtin = len(m[1]), m[2], m[3]
    cls = getattr(jr.errors, name)
    while stack and stack[-1][0] >= indent:
      stack.pop()
    if stack:
      assert stack[-1][1] in cls.__bases__, f"{name} does not derive from {stack[-1][1].__name__}"
    else:
      assert cls is jr.errors.ResidencyError
    if builtin:
      assert builtin in {b.__name__ for b in cls.__bases__}, f"{name} is not a {builtin}"
    stack.append((indent, cls))
    seen.add(name)
  assert seen == set(jr.errors.__all__), "the docstring's tree misses or adds error types"


# --- budget errors carry their numbers ------------------------------------------


CFG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=4)


@pytest.fixture(scope="module")
def toy(toy_model) -> ToyTransformer:
  return toy_model(CFG, seeded=True)


def test_device_budget_error_carries_its_numbers(toy):
  depth, budget = 2, 1000
  policy = jr.LayerwiseHost(
    jr.LayerwiseLoadOptions(
      offload=jr.OffloadConfig(prefetch_depth=depth, device_budget_bytes=budget)
    )
  )
  with pytest.raises(jr.errors.DeviceBudgetTooSmallError) as info:
    jr.place(toy, policy)
  e = info.value
  assert isinstance(e, jr.BudgetTooSmallError) and isinstance(e, ValueError)
  assert e.budget == budget and e.depth == depth
  assert e.window == depth * CFG.unit_bytes()
  assert e.static > 0 and e.required == e.static + e.window > e.budget
  assert e.staging is None
  for part in (f"static={e.static}", f"window={e.window}", f"required={e.required}"):
    assert part in str(e)


def test_host_budget_error_carries_its_numbers(toy, tmp_path):
  unit = CFG.unit_bytes()
  info = jr.save(toy, str(tmp_path / "toy"))
  policy = jr.DenseDiskStream(
    jr.DenseDiskStreamLoadOptions(host_budget_bytes=2 * unit - 1, host_lookahead=2)
  )
  abstract = nnx.eval_shape(lambda: ToyTransformer(CFG, rngs=nnx.Rngs(0)))
  with pytest.raises(jr.errors.HostBudgetTooSmallError) as err:
    jr.place(abstract, policy, store=info.path)
  e = err.value
  assert isinstance(e, jr.BudgetTooSmallError)
  assert e.budget == 2 * unit - 1 and e.window == 2 * unit
  assert e.staging is not None and e.required == e.window + e.staging > e.budget
  assert e.static is None and e.depth is None


# --- docs/reports.md ----------------------------------------------------------------


def test_reports_doc_example_runs(capsys):
  blocks = python_blocks(REPORTS_MD.read_text())
  assert blocks, "docs/reports.md has no python example"
  namespace: dict[str, object] = {"__name__": "docs_reports_example"}
  for block in blocks:
    exec(compile(block, str(REPORTS_MD), "exec"), namespace)
  assert isinstance(namespace["report"], jr.Report)
  assert isinstance(namespace["meta"], jr.ModelMetadata)
  assert "prefill" in capsys.readouterr().out


@pytest.mark.parametrize("cls", RETURNED, ids=lambda c: c.__name__)
def test_reports_doc_names_every_field(cls):
  text = REPORTS_MD.read_text()
  assert f"## `{cls.__name__}`" in text or f": `{cls.__name__}`" in text
  public_properties = [
    name
    for name, value in vars(cls).items()
    if isinstance(value, property) and not name.startswith("_")
  ]
  for name in [f.name for f in dataclasses.fields(cls)] + public_properties:
    assert f"`{name}`" in text, f"docs/reports.md does not describe {cls.__name__}.{name}"


def test_importing_the_package_or_asking_the_cli_for_help_does_not_import_jax():
  """The public names load when first used (PEP 562), so `import jax_residency` and
  ``jax-residency --help`` answer in a fraction of a second; using a name loads its module."""
  import subprocess
  import sys

  code = (
    "import sys, jax_residency as jr\n"
    "from jax_residency._src.cli.main import build_parser\n"
    "build_parser().format_help()\n"
    "print('jax' in sys.modules)\n"
    "jr.place\n"
    "print('jax' in sys.modules, sorted(set(jr.__all__) - set(dir(jr))))\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  assert out.stdout.split("\n")[:2] == ["False", "True []"], out.stdout + out.stderr
