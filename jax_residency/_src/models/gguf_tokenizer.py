"""A Hugging Face ``tokenizer.json`` built from a GGUF file's tokenizer metadata.

A GGUF file carries its vocabulary as metadata (``tokenizer.ggml.*``), not as a
``tokenizer.json``. `tokenizer_json` writes the one transformers builds when it
loads the file (``AutoTokenizer.from_pretrained(dir, gguf_file=...)``), so a store
converted from the file tokenizes as transformers does (``tests/test_gguf.py``
compares the ids on twenty strings). Two vocabularies are read, by
``tokenizer.ggml.model``:

* ``"gpt2"``: byte-level BPE (Llama 3, Qwen2, SmolLM...). Tokens are spelled in
  GPT-2's byte alphabet (a token using other characters is respelled from its
  UTF-8 bytes); ``tokenizer.ggml.merges`` are the merges. Text is split with the
  regex ``tokenizer.ggml.pre`` names (`PRE_SPLITS`; GPT-2's own otherwise, as
  transformers does, with a warning for a name it does not know).
* ``"llama"``: SentencePiece-style BPE (Llama 2, Mistral): a ``▁`` is put before
  the text and for every space, characters missing from the vocabulary fall back
  to the ``<0xXX>`` byte tokens, and the merges, which such files seldom hold, are
  derived from the tokens' scores (`merges_from_scores`).

Control tokens (``token_type`` 3) and the BOS, EOS, unknown and padding tokens
are special added tokens, matched whole in the text; user-defined ones (4) are
added tokens that are not special. A BOS is prepended when
``tokenizer.ggml.add_bos_token`` says so (default: yes for ``"llama"``, no for
``"gpt2"``), an EOS appended when ``add_eos_token`` does.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from jax_residency._src.errors import ModelConfigError

#: ``tokenizer.ggml.model`` values this module builds a tokenizer for.
TOKENIZER_MODELS = ("gpt2", "llama")
#: Token types in GGUF files (``tokenizer.ggml.token_type``).
CONTROL, USER_DEFINED = 3, 4

_LLAMA3_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
  r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
#: ``tokenizer.ggml.pre`` names → the regex their text is split with before byte-level
#: BPE. ``"gpt2"``, ``"default"`` or none: GPT-2's own split (the ByteLevel pre-tokenizer's).
PRE_SPLITS: dict[str, str] = {
  **dict.fromkeys(
    ("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx", "falcon3"), _LLAMA3_SPLIT
  ),
  **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}
_GPT2_PRE = ("gpt2", "default")
_META = "\u2581"  # SentencePiece's word boundary, "▁"


@functools.cache
def byte_alphabet() -> tuple[str, ...]:
  """GPT-2's spelling of each byte (index = byte): printable Latin-1 characters stand
  for themselves, the other bytes for the characters from U+0100 up, in byte order.

  Example:
    >>> byte_alphabet()[ord("a")], byte_alphabet()[ord(" ")], byte_alphabet()[ord("\\n")]
    ('a', 'Ġ', 'Ċ')
  """
  printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
  spelled, extra = {}, 0
  for b in range(256):
    if b in printable:
      spelled[b] = chr(b)
    else:
      spelled[b] = chr(256 + extra)
      extra += 1
  return tuple(spelled[b] for b in range(256))


def merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
  """The BPE merges a SentencePiece vocabulary implies: every split of a token into two
  tokens of the vocabulary, best score first (then longer left, then longer right
  piece; ties keep vocabulary order, and a token's splits are ordered by their pieces'
  ids).

  Example:
    >>> merges_from_scores(["a", "b", "ab", "abb"], [0.0, 0.0, -1.0, -2.0])
    [('a', 'b'), ('ab', 'b')]
  """
  ids = {t: i for i, t in enumerate(tokens)}
  score_of: dict[str, float] = {}
  for t, s in zip(tokens, scores, strict=True):
    score_of[t] = float(s)
  found: list[tuple[str, str, float]] = []
  for t, s in score_of.items():
    splits = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in ids and t[k:] in ids]
    splits.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
    found += [(left, right, s) for left, right in splits]
  found.sort(key=lambda m: (-m[2], -len(m[0]), -len(m[1])))
  return [(left, right) for left, right, _ in found]


def _bpe_model(vocab: dict[str, int], merges: list[tuple[str, str]], sentencepiece: bool) -> dict:
  return {
    "type": "BPE",
    "dropout": None,
    "unk_token": None,
    "continuing_subword_prefix": None if sentencepiece else "",
    "end_of_word_suffix": None if sentencepiece else "",
    "fuse_unk": sentencepiece,
    "byte_fallback": sentencepiece,
    "ignore_merges": False,
    "vocab": vocab,
    "merges": [list(m) for m in merges],
  }


def _byte_level_pre(pre: str | None, where: str) -> dict[str, Any]:
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
  split = PRE_SPLITS.get(pre or "default")
  if split is None:
    if pre not in (None, *_GPT2_PRE):
      warnings.warn(
        f"{where}: tokenizer.ggml.pre={pre!r} is not a split this version knows "
        f"({', '.join(sorted(PRE_SPLITS))}); the tokenizer splits text as GPT-2 does, as "
        "transformers does for it. Check its ids against the model's own tokenizer.",
        UserWarning,
        stacklevel=4,
      )
    return {**byte_level, "use_regex": True}
  return {
    "type": "Sequence",
    "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False},
      {**byte_level, "use_regex": False},
    ],
  }


def _post_processor(bos: str | None, eos: str | None, ids: Mapping[str, int]) -> dict[str, Any]:
  """Prepends ``bos`` and appends ``eos`` (each when given) to a sequence, and to a pair's
  second sequence too."""

  def part(type_id: int, seq: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if bos is not None:
      out.append({"SpecialToken": {"id": bos, "type_id": type_id}})
    out.append({"Sequence": {"id": seq, "type_id": type_id}})
    if eos is not None:
      out.append({"SpecialToken": {"id": eos, "type_id": type_id}})
    return out

  specials = {t: {"id": t, "ids": [ids[t]], "tokens": [t]} for t in (bos, eos) if t is not None}
  return {
    "type": "TemplateProcessing",
    "single": part(0, "A"),
    "pair": part(0, "A") + part(1, "B"),
    "special_tokens": specials,
  }


def _added(tokens: Sequence[str], types: Sequence[int], specials: set[int], keep: Any) -> list:
  """The added tokens: control and special ids (special), user-defined ones (not)."""
  out = []
  for i, (t, kind) in enumerate(zip(tokens, types, strict=True)):
    special = (kind == CONTROL and keep(t)) or i in specials
    if special or kind == USER_DEFINED:
      out.append(
        {
          "id": i,
          "content": t,
          "single_word": False,
          "lstrip": False,
          "rstrip": False,
          "normalized": False,
          "special": bool(special),
        }
      )
  return out


def _special_ids(meta: Mapping[str, Any], n: int) -> dict[str, int]:
  keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id"}
  keys["pad"] = "padding_token_id"
  out = {}
  for name, key in keys.items():
    value = meta.get(f"tokenizer.ggml.{key}")
    if value is not None and 0 <= int(value) < n:
      out[name] = int(value)
  return out


def tokenizer_json(meta: Mapping[str, Any], where: str) -> dict[str, Any] | None:
  """The ``tokenizer.json`` (as a dict) of the tokenizer ``meta`` describes, or None when
  the file holds none (no ``tokenizer.ggml.model``).

  Args:
    meta: the file's metadata, by key (``tokenizer.ggml.tokens`` a list of str...).
    where: the file, for messages.

  Raises:
    ModelConfigError: a tokenizer model other than ``"gpt2"`` and ``"llama"``, or
      metadata that does not describe one (missing tokens, merges or scores).

  Example:
    >>> meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
    ...         "tokenizer.ggml.merges": ["a b"]}
    >>> tok = tokenizer_json(meta, "f.gguf")
    >>> tok["model"]["merges"], tok["pre_tokenizer"]["type"]
    ([['a', 'b']], 'ByteLevel')
  """
  kind = meta.get("tokenizer.ggml.model")
  if kind is None:
    return None
  if kind not in TOKENIZER_MODELS:
    raise ModelConfigError(
      f"{where}: tokenizer.ggml.model={kind!r} is not a tokenizer this version converts; "
      f"supported: {', '.join(map(repr, TOKENIZER_MODELS))}. Convert the weights of a file "
      "without tokenizer metadata, or tokenize with the model's own tokenizer."
    )
  tokens = [str(t) for t in meta.get("tokenizer.ggml.tokens") or []]
  if not tokens:
    raise ModelConfigError(f"{where}: tokenizer.ggml.model={kind!r} but no tokenizer.ggml.tokens")
  types = [int(t) for t in meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)]
  if len(types) != len(tokens):
    raise ModelConfigError(
      f"{where}: {len(types)} tokenizer.ggml.token_type entries for {len(tokens)} tokens"
    )
  ids = _special_ids(meta, len(tokens))
  sentencepiece = kind == "llama"
  if sentencepiece:
    spelled, keep = tokens, (lambda t: True)
  else:
    alphabet = set(byte_alphabet())
    spelled = [
      t if set(t) <= alphabet else "".join(byte_alphabet()[b] for b in t.encode("utf-8"))
      for t in tokens
    ]
    keep = lambda t: set(t) <= alphabet  # noqa: E731 - a control token spelled in bytes
  vocab = {t: i for i, t in enumerate(spelled)}
  merges = _merges(meta, tokens, where)
  default_bos = sentencepiece
  add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", default_bos))
  add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
  bos = tokens[ids["bos"]] if add_bos and "bos" in ids else None
  eos = tokens[ids["eos"]] if add_eos and "eos" in ids else None
  return {
    "version": "1.0",
    "truncation": None,
    "padding": None,
    "added_tokens": _added(tokens, types, set(ids.values()), keep),
    "normalizer": None,
    "pre_tokenizer": (
      {"type": "Metaspace", "replacement": _META, "prepend_scheme": "first", "split": False}
      if sentencepiece
      else _byte_level_pre(meta.get("tokenizer.ggml.pre"), where)
    ),
    "post_processor": _post_processor(bos, eos, {t: i for i, t in enumerate(tokens)}),
    "decoder": _decoder(sentencepiece),
    "model": _bpe_model(vocab, merges, sentencepiece),
  }


def _merges(meta: Mapping[str, Any], tokens: list[str], where: str) -> list[tuple[str, str]]:
  listed = meta.get("tokenizer.ggml.merges")
  if listed is not None:
    merges = [tuple(str(m).split(" ")) for m in listed]
    bad = [m for m in merges if len(m) != 2]
    if bad:
      raise ModelConfigError(
        f"{where}: tokenizer.ggml.merges has {len(bad)} entries that are not two tokens "
        f"split by one space, e.g. {' '.join(bad[0])!r}"
      )
    return [(m[0], m[1]) for m in merges]
  if meta.get("tokenizer.ggml.model") == "gpt2":
    raise ModelConfigError(f"{where}: a byte-level BPE tokenizer without tokenizer.ggml.merges")
  scores = meta.get("tokenizer.ggml.scores")
  if scores is None or len(scores) != len(tokens):
    raise ModelConfigError(
      f"{where}: a SentencePiece tokenizer needs tokenizer.ggml.merges or one "
      "tokenizer.ggml.scores entry per token, to derive its merges from"
    )
  return merges_from_scores(tokens, scores)


def _decoder(sentencepiece: bool) -> dict[str, Any]:
  if not sentencepiece:
    return {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
  return {
    "type": "Sequence",
    "decoders": [
      {"type": "Replace", "pattern": {"String": _META}, "content": " "},
      {"type": "ByteFallback"},
      {"type": "Fuse"},
      {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ],
  }
