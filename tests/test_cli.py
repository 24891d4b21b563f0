"""The ``jax-residency`` command: every subcommand, its output fields, and its exit codes."""

from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
from importlib import metadata

import pytest
from cli_call import call
from user_env import run_script, user_env

from jax_residency._src.cli import console
from jax_residency._src.cli import demo as demo_mod
from jax_residency._src.cli import main as cli
from jax_residency._src.cli import stored_models as records
from jax_residency._src.models.toy import ToyConfig

#: A tiny demo model, so the demo runs in seconds.
TINY = ["--layers", "2", "--d-model", "32", "--d-ff", "64", "--vocab", "64", "--heads", "4"]
TINY_CONFIG = ToyConfig(vocab=64, d_model=32, n_heads=4, d_ff=64, n_layers=2)
SUBCOMMANDS = ("demo", "inspect", "plan", "run", "rechunk", "generate", "chat")


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
  assert code == 2
  lines = err.strip("\n").splitlines()
  assert len(lines) == 1, err
  assert "error:" in lines[0] and "Traceback" not in err
  for fragment in fragments:
    assert fragment in lines[0]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
  """The first demo run: it builds the store (in a child process) and prints the table."""
  cache = tmp_path_factory.mktemp("cache")
  code, out, err = call("demo", "--cache-dir", str(cache), *TINY, "--tokens", "4")
  return cache, code, out, err


@pytest.fixture(scope="module")
def store(demo):
  cache = demo[0]
  (path,) = [os.path.join(cache, d) for d in os.listdir(cache) if d.startswith("demo-")]
  return path


@pytest.fixture(scope="module")
def orbax_checkpoint(tmp_path_factory):
  """A plain Orbax checkpoint: units chunked together and compressed, no sidecar."""
  import numpy as np
  import orbax.checkpoint as ocp

  path = str(tmp_path_factory.mktemp("orbax") / "ckpt")
  tree = {
    "params": {
      "layers": {"w": np.ones((3, 16, 16), np.float32), "b": np.zeros((3, 16), np.float32)},
      "embed": np.ones((10, 16), np.float32),
    }
  }
  ocp.PyTreeCheckpointer().save(path, tree)
  return path


# --- demo --------------------------------------------------------------------


def test_demo_first_run_builds_the_store_and_prints_one_table(demo, store):
  cache, code, out, err = demo
  assert code == 0, out + err
  assert store.startswith(str(cache)) and os.path.basename(store).startswith("demo-")
  assert os.path.exists(os.path.join(store, records.MODEL_FILE))
  assert f"store:   {store} (created)" in out
  lines = out.splitlines()
  (header,) = [i for i, line in enumerate(lines) if line.startswith("policy ")]
  for column in (
    "pass time",
    "peak RSS",
    "device window",
    "bytes read",
    "cache hit rate",
    "parity",
  ):
    assert column in lines[header]
  rows = lines[header + 1 : header + 4]
  assert [r.split()[0] for r in rows] == list(demo_mod.POLICY_NAMES)
  assert all("✓" in r for r in rows)
  # Windows the pass held, except layerwise_host's, which is inside its program: the plan's.
  assert [("(planned)" in r) for r in rows] == [
    n == "layerwise_host" for n in demo_mod.POLICY_NAMES
  ]
  assert "all outputs match the plain model" in out
  assert "first run" in err


def test_demo_reuses_the_store_and_exits_1_when_parity_fails(demo, store, monkeypatch, capfd):
  cache = demo[0]
  monkeypatch.setattr(demo_mod, "PARITY_ATOL", -1.0)  # nothing can match now
  code = cli.main(["demo", "--cache-dir", str(cache), *TINY, "--tokens", "4", "--json"])
  out, err = capfd.readouterr()
  assert code == 1
  data = json.loads(out)
  assert data["store"] == {"path": store, "reused": True}
  assert data["ok"] is False
  assert [p["policy"] for p in data["policies"]] == list(demo_mod.POLICY_NAMES)
  for p in data["policies"]:
    assert p["parity"]["ok"] is False and p["parity"]["max_abs_diff"] >= 0
    assert p["report"]["total"]["passes"] == 2
  dense = data["policies"][2]
  assert dense["bytes_read"] == 0 or dense["bytes_read"] == data["unit_bytes"] * data["units"]
  assert dense["device_window_units"] == 2
  assert data["policies"][0]["device_window_units"] == data["units"]
  assert "first run" not in err and "%|" not in err  # no build, no progress bar off a terminal


