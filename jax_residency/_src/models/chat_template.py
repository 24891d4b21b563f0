"""A checkpoint's chat template: the Jinja text that turns a conversation into a prompt.

A Hugging Face checkpoint keeps it in ``tokenizer_config.json`` (``"chat_template"``: one
template, or a list of named ones, ``"default"`` the one used), with the special tokens
it refers to (``bos_token``, ``eos_token``); a llama.cpp GGUF file in its metadata
(``tokenizer.chat_template``), which `convert_gguf` writes into the store's
``tokenizer_config.json`` (`gguf_tokenizer_config`), so a store from either carries it.

`ChatTemplate.render` renders it as transformers' ``apply_chat_template`` does: Jinja2's
``ImmutableSandboxedEnvironment`` (a template cannot change the objects it is given,
nor reach Python's internals), ``trim_blocks`` and ``lstrip_blocks`` on, the
``loopcontrols`` extension, the ``tojson`` filter without ASCII escapes, and the
variables ``messages``, ``add_generation_prompt``, the special tokens, and the functions
``raise_exception`` and ``strftime_now``.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jax_residency._src.errors import ModelConfigError

#: The file of a checkpoint or store that holds the chat template.
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
#: The GGUF metadata key of the chat template.
GGUF_CHAT_TEMPLATE = "tokenizer.chat_template"
_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
  """A chat template and the special tokens it may refer to.

  Attributes:
    source: the Jinja template's text.
    special_tokens: ``bos_token``, ``eos_token`` and the like, as text (a token the
      checkpoint does not name is absent).
    where: the file it came from, for error messages.

  Example:
    >>> t = ChatTemplate(
    ...   source="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\\n{% endfor %}"
    ...   "{% if add_generation_prompt %}<assistant>{% endif %}",
    ...   special_tokens={},
    ... )
    >>> t.render([{"role": "user", "content": "hi"}])
    '<user>hi\\n<assistant>'
  """

  source: str
  special_tokens: Mapping[str, str]
  where: str = "the chat template"

  def render(
    self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
  ) -> str:
    """The conversation ``messages`` (``{"role": ..., "content": ...}`` each) as the
    model's prompt text; ``add_generation_prompt`` ends it with the assistant's turn.

    Raises:
      ModelConfigError: the template is not valid Jinja, or raised while rendering
        (``raise_exception``, say, for roles out of order); the message names it.
    """
    import jinja2  # noqa: PLC0415 - only chat needs it

    try:
      template = _compiled(self.source)
      return template.render(
        messages=[dict(m) for m in messages],
        add_generation_prompt=add_generation_prompt,
        **self.special_tokens,
      )
    except jinja2.TemplateError as e:
      raise ModelConfigError(
        f"{self.where}: the chat template cannot render this conversation: {type(e).__name__}: {e}"
      ) from e


def _raise_exception(message: str) -> None:
  import jinja2  # noqa: PLC0415

  raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
  return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(format: str) -> str:  # noqa: A002 - transformers' name for it
  return datetime.datetime.now().strftime(format)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
  """``source`` compiled in the sandbox transformers renders chat templates in."""
  import jinja2.ext  # noqa: PLC0415
  from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415

  env = ImmutableSandboxedEnvironment(
    trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
  )
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = _strftime_now
  return env.from_string(source)


def _token_text(value: Any) -> str | None:
  """A special token as ``tokenizer_config.json`` writes it: text, or an added token's
  ``{"content": ...}``."""
  if isinstance(value, str):
    return value
  if isinstance(value, Mapping) and isinstance(value.get("content"), str):
    return value["content"]
  return None


def _template_text(value: Any, where: str) -> str | None:
  """The template of a ``chat_template`` value: text, or the ``"default"`` one of a
  list of ``{"name", "template"}``."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, list):
    named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
    found = named.get("default")
    if isinstance(found, str):
      return found
  raise ModelConfigError(
    f"{where}: chat_template is {type(value).__name__}, not a template (text) or a list "
    "of named templates with a 'default' one"
  )


def chat_template_of(directory: str | os.PathLike[str]) -> ChatTemplate | None:
  """The chat template ``directory`` (a checkpoint directory, or a store from
  ``convert``) holds in its ``tokenizer_config.json``; None where it has none.

  Raises:
    ModelConfigError: the file is not a JSON object, or its template is neither text nor
      a list of named templates.
  """
  path = Path(directory) / TOKENIZER_CONFIG_FILE
  if not path.is_file():
    return None
  try:
    config = json.loads(path.read_text(encoding="utf-8"))
  except ValueError as e:
    raise ModelConfigError(f"{path}: not JSON ({e}); write it again") from e
  if not isinstance(config, dict):
    raise ModelConfigError(f"{path}: expected a JSON object, found {type(config).__name__}")
  source = _template_text(config.get("chat_template"), str(path))
  if source is None:
    return None
  special = {k: t for k in _SPECIAL if (t := _token_text(config.get(k))) is not None}
  return ChatTemplate(source=source, special_tokens=special, where=str(path))


def gguf_tokenizer_config(meta: Mapping[str, Any]) -> dict[str, Any] | None:
  """The ``tokenizer_config.json`` of a GGUF file's metadata: its chat template and the
  text of its BOS and EOS tokens; None where the file has no chat template.

  Example:
    >>> meta = {"tokenizer.chat_template": "{{ bos_token }}", "tokenizer.ggml.tokens":
    ...         ["<unk>", "<s>", "</s>"], "tokenizer.ggml.bos_token_id": 1}
    >>> gguf_tokenizer_config(meta)
    {'chat_template': '{{ bos_token }}', 'bos_token': '<s>'}
  """
  source = meta.get(GGUF_CHAT_TEMPLATE)
  if not isinstance(source, str):
    return None
  config: dict[str, Any] = {"chat_template": source}
  tokens = meta.get("tokenizer.ggml.tokens") or []
  for name in ("bos", "eos"):
    i = meta.get(f"tokenizer.ggml.{name}_token_id")
    if isinstance(i, int) and 0 <= i < len(tokens):
      config[f"{name}_token"] = str(tokens[i])
  return config
