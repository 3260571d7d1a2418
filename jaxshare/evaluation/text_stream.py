"""Printing generated text as it is produced, independent of how the tokens arrive."""

from __future__ import annotations

from typing import Iterable

from jaxshare.data import Tokenizer

_INCOMPLETE = "\ufffd"  # what a decoder gives for bytes that may still become a character


class TextStream:
  """Turns a growing sequence of token ids into the pieces of text to print.

  The whole continuation is decoded each time (a multi-byte character may span tokens), and trailing replacement
  characters (U+FFFD: an incomplete UTF-8 sequence, or byte-level tokens not yet completed) are held back until more
  tokens arrive or :meth:`finish` is called, as transformers' ``TextStreamer`` does. The printed text is therefore
  the same whether the tokens come one at a time or in chunks.
  """

  def __init__(self, tokenizer: Tokenizer):
    self.tokenizer = tokenizer
    self.ids: list[int] = []
    self.shown = 0  # characters of the decoded text already returned

  def push(self, ids: Iterable[int]) -> str:
    """Add token ids; the newly printable text (possibly empty)."""
    self.ids.extend(int(i) for i in ids)
    text = self.tokenizer.decode(self.ids)
    stable = len(text.rstrip(_INCOMPLETE))
    piece = text[self.shown:stable]
    self.shown = max(self.shown, stable)
    return piece

  def finish(self) -> str:
    """The text held back, replacement characters included (the stream has ended)."""
    text = self.tokenizer.decode(self.ids)
    piece, self.shown = text[self.shown:], len(text)
    return piece