def test_demo_parity_marks():
  run = demo_mod.PolicyRun("dense_disk_stream", 0.1, 0.01, None, (), None)
  import numpy as np

  run.outputs = (np.ones(3), np.ones(3) + 1e-7)
  demo_mod.check_parity(np.ones(3), run)
  assert run.ok and 0 < run.max_abs_diff < 1e-6
  run.outputs = (np.ones(3) * 2,)
  demo_mod.check_parity(np.ones(3), run)
  assert not run.ok and run.max_abs_diff == 1.0
  run.outputs = (np.ones(4),)
  demo_mod.check_parity(np.ones(3), run)
  assert not run.ok


def test_demo_cache_dir_defaults(monkeypatch, tmp_path):
  monkeypatch.setenv("JAX_RESIDENCY_CACHE_DIR", str(tmp_path / "jr"))
  assert demo_mod.cache_root(None) == str(tmp_path / "jr")
  monkeypatch.delenv("JAX_RESIDENCY_CACHE_DIR")
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert demo_mod.cache_root(None) == str(tmp_path / "xdg" / "jax_residency")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert demo_mod.cache_root(None) == str(tmp_path / "home" / ".cache" / "jax_residency")
  assert demo_mod.cache_root(str(tmp_path / "x")) == str(tmp_path / "x")
  a = demo_mod.demo_store_path("/c", TINY_CONFIG)
  b = demo_mod.demo_store_path("/c", ToyConfig(**{**TINY_CONFIG.__dict__, "n_layers": 3}))
  assert a != b and a.startswith("/c/demo-") and a == demo_mod.demo_store_path("/c", TINY_CONFIG)


def test_demo_store_is_rebuilt_when_its_record_is_wrong(store, tmp_path):
  assert demo_mod.demo_store_ready(store, TINY_CONFIG)
  assert not demo_mod.demo_store_ready(store, ToyConfig(n_layers=2))
  copy = str(tmp_path / "copy")
  shutil.copytree(store, copy)
  with open(os.path.join(copy, records.MODEL_FILE), "w") as f:
    f.write("{broken")
  assert not demo_mod.demo_store_ready(copy, TINY_CONFIG)
  os.remove(os.path.join(copy, records.MODEL_FILE))
  assert not demo_mod.demo_store_ready(copy, TINY_CONFIG)
  assert not demo_mod.demo_store_ready(str(tmp_path / "absent"), TINY_CONFIG)


def test_demo_rejects_heads_that_do_not_divide_the_width(tmp_path):
  code, _, err = call("demo", "--cache-dir", str(tmp_path), "--d-model", "30", "--heads", "4")
  assert_one_line_error(code, err, "--heads")


# --- help and usage ----------------------------------------------------------


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_has_help(command):
  code, out, _ = call(command, "--help")
  assert code == 0 and out.startswith(f"usage: jax-residency {command}")


def test_top_level_help_lists_the_subcommands():
  code, out, _ = call("--help")
  assert code == 0
  for command in SUBCOMMANDS:
    assert command in out


@pytest.mark.parametrize(
  "argv, fragment",
  [
    ((), "required"),
    (("nope",), "invalid choice"),
    (("run", "x", "--policy", "fully_resident"), "--shape"),
    (("run", "x", "--policy", "fully_resident", "--shape", "1,x"), "not a shape"),
    (("plan", "x", "--lookahead", "0"), "--lookahead"),
  ],
)
def test_usage_errors_are_one_line(argv, fragment):
  code, _, err = call(*argv)
  assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize(
  "command",
  [("plan", "{store}"), ("run", "{store}", "--policy", "layerwise_host", "--shape", "1,2")],
)
@pytest.mark.parametrize("flag", ["--device-budget", "--host-budget"])
def test_a_bad_budget_is_a_one_line_error(store, command, flag):
  argv = [a.format(store=store) for a in command]
  code, out, err = call(*argv, flag, "12 parsecs")
  assert_one_line_error(code, err, flag, "12 parsecs")
  assert out == ""


