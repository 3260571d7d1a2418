"""Streamed generation text does not depend on how the tokens are chunked (eval.py generate printed a broken
character when a multi-byte character's bytes came in separate chunks, so cached and uncached output differed)."""

import numpy as np
import pytest

from jaxshare.data import ByteTokenizer
from jaxshare.evaluation.text_stream import TextStream


def streamed(ids, chunk):
  stream = TextStream(ByteTokenizer())
  pieces = [stream.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
  return pieces, stream.finish()


@pytest.mark.parametrize("seed", range(20))
def test_printed_text_is_the_decoded_text_whatever_the_chunks(seed):
  rng = np.random.default_rng(seed)
  text = "ROMEO: ça, ÿ — 日本 🎭 x"  # 1- to 4-byte characters
  ids = list(text.encode())
  for _ in range(3):  # stray bytes (continuation or lead bytes a model may emit out of place)
    ids.insert(int(rng.integers(len(ids) + 1)), int(rng.integers(128, 256)))
  want = ByteTokenizer().decode(ids)
  for chunk in (1, 2, 3, 8, len(ids)):
    pieces, rest = streamed(ids, chunk)
    assert "".join(pieces) + rest == want
    assert want.startswith("".join(pieces))


def test_an_incomplete_character_is_held_back_until_completed_or_finished():
  stream = TextStream(ByteTokenizer())
  assert stream.push([ord("a"), 0xE6]) == "a"  # the first of the 3 bytes of 日
  assert stream.push([0x97]) == ""
  assert stream.push([0xA5]) == "日"
  assert stream.push([0xF0]) == ""
  assert stream.finish() == "\ufffd"  # the stream ended inside a character
