"""How far int8 and int4 stores move a Llama-family model's logits and greedy tokens.

For each tiny Hugging Face checkpoint in ``tests/fixtures`` (``llama_tiny_tied``,
``llama_tiny_untied``, ``mistral_tiny``, ``qwen2_tiny``: random weights, 3
layers, hidden size 32), converts it with ``models.convert_hf`` into a float
store, an ``int8`` store and an ``int4`` store, places each with
``jr.FullyResident()``, runs the fixture's prompt (``reference.json``'s
``input_ids`` and ``attention_mask``, 2 rows of 12) and generates
``GENERATED_TOKENS`` greedy tokens (argmax, no stop token) with
``models.generate_llm``. Per fixture and scheme it reports, against the float
store:

* ``max_rel_logit_error`` = max |q - f| / max |f| and ``mean_rel_logit_error``
  = mean |q - f| / mean |f|, over the prompt's real (unpadded) positions and
  every vocabulary entry (f: the float store's logits, q: the quantized one's);
* ``token_agreement``: the fraction of the generated tokens (both rows) equal
  to the float store's at the same position, and ``first_difference``: the
  first position (0-based) where some row differs (None: none does). After a
  difference the rows continue from different tokens;
* bytes at rest: the quantized tensors as floats and as stored
  (``StoreInfo.quantization.float_nbytes`` / ``stored_nbytes``), and each
  whole store (static + units);
* two controls that separate the method from the model: ``weight_rel_rms_error``
  = ||w_q - w|| / ||w|| over every quantized tensor (the store's own encoding,
  `Encoding.encode` then `decode`), and ``noise_max_rel_logit_error``: the
  max relative logit error of the float model with seeded Gaussian noise of the
  same RMS as each tensor's quantization error added to it instead (the mean
  over `NOISE_DRAWS` draws). When the two logit errors are alike, the logit
  error is how far this model moves for any perturbation of that size, not
  something particular to the rounding. Per fixture, the float model's top-2
  logit gap at its greedy picks says how small an error flips a token.

int4 uses the largest group size of 32/64/128 that divides the input dimension
of every tensor the scheme quantizes (the fixtures' hidden size is 32). When
none does (``mistral_tiny``: its ``o_proj`` takes 4 heads x 12 = 48 inputs),
the fixture's int4 row holds the library's ``QuantizationError`` instead of
figures.

Checks (``benchmarks/_result.py``; all are parity gates, so the script exits 1 if
one fails, --quick or not): the float store's logits are within
1e-5 of transformers' (``reference.json``); for every quantized store,
``DenseDiskStream(host_budget_bytes=0)``'s prompt logits are within 1e-5 of
``FullyResident``'s, and ``FullyResident``'s within 1e-5 of the plain model
holding the decoded weights; each scheme's mean relative logit error is at most
1.5x the noise control's (the rounding adds no error beyond what its size
explains); int8's max and mean relative errors are below int4's on every
fixture int4 can encode. (An absolute limit does not fit these fixtures: their
largest logits are 1.4-2.0 and their greedy picks are near ties, so any weight
change of int8's size moves them by 0.05-0.1.) docs/quantization.md
("Quantization error") says which held when its table was measured.

The fixtures are tiny random-weight models, not trained ones: the figures
describe the method on these shapes, not the quality of a trained model
quantized the same way. Prints a markdown table and the checks; ``--json`` prints
the result as one JSON object. On 2 CPU cores it takes about 10 s with the library's
compilation cache filled, and about 30 s without
(``JAX_RESIDENCY_COMPILATION_CACHE=0``). ``--quick`` measures ``QUICK_FIXTURE`` alone
with ``QUICK_NOISE_DRAWS`` noise draws and ``QUICK_GENERATED_TOKENS`` tokens: the
same code paths and checks.

  python benchmarks/quant_error.py [--fixtures qwen2_tiny ...] [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _result
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import jax_residency as jr
from jax_residency import models
from jax_residency.errors import QuantizationError

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
NAMES = ("llama_tiny_tied", "llama_tiny_untied", "mistral_tiny", "qwen2_tiny")
SCHEMES = ("int8", "int4")
GENERATED_TOKENS = 16
#: int4 group sizes the library offers, largest first.
GROUP_SIZES = (128, 64, 32)
#: Gate: each scheme's mean relative logit error at most this many times the noise
#: control's (Gaussian noise of the same RMS per tensor): rounding to codes adds no
#: error beyond what its size explains.
NOISE_RATIO_LIMIT = 1.5
#: Gate: |float store - transformers|, |DenseDiskStream - FullyResident| and
#: |quantized store - plain model with the decoded weights|, on the prompt's logits.
PARITY_ATOL = 1e-5
#: Draws of Gaussian noise the control averages over (seeds 0, 1, ...).
NOISE_DRAWS = 4
#: --quick: this fixture alone, with fewer noise draws and generated tokens.
QUICK_FIXTURE, QUICK_NOISE_DRAWS, QUICK_GENERATED_TOKENS = "llama_tiny_tied", 2, 8
#: Every field of a row of the JSON (a scheme int4 cannot encode has ``error`` and
#: ``None`` figures).
ROW_FIELDS = (
  "fixture",
  "scheme",
  "group_size",
  "error",
  "max_rel_logit_error",
  "mean_rel_logit_error",
  "max_abs_logit_error",
  "token_agreement",
  "first_difference",
  "weight_rel_rms_error",
  "noise_max_rel_logit_error",
  "noise_mean_rel_logit_error",
  "quantized_float_nbytes",
  "quantized_stored_nbytes",
  "store_float_nbytes",
  "store_nbytes",
  "dense_vs_resident_max_abs",
  "store_vs_decoded_max_abs",
)


def input_dims(info: jr.StoreInfo) -> list[int]:
  """The input dimensions (the quantized axis) of every tensor a store holds quantized."""
  plan = info.quantization
  assert plan is not None
  return sorted({t.shape[t.encoding.axis] for t in plan.tensors})


def pick_group_size(dims: list[int]) -> int | None:
  """The largest of `GROUP_SIZES` dividing every dimension in ``dims`` (None: none does)."""
  return next((g for g in GROUP_SIZES if all(d % g == 0 for d in dims)), None)


def store_nbytes(info: jr.StoreInfo) -> int:
  return info.static_nbytes + info.total_unit_bytes


def generate(store: str, cfg: Any, ids: Any, mask: Any, n: int) -> dict:
  """A store placed with ``FullyResident``: the prompt's logits (the prefill), ``n``
  greedy tokens, and the logits each token was picked from."""
  model = models.load(store)  # abstract: the weights are the store's
  seen: list[Any] = []
  with jr.place(model, jr.FullyResident(), store=store) as placed:

    def forward(*args: Any) -> Any:
      logits, cache = placed(*args)
      seen.append(logits)  # first the prefill (the whole prompt), then one per step
      return logits, cache

    tokens = models.generate_llm(forward, ids, n, config=cfg, attention_mask=mask, stop_tokens=())
  picked = np.stack([np.asarray(x[:, -1]) for x in seen], axis=1)  # (rows, tokens, vocab)
  return {"logits": np.asarray(seen[0]), "tokens": np.asarray(tokens), "picked": picked}


def top2_gaps(picked: np.ndarray) -> np.ndarray:
  """Largest minus second largest logit of each greedy pick."""
  top = np.sort(picked, axis=-1)
  return (top[..., -1] - top[..., -2]).ravel()


def dense_logits(store: str, ids: Any, mask: Any) -> np.ndarray:
  """The prompt's logits of a store streamed with no host cache."""
  with jr.place(models.load(store), jr.DenseDiskStream(host_budget_bytes=0), store=store) as p:
    return np.asarray(p(ids, mask))