@pytest.mark.parametrize(
  "argv",
  [
    ("inspect", "{missing}"),
    ("plan", "{missing}"),
    ("run", "{missing}", "--policy", "fully_resident", "--shape", "1,2"),
    ("rechunk", "{missing}", "{dst}"),
  ],
)
def test_a_missing_path_is_a_one_line_error(tmp_path, argv):
  missing = str(tmp_path / "missing")
  code, _, err = call(*(a.format(missing=missing, dst=tmp_path / "dst") for a in argv))
  assert_one_line_error(code, err, missing)


@pytest.mark.parametrize(
  "files",
  [{"notes.txt": "hello"}, {"_METADATA": "{not json"}, {"manifest.ocdbt": "garbage"}, {}],
  ids=["stray-file", "bad-metadata", "bad-manifest", "empty"],
)
@pytest.mark.parametrize("command", ["inspect", "plan"])
def test_an_unreadable_store_is_a_one_line_error(tmp_path, files, command):
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  code, _, err = call(command, str(tmp_path))
  assert_one_line_error(code, err, str(tmp_path))


def test_unexpected_exceptions_keep_their_traceback(monkeypatch, store):
  def boom(args):
    raise RuntimeError("a bug")

  monkeypatch.setattr(cli, "cmd_inspect", boom)
  with pytest.raises(RuntimeError, match="a bug"):
    cli.main(["inspect", store])


def test_one_line_elides_the_middle_of_long_messages():
  assert console.one_line("a\n  b\tc") == "a b c"
  long = console.one_line("x" * 500 + " middle " + "y" * 500, limit=300)
  assert len(long) < 400 and long.startswith("x") and long.endswith("y") and "elided" in long


# --- inspect -----------------------------------------------------------------


def test_inspect_a_streamable_store(store):
  code, out, _ = call("inspect", store)
  assert code == 0
  unit = TINY_CONFIG.unit_bytes()
  from jax_residency import format_bytes

  assert "units         2 under 'layers'" in out
  assert f"{format_bytes(unit)} each, {format_bytes(2 * unit)} total" in out
  assert "static bytes" in out and "one chunk per unit, uncompressed" in out
  assert "streamable    yes" in out and "`jax-residency run` works" in out
  assert "qkv.kernel" in out and "32x96" in out


def test_inspect_json(store):
  code, out, _ = call("inspect", store, "--json")
  data = json.loads(out)
  assert code == 0
  assert data["unit_count"] == 2 and data["unit_prefix"] == "layers"
  assert data["unit_bytes"] == TINY_CONFIG.unit_bytes()
  assert data["total_unit_bytes"] == 2 * data["unit_bytes"]
  assert data["static_bytes"] > 0 and data["streamable"] is True
  assert data["unit_tensors"]["qkv.kernel"] == {"shape": [32, 96], "dtype": "float32"}
  assert data["model"]["config"]["d_model"] == 32


def test_inspect_says_to_rechunk_and_rechunk_makes_it_streamable(orbax_checkpoint, tmp_path, capfd):
  code, _, err = call("inspect", orbax_checkpoint)
  assert_one_line_error(code, err, "--units")

  code, out, _ = call("inspect", orbax_checkpoint, "--units", "params.layers")
  assert code == 0
  assert "several units per chunk" in out
  assert "slowly: DenseDiskStream decodes 3.0 bytes for each byte it uses" in out
  assert f"run `jax-residency rechunk {orbax_checkpoint} DST --units params.layers`" in out

  dst = str(tmp_path / "streamable")
  capfd.readouterr()
  code, out, _ = call("rechunk", orbax_checkpoint, dst, "--units", "params.layers")
  assert code == 0 and "rechunked" in out and "3 units" in out
  assert "%|" not in capfd.readouterr().err  # no progress bar off a terminal
  code, out, _ = call("inspect", dst)
  assert code == 0 and "streamable    yes" in out and "one chunk per unit" in out

  code, _, err = call("rechunk", orbax_checkpoint, dst, "--units", "params.layers")
  assert_one_line_error(code, err, "overwrite")
  code, out, _ = call("rechunk", orbax_checkpoint, dst, "--units", "params.layers", "--overwrite")
  assert code == 0


