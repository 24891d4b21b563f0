"""Generated text written as its tokens arrive: ``generate`` and ``chat`` print with it.

A token is not always a whole piece of text: a byte-level or byte-fallback vocabulary
splits a character of several UTF-8 bytes over tokens, and a SentencePiece vocabulary
drops a word's leading space only at the start. So `TextStream` decodes every token
so far each time and writes what the text gained since the last write. A decode that
ends in U+FFFD (an unfinished character) is held until a later token completes it, and
one that rewrites text already written is held until the text again extends what was
written; `finish` writes whatever is left, so the text written is the final decode
whenever that decode extends what was written.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

#: What an unfinished UTF-8 sequence decodes to.
REPLACEMENT = "\ufffd"


class TextStream:
  """Writes the text of tokens as they are pushed.

  Args:
    decode: token ids to text (the tokenizer's decode, special tokens skipped).
    write: where text goes (stdout, flushed).

  Example:
    >>> pieces = {1: b"caf", 2: b"\\xc3", 3: b"\\xa9", 4: b"!"}
    >>> out = []
    >>> stream = TextStream(
    ...   lambda ids: b"".join(pieces[i] for i in ids).decode(errors="replace"), out.append
    ... )
    >>> for token in (1, 2, 3, 4):
    ...   stream.push(token)
    >>> stream.finish(), out
    ('café!', ['caf', 'é', '!'])
  """

  def __init__(self, decode: Callable[[Sequence[int]], str], write: Callable[[str], None]):
    self._decode, self._write = decode, write
    self._ids: list[int] = []
    self._written = ""

  @property
  def ids(self) -> list[int]:
    """The tokens pushed so far."""
    return list(self._ids)

  def push(self, token: int) -> None:
    """Adds ``token`` and writes what the text gained, where it is whole."""
    self._ids.append(int(token))
    text = self._decode(self._ids)
    if not text.endswith(REPLACEMENT) and text.startswith(self._written):
      self._emit(text)

  def finish(self) -> str:
    """Writes what is left; returns the text of every token pushed."""
    text = self._decode(self._ids)
    if text.startswith(self._written):
      self._emit(text)
    return text

  def _emit(self, text: str) -> None:
    delta = text[len(self._written) :]
    if delta:
      self._write(delta)
      self._written = text
