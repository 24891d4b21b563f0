"""The package's shape: layers that import only downward, small modules, no cycles.

Every module of `jax_residency` (found with `pkgutil.walk_packages`) is parsed
with `ast`, never run, and checked for:

* privacy: no module uses another module's private (``_``) names;
* functions: at most `MAX_FUNCTION_LINES` lines of code each;
* layers: each part of `jax_residency._src` sits on one floor of `LAYERS`
  (docs/design.md, "Layers"), and imports only parts on floors below its own;
  the public modules (`jax_residency`, `jax_residency.errors`, ...) sit on top,
  and nothing in `_src` imports them;
* size: a module past `REVIEW_LINES` lines is listed for review and must say why it
  is one concept in docs/design.md ("Module sizes");
* imports: the graph of imports between `jax_residency` modules, counting
  imports anywhere in a module (inside functions and methods too, where a lazy
  import can hide a cycle), has no cycle, except through `KNOWN_CYCLE_EDGES`.

The lists must not rot: a module the design lists that is no longer past the review
size, or a listed edge that no longer closes a cycle, fails the test until it is
removed from the list.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import pkgutil
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import jax_residency

#: The floors of `jax_residency._src`, bottom first (docs/design.md, "Layers"). A part
#: (a subpackage, or a module directly under `_src`) imports only parts on lower
#: floors; parts on one floor are independent of each other.
LAYERS: tuple[tuple[str, ...], ...] = (
  # errors; type aliases; cache folder; version; evaluating a jaxpr equation by equation
  ("errors", "typing", "cache_dir", "version", "jaxprs"),
  ("policy",),  # what the user asks for (pure Python)
  ("quant",),  # quantization schemes: encoding on the host, decoding in JAX
  ("plan",),  # the model split, budgets, metadata, memory items, shardings, arguments
  ("loop",),  # the layer loop models call, and finding stacks by tracing
  ("report",),  # metric types, pass reports, samplers
  ("store",),  # units at rest: layout, writing, reading, read options
  ("stream",),  # the dense stream's engine, ledger and reader
  ("models",),  # real models, their loaders and converters, the toy
  ("run",),  # place, PlacedModel, the executors: the only code that picks an engine
  ("cli", "testing", "store_server"),  # entry points: the command line, test helpers
)

#: The most lines of code a function may have (its docstring not counted). A longer
#: function is split where a reader wants names for its parts.
MAX_FUNCTION_LINES = 80

#: Lines past which a module is listed for review (docs/design.md, "Module sizes"): a
#: module is sized by its concept (../shared/STYLE.md), and one past this many lines
#: must say in the design why it is one concept, or be split.
REVIEW_LINES = 600

#: Import edges (importer, imported) allowed to close a cycle for now, each with
#: why. Empty (the layers of `LAYERS` leave no cycle between parts). An edge listed here
#: must exist and lie on a cycle, or the test fails until it is removed.
KNOWN_CYCLE_EDGES: dict[tuple[str, str], str] = {}


@dataclasses.dataclass(frozen=True)
class Module:
  name: str
  path: str
  is_package: bool

  @property
  def package(self) -> str:
    """The package relative imports in this module start from."""
    return self.name if self.is_package else self.name.rpartition(".")[0]

  def source(self) -> str:
    with open(self.path, encoding="utf-8") as f:
      return f.read()


def modules() -> dict[str, Module]:
  """Every module of `jax_residency`, the package itself included, by dotted name."""

  def fail(name: str) -> None:
    raise AssertionError(f"pkgutil.walk_packages could not import package {name}")

  found = {"jax_residency": Module("jax_residency", jax_residency.__file__ or "", True)}
  for info in pkgutil.walk_packages(jax_residency.__path__, "jax_residency.", onerror=fail):
    spec = importlib.util.find_spec(info.name)
    assert spec is not None and spec.origin, f"no source file for {info.name}"
    found[info.name] = Module(info.name, spec.origin, info.ispkg)
  return found


def _is_type_checking(test: ast.expr) -> bool:
  return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
    isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
  )


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
  """Every import that can run: at module level, in functions, methods, branches.

  Imports under `if TYPE_CHECKING:` are skipped: they never run (annotations are
  strings under `from __future__ import annotations`), so they cannot form a cycle.
  """
  todo: list[ast.AST] = [tree]
  while todo:
    node = todo.pop()
    if isinstance(node, ast.Import | ast.ImportFrom):
      yield node
    elif isinstance(node, ast.If) and _is_type_checking(node.test):
      todo.extend(node.orelse)
      continue
    todo.extend(ast.iter_child_nodes(node))


def import_graph(mods: Mapping[str, Module]) -> dict[str, set[str]]:
  """importer -> the `jax_residency` modules it imports (the modules named, not
  the packages above them that Python initialises on the way)."""

  def resolve(name: str) -> str | None:
    while name and name not in mods:
      name = name.rpartition(".")[0]
    return name or None

  graph: dict[str, set[str]] = {}
  for mod in mods.values():
    edges: set[str] = set()
    for node in _import_nodes(ast.parse(mod.source(), mod.path)):
      if isinstance(node, ast.Import):
        targets = [a.name for a in node.names]
      else:
        if node.level:
          parts = mod.package.split(".")
          base = ".".join(parts[: len(parts) - node.level + 1])
          base = f"{base}.{node.module}" if node.module else base
        else:
          base = node.module or ""
        # `from pkg import name`: the submodule `pkg.name` if there is one, else `pkg`.
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
      for target in targets:
        if target == "jax_residency" or target.startswith("jax_residency."):
          resolved = resolve(target)
          if resolved is not None and resolved != mod.name:
            edges.add(resolved)
    graph[mod.name] = edges
  return graph


def strongly_connected(graph: Mapping[str, set[str]]) -> list[set[str]]:
  """The graph's strongly connected components with more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  out: list[set[str]] = []
  for root in sorted(graph):
    if root in index:
      continue
    # Iterative depth-first search: (node, its remaining successors).
    work = [(root, iter(sorted(graph[root])))]
    index[root] = low[root] = len(index)
    stack.append(root)
    on_stack.add(root)
    while work:
      node, successors = work[-1]
      for nxt in successors:
        if nxt not in index:
          index[nxt] = low[nxt] = len(index)
          stack.append(nxt)
          on_stack.add(nxt)
          work.append((nxt, iter(sorted(graph.get(nxt, ())))))
          break
        if nxt in on_stack:
          low[node] = min(low[node], index[nxt])
      else:
        work.pop()
        if work:
          parent = work[-1][0]
          low[parent] = min(low[parent], low[node])
        if low[node] == index[node]:
          component = set()
          while True:
            member = stack.pop()
            on_stack.discard(member)
            component.add(member)
            if member == node:
              break
          if len(component) > 1:
            out.append(component)
  return out