def test_rechunk_keeps_the_model_record(store, tmp_path):
  dst = str(tmp_path / "copy")
  code, _, _ = call("rechunk", store, dst)
  assert code == 0
  assert os.path.exists(os.path.join(dst, records.MODEL_FILE))


# --- plan --------------------------------------------------------------------


def test_plan_shows_what_fits_with_the_arithmetic(store):
  from jax_residency import format_bytes

  unit = TINY_CONFIG.unit_bytes()
  budget = 10 * unit  # every policy fits on the device...
  code, out, _ = call("plan", store, "--device-budget", str(budget), "--host-budget", str(unit))
  assert code == 0
  assert "static + window = required" in out
  assert f"+ 2 x {format_bytes(unit)} = " in out
  assert f"host    2 x {format_bytes(unit)} = {format_bytes(2 * unit)}" in out
  # ...but a host budget of one unit holds neither LayerwiseHost's units nor lookahead 2.
  assert "fits: fully_resident, dense_disk_stream" not in out
  assert out.rstrip().splitlines()[-1] == "fits: fully_resident"
  assert "host_lookahead <= 1 fits" in out


def test_plan_json_and_lookahead(store):
  unit = TINY_CONFIG.unit_bytes()
  code, out, _ = call(
    "plan",
    store,
    "--device-budget",
    "1MiB",
    "--host-budget",
    "unbounded",
    "--lookahead",
    "1",
    "--json",
  )
  data = json.loads(out)
  assert code == 0
  assert data["units"] == 2 and data["unit_bytes"] == unit
  assert data["device_budget_bytes"] == 2**20 and data["host_budget_bytes"] is None
  assert data["fits"] == list(demo_mod.POLICY_NAMES)
  dense = data["plans"][2]
  assert dense["setting"] == "host_lookahead 1" and dense["lookahead_max"] == 2
  device = dense["tiers"][0]
  assert device["required_bytes"] == data["static_bytes"] + 2 * unit
  assert device["window_units"] == 2 and device["budget_bytes"] == 2**20


def test_plan_says_why_nothing_fits(store):
  code, out, _ = call("plan", store, "--device-budget", "1KiB", "--host-budget", "1KiB")
  assert code == 1
  last = out.rstrip().splitlines()[-1]
  assert last.startswith("nothing fits.")
  for name in demo_mod.POLICY_NAMES:
    assert f"{name}: device needs" in last


def test_plan_direct_disk_to_device(store):
  code, out, _ = call("plan", store, "--device-budget", "1MiB", "--host-budget", "0")
  assert code == 0
  assert "dense_disk_stream direct disk-to-device" in out
  assert "LayerwiseHost keeps every unit in host memory" in out  # host 0 cannot hold its units
  assert out.rstrip().splitlines()[-1] == (
    "fits: fully_resident, dense_disk_stream (direct disk-to-device)"
  )


# --- run ---------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fully_resident", "dense_disk_stream"])
def test_run_json(store, policy):
  extra = ["--host-budget", "1MiB", "--lookahead", "1"] if policy == "dense_disk_stream" else []
  code, out, _ = call("run", store, "--policy", policy, "--shape", "2,3", *extra, "--json")
  assert code == 0
  data = json.loads(out)
  assert data["policy"]["kind"] == policy
  assert data["input_shape"] == [2, 3] and data["output_shape"] == [2, 3, 64]
  report = data["report"]
  assert report["total"]["passes"] == 1 and report["prefill"]["passes"] == 1
  (p,) = report["passes"]
  assert p["phase"] == "prefill" and p["tokens"] == 3
  if policy == "dense_disk_stream":
    assert p["bytes_read"] == 2 * TINY_CONFIG.unit_bytes()
    assert report["policy"]["options"]["host_lookahead"] == 1
    assert p["backend"] is not None  # the CLI turns sampling on where the policy has the flags
  else:
    assert p["backend"] is None and p["process"] is None


def test_run_prints_the_report(store):
  code, out, _ = call(
    "run", store, "--policy", "layerwise_host", "--prefetch-depth", "2", "--shape", "1,1"
  )
  assert code == 0
  assert out.startswith(f"ran layerwise_host on {store}: token ids (1, 1) -> output (1, 1, 64)")
  assert "device window          2 units" in out
  assert "policy: layerwise_host" in out and "decode   1" in out
  assert "backend memory:" in out


