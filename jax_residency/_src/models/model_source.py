"""A model's source as a store: what `models.as_store` and `models.draft_from` take.

A source is a store written by ``convert`` (used as it is), a Hugging Face checkpoint
directory, or a llama.cpp ``.gguf`` file. The last two are converted once, into a store
the caller names or under the library's cache directory (named by the source's path,
its modification time and the quantization, so a changed source is converted again),
and the store is reused after that.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from jax_residency._src.cache_dir import library_cache_dir
from jax_residency._src.errors import QuantizationError
from jax_residency._src.models.gguf_convert import convert_gguf
from jax_residency._src.models.gguf_file import is_gguf_file
from jax_residency._src.models.hf_convert import CONVERSION_FILE, HF_CONFIG_FILE, convert_hf
from jax_residency._src.quant.schemes import Quantization


def is_checkpoint_dir(path: str | os.PathLike[str]) -> bool:
  """Whether ``path`` is a Hugging Face checkpoint directory (a ``config.json``, and not
  a store written by ``convert``)."""
  p = Path(path)
  return (p / "config.json").is_file() and not (p / HF_CONFIG_FILE).is_file()


def cached_store_path(
  source: str | os.PathLike[str], quantize: Quantization | None, folder: str = "stores"
) -> str:
  """Where ``source`` is converted by default: under the library's cache directory's
  ``folder``, named by the source's name, its absolute path and modification time, and
  the quantization (None: as the source stores it)."""
  src = Path(source).resolve()
  how = None if quantize is None else quantize.to_dict()
  stamp = f"{src}:{src.stat().st_mtime_ns}:{json.dumps(how, sort_keys=True)}"
  digest = hashlib.sha256(stamp.encode()).hexdigest()[:10]
  scheme = ("gguf" if src.is_file() else "float") if quantize is None else quantize.scheme
  return os.path.join(library_cache_dir(), folder, f"{src.stem}-{digest}-{scheme}")


def _written(store: str) -> bool:
  return os.path.isfile(os.path.join(store, "commit_success.txt")) and os.path.isfile(
    os.path.join(store, HF_CONFIG_FILE)
  )


def converted_store(
  source: str | os.PathLike[str],
  *,
  quantize: Quantization | None = None,
  store: str | None = None,
  progress: bool | None = None,
  folder: str = "stores",
  caller: str = "as_store",
) -> str:
  """The store of ``source`` (see the module's docstring), written once, then reused;
  errors name ``caller``."""
  source = Path(source)
  who = f"{caller}({str(source)!r})"
  if source.is_file():
    if not is_gguf_file(source):
      raise FileNotFoundError(
        f"{who}: not a GGUF file; pass a GGUF file, a Hugging Face checkpoint directory "
        "or a store written by convert"
      )
    if quantize is not None:
      raise QuantizationError(
        f"{caller}({str(source)!r}, quantize={quantize.to_dict()!r}): a GGUF file's tensors "
        "are kept in their own GGML types (Q4_1, Q8_0, ...); pass quantize=None, or the "
        "model's float checkpoint directory to quantize it"
      )
    out = store or cached_store_path(source, None, folder)
    if not _written(out):
      convert_gguf(source, out, progress=progress, overwrite=True)
    return out
  if (source / HF_CONFIG_FILE).is_file():  # a store written by convert
    if quantize is None:
      return os.fspath(source)
    recorded = source / CONVERSION_FILE
    origin = json.loads(recorded.read_text()).get("source") if recorded.is_file() else None
    if origin is None or not Path(origin).exists():
      raise FileNotFoundError(
        f"{caller}({str(source)!r}, quantize={quantize.to_dict()!r}): the store records no "
        f"source to quantize from ({origin!r} in {CONVERSION_FILE}); pass the checkpoint "
        "directory or GGUF file it was converted from, or quantize=None to use the store as "
        "it is"
      )
    return converted_store(
      origin, quantize=quantize, store=store, progress=progress, folder=folder, caller=caller
    )
  if (source / "config.json").is_file():  # a Hugging Face checkpoint directory
    out = store or cached_store_path(source, quantize, folder)
    if not _written(out):
      convert_hf(source, out, quantize=quantize, progress=progress, overwrite=True)
    return out
  raise FileNotFoundError(
    f"{who}: neither a GGUF file, a Hugging Face checkpoint directory (no config.json) nor "
    f"a store written by convert (no {HF_CONFIG_FILE})"
  )


def as_store(
  source: str | os.PathLike[str],
  *,
  quantize: str | dict | None = None,
  store: str | os.PathLike[str] | None = None,
  progress: bool | None = None,
) -> str:
  """The store of a model's ``source``, converting it once where it is not one yet.

  Args:
    source: a store written by ``convert`` (returned as it is), a Hugging Face checkpoint
      directory (converted with ``quantize``; None keeps its floats), or a llama.cpp
      ``.gguf`` file (converted in its own GGML types).
    quantize: ``"int8"``, ``"int4"`` or ``{"scheme": "int4", "group_size": 64}``; for a
      store, its recorded source is converted with it instead.
    store: where to write the conversion (default: under the library's cache directory,
      named by the source's path, modification time and quantization); a store already
      written there is reused.
    progress: a progress bar while converting (None: when stderr is a terminal).

  Returns:
    The store's path, for ``models.load(path)`` and ``jr.place(..., store=path)``.

  Raises:
    FileNotFoundError: ``source`` is none of the three, or a store's recorded source is
      gone.
    QuantizationError: ``quantize`` given for a GGUF file.

  Example:
    >>> import tempfile
    >>> from jax_residency._src.models.model_source import as_store
    >>> try:
    ...   as_store(tempfile.mkdtemp())
    ... except FileNotFoundError as e:
    ...   print("no config.json" in str(e))
    True
  """
  wanted = None if quantize is None else Quantization.of(quantize)
  return converted_store(
    source, quantize=wanted, store=None if store is None else os.fspath(store), progress=progress
  )