def a_cycle(graph: Mapping[str, set[str]], component: set[str]) -> list[str]:
  """One cycle through the component's first module, as a path that ends where it starts."""
  start = min(component)
  parents: dict[str, str] = {}
  frontier = [start]
  while frontier:  # breadth first, inside the component: a shortest cycle
    nxt_frontier = []
    for node in frontier:
      for nxt in sorted(graph[node] & component):
        if nxt == start:
          path = [node]
          while path[-1] != start:
            path.append(parents[path[-1]])
          return [start, *reversed(path[:-1]), start]
        if nxt not in parents:
          parents[nxt] = node
          nxt_frontier.append(nxt)
    frontier = nxt_frontier
  raise AssertionError(f"no cycle through {start}")


def part_of(module: str) -> str | None:
  """The part of `_src` a module belongs to (`jax_residency._src.plan.split` -> `plan`),
  or None for the public modules outside `_src`."""
  parts = module.split(".")
  if parts[:2] != ["jax_residency", "_src"]:
    return None
  return parts[2] if len(parts) > 2 else ""


def floors() -> dict[str, int]:
  """part -> its floor (0 = bottom)."""
  return {part: i for i, layer in enumerate(LAYERS) for part in layer}


def layer_violations(graph: Mapping[str, set[str]]) -> list[str]:
  """Every import that does not point down a floor, as 'importer -> imported (why)'."""
  floor = floors()
  out = []
  for importer, imported in sorted((a, b) for a, bs in graph.items() for b in bs):
    src, dst = part_of(importer), part_of(imported)
    if src == "" or dst == "":
      continue  # `jax_residency._src` itself, an empty package
    if src is None:
      continue  # a public module: on top, it may import anything
    if dst is None:
      out.append(f"{importer} -> {imported} (_src imports a public module)")
    elif src == dst:
      continue
    elif src not in floor or dst not in floor:
      unknown = src if src not in floor else dst
      out.append(f"{importer} -> {imported} ({unknown!r} is on no floor of LAYERS)")
    elif floor[dst] == floor[src]:
      out.append(f"{importer} -> {imported} ({src} and {dst} share a floor)")
    elif floor[dst] > floor[src]:
      out.append(
        f"{importer} -> {imported} (up from {src}, floor {floor[src]}, to {dst}, "
        f"floor {floor[dst]})"
      )
  return out