@pytest.mark.parametrize(
  "extra, fragment",
  [
    (["--policy", "fully_resident", "--device-budget", "1GiB"], "does not apply"),
    (["--policy", "layerwise_host", "--lookahead", "2"], "does not apply"),
    (["--policy", "dense_disk_stream", "--device-budget", "1KiB"], "device_budget_bytes"),
    (["--policy", "dense_disk_stream", "--host-budget", "0", "--lookahead", "2"], "host_lookahead"),
    (["--policy", "fully_resident", "--shape", "1,2,3"], "(batch, tokens)"),
  ],
)
def test_run_errors_are_one_line(store, extra, fragment):
  code, _, err = call("run", store, "--shape", "1,2", *extra)
  assert_one_line_error(code, err, fragment)


def test_run_needs_a_recorded_model_or_a_factory(store, tmp_path, monkeypatch):
  bare = str(tmp_path / "bare")
  shutil.copytree(store, bare)
  os.remove(os.path.join(bare, records.MODEL_FILE))
  code, _, err = call("run", bare, "--policy", "fully_resident", "--shape", "1,2")
  assert_one_line_error(code, err, "has no recorded model", "convert", "--model")

  (tmp_path / "my_models.py").write_text(
    textwrap.dedent(
      f"""
      from flax import nnx
      from jax_residency.toy import ToyConfig, ToyTransformer

      def tiny():
        return ToyTransformer(ToyConfig(**{TINY_CONFIG.__dict__!r}), rngs=nnx.Rngs(0))
      """
    )
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  code, _, err = call(
    "run", bare, "--policy", "fully_resident", "--shape", "1,2", "--model", "my_models:tiny"
  )
  assert_one_line_error(code, err, "--vocab")
  code, _, err = call(
    "run",
    bare,
    "--policy",
    "fully_resident",
    "--shape",
    "1,2",
    "--model",
    "my_models:nope",
    "--vocab",
    "64",
  )
  assert_one_line_error(code, err, "nope")
  code, out, _ = call(
    "run",
    bare,
    "--policy",
    "dense_disk_stream",
    "--shape",
    "1,2",
    "--model",
    "my_models:tiny",
    "--vocab",
    "64",
    "--json",
  )
  assert code == 0 and json.loads(out)["output_shape"] == [1, 2, 64]


# --- the installed command ---------------------------------------------------


def test_python_dash_m_runs_the_command(store, zygote, tmp_path):
  done = run_script(
    [sys.executable, "-m", "jax_residency", "inspect", store],
    zygote,
    env=user_env(tmp_path),
    capture_output=True,
    text=True,
  )
  assert done.returncode == 0, done.stderr
  assert "streamable    yes" in done.stdout


def test_console_script_entry_point():
  scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
  if "jax-residency" not in scripts:
    pytest.skip("jax-residency is not installed")
  assert scripts["jax-residency"] == "jax_residency._src.cli.main:main"


def test_run_and_measure_take_the_model_a_converted_store_records(tmp_path, capfd):
  """A store written by ``convert`` records its model: ``run`` places and runs it, and
  ``measure`` builds it to time a step, with no --model; ``run`` takes resident units."""
  from pathlib import Path

  gguf = Path(__file__).parent / "fixtures" / "gguf_tiny_tied" / "model.gguf"
  store = str(tmp_path / "store")
  assert cli.main(["convert", "gguf", str(gguf), store]) == 0
  capfd.readouterr()
  assert cli.main(["run", store, "--policy", "dense_disk_stream", "--shape", "1,4"]) == 0
  out = capfd.readouterr().out
  assert "output" in out and "policy: dense_disk_stream" in out, out
  assert cli.main(["measure", store]) == 0
  assert "records no model" not in capfd.readouterr().out
  # `plan --auto`'s advice, as run takes it: units kept on the device beside a direct stream.
  kept = ["--host-budget", "0", "--device-resident-units", "1"]
  assert cli.main(["run", store, "--policy", "dense_disk_stream", *kept, "--shape", "1,4"]) == 0
  assert "1 units read at placement, never moved again" in capfd.readouterr().out
  assert cli.main(["run", store, "--policy", "fully_resident", *kept[2:], "--shape", "1,4"]) == 2
  assert "does not apply to --policy fully_resident" in capfd.readouterr().err
