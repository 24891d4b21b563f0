"""The README stays short, and the documentation's links lead somewhere.

README.md holds what the library does, the two set-up commands, the tour, the
policies and a table of the pages in ``docs/``; everything else lives in those
pages. These tests hold that shape: the README's length, every relative link
(and its ``#anchor``) in the README and in ``docs/*.md``, and a README link to
every page. The tour runs as written, and code cites only sections of
docs/design.md that exist, never an outside spec or an issue number.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest
from flax import nnx
from md_blocks import python_blocks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 250
#: Pages the README's table need not link: the design contract and the report fields
#: (linked anyway, but owned and checked elsewhere).
NOT_REQUIRED_IN_TABLE = {"design.md", "reports.md"}

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def markdown_files() -> list[Path]:
  return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(path: Path) -> list[tuple[int, str]]:
  """``(line number, text)`` of the lines outside fenced code blocks."""
  lines: list[tuple[int, str]] = []
  fence: str | None = None
  for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
    match = FENCE.match(line)
    if fence is not None:
      if match and match.group(1) == fence:
        fence = None
      continue
    if match:
      fence = match.group(1)
      continue
    lines.append((number, line))
  return lines


def slug(heading: str) -> str:
  """GitHub's anchor for a heading: its text lower-cased, punctuation other than '-'
  and '_' dropped, spaces turned into '-'."""
  text = LINK.sub(lambda m: m.group(1), heading)  # a link in a heading anchors on its text
  text = CODE_SPAN.sub(lambda m: m.group(2), text)
  text = re.sub(r"[^\w\- ]", "", text.lower())
  return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
  """Every heading anchor of ``path``, with GitHub's ``-1``, ``-2`` ... for repeats."""
  seen: dict[str, int] = {}
  found: set[str] = set()
  for _, line in prose_lines(path):
    match = HEADING.match(line)
    if not match:
      continue
    base = slug(match.group(2))
    count = seen.get(base, 0)
    seen[base] = count + 1
    found.add(base if count == 0 else f"{base}-{count}")
  return found


def links(path: Path) -> list[tuple[int, str]]:
  """``(line number, target)`` of every link in ``path``'s prose (not in code)."""
  found: list[tuple[int, str]] = []
  for number, line in prose_lines(path):
    text = CODE_SPAN.sub("", line)
    found.extend((number, m.group(2)) for m in LINK.finditer(text))
  return found


def relative_links() -> list[tuple[Path, int, str]]:
  return [
    (path, number, target)
    for path in markdown_files()
    for number, target in links(path)
    if target and not EXTERNAL.match(target)
  ]


def test_slug_follows_github():
  assert slug("Where the bytes go") == "where-the-bytes-go"
  assert slug("`read_path.py`: the read path and checksum cost") == (
    "read_pathpy-the-read-path-and-checksum-cost"
  )
  assert slug('What "the same outputs" means') == "what-the-same-outputs-means"
  assert slug("Hugging Face checkpoints: Llama, Mistral, Qwen2") == (
    "hugging-face-checkpoints-llama-mistral-qwen2"
  )
  assert slug("A [linked](other.md) heading") == "a-linked-heading"


def test_readme_is_at_most_250_lines():
  count = len(README.read_text(encoding="utf-8").splitlines())
  assert count <= README_MAX_LINES, (
    f"README.md has {count} lines (at most {README_MAX_LINES}): move detail into a page "
    "in docs/ and link it from the README's pages table"
  )


def test_the_docs_have_links_to_check():
  assert len(relative_links()) > 10


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path: Path):
  broken: list[str] = []
  for number, target in links(path):
    if not target or EXTERNAL.match(target):
      continue
    file_part, _, anchor = target.partition("#")
    where = f"{path.relative_to(ROOT)}:{number}: {target}"
    dest = (path.parent / unquote(file_part)).resolve() if file_part else path
    if not dest.exists():
      broken.append(
        f"{where} (no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest})"
      )
      continue
    if anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
      broken.append(f"{where} (no heading with anchor #{anchor} in {dest.relative_to(ROOT)})")
  assert not broken, "broken links:\n" + "\n".join(broken)