def test_every_part_is_on_a_floor() -> None:
  parts = {part_of(name) for name in modules()} - {None, ""}
  floor = floors()
  assert len(floor) == sum(map(len, LAYERS)), "a part is on two floors of LAYERS"
  assert not parts - set(floor), (
    f"parts of _src on no floor of LAYERS: {sorted(parts - set(floor))}"
  )
  assert not set(floor) - parts, (
    f"LAYERS names parts that do not exist: {sorted(set(floor) - parts)}"
  )


def test_imports_point_down() -> None:
  bad = layer_violations(import_graph(modules()))
  assert not bad, (
    'imports that do not point down a floor of LAYERS (docs/design.md, "Layers"); move '
    "what both sides need to the lower floor:\n  " + "\n  ".join(bad)
  )


def test_layer_check_catches_upward_and_sideways_imports() -> None:
  graph = {
    "jax_residency._src.plan.budget": {"jax_residency._src.run.place"},  # up
    "jax_residency._src.cli.main": {"jax_residency._src.testing"},  # same floor
    "jax_residency._src.store.save": {"jax_residency"},  # a public module
    "jax_residency._src.run.place": {"jax_residency._src.plan.budget"},  # down: fine
    "jax_residency.errors": {"jax_residency._src.errors"},  # public: fine
  }
  bad = layer_violations(graph)
  assert [line.split(" (")[0] for line in bad] == [
    "jax_residency._src.cli.main -> jax_residency._src.testing",
    "jax_residency._src.plan.budget -> jax_residency._src.run.place",
    "jax_residency._src.store.save -> jax_residency",
  ], bad


def reviewed_sizes() -> dict[str, str]:
  """docs/design.md's "Module sizes": each listed module and why it is one concept."""
  text = (Path(jax_residency.__file__).parent.parent / "docs" / "design.md").read_text()
  section = text.split("### Module sizes", 1)[1].split("\n#", 1)[0]
  return dict(re.findall(r"^- `([\w.]+)`: (.+)$", section, re.M))


def test_modules_past_the_review_size_say_why_in_the_design() -> None:
  """Size by concept: a module past `REVIEW_LINES` is listed for review (printed), and
  passes only where docs/design.md's "Module sizes" says why it is one concept; a listed
  module back under the limit fails until its entry goes."""
  sizes = {name: len(mod.source().splitlines()) for name, mod in modules().items()}
  reviewed = reviewed_sizes()
  past = {name: n for name, n in sorted(sizes.items()) if n > REVIEW_LINES}
  print(f"Modules past {REVIEW_LINES} lines, to review:")
  for name, n in past.items():
    print(f"  {name}: {n} lines ({reviewed.get(name, 'no reason given')})")
  if not past:
    print("  (none)")
  unexplained = [f"{name}: {n} lines" for name, n in past.items() if name not in reviewed]
  assert not unexplained, (
    f"Modules past {REVIEW_LINES} lines: split them into modules whose names say what "
    "they do, or say in docs/design.md's 'Module sizes' why each is one concept:\n  "
    + "\n  ".join(unexplained)
  )
  stale = [name for name in sorted(reviewed) if sizes.get(name, 0) <= REVIEW_LINES]
  assert not stale, f"'Module sizes' lists modules not past {REVIEW_LINES} lines: {stale}"


