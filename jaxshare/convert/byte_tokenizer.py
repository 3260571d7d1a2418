"""jaxshare's byte tokenizer (UTF-8 bytes as ids 0..255, EOS = 0) as Hugging Face tokenizer files, written into every
export of a byte-level run so that ``AutoTokenizer.from_pretrained(export)`` loads it, and recognised on import so
that the run keeps its own ``byte`` tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_JSON = "tokenizer.json"


def write_byte_tokenizer(out: Path, max_length: int) -> None:
  """jaxshare's byte tokenizer as ``tokenizer.json`` + ``tokenizer_config.json`` in ``out``, so that ``AutoTokenizer``
  loads the directory: a byte-level BPE without merges whose vocabulary maps each byte's GPT-2 character to the
  byte's value, EOS (and padding) the byte 0. Written as the JSON the ``tokenizers`` library saves for that model
  (tests/equivalence/test_hf_export.py compares them), so exporting needs no tokenizers install."""
  alphabet = byte_alphabet()
  byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
  spec = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
          "pre_tokenizer": byte_level, "post_processor": None,
          "decoder": {**byte_level, "add_prefix_space": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                    "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                    "vocab": {alphabet[b]: b for b in range(256)}, "merges": []}}
  (out / TOKENIZER_JSON).write_text(json.dumps(spec, ensure_ascii=False, indent=2))
  eos = alphabet[0]
  (out / "tokenizer_config.json").write_text(json.dumps(
    {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": eos,
     "model_max_length": max_length, "clean_up_tokenization_spaces": False}, indent=2))


def byte_alphabet() -> list[str]:
  """GPT-2's printable character for each byte value (the ``ByteLevel`` pre-tokenizer's alphabet)."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
  extra = iter(range(256, 512))
  return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def is_byte_tokenizer(directory: Path) -> bool:
  """Whether ``directory``'s ``tokenizer.json`` is the one :func:`write_byte_tokenizer` writes: a byte-level BPE
  without merges or added tokens whose vocabulary maps each byte's character to the byte's value."""
  path = Path(directory) / TOKENIZER_JSON
  if not path.is_file():
    return False
  try:
    spec = json.loads(path.read_text())
    model = spec["model"]
    alphabet = byte_alphabet()
    return (model["type"] == "BPE" and not model["merges"] and not spec.get("added_tokens")
            and model["vocab"] == {alphabet[b]: b for b in range(256)})
  except (ValueError, KeyError, TypeError):  # not JSON, or not a tokenizers model
    return False