def readme_table_pages() -> set[str]:
  """The ``docs/*.md`` pages linked from a table row of the README."""
  pages: set[str] = set()
  for _, line in prose_lines(README):
    if not line.lstrip().startswith("|"):
      continue
    for m in LINK.finditer(CODE_SPAN.sub("", line)):
      target = (README.parent / unquote(m.group(2).partition("#")[0])).resolve()
      if target.parent == DOCS.resolve() and target.suffix == ".md":
        pages.add(target.name)
  return pages


def test_every_docs_page_is_in_the_readme_pages_table():
  pages = {p.name for p in DOCS.glob("*.md")} - NOT_REQUIRED_IN_TABLE
  missing = sorted(pages - readme_table_pages())
  assert not missing, f"docs pages the README's pages table does not link: {missing}"


# --- references in code ----------------------------------------------------------------

#: Where code and tests may point a reader: the repository's own docs, by section.
CODE_DIRS = ("jax_residency", "tests", "benchmarks", "examples", "scripts")
#: References a reader cannot follow: a spec that is not in the repository, issue numbers.
UNFOLLOWABLE = re.compile(r"\bSPEC\s*§|\b[Ii]ssues? #?\d+|\(#\d+\)")
DESIGN_SECTION = re.compile(r"docs/design\.md, sections? ([\d.]+(?:(?:, | and )[\d.]+)*)")


def code_files() -> list[Path]:
  return sorted(p for d in CODE_DIRS for p in (ROOT / d).rglob("*.py") if "fixtures" not in p.parts)


def design_sections() -> set[str]:
  """The numbers of docs/design.md's numbered headings ('1', '2.3', ...)."""
  found = set()
  for _, line in prose_lines(DOCS / "design.md"):
    m = HEADING.match(line)
    if m and (num := re.match(r"([\d.]+?)\.?\s", m.group(2))):
      found.add(num.group(1))
  return found


def test_code_cites_only_what_a_reader_can_follow():
  assert UNFOLLOWABLE.search("(SPEC §2)") and UNFOLLOWABLE.search("(issue 12, item 4)")
  bad = [
    f"{p.relative_to(ROOT)}:{i}: {line.strip()}"
    for p in code_files()
    if p.name != "test_docs.py"
    for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
    if UNFOLLOWABLE.search(line)
  ]
  assert not bad, "cite docs/design.md sections (or nothing) instead of:\n" + "\n".join(bad)


def test_cited_design_sections_exist():
  sections = design_sections()
  assert {"1", "2.3", "4.4", "6", "9"} <= sections, sorted(sections)
  cited = [
    (p, n)
    for p in code_files()
    for m in DESIGN_SECTION.finditer(p.read_text(encoding="utf-8"))
    for n in re.split(r", | and ", m.group(1))
  ]
  assert cited, "no code cites a docs/design.md section"
  missing = sorted({f"{p.relative_to(ROOT)}: section {n}" for p, n in cited if n not in sections})
  assert not missing, "docs/design.md has no such section:\n" + "\n".join(missing)


# --- the README's tour runs as written -------------------------------------------------

#: What the tour leaves to the reader: their layer block and their tokens.
TOUR_PRELUDE = """
import jax, jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  def __init__(self, d, *, rngs):
    self.linear = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, h):
    return jnp.tanh(self.linear(h))


tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
"""


def tour_blocks() -> list[str]:
  """The python blocks of the README's "A tour" section, in order."""
  text = README.read_text(encoding="utf-8")
  section = text.split("\n## A tour\n", 1)[1].split("\n## ", 1)[0]
  return python_blocks(section)


def test_the_readme_tour_runs_as_written(tmp_path, monkeypatch, capsys):
  blocks = tour_blocks()
  assert len(blocks) == 2 and "/data/my-model" in blocks[1], "the tour changed shape"
  store = str(tmp_path / "my-model")
  namespace: dict = {}
  exec(TOUR_PRELUDE, namespace)  # noqa: S102 - the README's own code, with the reader's parts
  exec(blocks[0], namespace)  # noqa: S102
  # The only edit: the store goes to a temporary directory instead of /data.
  exec(blocks[1].replace('"/data/my-model"', repr(store)), namespace)  # noqa: S102
  model, tokens = namespace["model"], namespace["tokens"]
  plain = nnx.jit(lambda m, t: m(t))(model, tokens)
  assert (namespace["logits"] == plain).all()  # the last placement: LayerwiseHost from a store
  assert namespace["direct"].offload().host_budget_bytes == 0
  out = capsys.readouterr().out
  assert "policy                 layerwise_host" in out and "peak device:" in out  # the prints
