"""An Orbax checkpoint streamed in place against the same weights rechunked.

Writes a seeded toy transformer's ``nnx.state`` with
``orbax.checkpoint.StandardCheckpointer`` (Orbax's default chunking: each stacked
layer parameter is one zstd chunk holding every layer), then measures, each in a
fresh process (its RSS before ``place`` is the baseline):

* ``orbax``: ``DenseDiskStream(host_budget_bytes=<2 units>, sample_process_memory=True)``
  placed from the Orbax checkpoint; 2 passes. Each unit read decodes a whole
  chunk, so ``metadata.bytes_read_per_byte_used`` is the layer count and the plan
  has a "chunk decode" item (2 x the largest chunk);
* ``rechunked``: ``jax-residency rechunk CKPT DST --units layers`` (timed, with the
  peak RSS of that process), then the same stream from DST;
* ``resident``: ``FullyResident`` from the Orbax checkpoint (each array read whole
  once): place + first pass.

For each: the second pass's time (pass 1 compiles), the unit bytes the passes used
against the bytes fetched from storage, and the process's peak RSS growth
(``VmHWM`` after the passes minus RSS before ``place``; ``VmHWM`` is reset just
before ``place``) against ``metadata.planned_process_bytes``, the most bytes the
placement says it holds in this process. The memory promise is growth <= plan: a
target per case (``benchmarks/_result.py``: a missed one exits 1, except under
--quick). Parity gates (exit 1 whenever one fails): every pass's outputs of each case
equal the plain model's (the save process runs it on the same tokens: eagerly, as the
streams' per-unit steps do; jitted for ``FullyResident`` off CPU), bit for bit on a
CPU backend (``PARITY_ATOL`` elsewhere), and the streams from the Orbax checkpoint
and from DST agree bit for bit.

Fetched bytes are given twice: as the placement's report says (TensorStore's kvstore
byte counters plus the library's own file reads) and from the layout (unit reads x the
stored bytes of the chunks each one fetches: every stacked array's whole compressed
chunk from the Orbax checkpoint, one uncompressed chunk per unit from DST), as
TensorStore's ``file_io_mode: memmap`` reads of values over ~64 KiB do not add to its
``bytes_read`` counter. The files were just written, so they are in the page cache:
pass times are decoding and copying, not disk reads.

The checkpoint and DST go to a temporary directory under --dir (removed at the
end unless --keep). Linux only (``/proc``).

--quick runs the three placements one after another in one process (two starts of
Python and JAX fewer; the later ones' figures include what the earlier left behind)
and leaves out the idle-import reading: its figures are informational, its parity
gates are not.

    python benchmarks/orbax_in_place.py            # 8 layers of ~64 MiB units
    python benchmarks/orbax_in_place.py --quick    # 4 layers of 3 MiB (~14 s on 2 cores)
    python benchmarks/orbax_in_place.py --json     # one JSON object
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import _child
import _result
import _zygote
from _measure import (
  MiB,
  files_under,
  peak_rss_bytes,
  reset_peak_rss,
  rss_bytes,
  toy_model,
  toy_tokens,
)

#: The Orbax checkpoint's and the rechunked store's names under the run's directory.
CKPT, DST = "orbax_state", "rechunked"
#: The placements measured, in order: streamed from the checkpoint, from DST, resident.
CASES = ("orbax", "rechunked", "resident")
#: Parity gate off a CPU backend: largest |placed - plain| allowed (on CPU: 0, bit for bit).
PARITY_ATOL = 1e-5


def config(args: argparse.Namespace):
  from jax_residency.toy import ToyConfig

  return ToyConfig(
    vocab=512,
    d_model=args.d_model,
    n_heads=args.heads,
    d_ff=args.d_ff or 4 * args.d_model,
    n_layers=args.layers,
  )


def child_save(args: argparse.Namespace) -> dict:
  """Builds the model once (its arrays are the only copy), writes its outputs on the
  tokens (the parity reference) under ``args.out`` and saves its state with Orbax."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from flax import nnx

  from jax_residency.toy import ToyTransformer

  # Initialised jitted: one compile, not one per initialiser (seconds at --quick's size).
  model = nnx.jit(lambda: ToyTransformer(config(args), rngs=nnx.Rngs(0)))()
  # The plain model's outputs, the parity reference: eager (what a dense stream's per-unit
  # steps and, on CPU, FullyResident's run) and, off CPU, jitted (FullyResident's there).
  x = toy_tokens(args.tokens)
  np.save(plain_path(args.out, jit=False), np.asarray(model(x)))
  if jax.default_backend() != "cpu":
    np.save(plain_path(args.out, jit=True), np.asarray(nnx.jit(lambda m, t: m(t))(model, x)))
  state = nnx.state(model)
  start = time.perf_counter()
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(args.store, state)
  seconds = time.perf_counter() - start
  del state, model
  return {
    "backend": jax.default_backend(),
    "unit_bytes": config(args).unit_bytes(),
    "save_s": seconds,
    "checkpoint_bytes": sum(map(os.path.getsize, files_under(args.store))),
    "unit_chunk_stored_bytes": unit_chunk_stored_bytes(args.store),
  }