def function_lengths(source: str) -> dict[str, int]:
  """Each function's lines of code, its docstring not counted, by qualified name."""
  out: dict[str, int] = {}

  def visit(node: ast.AST, prefix: str) -> None:
    for child in ast.iter_child_nodes(node):
      if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
        n = (child.end_lineno or child.lineno) - child.lineno + 1
        first = child.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
          n -= (first.end_lineno or first.lineno) - first.lineno + 1
        out[prefix + child.name] = n
        visit(child, f"{prefix}{child.name}.")
      elif isinstance(child, ast.ClassDef):
        visit(child, f"{prefix}{child.name}.")

  visit(ast.parse(source), "")
  return out


def test_functions_are_short() -> None:
  sample = 'def f():\n  """Doc.\n\n  More."""\n  a = 1\n  return a\n'
  assert function_lengths(sample) == {"f": 3}
  too_long = [
    f"{name}:{fn}: {n} lines"
    for name, mod in sorted(modules().items())
    for fn, n in function_lengths(mod.source()).items()
    if n > MAX_FUNCTION_LINES
  ]
  assert not too_long, (
    f"functions over {MAX_FUNCTION_LINES} lines of code; split them where a reader wants "
    "names for the parts:\n  " + "\n  ".join(too_long)
  )


def private_reaches(mod: Module, mods: Mapping[str, Module]) -> list[str]:
  """Where ``mod`` uses another module's private name: ``from m import _name``, or
  ``m._name`` with ``m`` a `jax_residency` module it imported."""
  tree = ast.parse(mod.source(), mod.path)
  aliases: set[str] = set()
  out = []
  for node in _import_nodes(tree):
    if isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = mod.package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1]) + (f".{base}" if base else "")
      if not base.startswith("jax_residency"):
        continue
      for a in node.names:
        if f"{base}.{a.name}" in mods:
          aliases.add(a.asname or a.name)
        elif a.name.startswith("_") and not a.name.startswith("__"):
          out.append(f"{mod.name}:{node.lineno}: from {base} import {a.name}")
    else:
      aliases.update(a.asname or a.name for a in node.names if a.name.startswith("jax_residency"))
  for node in ast.walk(tree):
    if (
      isinstance(node, ast.Attribute)
      and isinstance(node.value, ast.Name)
      and node.value.id in aliases
      and node.attr.startswith("_")
      and not node.attr.startswith("__")
    ):
      out.append(f"{mod.name}:{node.lineno}: {node.value.id}.{node.attr}")
  return out


def test_no_module_reaches_into_another_modules_private_names(tmp_path) -> None:
  mods = modules()
  fake = tmp_path / "fake.py"
  fake.write_text(
    "from jax_residency._src.testing import _max_diff\n"
    "from jax_residency._src.store import writer as wr\n"
    "wr._host(1)\nwr.save_store\n"
  )
  found = private_reaches(Module("jax_residency._src.fake", str(fake), False), mods)
  assert [line.split(": ", 1)[1] for line in found] == [
    "from jax_residency._src.testing import _max_diff",
    "wr._host",
  ], found
  bad = [line for mod in mods.values() for line in private_reaches(mod, mods)]
  assert not bad, (
    "private names used across modules; make the name public in its module (or move the "
    "code that needs it there):\n  " + "\n  ".join(sorted(bad))
  )


def test_import_graph_sees_relative_and_function_body_imports() -> None:
  graph = import_graph(modules())
  # `from ._src.run.draft import draft_from as draft_from` in jax_residency/models.py.
  assert "jax_residency._src.run.draft" in graph["jax_residency.models"]
  # `open_store` imports the store inside its body.
  assert "jax_residency._src.store.unit_store" in graph["jax_residency._src.cli.stored_models"]


def test_no_import_cycles() -> None:
  graph = import_graph(modules())
  print("Import edges allowed to close a cycle for now (KNOWN_CYCLE_EDGES):")
  for (a, b), why in sorted(KNOWN_CYCLE_EDGES.items()):
    print(f"  {a} -> {b} ({why})")
  if not KNOWN_CYCLE_EDGES:
    print("  (none)")
  in_cycles = strongly_connected(graph)
  stale = [
    f"{a} -> {b}"
    for a, b in sorted(KNOWN_CYCLE_EDGES)
    if b not in graph.get(a, set()) or not any({a, b} <= c for c in in_cycles)
  ]
  assert not stale, (
    "KNOWN_CYCLE_EDGES lists imports that no longer close a cycle (or no longer "
    "exist); remove them from it:\n  " + "\n  ".join(stale)
  )
  allowed = {a: graph[a] - {b for (x, b) in KNOWN_CYCLE_EDGES if x == a} for a in graph}
  cycles = [" -> ".join(a_cycle(allowed, c)) for c in strongly_connected(allowed)]
  assert not cycles, (
    "jax_residency modules import each other in a cycle (imports inside functions "
    "count); move what both need into a module below them:\n  " + "\n  ".join(cycles)
  )


