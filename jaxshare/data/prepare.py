"""Tokenize a corpus once, in parallel, into token shards and a manifest (:mod:`jaxshare.data.shards`).

Documents stream from the inputs in order (:func:`~jaxshare.data.documents.iter_documents`); batches of them are
tokenized by ``workers`` processes (HF tokenizers' batch encode for BPE) with a bounded number of batches in flight,
and written in input order, so memory is bounded by the batches in flight and one shard, and the output is the same
bytes whatever the number of workers. Shards close at document boundaries once they reach ``shard_tokens``.

Every finished shard is recorded in ``DIR/.prepare-state.json`` with the number of documents it brings the
preparation to; a preparation killed at any point and run again with the same inputs and options keeps its finished
shards and continues after their last document. The manifest is written last: a directory with one is complete.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import itertools
import json
import multiprocessing
import os
import time
from typing import Iterable, Iterator, Sequence

import numpy as np
from etils import epath
from tqdm import tqdm

from jaxshare.data.documents import Input, expand_inputs, iter_documents
from jaxshare.data.errors import DataError
from jaxshare.data.shards import (FORMAT_VERSION, MANIFEST, Manifest, Shard, read_manifest, read_shard, token_dtype,
                                  write_manifest, write_shard)
from jaxshare.data.tokenizers import (BackendTokenizer, ByteTokenizer, HFTokenizer, Tokenizer, encoding_tokenizer,
                                     make_tokenizer, tokenizer_fingerprint)

STATE = ".prepare-state.json"
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MB of uint16 tokens per shard


@dataclasses.dataclass(frozen=True)
class PrepareOptions:
  """What the prepared tokens depend on (besides the inputs' contents); the ``workers`` count is not among them.

  Attributes:
    tokenizer: ``byte`` or a local Hugging Face tokenizer directory.
    separator: split text files into documents at this string (empty: one document per file).
    text_field: the text of JSONL records, parquet and ``datasets`` columns, TFDS features.
    tfds_data_dir: where ``tfds:`` inputs are prepared (empty: TFDS's default).
    val_docs: hold out the last ``val_docs`` documents for validation; or
    val_fraction: hold out the last documents that make up this share of the tokens. The cut falls on the document
      boundary nearest to it, or inside a document when that boundary would leave a split empty (one document:
      the tail of the stream, as the token cache splits it).
    shard_tokens: a shard closes after the document that brings it to this many tokens.
    batch_docs: documents per tokenization batch.
    skip_bad_docs: skip unreadable, non-UTF-8 or malformed documents and files, counting them, instead of stopping.
  """

  tokenizer: str = "byte"
  separator: str = ""
  text_field: str = "text"
  tfds_data_dir: str = ""
  val_docs: int = 0
  val_fraction: float = 0.0
  shard_tokens: int = DEFAULT_SHARD_TOKENS
  batch_docs: int = 1024
  skip_bad_docs: bool = False

  def check(self) -> None:
    """Raises DataError naming a field that is out of range."""
    if self.val_docs < 0 or not 0.0 <= self.val_fraction < 1.0 or (self.val_docs and self.val_fraction):
      raise DataError(f"--val-docs={self.val_docs} / --val-fraction={self.val_fraction}: give at most one, "
                      "--val-docs >= 0 or 0 <= --val-fraction < 1")
    if self.shard_tokens < 1 or self.batch_docs < 1:
      raise DataError(f"--shard-tokens={self.shard_tokens} and --batch-docs={self.batch_docs} must be >= 1")


_worker_tokenizer: Tokenizer | None = None


def _init_worker(tokenizer: tuple[str, int, int] | str) -> None:
  """A worker's tokenizer: the main process's Rust backend (:meth:`HFTokenizer.backend_args`; no transformers
  import), or a tokenizer's name."""
  global _worker_tokenizer
  os.environ["RAYON_NUM_THREADS"] = "1"  # one thread per worker (before tokenizers starts its pool): workers are the
  # parallelism, and more threads than cores only contend
  _worker_tokenizer = make_tokenizer(tokenizer) if isinstance(tokenizer, str) else BackendTokenizer(*tokenizer)


def _encode(docs: list[str | DataError], tokenizer: Tokenizer, dtype: np.dtype
            ) -> tuple[np.ndarray, list[int], list[int]]:
  """A batch's tokens: every document's tokens followed by EOS, concatenated (in ``dtype``), with each document's
  token count and UTF-8 byte count (0 and 0 for a skipped bad document, a DataError in its place). One array per
  batch, not per document: the per-document NumPy calls cost more than byte-level tokenization itself."""
  texts = [d for d in docs if isinstance(d, str)]
  if isinstance(tokenizer, ByteTokenizer):  # the UTF-8 bytes are the ids, and EOS is the byte 0
    raw = [t.encode("utf-8") for t in texts]
    tokens = np.frombuffer(b"\0".join(raw) + b"\0" if raw else b"", np.uint8).astype(dtype)
    counts, sizes = iter([len(r) + 1 for r in raw]), iter([len(r) for r in raw])
  else:
    batched = isinstance(tokenizer, (HFTokenizer, BackendTokenizer))
    ids = tokenizer.encode_batch(texts) if batched else [tokenizer.encode(t) for t in texts]
    tokens = np.fromiter(itertools.chain.from_iterable(i + [tokenizer.eos_id] for i in ids), dtype,
                         sum(len(i) + 1 for i in ids))
    counts, sizes = iter([len(i) + 1 for i in ids]), iter([len(t.encode("utf-8")) for t in texts])
  lengths, utf8 = [], []
  for d in docs:
    good = isinstance(d, str)
    lengths.append(next(counts) if good else 0)
    utf8.append(next(sizes) if good else 0)
  return tokens, lengths, utf8


def _encode_in_worker(args: tuple[list[str | DataError], str]) -> tuple[np.ndarray, list[int], list[int]]:
  docs, dtype = args
  return _encode(docs, _worker_tokenizer, np.dtype(dtype))


def preparation_fingerprint(inputs: Sequence[str | Input], options: PrepareOptions) -> str:
  """What a preparation's output depends on: the inputs (local files by path, size and modification time; others by
  name), the options and the tokenizer's files (24 hex digits).

  Raises:
    DataError: an input that does not exist, or a tokenizer that is neither ``byte`` nor a directory.
  """
  return _fingerprint(expand_inputs(list(inputs)), options, tokenizer_fingerprint(options.tokenizer))


def _fingerprint(inputs: Sequence[Input], options: PrepareOptions, tok_fingerprint: str) -> str:
  described = []
  for i in inputs:
    p = epath.Path(i.path)
    try:
      st = p.stat()
      described.append([i.kind, i.path, st.length, st.mtime])
    except (OSError, FileNotFoundError, ValueError):
      described.append([i.kind, i.path])
  settings = {k: v for k, v in dataclasses.asdict(options).items() if k != "batch_docs"}  # batches change no byte
  blob = json.dumps([FORMAT_VERSION, described, settings, tok_fingerprint], default=str)
  return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _batched(docs: Iterable[str | DataError], n: int) -> Iterator[list[str | DataError]]:
  batch: list[str | DataError] = []
  for d in docs:
    batch.append(d)
    if len(batch) == n:
      yield batch
      batch = []
  if batch:
    yield batch


def _ordered_map(batches: Iterator[list[str | DataError]], dtype: np.dtype, workers: int, tokenizer: Tokenizer,
                 spec: str) -> Iterator[tuple[list[str | DataError], np.ndarray, list[int], list[int]]]:
  """``(batch, its tokens, its documents' token counts, their UTF-8 byte counts)`` in input order, at most
  ``2 * workers`` batches in flight (memory stays bounded). Byte-level tokenization stays in this process: it is a
  copy, which sending batches to workers and tokens back would only slow down (measured by scripts/bench_data.py)."""
  if workers <= 1 or isinstance(tokenizer, ByteTokenizer):
    for b in batches:
      yield b, *_encode(b, tokenizer, dtype)
    return
  backend = tokenizer.backend_args() if isinstance(tokenizer, (HFTokenizer, BackendTokenizer)) else None
  ctx = multiprocessing.get_context("spawn")  # no fork of a process that may hold JAX or tokenizer threads
  with ctx.Pool(workers, initializer=_init_worker, initargs=(backend or spec,)) as pool:
    pending: collections.deque = collections.deque()
    for b in batches:
      pending.append((b, pool.apply_async(_encode_in_worker, ((b, dtype.str),))))
      if len(pending) >= 2 * workers:
        b, result = pending.popleft()
        yield b, *result.get()
    while pending:
      b, result = pending.popleft()
      yield b, *result.get()


@dataclasses.dataclass
class _State:
  """The resumable progress of a preparation (``.prepare-state.json``)."""

  fingerprint: str
  shards: list[Shard]
  documents: int  # documents of the input stream consumed by the finished shards
  skipped: int

  def write(self, directory: epath.Path) -> None:
    tmp = directory / f".{STATE}.tmp"
    tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "shards": [dataclasses.asdict(s) for s in self.shards],
                               "documents": self.documents, "skipped": self.skipped}))
    tmp.replace(directory / STATE)

  @classmethod
  def read(cls, directory: epath.Path, fingerprint: str) -> "_State":
    path = directory / STATE
    if path.exists():
      try:
        d = json.loads(path.read_text())
        state = cls(d["fingerprint"], [Shard(**s) for s in d["shards"]], int(d["documents"]), int(d["skipped"]))
      except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        state = None
      if state is not None and state.fingerprint == fingerprint and all(
          (directory / f"{s.name}.tokens").exists() for s in state.shards):
        return state
    return cls(fingerprint, [], 0, 0)