def unit_chunk_stored_bytes(path: str) -> int | None:
  """Stored (compressed) bytes of the chunks of the stacked ``layers.*`` arrays in an
  Orbax OCDBT checkpoint (None if it is not one): what one unit read fetches, as each
  chunk holds every unit of its array."""
  import tensorstore as ts

  try:
    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{os.path.abspath(path)}/"}).result()
    keys = [k for k in kv.list().result() if k.startswith(b"layers.") and b"/." not in k]
    return sum(len(kv.read(k).result().value) for k in keys)
  except ValueError:
    return None


def plain_path(work: str, *, jit: bool) -> str:
  """Where the save process writes the plain model's outputs (eager or jitted)."""
  return os.path.join(work, f"plain-{'jit' if jit else 'eager'}.npy")


def child_place(args: argparse.Namespace) -> dict:
  """One case in this process: ``args.child``'s placement from ``args.store``."""
  return place_case(args, args.child, args.store, args.out)


def child_places(args: argparse.Namespace) -> dict:
  """--quick: every case in this one process, one after another (``args.store``: the
  Orbax checkpoint, ``args.dst``: the rechunked store, outputs under ``args.out``)."""
  stores = {"orbax": args.store, "rechunked": args.dst, "resident": args.store}
  return {c: place_case(args, c, stores[c], case_out(args.out, c)) for c in CASES}


def case_out(work: str, case: str) -> str:
  """Where a case's outputs (both passes, stacked) go."""
  return os.path.join(work, f"out-{case}.npy")


def place_case(args: argparse.Namespace, which: str, store: str, out: str) -> dict:
  """One measurement: place from ``store`` with case ``which``'s policy, 2 passes; the
  outputs go to ``out``."""
  import warnings

  import jax
  import numpy as np

  import jax_residency as jr

  x = toy_tokens(args.tokens)
  abstract = toy_model(config(args), abstract=True)
  unit = config(args).unit_bytes()
  if which == "resident":
    policy = jr.FullyResident()  # no sampling fields: VmHWM only
  else:
    policy = jr.DenseDiskStream(
      host_budget_bytes=args.host_units * unit, sample_process_memory=True
    )
  jax.numpy.zeros(()).block_until_ready()  # backend initialised
  baseline = rss_bytes()
  reset_peak_rss()
  outputs, seconds = [], []
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    with jr.place(abstract, policy, store=store) as placed:
      place_s = time.perf_counter() - start
      placed_rss, placed_peak = rss_bytes() - baseline, peak_rss_bytes() - baseline
      for _ in range(2):
        start = time.perf_counter()
        outputs.append(np.asarray(jax.block_until_ready(placed(x))))
        seconds.append(time.perf_counter() - start)
      peak = peak_rss_bytes()
      meta, report = placed.metadata, placed.report()
  np.save(out, np.stack(outputs))
  return {
    "policy": policy.name,
    "baseline_rss_bytes": baseline,
    "peak_rss_growth_bytes": peak - baseline,
    "place_rss_growth_bytes": placed_rss,  # when place returned
    "place_peak_rss_growth_bytes": placed_peak,
    "pass_peak_rss_growth_bytes": [
      None if p.process is None else p.process["peak_rss_bytes"] - baseline for p in report.passes
    ],
    "planned_process_bytes": meta.planned_process_bytes,
    "memory": [(m.name, m.nbytes, m.counted_in) for m in meta.memory],
    "memory_table": meta.memory_table(),
    "chunk_decode_bytes": meta.item_bytes("chunk decode"),
    "bytes_read_per_byte_used": meta.bytes_read_per_byte_used,
    "place_s": place_s,
    "pass_s": seconds,
    "used_bytes": report.total.bytes_read,
    "fetched_bytes": report.total.fetched_bytes,
    "fetched_since_place_bytes": report.fetched_bytes,
    "pass_used_bytes": [p.bytes_read for p in report.passes],
    "pass_fetched_bytes": [p.fetched_bytes for p in report.passes],
    "step_temp_bytes": report.total.step_temp_bytes,
    "warnings": [str(w.message) for w in caught if "rechunk" in str(w.message)],
  }


