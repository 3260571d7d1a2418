"""Tokenizers: UTF-8 bytes, or a local Hugging Face tokenizer directory."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import Protocol, Sequence

import numpy as np
from etils import epath

from jaxshare.config import DataConfig
from jaxshare.data.errors import DataError
from jaxshare.files import copy_files, is_remote, write_atomic


class Tokenizer(Protocol):
  vocab_size: int
  eos_id: int

  def encode(self, text: str) -> list[int]: ...

  def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
  """UTF-8 bytes as tokens: ids 0..255, EOS = 0 (NUL never occurs in text, which is checked on load)."""

  vocab_size = 256
  eos_id = 0

  def encode(self, text: str) -> list[int]:
    return list(text.encode("utf-8"))

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    ids = np.asarray(ids, np.int64)
    return ids[(ids > 0) & (ids < 256)].astype(np.uint8).tobytes().decode("utf-8", errors="replace")


class HFTokenizer:
  """A Hugging Face tokenizer directory (``tokenizer.json`` etc.), local or on a bucket (read through a local copy:
  :func:`local_tokenizer_dir`); never downloads from a hub."""

  def __init__(self, path: str):
    if not epath.Path(path).is_dir():
      raise DataError(f"data.tokenizer={path!r} is neither 'byte' nor an existing tokenizer directory")
    path = local_tokenizer_dir(path)
    try:
      from transformers import AutoTokenizer  # heavy import, only when asked for
    except ImportError as e:
      raise DataError(f"data.tokenizer={path!r} is a Hugging Face tokenizer directory, which needs transformers: "
                      "pip install 'jaxshare[hf]'") from e

    try:
      self._tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # transformers raises OSError/ValueError variants
      raise DataError(f"data.tokenizer={path!r} could not be loaded as a Hugging Face tokenizer: {e}") from e
    self.vocab_size = len(self._tok)
    eos = self._tok.eos_token_id
    self.eos_id = int(eos) if eos is not None else 0

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False)

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """:meth:`encode` of each text, in one call of the Rust tokenizer's batch encoder (threads across the batch;
    ``encode_batch_fast`` skips the character offsets, ~1.7x faster than the transformers wrapper)."""
    backend = getattr(self._tok, "backend_tokenizer", None)
    if backend is None:  # a slow (Python) tokenizer
      return self._tok(texts, add_special_tokens=False)["input_ids"]
    return _encode_batch(backend, texts)

  def cleans_up_spaces(self) -> bool:
    """Whether :meth:`decode` removes spaces that the Rust backend's decoder keeps (transformers'
    ``clean_up_tokenization_spaces``)."""
    return bool(getattr(self._tok, "clean_up_tokenization_spaces", False))

  def backend_args(self) -> tuple[str, int, int] | None:
    """``BackendTokenizer(*args)``: the Rust tokenizer alone, as transformers configured it, for processes that only
    encode (None: a slow tokenizer, which has no Rust backend)."""
    backend = getattr(self._tok, "backend_tokenizer", None)
    return None if backend is None else (backend.to_str(), self.vocab_size, self.eos_id)

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode([int(i) for i in ids])


def _encode_batch(backend, texts: list[str]) -> list[list[int]]:
  encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
  return [e.ids for e in encode(texts, add_special_tokens=False)]


class BackendTokenizer:
  """A Hugging Face fast tokenizer's Rust backend (``tokenizers.Tokenizer``) without transformers: what preparation
  workers encode with. Built from :meth:`HFTokenizer.backend_args` (the serialised backend), so its ids are the
  transformers tokenizer's, and a worker skips importing transformers and torch (~4 s of CPU per process)."""

  def __init__(self, backend_json: str, vocab_size: int, eos_id: int):
    from tokenizers import Tokenizer as RustTokenizer

    self._args = (backend_json, vocab_size, eos_id)
    self.vocab_size, self.eos_id = vocab_size, eos_id
    self._backend = RustTokenizer.from_str(backend_json)

  def backend_args(self) -> tuple[str, int, int]:
    """What rebuilds this tokenizer in another process: ``BackendTokenizer(*args)``."""
    return self._args

  def encode(self, text: str) -> list[int]:
    return self._backend.encode(text, add_special_tokens=False).ids

  def encode_batch(self, texts: list[str]) -> list[list[int]]:
    """:meth:`encode` of each text, in one call of the batch encoder."""
    return _encode_batch(self._backend, texts)

  def decode(self, ids: Sequence[int] | np.ndarray) -> str:
    """As transformers decodes without clean-up (:func:`encoding_tokenizer` caches no tokenizer that cleans up)."""
    return self._backend.decode([int(i) for i in ids], skip_special_tokens=False)