class Plain:
  """The checkpoint's plain model in memory, run jitted on the prompt with any weights."""

  def __init__(self, src: Path, ids: Any, mask: Any) -> None:
    graphdef, state = nnx.split(models.load_llama(src))
    self.flat = {tuple(str(k) for k in path): v for path, v in nnx.to_flat_state(state)}
    self._paths = [path for path, _ in nnx.to_flat_state(state)]
    self._run = jax.jit(lambda st: nnx.merge(graphdef, st)(ids, mask))

  def weights(self, path: tuple[str, ...]) -> np.ndarray:
    return np.asarray(self.flat[path][...])

  def logits(self, replaced: dict[tuple[str, ...], np.ndarray]) -> np.ndarray:
    """The prompt's logits with the tensors in ``replaced`` swapped for the given values."""
    flat = [
      (path, v.replace(jnp.asarray(replaced[key])) if key in replaced else v)
      for path, (key, v) in zip(self._paths, self.flat.items(), strict=True)
    ]
    return np.asarray(self._run(nnx.from_flat_state(flat)))


def relative(q: np.ndarray, f: np.ndarray) -> tuple[float, float]:
  """``(max |q - f| / max |f|, mean |q - f| / mean |f|)``."""
  diff = np.abs(q - f)
  return float(diff.max() / np.abs(f).max()), float(diff.mean() / np.abs(f).mean())


