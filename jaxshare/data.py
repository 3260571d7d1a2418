"""Input pipeline: documents -> tokens -> fixed-length packed windows -> shuffled grain batches.

Documents come from a local text file (optionally split at a separator), a JSONL file, or a TFDS dataset read
with ``tfds.data_source`` (ArrayRecord, no TensorFlow). Every document is tokenised and followed by EOS; the
token stream is split into train (first ``1 - val_fraction``) and validation (the rest), then cut into windows of
``seq_len + 1`` tokens. Each window carries ``segment_ids`` and per-document ``positions`` so documents packed into
one sequence never attend to each other, and ``loss_mask`` drops the target that crosses a document boundary.

The training order is a deterministic grain shuffle, reshuffled each epoch; the iterator state is saved in
checkpoints so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import warnings
from pathlib import Path
from typing import Iterator, Protocol

import grain
import jax
import numpy as np

from jaxshare.config import TOKEN_CACHE_ENV, DataConfig, resolve_data_dir


class DataError(ValueError):
  """Missing, empty, binary, unreadable or malformed input data; the message says what was expected."""


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

  def decode(self, ids: list[int]) -> str:
    return bytes(int(i) for i in ids if 0 < int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
  """A local Hugging Face tokenizer directory (``tokenizer.json`` etc.); never downloads."""

  def __init__(self, path: str):
    if not Path(path).is_dir():
      raise DataError(f"data.tokenizer={path!r} is neither 'byte' nor an existing tokenizer directory")
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

  def decode(self, ids: list[int]) -> str:
    return self._tok.decode([int(i) for i in ids])


def make_tokenizer(cfg: DataConfig) -> Tokenizer:
  return ByteTokenizer() if cfg.tokenizer == "byte" else HFTokenizer(cfg.tokenizer)


def resolve_path(cfg: DataConfig) -> Path:
  p = Path(cfg.path).expanduser()
  return p if p.is_absolute() else resolve_data_dir(cfg) / p


def _read_text(path: Path, what: str) -> str:
  if not path.exists():
    raise DataError(f"data.path: {what} {str(path)!r} does not exist (expected a UTF-8 text file; set data.path, "
                    "data.data_dir or $JAXSHARE_DATA_DIR)")
  if not path.is_file():
    raise DataError(f"data.path: {what} {str(path)!r} is not a regular file")
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"data.path: {what} {str(path)!r} is unreadable: {e.strerror}") from e
  if not raw.strip():
    raise DataError(f"data.path: {what} {str(path)!r} is empty (expected UTF-8 text)")
  if b"\x00" in raw[:1 << 20]:
    raise DataError(f"data.path: {what} {str(path)!r} looks binary (contains NUL bytes); expected UTF-8 text")
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise DataError(f"data.path: {what} {str(path)!r} is not valid UTF-8 text (byte {e.start}): expected a "
                    "UTF-8 text file") from e


def _jsonl_documents(path: Path, field: str) -> list[str]:
  docs = []
  for n, line in enumerate(_read_text(path, "JSONL file").splitlines(), start=1):
    if not line.strip():
      continue
    try:
      rec = json.loads(line)
    except json.JSONDecodeError as e:
      raise DataError(f"data.path: {str(path)!r} line {n} is not valid JSON ({e.msg}); expected one JSON object "
                      "per line") from e
    if not isinstance(rec, dict) or not isinstance(rec.get(field), str):
      raise DataError(f"data.path: {str(path)!r} line {n} has no string field {field!r} (data.text_field)")
    docs.append(rec[field])
  return docs


def _tfds_documents(cfg: DataConfig) -> list[str]:
  import tensorflow_datasets as tfds  # heavy import, only when asked for

  try:
    source = tfds.data_source(cfg.tfds_name, split=cfg.tfds_split, data_dir=cfg.tfds_data_dir or None,
                              download=False)
  except Exception as e:  # tfds raises many types for a missing dataset
    raise DataError(f"data.tfds_name={cfg.tfds_name!r} split {cfg.tfds_split!r} could not be opened from "
                    f"data.tfds_data_dir={cfg.tfds_data_dir!r}: {e}") from e
  docs = []
  for i in range(len(source)):
    rec = source[i]
    if cfg.text_field not in rec:
      raise DataError(f"data.text_field={cfg.text_field!r} is not a feature of {cfg.tfds_name} "
                      f"(features: {sorted(rec)})")
    val = rec[cfg.text_field]
    docs.append(val.decode("utf-8") if isinstance(val, bytes) else str(val))
  return docs


def load_documents(cfg: DataConfig) -> list[str]:
  """The corpus as a list of documents.

  Raises:
    DataError: the source is missing, empty, binary, unreadable or malformed.
  """
  if cfg.source == "text":
    text = _read_text(resolve_path(cfg), "text file")
    docs = text.split(cfg.document_separator) if cfg.document_separator else [text]
  elif cfg.source == "jsonl":
    docs = _jsonl_documents(resolve_path(cfg), cfg.text_field)
  else:
    docs = _tfds_documents(cfg)
  docs = [d for d in docs if d]
  if not docs:
    raise DataError(f"data source {cfg.source!r} yielded no non-empty documents")
  return docs


class TokenStream:
  """Tokens of all documents, each followed by EOS, with the document index and in-document position of every token
  (int32 arrays; memory maps when read from the token cache)."""

  def __init__(self, tokens: np.ndarray, doc_ids: np.ndarray, positions: np.ndarray):
    self.tokens, self.doc_ids, self.positions = tokens, doc_ids, positions

  @classmethod
  def from_documents(cls, docs: list[str], tokenizer: Tokenizer) -> "TokenStream":
    ids, doc_ids = [], []
    for n, doc in enumerate(docs):
      toks = tokenizer.encode(doc) + [tokenizer.eos_id]
      ids.append(np.asarray(toks, np.int32))
      doc_ids.append(np.full(len(toks), n, np.int32))
    tokens, doc_ids = np.concatenate(ids), np.concatenate(doc_ids)
    starts = np.flatnonzero(np.r_[True, doc_ids[1:] != doc_ids[:-1]])
    positions = np.arange(len(tokens)) - np.repeat(starts, np.diff(np.r_[starts, len(tokens)]))
    return cls(tokens, doc_ids, positions.astype(np.int32))

  def split(self, val_fraction: float) -> tuple[slice, slice]:
    n_val = int(round(len(self.tokens) * val_fraction))
    cut = len(self.tokens) - n_val
    return slice(0, cut), slice(cut, len(self.tokens))


_STREAM_ARRAYS = ("tokens", "doc_ids", "positions")


def token_cache_dir(cfg: DataConfig) -> Path | None:
  """Where tokenized corpora are cached (None: ``data.token_cache=off``)."""
  if cfg.token_cache == "off":
    return None
  if cfg.token_cache:
    return Path(cfg.token_cache).expanduser()
  return Path(os.environ.get(TOKEN_CACHE_ENV) or Path.home() / ".cache" / "jaxshare" / "tokens")


def _fingerprint(cfg: DataConfig) -> str:
  """What the token stream depends on: the source (a file by path, size and modification time; a TFDS split by
  name) and the tokenizer (a directory by its files' contents)."""
  if cfg.source == "tfds":
    source = [cfg.tfds_name, cfg.tfds_split, cfg.tfds_data_dir, cfg.text_field]
  else:
    path = resolve_path(cfg).resolve()
    st = path.stat()
    source = [str(path), st.st_size, st.st_mtime_ns, cfg.document_separator, cfg.text_field]
  if cfg.tokenizer == "byte":
    tok: list = ["byte"]
  else:
    tok = [(f.name, hashlib.sha256(f.read_bytes()).hexdigest()) for f in sorted(Path(cfg.tokenizer).iterdir())
           if f.is_file()]
  blob = json.dumps([cfg.source, source, tok])
  return hashlib.sha256(blob.encode()).hexdigest()[:24]


def cached_token_stream(cfg: DataConfig, tokenizer: Tokenizer) -> TokenStream:
  """The corpus's :class:`TokenStream`, tokenized once and memory-mapped after.

  The arrays live as ``.npy`` files under :func:`token_cache_dir` keyed by :func:`_fingerprint`. The first process
  to get the directory's lock tokenizes and publishes them with an atomic rename; every other process on the same
  filesystem (the 8 processes of a GPU node, all hosts of a shared NFS) waits for it and maps the same pages, so a
  multi-host run does not hold one copy of the corpus per process.

  Raises:
    DataError: the source is missing, empty, binary, unreadable or malformed (as :func:`load_documents`).
  """
  root = token_cache_dir(cfg)
  if root is None or (cfg.source != "tfds" and not resolve_path(cfg).is_file()):
    return TokenStream.from_documents(load_documents(cfg), tokenizer)  # no cache, or let the reader say what's wrong
  key = root / _fingerprint(cfg)
  try:
    root.mkdir(parents=True, exist_ok=True)
    if not key.is_dir():
      with open(root / f"{key.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one tokenizer per filesystem; the others wait here and then read
        if not key.is_dir():
          stream = TokenStream.from_documents(load_documents(cfg), tokenizer)
          tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{key.name}-"))
          for name in _STREAM_ARRAYS:
            np.save(tmp / f"{name}.npy", getattr(stream, name))
          os.replace(tmp, key)
    return TokenStream(*(np.load(key / f"{name}.npy", mmap_mode="r") for name in _STREAM_ARRAYS))
  except OSError as e:  # unwritable cache (read-only home, full disk): tokenize in memory, say so once
    warnings.warn(f"data.token_cache: {root} is not usable ({e.strerror or e}); tokenizing in memory")
    return TokenStream.from_documents(load_documents(cfg), tokenizer)


class WindowSource:
  """Random-access windows of ``seq_len + 1`` tokens of one split (a grain ``RandomAccessDataSource``).

  Item ``i`` is a dict of int32 ``[seq_len]`` arrays: ``inputs``, ``targets``, ``positions``, ``segment_ids``
  (1-based, per window) and ``loss_mask`` (0 where the target belongs to the next document).
  """

  def __init__(self, stream: TokenStream, span: slice, seq_len: int, name: str):
    self.stream, self.start, self.seq_len = stream, span.start, seq_len
    self.n = (span.stop - span.start - 1) // seq_len
    if self.n < 1:
      raise DataError(f"the {name} split has {span.stop - span.start} tokens, fewer than data.seq_len + 1 = "
                      f"{seq_len + 1}: use a larger corpus, a smaller data.seq_len or another data.val_fraction")

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    a = self.start + int(i) * self.seq_len
    s = self.stream
    tok, doc, pos = (np.array(x[a:a + self.seq_len + 1]) for x in (s.tokens, s.doc_ids, s.positions))
    seg = (doc - doc[0] + 1).astype(np.int32)
    return {"inputs": tok[:-1], "targets": tok[1:], "positions": pos[:-1], "segment_ids": seg[:-1],
            "loss_mask": (doc[1:] == doc[:-1]).astype(np.int32)}


def batch_rows(process_index: int, process_count: int, batch_size: int) -> slice:
  """The rows of every global batch that process ``process_index`` of ``process_count`` feeds: one contiguous block,
  so the global batch is the same sequences in the same order whatever the process count."""
  if batch_size % process_count:
    raise DataError(f"train.batch_size={batch_size} must divide by the process count {process_count}")
  local = batch_size // process_count
  return slice(process_index * local, (process_index + 1) * local)


def _block_rows(ds: grain.MapDataset, batch_size: int, rows: slice, num_batches: int) -> grain.MapDataset:
  """Element ``i`` is row ``rows.start + i % n`` of global batch ``i // n`` of ``ds`` (``n`` rows per batch): only this
  process's windows are ever read."""
  n = rows.stop - rows.start
  return grain.MapDataset.range(num_batches * n).map(lambda i: ds[(i // n) * batch_size + rows.start + i % n])


class Datasets:
  """Train and validation pipelines of one corpus.

  Every global batch of ``batch_size`` sequences is the same whatever the number of processes; each process reads
  only its :attr:`rows` of it (default: block ``process_index`` of ``process_count`` equal blocks; the training loop
  sets the rows its devices hold, :func:`jaxshare.parallel.local_batch_rows`).
  """

  def __init__(self, cfg: DataConfig, batch_size: int, *, tokenizer: Tokenizer | None = None,
               process_index: int | None = None, process_count: int | None = None):
    self.cfg = cfg
    self.batch_size = batch_size
    self.tokenizer = tokenizer or make_tokenizer(cfg)
    self.stream = cached_token_stream(cfg, self.tokenizer)
    train_span, val_span = self.stream.split(cfg.val_fraction)
    self.train_source = WindowSource(self.stream, train_span, cfg.seq_len, "training")
    self.val_source = WindowSource(self.stream, val_span, cfg.seq_len, "validation")
    self.rows = batch_rows(jax.process_index() if process_index is None else process_index,
                           jax.process_count() if process_count is None else process_count, batch_size)
    val_tokens = self.stream.tokens[val_span]
    # UTF-8 bytes per validation token, to report bits per byte for any tokenizer.
    self.bytes_per_token = len(self.tokenizer.decode(val_tokens.tolist()).encode("utf-8")) / len(val_tokens)
    if len(self.val_source) < batch_size:
      raise DataError(f"the validation split has {len(self.val_source)} sequences, fewer than one batch of "
                      f"{batch_size}: raise data.val_fraction or lower train.batch_size")

  @property
  def local_batch(self) -> int:
    return self.rows.stop - self.rows.start

  def train_iter(self) -> grain.DatasetIterator:
    """Endless, per-epoch reshuffled batches (this process's :attr:`rows` of each global batch);
    ``get_state``/``set_state`` resume exactly."""
    rows = self.rows
    ds = grain.MapDataset.source(self.train_source).shuffle(seed=self.cfg.shuffle_seed).repeat(None)
    ds = _block_rows(ds, self.batch_size, rows, len(ds) // self.batch_size)
    return iter(ds.batch(rows.stop - rows.start, drop_remainder=True).to_iter_dataset())

  def val_batches(self, max_batches: int = 0) -> Iterator[dict[str, np.ndarray]]:
    """The validation split in order, in global batches (this process's :attr:`rows` of each); ``max_batches`` 0
    means all."""
    rows = self.rows
    total = len(self.val_source) // self.batch_size
    n = total if not max_batches else min(max_batches, total)
    ds = _block_rows(grain.MapDataset.source(self.val_source), self.batch_size, rows, n)
    ds = ds.batch(rows.stop - rows.start, drop_remainder=True)
    for i in range(n):
      yield ds[i]