def cache_dir() -> Path:
  """Where jaxshare keeps what it can rebuild: ``$JAXSHARE_CACHE_DIR``, else ``$XDG_CACHE_HOME/jaxshare``, else
  ``~/.cache/jaxshare``."""
  root = os.environ.get("JAXSHARE_CACHE_DIR")
  return Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxshare"


def local_tokenizer_dir(spec: str) -> str:
  """``spec`` itself when local; a tokenizer directory on a bucket (a converted run's ``<run>/tokenizer`` on gs://)
  as a local copy under :func:`cache_dir`, named by its content's fingerprint, since transformers reads local files
  only. Copied once per content: into a temporary directory renamed into place, so concurrent processes (a pod
  host's) never load a half-copied one."""
  if not is_remote(spec):
    return spec
  local = cache_dir() / "tokenizer-dirs" / tokenizer_fingerprint(spec)
  if not local.is_dir():
    tmp = local.with_name(f".{local.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    copy_files(spec, tmp)
    try:
      tmp.rename(local)
    except OSError:  # another process put its copy there first
      shutil.rmtree(tmp, ignore_errors=True)
  return str(local)


def encoding_tokenizer(spec: str, fingerprint: str) -> Tokenizer:
  """The tokenizer a preparation encodes and decodes with: bytes; or a Hugging Face directory's Rust backend as
  transformers configures it, kept in :func:`cache_dir` under the directory's ``fingerprint``
  (:func:`tokenizer_fingerprint`) and the transformers version, so that later preparations with this tokenizer
  skip importing transformers and torch (~4 s). The first use, a slow tokenizer, or one whose decoding cleans up
  spaces (which the backend alone does not) load through transformers (:class:`HFTokenizer`).

  Raises:
    DataError: as :class:`HFTokenizer`.
  """
  if spec == "byte":
    return ByteTokenizer()
  try:
    version = importlib.metadata.version("transformers")
    path = cache_dir() / "tokenizers" / f"{fingerprint}-transformers-{version}.json"
  except (importlib.metadata.PackageNotFoundError, RuntimeError):  # no transformers (HFTokenizer names it), no home
    version = None
  if version is not None:
    try:
      entry = json.loads(path.read_text())
      return BackendTokenizer(entry["backend"], entry["vocab_size"], entry["eos_id"])
    except Exception:  # no entry yet, or an unreadable or damaged one: (re)built from the directory below
      pass
  tokenizer = HFTokenizer(spec)
  args = tokenizer.backend_args()
  if args is not None and version is not None and not tokenizer.cleans_up_spaces():
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
      write_atomic(path, json.dumps(dict(zip(("backend", "vocab_size", "eos_id"), args))).encode())
    except OSError:  # a read-only home: every preparation loads through transformers
      pass
  return tokenizer


def make_tokenizer(spec: DataConfig | str) -> Tokenizer:
  """The tokenizer ``byte`` or a local tokenizer directory names: a config's ``data.tokenizer``, or the name itself."""
  name = spec if isinstance(spec, str) else spec.tokenizer
  return ByteTokenizer() if name == "byte" else HFTokenizer(name)


def tokenizer_fingerprint(spec: str) -> str:
  """What tokens depend on, of the tokenizer ``spec`` (``byte`` or a tokenizer directory, local or on a bucket):
  ``"byte"``, or the SHA-256 (24 hex digits) of the directory's file names and contents.

  Raises:
    DataError: ``spec`` is neither ``byte`` nor an existing directory.
  """
  if spec == "byte":
    return "byte"
  path = epath.Path(spec)
  if not path.is_dir():
    raise DataError(f"tokenizer {spec!r} is neither 'byte' nor an existing tokenizer directory")
  files = [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in sorted(path.iterdir()) if f.is_file()]
  return hashlib.sha256(json.dumps(files).encode()).hexdigest()[:24]