def child_rechunk(args: argparse.Namespace) -> dict:
  """Runs ``jax-residency rechunk`` as this process's only child: its peak RSS is
  ``RUSAGE_CHILDREN``'s ``ru_maxrss``."""
  import resource

  cmd = [
    sys.executable,
    "-m",
    "jax_residency",
    "rechunk",
    args.store,
    args.dst,
    "--units",
    "layers",
  ]
  start = time.perf_counter()
  done = _zygote.run(cmd, capture_output=True, text=True, check=False)
  seconds = time.perf_counter() - start
  if done.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")
  return {
    "rechunk_s": seconds,
    "rechunk_peak_rss_bytes": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    "rechunk_says": done.stdout.strip(),
    "store_bytes": sum(map(os.path.getsize, files_under(args.dst))),
  }


def child_idle(args: argparse.Namespace) -> dict:
  """The RSS of a process that imported what ``jax-residency rechunk`` imports, for context."""
  import jax_residency._src.cli.main  # noqa: F401
  import jax_residency._src.store.writer  # noqa: F401

  return {"import_rss_bytes": rss_bytes()}


CHILDREN = {
  "save": child_save,
  "orbax": child_place,
  "rechunked": child_place,
  "resident": child_place,
  "places": child_places,
  "rechunk": child_rechunk,
  "idle": child_idle,
}


def run_child(args: argparse.Namespace, which: str, store: str, **extra: str) -> dict:
  argv = ["--child", which, "--store", store]
  argv += _child.flags(args, ("layers", "d_model", "heads", "d_ff", "tokens", "host_units"))
  argv += [a for k, v in extra.items() for a in (f"--{k}", v)]
  return _child.run(os.path.abspath(__file__), *argv, what=f"child {which!r}")