def attribute_probes(mod: Module) -> list[str]:
  """Calls of ``getattr``/``hasattr`` on an object in ``mod``: a seam read by probing, not
  declared. Probing an imported module for what the platform has (``hasattr(mmap, ...)``)
  is no seam, and not counted."""
  tree = ast.parse(mod.source(), mod.path)
  imported = {
    (a.asname or a.name).split(".")[0]
    for node in ast.walk(tree)
    if isinstance(node, ast.Import)
    for a in node.names
  }
  return [
    f"{mod.name}:{node.lineno}: {node.func.id}(...)"
    for node in ast.walk(tree)
    if isinstance(node, ast.Call)
    and isinstance(node.func, ast.Name)
    and node.func.id in ("getattr", "hasattr")
    and not (isinstance(node.args[0], ast.Name) and node.args[0].id in imported)
  ]


def test_the_stream_reads_its_store_through_the_declared_protocol(tmp_path) -> None:
  """docs/design.md, 5.3: the dense stream reads a store through `UnitReader`, every
  member declared; nothing in `stream/` probes an object for a member it may lack."""
  fake = tmp_path / "fake.py"
  fake.write_text(
    "import mmap\nadvise = getattr(source, 'advise_unit', None)\nhasattr(source, 'x')\n"
    "hasattr(mmap, 'MADV_DONTNEED')\n"
  )
  found = attribute_probes(Module("jax_residency._src.stream.fake", str(fake), False))
  assert [line.split(": ", 1)[1] for line in found] == ["getattr(...)", "hasattr(...)"]
  stream = [m for name, m in modules().items() if name.startswith("jax_residency._src.stream.")]
  assert len(stream) > 10
  bad = [line for mod in stream for line in attribute_probes(mod)]
  assert not bad, "declare what the stream needs in store/unit_reader.py:\n  " + "\n  ".join(bad)


def package_bases(mod: Module, ours: set[str]) -> list[str]:
  """Classes of ``mod`` built on a class of this package (a mixin, or a base the
  subclass must fill in), by the base's name."""
  tree = ast.parse(mod.source(), mod.path)
  out = []
  for node in ast.walk(tree):
    if isinstance(node, ast.ClassDef):
      for base in node.bases:
        name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
        if name in ours:
          out.append(f"{mod.name}:{node.lineno}: {node.name}({name})")
  return out


def test_store_classes_are_made_of_parts_not_mixins(tmp_path) -> None:
  """docs/design.md, 5.3: a store holds its parts (layout, buffers, mappers, counters);
  no class in `store/` inherits from another of this package's classes (its errors and
  protocols aside)."""
  mods = modules()
  ours = {
    node.name
    for name, mod in mods.items()
    if not name.startswith("jax_residency._src.errors")
    for node in ast.walk(ast.parse(mod.source(), mod.path))
    if isinstance(node, ast.ClassDef)
    and not any(isinstance(b, ast.Name) and b.id == "Protocol" for b in node.bases)
  }
  assert {"UnitStore", "StoreLayout", "ReadCounts"} <= ours
  fake = tmp_path / "fake.py"
  fake.write_text("class Store(StoreLayout, ReadCounts):\n  pass\n")
  found = package_bases(Module("jax_residency._src.store.fake", str(fake), False), ours)
  assert [line.split(": ", 1)[1] for line in found] == [
    "Store(StoreLayout)",
    "Store(ReadCounts)",
  ]
  store = [m for name, m in mods.items() if name.startswith("jax_residency._src.store.")]
  bad = [line for mod in store for line in package_bases(mod, ours)]
  assert not bad, "hold the part as an attribute instead:\n  " + "\n  ".join(bad)
