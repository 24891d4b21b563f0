"""Reading a Hugging Face ``config.json``: finding the file, and the error for a field that
asks for math a model here does not implement.

Each family's config class (``LlamaConfig``, ``T5Config``, ``BertConfig``) parses the
dict with its own ``from_hf``; what they share is here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from jax_residency._src.errors import ModelConfigError
from jax_residency._src.models.gguf_file import is_gguf_file


def read_config(path: str | Path, config_type: str) -> dict[str, Any]:
  """The ``config.json`` in ``path`` (a directory) or beside it (a file).

  Raises:
    FileNotFoundError: there is none; the message says to pass ``config_type(...)``.
  """
  p = Path(path)
  config = (p if p.is_dir() else p.parent) / "config.json"
  if not config.is_file() and is_gguf_file(p):
    raise FileNotFoundError(
      f"{str(path)!r} is a GGUF file, which holds its own config and tokenizer: convert it "
      f"once with models.as_store({str(path)!r}) (or `jax-residency convert gguf {path} "
      "STORE`) and load the store with models.load(store)"
    )
  if not config.is_file():
    raise FileNotFoundError(
      f"no config.json beside {str(path)!r}: pass config={config_type}(...) with the model's sizes"
    )
  return json.loads(config.read_text())


def unsupported(model: str, field: str, value: Any, fix: str) -> ModelConfigError:
  """The error for a config ``field`` whose ``value`` the ``model`` family does not implement.

  Example:
    >>> str(unsupported("T5", "is_encoder_decoder", False, "this T5 is an encoder–decoder"))
    'T5 config is_encoder_decoder=False is not supported: this T5 is an encoder–decoder'
  """
  return ModelConfigError(f"{model} config {field}={value!r} is not supported: {fix}")