def controls(plain: Plain, plan: Any, flt: np.ndarray, real: np.ndarray, draws: int) -> dict:
  """The plain model with the store's decoded weights (its prompt logits), the weights'
  relative RMS error, and the logit error of Gaussian noise of the same RMS per tensor
  (the mean over ``draws`` draws)."""
  decoded, rms = {}, {}
  err2 = norm2 = 0.0
  for t in plan.tensors:
    w = plain.weights(t.path)
    decoded[t.path] = np.asarray(t.encoding.decode(t.encoding.encode(w, "/".join(t.path))))
    rms[t.path] = float(np.sqrt(np.mean(np.square(decoded[t.path] - w))))
    err2 += float(np.sum(np.square(decoded[t.path] - w)))
    norm2 += float(np.sum(np.square(w)))
  noise = []
  for seed in range(draws):
    rng = np.random.default_rng(seed)
    noisy = {}
    for path, r in rms.items():
      w = plain.weights(path)
      noisy[path] = w + r * rng.standard_normal(w.shape).astype(w.dtype)
    noise.append(relative(plain.logits(noisy)[real], flt[real]))
  return {
    "decoded_logits": plain.logits(decoded),
    "weight_rel_rms_error": (err2 / norm2) ** 0.5,
    "noise_max_rel_logit_error": float(np.mean([n[0] for n in noise])),
    "noise_mean_rel_logit_error": float(np.mean([n[1] for n in noise])),
  }


def compare(quant: dict, flt: dict, real: np.ndarray) -> dict:
  """The figures of a quantized run against the float one (``real``: unpadded positions)."""
  q, f = quant["logits"][real], flt["logits"][real]
  equal = quant["tokens"] == flt["tokens"]  # (rows, generated tokens)
  differs = np.flatnonzero(~equal.all(axis=0))
  max_rel, mean_rel = relative(q, f)
  return {
    "max_rel_logit_error": max_rel,
    "mean_rel_logit_error": mean_rel,
    "max_abs_logit_error": float(np.abs(q - f).max()),
    "token_agreement": float(equal.mean()),
    "first_difference": int(differs[0]) if differs.size else None,
  }


