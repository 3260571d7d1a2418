"""The prepared-data format: a directory of token shards and a manifest (``python -m jaxshare.data prepare``).

``DIR/manifest.json`` describes the dataset; every shard ``NAME`` is two little-endian files:

- ``NAME.tokens``: the tokens of whole documents, each followed by EOS, as ``uint16`` when the vocabulary fits
  (below 65,536 ids) and ``uint32`` otherwise (2 or 4 bytes per token, not 12 as the token cache stores);
- ``NAME.docs``: ``int64`` offsets of the documents' first tokens in the shard (one per document; positions and
  document ids are derived from them when a window is read, never stored per token).

The shards in manifest order are one token stream. ``splits`` gives each split's ``[start, stop)`` range of it (the
validation split is the corpus's last documents), and each shard carries token, document and UTF-8 byte counts and
SHA-256 checksums (of the offsets file, and of each 4 MiB chunk of the tokens file, so that a reader verifies what it
reads without hashing whole shards first). Files are written under a temporary name and renamed, so a shard that
exists is whole.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any

import numpy as np
from etils import epath

from jaxshare.data.errors import DataError
from jaxshare.files import write_atomic

FORMAT = "jaxshare-tokens"
FORMAT_VERSION = 2  # 2: tokens checksummed per chunk
CHUNK_BYTES = 1 << 22  # tokens files are checksummed per 4 MiB chunk, so reading a window verifies only its chunk
MANIFEST = "manifest.json"
TOKENS, DOCS = ".tokens", ".docs"
SPLITS = ("train", "validation")


def token_dtype(vocab_size: int) -> np.dtype:
  """``uint16`` for vocabularies of up to 65,536 ids, else ``uint32``."""
  return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


@dataclasses.dataclass(frozen=True)
class Shard:
  """One shard: its name (files ``name.tokens`` and ``name.docs``), counts and checksums."""

  name: str
  tokens: int
  documents: int
  utf8_bytes: int  # UTF-8 bytes of its documents' text (EOS excluded)
  tokens_sha256: tuple[str, ...]  # of each CHUNK_BYTES chunk of the tokens file (128-bit hex): a read verifies its own
  docs_sha256: str

  def __post_init__(self):
    object.__setattr__(self, "tokens_sha256", tuple(self.tokens_sha256))  # JSON gives a list


@dataclasses.dataclass(frozen=True)
class Manifest:
  """What a prepared directory holds (``manifest.json``)."""

  tokenizer: str  # "byte" or the tokenizer directory it was prepared with
  tokenizer_fingerprint: str  # :func:`~jaxshare.data.tokenizers.tokenizer_fingerprint`
  vocab_size: int
  eos_id: int
  dtype: str  # "uint16" or "uint32"
  shards: tuple[Shard, ...]
  splits: dict[str, tuple[int, int]]  # split -> [start, stop) of the token stream
  validation_utf8_bytes: int  # UTF-8 bytes the validation tokens decode to (bits per byte)
  inputs: tuple[str, ...]  # as given to prepare
  preparation: str  # fingerprint of the inputs and options: a re-run with the same ones finds the work done
  skipped_documents: int = 0  # bad documents or files skipped under --skip-bad-docs
  format: str = FORMAT
  version: int = FORMAT_VERSION

  @property
  def num_tokens(self) -> int:
    return sum(s.tokens for s in self.shards)

  @property
  def num_documents(self) -> int:
    return sum(s.documents for s in self.shards)

  def to_json(self) -> str:
    d = dataclasses.asdict(self)
    d["splits"] = {k: list(v) for k, v in self.splits.items()}
    return json.dumps(d, indent=1)

  @classmethod
  def from_json(cls, text: str, where: str) -> "Manifest":
    """Parse a manifest.

    Raises:
      DataError: not JSON, another format or version, or fields missing.
    """
    try:
      d = json.loads(text)
    except json.JSONDecodeError as e:
      raise DataError(f"{where} is not valid JSON ({e.msg}): re-run python -m jaxshare.data prepare") from e
    if not isinstance(d, dict) or d.get("format") != FORMAT:
      raise DataError(f"{where} is not a {FORMAT} manifest (format {d.get('format') if isinstance(d, dict) else d!r})")
    if d.get("version") != FORMAT_VERSION:
      raise DataError(f"{where} has format version {d.get('version')!r}; this jaxshare reads version "
                      f"{FORMAT_VERSION}: prepare the data again with this version")
    try:
      shards = tuple(Shard(**s) for s in d.pop("shards"))
      splits = {k: (int(a), int(b)) for k, (a, b) in d.pop("splits").items()}
      return cls(shards=shards, splits=splits, **{**d, "inputs": tuple(d["inputs"])})
    except (KeyError, TypeError, ValueError) as e:
      raise DataError(f"{where} is malformed ({type(e).__name__}: {e}): re-run python -m jaxshare.data prepare") from e


def chunk_digest(data: bytes | memoryview) -> str:
  """The checksum of one chunk of a tokens file: SHA-256 truncated to 128 bits (hex)."""
  return hashlib.sha256(data).hexdigest()[:32]


def chunk_digests(data: bytes | memoryview) -> tuple[str, ...]:
  return tuple(chunk_digest(data[i:i + CHUNK_BYTES]) for i in range(0, max(len(data), 1), CHUNK_BYTES))


def write_shard(directory: epath.Path, name: str, pieces: list[np.ndarray], lengths: list[int],
                utf8_bytes: int) -> Shard:
  """Write a shard ``name`` of documents whose tokens (in the shard's dtype, each document ending with EOS) are
  ``pieces`` concatenated and whose token counts are ``lengths``."""
  starts = np.cumsum([0] + lengths[:-1], dtype=np.int64)
  tokens = memoryview(np.concatenate(pieces)).cast("B")  # the shard's bytes, not copied again
  if len(tokens) != sum(lengths) * pieces[0].itemsize:
    raise ValueError(f"shard {name}: {len(tokens)} token bytes for documents of {sum(lengths)} tokens")
  docs = starts.astype("<i8").tobytes()
  write_atomic(directory / f"{name}{DOCS}", docs)
  write_atomic(directory / f"{name}{TOKENS}", tokens)
  return Shard(name, sum(lengths), len(lengths), utf8_bytes, chunk_digests(tokens), hashlib.sha256(docs).hexdigest())


def write_manifest(directory: epath.Path, manifest: Manifest) -> None:
  write_atomic(directory / MANIFEST, manifest.to_json().encode())


def read_manifest(directory: str | os.PathLike) -> Manifest:
  """The manifest of a prepared directory.

  Raises:
    DataError: no manifest (not prepared, or its preparation has not finished), or one :meth:`Manifest.from_json`
      refuses.
  """
  path = epath.Path(directory) / MANIFEST
  if not path.exists():
    raise DataError(f"{directory} has no {MANIFEST}: it is not a prepared dataset, or its preparation has not "
                    "finished (python -m jaxshare.data prepare --out DIR ... resumes it)")
  return Manifest.from_json(path.read_text(), str(path))


def check_shard_files(directory: epath.Path, shard: Shard, dtype: np.dtype) -> None:
  """What opening a shard checks: both files exist with the manifest's sizes, and the document offsets match their
  checksum (the tokens are checked chunk by chunk as they are read: :func:`verify_chunk`).

  Raises:
    DataError: naming the file and what is wrong.
  """
  for suffix, size in ((TOKENS, shard.tokens * dtype.itemsize), (DOCS, shard.documents * 8)):
    path = directory / f"{shard.name}{suffix}"
    if not path.exists():
      raise DataError(f"shard file {path} is missing (the manifest lists it): restore it or prepare the data again")
    actual = path.stat().length
    if actual != size:
      raise DataError(f"shard file {path} has {actual} bytes, the manifest says {size}: it is truncated or was "
                      "replaced; prepare the data again")
  docs = directory / f"{shard.name}{DOCS}"
  if hashlib.sha256(docs.read_bytes()).hexdigest() != shard.docs_sha256:
    raise DataError(f"shard file {docs} does not match its checksum in the manifest: it is corrupt; prepare the data "
                    "again")


def verify_chunk(directory: epath.Path, shard: Shard, chunk: int, data: bytes | memoryview) -> None:
  """Check chunk ``chunk`` (bytes ``[chunk * CHUNK_BYTES, ...)``) of a shard's tokens file against the manifest.

  Raises:
    DataError: naming the file and the byte range.
  """
  if chunk_digest(data) != shard.tokens_sha256[chunk]:
    start = chunk * CHUNK_BYTES
    raise DataError(f"shard file {directory / (shard.name + TOKENS)} does not match its checksum in the manifest at "
                    f"bytes [{start}, {start + len(data)}): it is corrupt; prepare the data again")


def verify_shard(directory: epath.Path, shard: Shard, dtype: np.dtype) -> None:
  """Check a whole shard: :func:`check_shard_files` and every chunk of its tokens.

  Raises:
    DataError: naming the file and what is wrong.
  """
  check_shard_files(directory, shard, dtype)
  with (directory / f"{shard.name}{TOKENS}").open("rb") as f:
    for chunk in range(len(shard.tokens_sha256)):
      verify_chunk(directory, shard, chunk, f.read(CHUNK_BYTES))


def read_shard(directory: epath.Path, shard: Shard, dtype: np.dtype, verify: bool = True
               ) -> tuple[np.ndarray, np.ndarray]:
  """``(tokens, document starts)`` of a shard, verified first (:func:`verify_shard`) unless its writer reads it back:
  memory maps for local files, arrays read whole otherwise."""
  if verify:
    verify_shard(directory, shard, dtype)
  paths = directory / f"{shard.name}{TOKENS}", directory / f"{shard.name}{DOCS}"
  if all(os.path.exists(str(p)) for p in paths):
    return tuple(np.memmap(str(p), dtype=t, mode="r", shape=(n,))
                 for p, t, n in zip(paths, (dtype, np.dtype("<i8")), (shard.tokens, shard.documents)))
  return tuple(np.frombuffer(p.read_bytes(), dtype=t) for p, t in zip(paths, (dtype, np.dtype("<i8"))))


def manifest_summary(m: Manifest) -> dict[str, Any]:
  """Counts of a manifest for a log line."""
  return {"shards": len(m.shards), "documents": m.num_documents, "tokens": m.num_tokens, "dtype": m.dtype,
          **{f"{k}_tokens": b - a for k, (a, b) in m.splits.items()}}