def _split_point(out: epath.Path, shards: list[Shard], dtype: np.dtype, options: PrepareOptions) -> int:
  """Where the validation split starts in the token stream (see :class:`PrepareOptions`); reads the document offsets
  of one shard only."""
  offsets = np.cumsum([0] + [s.tokens for s in shards])
  total = int(offsets[-1])
  num_docs = sum(s.documents for s in shards)
  if options.val_docs:
    if options.val_docs >= num_docs:
      raise DataError(f"--val-docs={options.val_docs} holds out every one of the corpus's {num_docs} documents: "
                      "lower it")
    first = num_docs - options.val_docs  # the first validation document, and the shard holding it
    k = int(np.searchsorted(np.cumsum([s.documents for s in shards]), first, side="right"))
    return int(offsets[k] + read_shard(out, shards[k], dtype, verify=False)[1][first - sum(
      s.documents for s in shards[:k])])
  if not options.val_fraction:
    return total
  target = total - int(round(total * options.val_fraction))
  k = min(int(np.searchsorted(offsets, target, side="right")) - 1, len(shards) - 1)
  boundaries = np.append(read_shard(out, shards[k], dtype, verify=False)[1] + offsets[k], offsets[k + 1])
  nearest = int(boundaries[np.argmin(np.abs(boundaries - target))])
  return nearest if 0 < nearest < total else target


