"""Reading a prepared directory (:mod:`jaxshare.data.shards`) as one token stream, lazily.

Opening reads only the manifest, so start-up time and memory do not grow with the corpus. A shard's files are opened
(their sizes and document offsets checked against the manifest) the first time a window touches them, and each 4 MiB
chunk of tokens is verified against its checksum the first time a window reads it; local shards are memory-mapped,
remote ones (gs://, any ``etils.epath`` path) read by byte range. Document ids and in-document
positions are derived from the shards' document offsets when a window is read.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from etils import epath

from jaxshare.data.errors import DataError
from jaxshare.data.shards import CHUNK_BYTES, DOCS, TOKENS, Manifest, check_shard_files, read_manifest, verify_chunk
from jaxshare.data.tokenizers import tokenizer_fingerprint


class _RemoteTokens:
  """Byte-range reads of a remote tokens file (one open handle per shard)."""

  def __init__(self, path: epath.Path, dtype: np.dtype, n: int):
    self._file, self._dtype, self._n, self._lock = path.open("rb"), dtype, n, threading.Lock()

  def __len__(self) -> int:
    return self._n

  def __getitem__(self, s: slice) -> np.ndarray:
    return np.frombuffer(self.read_bytes(s.start * self._dtype.itemsize, (s.stop - s.start) * self._dtype.itemsize),
                         self._dtype)

  def read_bytes(self, offset: int, size: int) -> bytes:
    with self._lock:
      self._file.seek(offset)
      return self._file.read(size)


class _LocalTokens:
  """A local tokens file: windows through a memory map, checksum chunks through ``pread`` (hashing a chunk then
  leaves no 4 MiB of mapped pages resident for each window read)."""

  def __init__(self, path: str, dtype: np.dtype, n: int):
    self._map = np.memmap(path, dtype=dtype, mode="r", shape=(n,))
    self._fd = os.open(path, os.O_RDONLY)

  def __len__(self) -> int:
    return len(self._map)

  def __getitem__(self, s: slice) -> np.ndarray:
    return self._map[s]

  def read_bytes(self, offset: int, size: int) -> bytes:
    return os.pread(self._fd, size, offset)


class PreparedTokens:
  """The token stream of a prepared directory: :meth:`read` returns any token range with its document ids and
  in-document positions, as :class:`~jaxshare.data.pipeline.TokenStream` does for an in-memory corpus.

  Args:
    directory: the prepared directory (local or remote).
    tokenizer: the ``data.tokenizer`` the run tokenizes prompts with; must be the one the data was prepared with.

  Raises:
    DataError: no or unreadable manifest, another format version, or a tokenizer other than the manifest's.
  """

  def __init__(self, directory: str | os.PathLike, tokenizer: str):
    self.directory = epath.Path(directory)
    self.manifest: Manifest = read_manifest(self.directory)
    m = self.manifest
    if tokenizer_fingerprint(tokenizer) != m.tokenizer_fingerprint:
      raise DataError(f"data.tokenizer={tokenizer!r} is not the tokenizer {self.directory} was prepared with "
                      f"({m.tokenizer!r}, fingerprint {m.tokenizer_fingerprint}): set data.tokenizer to it, or "
                      "prepare the data again with this one")
    self.dtype = np.dtype(m.dtype)
    self.offsets = np.cumsum([0] + [s.tokens for s in m.shards])  # first token of each shard
    self.doc_bases = np.cumsum([0] + [s.documents for s in m.shards])  # first document of each shard
    self._open: dict[int, tuple[_LocalTokens | _RemoteTokens, np.ndarray]] = {}
    self._verified: set[tuple[int, int]] = set()  # (shard, checksum chunk) pairs read and found intact
    self._lock = threading.Lock()

  def __len__(self) -> int:
    return int(self.offsets[-1])

  def split(self, name: str) -> slice:
    start, stop = self.manifest.splits[name]
    return slice(start, stop)

  @property
  def validation_bytes_per_token(self) -> float:
    start, stop = self.manifest.splits["validation"]
    return self.manifest.validation_utf8_bytes / max(stop - start, 1)

  def _shard(self, k: int) -> tuple[_LocalTokens | _RemoteTokens, np.ndarray]:
    with self._lock:
      if k not in self._open:
        shard = self.manifest.shards[k]
        check_shard_files(self.directory, shard, self.dtype)
        tokens_path, docs_path = (self.directory / f"{shard.name}{s}" for s in (TOKENS, DOCS))
        starts = np.frombuffer(docs_path.read_bytes(), "<i8")
        if os.path.exists(str(tokens_path)):
          tokens = _LocalTokens(str(tokens_path), self.dtype, shard.tokens)
        else:
          tokens = _RemoteTokens(tokens_path, self.dtype, shard.tokens)
        self._open[k] = tokens, starts
      return self._open[k]

  def _verify(self, k: int, tokens: _LocalTokens | _RemoteTokens, lo: int, hi: int) -> None:
    """Verify the checksum chunks of shard ``k`` that tokens ``[lo, hi)`` lie in, the first time each is read."""
    size = len(tokens) * self.dtype.itemsize
    first, last = lo * self.dtype.itemsize // CHUNK_BYTES, (hi * self.dtype.itemsize - 1) // CHUNK_BYTES
    for chunk in range(first, last + 1):
      if (k, chunk) not in self._verified:
        start = chunk * CHUNK_BYTES
        verify_chunk(self.directory, self.manifest.shards[k], chunk,
                     tokens.read_bytes(start, min(CHUNK_BYTES, size - start)))
        self._verified.add((k, chunk))

  def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, document ids, positions)`` of tokens ``[start, stop)`` of the stream, int32 (document ids int64:
    the document's index in the corpus).

    Raises:
      DataError: a shard file the range reads is missing, truncated or does not match its checksum.
    """
    if not 0 <= start <= stop <= len(self):
      raise IndexError(f"token range [{start}, {stop}) outside the stream of {len(self)} tokens")
    parts = []
    k = int(np.searchsorted(self.offsets, start, side="right")) - 1
    while start < stop:
      tokens, starts = self._shard(k)
      lo, hi = start - self.offsets[k], min(stop, self.offsets[k + 1]) - self.offsets[k]
      self._verify(k, tokens, int(lo), int(hi))
      local = np.arange(lo, hi)
      doc = np.searchsorted(starts, local, side="right") - 1
      parts.append((np.asarray(tokens[lo:hi], np.int32), doc + self.doc_bases[k], (local - starts[doc]).astype(np.int32)))
      start, k = int(self.offsets[k] + hi), k + 1
    if not parts:
      return np.zeros(0, np.int32), np.zeros(0, np.int64), np.zeros(0, np.int32)
    return tuple(np.concatenate(p) for p in zip(*parts))