def measure_fixture(name: str, tmp: Path, tokens: int, draws: int) -> dict:
  """Every scheme's row for fixture ``name`` (``tokens`` generated, ``draws`` noise
  draws), and the fixture's own figures."""
  src = FIXTURES / name
  ref = json.loads((src / "reference.json").read_text())
  ids = jnp.asarray(ref["input_ids"], jnp.int32)
  mask = jnp.asarray(ref["attention_mask"], jnp.int32)
  real = np.asarray(mask) == 1  # a padded query's logits are arbitrary
  cfg = models.read_llama_config(src)
  plain = Plain(src, ids, mask)

  float_store = str(tmp / f"{name}-float")
  float_info = models.convert_hf(src, float_store, progress=False)
  flt = generate(float_store, cfg, ids, mask, tokens)
  want = np.asarray(ref["logits"], np.float32).reshape(flt["logits"].shape)
  fixture: dict[str, Any] = {
    "fixture": name,
    "float_vs_reference_max_abs": float(np.abs(flt["logits"] - want)[real].max()),
    "max_abs_logit": float(np.abs(flt["logits"][real]).max()),
    # How close the float model's greedy choices are: a logit error this large flips one.
    "float_top2_gap_min": float(top2_gaps(flt["picked"]).min()),
    "float_top2_gap_median": float(np.median(top2_gaps(flt["picked"]))),
  }

  rows = []
  dims: list[int] = []
  for scheme in SCHEMES:
    row: dict[str, Any] = dict.fromkeys(ROW_FIELDS)
    row.update(fixture=name, scheme=scheme, store_float_nbytes=store_nbytes(float_info))
    quantize: Any = scheme
    if scheme == "int4":
      row["group_size"] = pick_group_size(dims)
      # With no group size that fits, ask for the smallest: the library names the tensors.
      quantize = {"scheme": "int4", "group_size": row["group_size"] or GROUP_SIZES[-1]}
    store = str(tmp / f"{name}-{scheme}")
    try:
      info = models.convert_hf(src, store, quantize=quantize, progress=False)
    except QuantizationError as e:
      row["error"] = f"{type(e).__name__}: {e}"
      rows.append(row)
      continue
    plan = info.quantization
    assert plan is not None
    if scheme == "int8":
      dims = input_dims(info)  # int4 quantizes the same tensors
    quant = generate(store, cfg, ids, mask, tokens)
    row.update(compare(quant, flt, real))
    control = controls(plain, plan, flt["logits"], real, draws)
    decoded = control.pop("decoded_logits")
    row.update(
      control,
      quantized_float_nbytes=plan.float_nbytes,
      quantized_stored_nbytes=plan.stored_nbytes,
      store_nbytes=store_nbytes(info),
      dense_vs_resident_max_abs=float(
        np.abs(dense_logits(store, ids, mask) - quant["logits"])[real].max()
      ),
      store_vs_decoded_max_abs=float(np.abs(decoded - quant["logits"])[real].max()),
    )
    rows.append(row)
  fixture["input_dims"] = dims
  fixture["int4_group_size"] = pick_group_size(dims)
  return {"fixture": fixture, "rows": rows}


def gates(fixtures: list[dict], rows: list[dict]) -> list[dict]:
  """Each check (``_result.check``: its name, kind, whether it held, the values it looked
  at). All are parity gates: the parity of the stores with transformers, with each other
  and with the decoded weights, and the properties of the quantization (its error
  within the noise control's, int8 below int4) gate correctness, not speed."""
  out: list[dict] = []

  def check(name: str, ok: bool, value: Any) -> None:
    _result.check(out, name, ok, value, _result.PARITY)

  for fx in fixtures:
    name = fx["fixture"]
    value = fx["float_vs_reference_max_abs"]
    check(
      f"{name}: float store vs transformers' logits <= {PARITY_ATOL:g}", value <= PARITY_ATOL, value
    )
    ran = [r for r in rows if r["fixture"] == name and r["error"] is None]
    dense = [r["dense_vs_resident_max_abs"] for r in ran]
    check(
      f"{name}: DenseDiskStream(host 0) vs FullyResident logits <= {PARITY_ATOL:g}, "
      "every quantized store",
      max(dense, default=0.0) <= PARITY_ATOL,
      dense,
    )
    decoded = [r["store_vs_decoded_max_abs"] for r in ran]
    check(
      f"{name}: quantized store vs plain model with decoded weights <= {PARITY_ATOL:g}",
      max(decoded, default=0.0) <= PARITY_ATOL,
      decoded,
    )
    by = {r["scheme"]: r for r in ran}
    for scheme, r in by.items():
      pair = [r["mean_rel_logit_error"], r["noise_mean_rel_logit_error"]]
      check(
        f"{name}: {scheme} mean relative logit error <= {NOISE_RATIO_LIMIT:g}x the noise control's",
        pair[0] <= NOISE_RATIO_LIMIT * pair[1],
        pair,
      )
    if "int8" in by and "int4" in by:
      for what in ("max", "mean"):
        key = f"{what}_rel_logit_error"
        pair = [by["int8"][key], by["int4"][key]]
        check(f"{name}: int8 {what} relative logit error < int4's", pair[0] < pair[1], pair)
  return out