def prepare(inputs: Sequence[str | Input], out: str | os.PathLike, options: PrepareOptions = PrepareOptions(), *,
            workers: int = 1, progress: bool = True) -> Manifest:
  """Tokenize ``inputs`` into ``out`` (local or any ``etils.epath`` path); resumes an interrupted preparation.

  Args:
    inputs: files, directories, globs of UTF-8 text (``options.separator``), JSONL (``.gz``/``.zst``), parquet,
      ``datasets`` directories saved to disk, ``tfds:NAME/SPLIT``; or :class:`~jaxshare.data.documents.Input`
      objects of a known kind.
    workers: tokenizer processes (1: in this process).

  Returns:
    The manifest written to ``out/manifest.json``.

  Raises:
    DataError: bad options, inputs that do not exist or (without ``skip_bad_docs``) a bad document, no documents,
      or ``out`` holding a finished preparation of other inputs or options.
  """
  options.check()
  out = epath.Path(out)
  found = expand_inputs(list(inputs))
  tok_fingerprint = tokenizer_fingerprint(options.tokenizer)
  fingerprint = _fingerprint(found, options, tok_fingerprint)
  if (out / MANIFEST).exists():
    manifest = read_manifest(out)
    if manifest.preparation == fingerprint:
      return manifest
    raise DataError(f"{out} holds a finished preparation of other inputs or options: choose another --out or "
                    "delete it")
  out.mkdir(parents=True, exist_ok=True)
  tokenizer = encoding_tokenizer(options.tokenizer, tok_fingerprint)
  dtype = token_dtype(tokenizer.vocab_size)
  state = _State.read(out, fingerprint)

  def documents() -> Iterator[str | DataError]:
    for source in found:
      yield from iter_documents(source, separator=options.separator, text_field=options.text_field,
                                tfds_data_dir=options.tfds_data_dir, skip_bad=options.skip_bad_docs)

  stream = documents()
  for _ in range(state.documents):  # resume: the finished shards' documents are read again, not tokenized
    next(stream)
  bar = tqdm(desc=f"prepare {out.name}", unit="B", unit_scale=True, disable=not progress, dynamic_ncols=True)
  t0, tokens_done = time.perf_counter(), 0
  pieces: list[np.ndarray] = []  # the open shard's tokens, in pieces of batches
  lengths: list[int] = []  # its documents' token counts
  shard_bytes = shard_tokens = 0
  consumed, skipped = state.documents, state.skipped

  def close_shard() -> None:
    nonlocal pieces, lengths, shard_bytes, shard_tokens
    shard = write_shard(out, f"shard-{len(state.shards):05d}", pieces, lengths, shard_bytes)
    state.shards.append(shard)
    state.documents, state.skipped = consumed, skipped
    state.write(out)
    pieces, lengths, shard_bytes, shard_tokens = [], [], 0, 0

  for batch, tokens, counts, sizes in _ordered_map(_batched(stream, options.batch_docs), dtype, workers, tokenizer,
                                                   options.tokenizer):
    start = end = 0  # the batch's tokens not yet in a closed shard: tokens[start:end]
    for item, n, size in zip(batch, counts, sizes):
      consumed += 1
      if not isinstance(item, str):
        skipped += 1
        tqdm.write(f"skipped: {item}")
        continue
      lengths.append(n)
      shard_bytes += size
      shard_tokens += n
      end += n
      if shard_tokens >= options.shard_tokens:
        pieces.append(tokens[start:end])
        close_shard()
        start = end
    if end > start:
      pieces.append(tokens[start:end])
    tokens_done += len(tokens)
    bar.update(sum(sizes))
    bar.set_postfix(tokens_per_s=f"{tokens_done / max(time.perf_counter() - t0, 1e-9):,.0f}", refresh=False)
  if lengths:
    close_shard()
  bar.close()
  if not state.shards:
    raise DataError(f"the inputs {list(inputs)} hold no non-empty document")
  manifest = _manifest(out, state, options, tokenizer, dtype, inputs, tok_fingerprint, fingerprint)
  write_manifest(out, manifest)
  (out / STATE).unlink()
  return manifest


