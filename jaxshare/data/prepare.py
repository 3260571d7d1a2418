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
import re
import sys
import time
from typing import Iterable, Iterator, Sequence

import numpy as np
from etils import epath
from tqdm import tqdm

from jaxshare.data.documents import Input, expand_inputs, files_below, iter_documents
from jaxshare.data.errors import DataError
from jaxshare.data.shards import (DOCS, FORMAT_VERSION, MANIFEST, TOKENS, Manifest, Shard, read_manifest, read_shard,
                                  token_dtype, write_manifest, write_shard)
from jaxshare.data.tokenizers import (BackendTokenizer, ByteTokenizer, HFTokenizer, Tokenizer, encoding_tokenizer,
                                     make_tokenizer, tokenizer_fingerprint)

STATE = ".prepare-state.json"
DEFAULT_SHARD_TOKENS = 1 << 27  # 256 MB of uint16 tokens per shard
# The validation share held out when neither --val-docs nor --val-fraction is given: the share train.py holds out of a
# text file (data.val_fraction's default), so a file prepared with the defaults has the splits train.py gives it read
# as text. (Megatron-LM holds out 3% by default, nanoGPT 10% of Shakespeare; on a large corpus --val-docs N keeps the
# held-out set a fixed size.)
DEFAULT_VAL_FRACTION = 0.1


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
      the tail of the stream, as the token cache splits it). None (the default): :data:`DEFAULT_VAL_FRACTION`
      unless ``val_docs`` is given; 0 holds out nothing (training then runs without validation).
    shard_tokens: a shard closes after the document that brings it to this many tokens.
    batch_docs: documents per tokenization batch.
    skip_bad_docs: skip unreadable, non-UTF-8 or malformed documents and files, counting them, instead of stopping.
  """

  tokenizer: str = "byte"
  separator: str = ""
  text_field: str = "text"
  tfds_data_dir: str = ""
  val_docs: int = 0
  val_fraction: float | None = None
  shard_tokens: int = DEFAULT_SHARD_TOKENS
  batch_docs: int = 1024
  skip_bad_docs: bool = False

  def resolved(self) -> "PrepareOptions":
    """These options with the default validation share filled in (what the output depends on).

    Raises:
      DataError: a field out of range, naming it.
    """
    fraction = self.val_fraction
    if fraction is None:
      fraction = 0.0 if self.val_docs else DEFAULT_VAL_FRACTION
    if self.val_docs < 0 or not 0.0 <= fraction < 1.0 or (self.val_docs and fraction):
      raise DataError(f"--val-docs={self.val_docs} / --val-fraction={self.val_fraction}: give at most one, "
                      "--val-docs >= 0 or 0 <= --val-fraction < 1")
    if self.shard_tokens < 1 or self.batch_docs < 1:
      raise DataError(f"--shard-tokens={self.shard_tokens} and --batch-docs={self.batch_docs} must be >= 1")
    return dataclasses.replace(self, val_fraction=fraction)


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
  """What a preparation's output depends on: the inputs (files and directories by path, size and content hash;
  ``tfds:`` inputs by name), the options and the tokenizer's files (24 hex digits). Content, not modification times:
  an input that was only touched (or copied with new times) is the same input.

  Raises:
    DataError: an input that does not exist, or a tokenizer that is neither ``byte`` nor a directory.
  """
  options = options.resolved()
  return _fingerprint(expand_inputs(list(inputs)), options, tokenizer_fingerprint(options.tokenizer))


def _content(path: epath.Path) -> list:
  """``[size, SHA-256]`` of a file, or of every file below a directory (a saved ``datasets`` directory), by name."""
  if path.is_dir():
    files = [_content(p) + [str(p)[len(str(path)):]] for p in files_below(path)]
    return [sum(size for size, _, _ in files), [[name, digest] for _, digest, name in files]]
  digest = hashlib.sha256()
  with path.open("rb") as f:
    while chunk := f.read(1 << 24):
      digest.update(chunk)
  return [path.stat().length, digest.hexdigest()]


_SPLIT_OPTIONS = ("val_docs", "val_fraction")  # where the validation split starts: no shard's bytes depend on it


def _fingerprint(inputs: Sequence[Input], options: PrepareOptions, tok_fingerprint: str, *, shards_only: bool = False
                 ) -> str:
  """The preparation's fingerprint, or with ``shards_only`` its shards' (the split options left out: a preparation
  whose split failed, e.g. ``--val-docs`` larger than the corpus, resumes its shards under a corrected split)."""
  described = [[i.kind, i.path] + ([] if i.kind == "tfds" else _content(epath.Path(i.path))) for i in inputs]
  left_out = ("batch_docs", *(_SPLIT_OPTIONS if shards_only else ()))  # batches change no byte
  settings = {k: v for k, v in dataclasses.asdict(options).items() if k not in left_out}
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
  def read(cls, directory: epath.Path) -> "_State | None":
    """The state an earlier run left in ``directory`` (None: none, or unreadable: a kill before its first write)."""
    path = directory / STATE
    if not path.exists():
      return None
    try:
      d = json.loads(path.read_text())
      return cls(d["fingerprint"], [Shard(**s) for s in d["shards"]], int(d["documents"]), int(d["skipped"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
      return None


# What a preparation writes into its directory (temporary files included): anything else there is someone else's.
_OWN_FILE = re.compile(rf"\.?(shard-\d+\.(tokens|docs)|{re.escape(MANIFEST)}|{re.escape(STATE)})(\.\d+\.\d+)?(\.tmp)?")


def _resumable(out: epath.Path, fingerprint: str, shards_fingerprint: str) -> tuple[Manifest | None, _State | None]:
  """What ``out`` already holds of this preparation: ``(its manifest, None)`` when it is finished, ``(None, the
  state of its finished shards)`` when it was interrupted, ``(None, None)`` when ``out`` is new or empty (or a
  kill came before the first shard). Reads nothing but the manifest or state.

  Raises:
    DataError: ``out`` is a file, holds a preparation of other inputs or options (finished, or interrupted with other
      shards), or holds files a preparation does not write.
  """
  if not out.exists():
    return None, None
  if not out.is_dir():
    raise DataError(f"--out {out} is a file, not a directory: choose a new directory")
  if (out / MANIFEST).exists():
    manifest = read_manifest(out)
    if manifest.preparation == fingerprint:
      return manifest, None
    raise DataError(f"--out {out} holds a finished preparation of other inputs or options: choose another --out, or "
                    "delete it to prepare these inputs there")
  foreign = sorted(p.name for p in out.iterdir() if not _OWN_FILE.fullmatch(p.name))
  if foreign:
    raise DataError(f"--out {out} is not empty and holds no preparation ({', '.join(foreign[:3])}"
                    f"{', ...' if len(foreign) > 3 else ''}): choose a new or empty directory")
  state = _State.read(out)
  if state is None:
    return None, None
  if state.fingerprint != shards_fingerprint:
    raise DataError(f"--out {out} holds an unfinished preparation of other inputs or options: run it again with "
                    "the inputs and options it was started with to finish it, or choose another --out")
  kept = [s for s in state.shards if (out / f"{s.name}{TOKENS}").exists() and (out / f"{s.name}{DOCS}").exists()]
  if len(kept) < len(state.shards):  # a shard file removed by hand: the documents after the last whole one again
    return None, None
  return None, state


def _say(message: str) -> None:
  """``message`` on a line of its own on standard error, above the progress bar (never glued onto its line)."""
  tqdm.write(message, file=sys.stderr)


def _split_point(out: epath.Path, shards: list[Shard], dtype: np.dtype, options: PrepareOptions) -> int:
  """Where the validation split starts in the token stream (see :class:`PrepareOptions`); reads the document offsets
  of one shard only."""
  offsets = np.cumsum([0] + [s.tokens for s in shards])
  total = int(offsets[-1])
  num_docs = sum(s.documents for s in shards)
  if options.val_docs:
    if options.val_docs >= num_docs:
      raise DataError(f"--val-docs={options.val_docs} holds out every one of the corpus's {num_docs} documents: "
                      "lower it (the tokenized shards are kept: the same command with a lower --val-docs, or with "
                      "--val-fraction, finishes from them)")
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
  options = options.resolved()
  out = epath.Path(out)
  found = expand_inputs(list(inputs))
  tok_fingerprint = tokenizer_fingerprint(options.tokenizer)
  fingerprint = _fingerprint(found, options, tok_fingerprint)
  shards_fingerprint = _fingerprint(found, options, tok_fingerprint, shards_only=True)
  manifest, state = _resumable(out, fingerprint, shards_fingerprint)
  if manifest is not None:
    return manifest
  out.mkdir(parents=True, exist_ok=True)
  tokenizer = encoding_tokenizer(options.tokenizer, tok_fingerprint)
  dtype = token_dtype(tokenizer.vocab_size)
  if state is not None:
    present = len(list(out.glob(f"shard-*{TOKENS}")))
    _say(f"resumed: {len(state.shards)} of {present} shards kept in {out} (the finished ones, {state.documents:,} "
         "documents); tokenizing the rest")
  else:
    state = _State(shards_fingerprint, [], 0, 0)

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

  try:
    for batch, tokens, counts, sizes in _ordered_map(_batched(stream, options.batch_docs), dtype, workers, tokenizer,
                                                     options.tokenizer):
      start = end = 0  # the batch's tokens not yet in a closed shard: tokens[start:end]
      for item, n, size in zip(batch, counts, sizes):
        consumed += 1
        if not isinstance(item, str):
          skipped += 1
          _say(f"skipped: {item}")
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
  finally:  # an error then prints below the bar, not onto its line
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