def mib(n: float) -> str:
  return f"{n / MiB:,.0f} MiB"


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the run's files go")
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=1184, help="default: units of ~64 MiB")
  parser.add_argument("--d-ff", type=int, default=0, help="default: 4 x d-model")
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--tokens", type=int, default=16)
  parser.add_argument("--host-units", type=int, default=2, help="host budget, in units")
  parser.add_argument("--keep", action="store_true", help="keep the checkpoint and DST")
  _result.add_args(parser)
  parser.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
  parser.add_argument("--store", help=argparse.SUPPRESS)
  parser.add_argument("--dst", help=argparse.SUPPRESS)
  parser.add_argument("--out", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    return _child.answer(CHILDREN[args.child](args))
  if args.quick:
    args.layers, args.d_model, args.heads = 4, 256, 8
  args.d_ff = args.d_ff or 4 * args.d_model

  r = _result.stamp("orbax_in_place", argv, args.quick)
  work = tempfile.mkdtemp(prefix="jax_residency_orbax_bench-", dir=args.dir)
  ckpt, dst = os.path.join(work, CKPT), os.path.join(work, DST)
  say = (lambda *a, **k: None) if args.json else (lambda *a, **k: print(*a, **k, flush=True))
  try:
    r.update(layers=args.layers, tokens=args.tokens, host_units=args.host_units)
    r["save"] = run_child(args, "save", ckpt, out=work)
    r["unit_bytes"] = unit = r["save"]["unit_bytes"]
    say(
      f"model: {args.layers} layers x {mib(unit)} units (d_model {args.d_model}, "
      f"d_ff {args.d_ff}), host budget {args.host_units} units; files under {work}"
    )
    say(f"orbax save: {r['save']['save_s']:.1f} s, {mib(r['save']['checkpoint_bytes'])}")
    if args.quick:  # the checkpoint read in place, rechunked, then every case in one process
      r["rechunk"] = run_child(args, "rechunk", ckpt, dst=dst)
      r.update(run_child(args, "places", ckpt, dst=dst, out=work))
    else:
      r["orbax"] = run_child(args, "orbax", ckpt, out=case_out(work, "orbax"))
      say(f"orbax stream: pass 2 {r['orbax']['pass_s'][1]:.2f} s")
      r["rechunk"] = run_child(args, "rechunk", ckpt, dst=dst)
      r["rechunk"].update(run_child(args, "idle", ckpt))
      say(f"rechunk: {r['rechunk']['rechunk_s']:.1f} s")
      r["rechunked"] = run_child(args, "rechunked", dst, out=case_out(work, "rechunked"))
      say(f"rechunked stream: pass 2 {r['rechunked']['pass_s'][1]:.2f} s")
      r["resident"] = run_child(args, "resident", ckpt, out=case_out(work, "resident"))

    import numpy as np

    got = {c: np.load(case_out(work, c)) for c in CASES}
    eager = np.load(plain_path(work, jit=False))
    jitted = r["save"]["backend"] != "cpu"
    plain = {c: eager for c in CASES}
    if jitted:  # FullyResident runs the jitted program off CPU
      plain["resident"] = np.load(plain_path(work, jit=True))
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)

  atol = PARITY_ATOL if jitted else 0.0
  checks = r["checks"] = []
  for c in CASES:
    diff = r[c]["plain_max_abs_diff"] = float(np.max(np.abs(got[c] - plain[c])))
    reference = "jitted" if c == "resident" and jitted else "eager"
    _result.check(
      checks,
      f"{c}: both passes' outputs == the plain model's ({reference}), max |diff| <= {atol:g}",
      diff <= atol,
      diff,
      _result.PARITY,
    )
  r["bit_identical"] = bool(np.array_equal(got["orbax"], got["rechunked"]))
  r["resident_max_abs_diff"] = float(np.max(np.abs(got["resident"] - got["orbax"])))
  _result.check(
    checks,
    "orbax stream == rechunked stream bit for bit (2 passes)",
    r["bit_identical"],
    r["bit_identical"],
    _result.PARITY,
  )

  stored = r["save"]["unit_chunk_stored_bytes"]
  for name in CASES:
    c = r[name]
    c["within_plan"] = c["peak_rss_growth_bytes"] <= c["planned_process_bytes"]
    used = c["used_bytes"]
    c["fetched_per_used"] = c["fetched_bytes"] / used if used else None
    # What the unit reads fetch by the stores' layouts: from the Orbax checkpoint every
    # stacked array's whole chunk per unit read; from DST one uncompressed chunk per unit.
    if name == "orbax" and stored is not None:
      c["layout_fetched_bytes"] = used // unit * stored
    else:
      c["layout_fetched_bytes"] = used if name == "rechunked" else None
    c["layout_fetched_per_used"] = c["layout_fetched_bytes"] / used if used and stored else None
    # --quick's plans are a few MiB, below what the plan leaves out (XLA's compile, ~20 MiB).
    _result.check(
      checks,
      f"{name}: peak RSS growth <= planned process bytes (MiB)",
      c["within_plan"],
      [round(c["peak_rss_growth_bytes"] / MiB, 1), round(c["planned_process_bytes"] / MiB, 1)],
    )
  r["orbax_over_rechunked_pass"] = r["orbax"]["pass_s"][1] / r["rechunked"]["pass_s"][1]
  r["memory_promise_held"] = all(r[n]["within_plan"] for n in CASES)
  return _result.finish(r, args, render)


def markdown(r: dict) -> str:
  """The three cases as the Markdown table ``benchmarks/report.py`` renders."""
  cases = (
    ("`DenseDiskStream`, in place", r["orbax"]),
    ("`DenseDiskStream`, after `rechunk`", r["rechunked"]),
    ("`FullyResident` (reads each array once)", r["resident"]),
  )
  out = [
    "| from the Orbax checkpoint | pass (after the compiling one) | fetched / used "
    "| peak RSS growth / plan |",
    "|---|---|---|---|",
  ]
  for name, c in cases:
    fetched = "-" if c["fetched_per_used"] is None else f"{c['fetched_per_used']:.2f}"
    out.append(
      f"| {name} | {c['pass_s'][1]:.2f} s | {fetched} "
      f"| {mib(c['peak_rss_growth_bytes'])} / {mib(c['planned_process_bytes'])} |"
    )
  return "\n".join(out)