def _manifest(out: epath.Path, state: _State, options: PrepareOptions, tokenizer: Tokenizer, dtype: np.dtype,
              inputs: Sequence[str], tok_fingerprint: str, fingerprint: str) -> Manifest:
  """The split point and the validation split's UTF-8 bytes (decoded from the shards, a document at a time), then
  the manifest."""
  offsets = np.cumsum([0] + [s.tokens for s in state.shards])
  cut = _split_point(out, state.shards, dtype, options)
  total = int(offsets[-1])
  val_bytes = 0
  for n, shard in enumerate(state.shards):
    lo, hi = max(cut - offsets[n], 0), shard.tokens
    if lo >= hi:
      continue
    tokens, doc_starts = read_shard(out, shard, dtype, verify=False)
    bounds = np.unique(np.concatenate([[lo], doc_starts[(doc_starts > lo) & (doc_starts < hi)], [hi]]))
    for a, b in zip(bounds[:-1], bounds[1:]):
      window = tokens[a:b]
      val_bytes += len(tokenizer.decode(window if isinstance(tokenizer, ByteTokenizer) else window.tolist()).encode())
  return Manifest(
    tokenizer=options.tokenizer, tokenizer_fingerprint=tok_fingerprint, vocab_size=tokenizer.vocab_size,
    eos_id=tokenizer.eos_id, dtype=dtype.name, shards=tuple(state.shards),
    splits={"train": (0, cut), "validation": (cut, total)}, validation_utf8_bytes=val_bytes,
    inputs=tuple(str(i.path) if isinstance(i, Input) else i for i in inputs), preparation=fingerprint, skipped_documents=state.skipped)