def measure(names: list[str], tokens: int = GENERATED_TOKENS, draws: int = NOISE_DRAWS) -> dict:
  """Every figure and check of fixtures ``names`` (``tokens`` generated, ``draws`` noise
  draws), as ``--json`` prints them after the stamp."""
  start = time.perf_counter()
  with tempfile.TemporaryDirectory() as tmp:
    measured = [measure_fixture(name, Path(tmp), tokens, draws) for name in names]
  fixtures = [m["fixture"] for m in measured]
  rows = [r for m in measured for r in m["rows"]]
  checks = gates(fixtures, rows)
  return {
    "generated_tokens": tokens,
    "noise_draws": draws,
    "definitions": {
      "max_rel_logit_error": "max |q - f| / max |f| over the prompt's real positions",
      "mean_rel_logit_error": "mean |q - f| / mean |f| over the same",
      "token_agreement": f"fraction of the {tokens} greedy tokens of every row "
      "equal to the float store's",
      "first_difference": "first position (0-based) where some row's token differs",
      "weight_rel_rms_error": "||w_q - w|| / ||w|| over every quantized tensor",
      "noise_max_rel_logit_error": "max relative logit error with Gaussian noise of each "
      f"tensor's quantization error RMS instead of the quantization (mean of {draws})",
      "float_top2_gap": "largest minus second largest logit of the float store's greedy picks",
    },
    "fixtures": fixtures,
    "rows": rows,
    "checks": checks,
    "seconds": time.perf_counter() - start,
  }


def kib(n: int) -> str:
  return f"{n / 1024:.1f}"


def table(result: dict) -> str:
  lines = [
    "| fixture | scheme | max relative logit error | mean relative logit error "
    f"| tokens agreeing ({result['generated_tokens']} per row) | first difference "
    "| weight RMS error | noise control: max / mean | quantized tensors KiB: float → stored "
    "| store KiB: float → quantized |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in result["rows"]:
    if r["error"] is not None:
      reason = r["error"].split("\n", 1)[-1].strip().split(";")[0]
      lines.append(f"| {r['fixture']} | int4 | not encodable: {reason} | | | | | | | |")
      continue
    scheme = r["scheme"] + (f", groups of {r['group_size']}" if r["group_size"] else "")
    first = "none" if r["first_difference"] is None else str(r["first_difference"])
    lines.append(
      f"| {r['fixture']} | {scheme} | {r['max_rel_logit_error']:.3f} "
      f"| {r['mean_rel_logit_error']:.3f} | {r['token_agreement']:.2f} | {first} "
      f"| {r['weight_rel_rms_error']:.4f} "
      f"| {r['noise_max_rel_logit_error']:.3f} / {r['noise_mean_rel_logit_error']:.3f} "
      f"| {kib(r['quantized_float_nbytes'])} → {kib(r['quantized_stored_nbytes'])} "
      f"| {kib(r['store_float_nbytes'])} → {kib(r['store_nbytes'])} |"
    )
  return "\n".join(lines)


def markdown(result: dict) -> str:
  """The table ``benchmarks/report.py`` renders into docs/quantization.md."""
  return table(result)


def report(result: dict) -> str:
  """The fixtures' own figures and the table (``_result.finish`` adds the checks)."""
  out = [
    f"commit {result['commit']}; {result['seconds']:.1f} s; {result['generated_tokens']} "
    f"tokens generated, {result['noise_draws']} noise draws"
    + (" (--quick)" if result["quick"] else "")
  ]
  for fx in result["fixtures"]:
    group = fx["int4_group_size"]
    out.append(
      f"{fx['fixture']}: quantized input dims {fx['input_dims']}, int4 group size "
      f"{group if group else 'none (none of ' + str(GROUP_SIZES) + ' divides them)'}; "
      f"max |f| {fx['max_abs_logit']:.3f}; float greedy picks' top-2 gap min "
      f"{fx['float_top2_gap_min']:.4f}, median {fx['float_top2_gap_median']:.4f}"
    )
  out += ["", table(result), ""]
  return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  parser.add_argument(
    "--fixtures",
    nargs="+",
    choices=NAMES,
    help=f"default: every fixture ({QUICK_FIXTURE} alone with --quick)",
  )
  _result.add_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    names = args.fixtures or [QUICK_FIXTURE]
    measured = measure(names, QUICK_GENERATED_TOKENS, QUICK_NOISE_DRAWS)
  else:
    measured = measure(args.fixtures or list(NAMES))
  result = _result.stamp("quant_error", argv, args.quick) | measured
  return _result.finish(result, args, report)


if __name__ == "__main__":
  sys.exit(main())