def render(r: dict) -> str:
  """The plan of the Orbax stream, a table of the cases, and the rechunk's figures."""

  def ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"

  def size(x: int | None) -> str:
    return "-" if x is None else mib(x)

  o, d = r["orbax"], r["rechunked"]
  out = ["", "plan of the Orbax stream (metadata.memory_table()):"]
  out += ["  " + o["memory_table"].replace("\n", "\n  "), ""]
  if o["warnings"]:
    out += [f"warning on place: {o['warnings'][0]}", ""]
  head = ("", "orbax in place", "rechunked", "resident (orbax)")
  cases = (o, d, r["resident"])
  rows = [
    ("place s", *(f"{c['place_s']:.2f}" for c in cases)),
    ("pass 1 s (compiles)", *(f"{c['pass_s'][0]:.2f}" for c in cases)),
    ("pass 2 s", *(f"{c['pass_s'][1]:.2f}" for c in cases)),
    ("place + pass 1 s", *(f"{c['place_s'] + c['pass_s'][0]:.2f}" for c in cases)),
    ("bytes_read_per_byte_used", *(f"{c['bytes_read_per_byte_used']:.1f}" for c in cases)),
    ("chunk decode item", *(mib(c["chunk_decode_bytes"]) for c in cases)),
    ("used, 2 passes", *(mib(c["used_bytes"]) for c in cases)),
    ("fetched, 2 passes (report)", *(mib(c["fetched_bytes"]) for c in cases)),
    ("  / used", *(ratio(c["fetched_per_used"]) for c in cases)),
    ("fetched since place (report)", *(mib(c["fetched_since_place_bytes"]) for c in cases)),
    ("fetched, 2 passes (layout)", *(size(c["layout_fetched_bytes"]) for c in cases)),
    ("  / used", *(ratio(c["layout_fetched_per_used"]) for c in cases)),
    ("planned process bytes", *(mib(c["planned_process_bytes"]) for c in cases)),
    ("RSS growth, place returned", *(mib(c["place_rss_growth_bytes"]) for c in cases)),
    ("  peak so far (VmHWM)", *(mib(c["place_peak_rss_growth_bytes"]) for c in cases)),
    ("peak RSS growth (VmHWM)", *(mib(c["peak_rss_growth_bytes"]) for c in cases)),
    (
      "  growth - plan",
      *(
        f"{(c['peak_rss_growth_bytes'] - c['planned_process_bytes']) / MiB:+,.0f} MiB"
        for c in cases
      ),
    ),
    *(
      (
        f"sampled peak growth, pass {k + 1}",
        *(size(c["pass_peak_rss_growth_bytes"][k]) for c in cases),
      )
      for k in range(2)
    ),
    ("memory promise", *("met" if c["within_plan"] else "MISSED" for c in cases)),
  ]
  widths = [max(len(row[k]) for row in (head, *rows)) for k in range(4)]
  for row in (head, *rows):
    cells = (f"{v:>{w}}" for v, w in zip(row[1:], widths[1:], strict=True))
    out.append(f"{row[0]:<{widths[0]}}  " + "  ".join(cells))
  out.append(
    "(report: TensorStore's kvstore byte counters plus the library's own reads; layout: unit "
    "reads x the bytes of the chunks each fetches)"
  )
  rc, sv = r["rechunk"], r["save"]
  imports = rc.get("import_rss_bytes")
  out += [
    "",
    f"orbax save              {sv['save_s']:.1f} s  ({mib(sv['checkpoint_bytes'])})",
    f"rechunk                 {rc['rechunk_s']:.1f} s  ({mib(rc['store_bytes'])} written), "
    f"peak RSS {mib(rc['rechunk_peak_rss_bytes'])}"
    + ("" if imports is None else f" (RSS after its imports alone: {mib(imports)})"),
    f"orbax / rechunked pass  {r['orbax_over_rechunked_pass']:.2f}x  (pass 2)",
    f"fetched / used          orbax {ratio(o['fetched_per_used'])} (report), "
    f"{ratio(o['layout_fetched_per_used'])} (layout); rechunked "
    f"{ratio(d['fetched_per_used'])} (report), {ratio(d['layout_fetched_per_used'])} (layout)",
    "outputs                 every case vs the plain model, max |diff|: "
    + ", ".join(f"{c} {r[c]['plain_max_abs_diff']:.3g}" for c in CASES),
  ]
  if r["quick"]:
    out.append(
      "(--quick: the three cases ran in one process, and the memory verdicts are "
      "informational; its plans are smaller than XLA's compile)"
    )
  return "\n".join(out)


if __name__ == "__main__":
  sys.exit(main())
