"""Token streams, the token cache (text, JSONL and TFDS sources prepared on first use), packed windows and the
per-process grain batches of training and validation."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Iterator

import grain
import jax
import numpy as np

from jaxshare.config import TOKEN_CACHE_ENV, DataConfig, mixture_name
from jaxshare.data.batch import Batch
from jaxshare.data.documents import Input
from jaxshare.data.paths import prepared_location, source_file
from jaxshare.data.errors import DataError
from jaxshare.data.prepare import PrepareOptions, prepare, preparation_fingerprint
from jaxshare.data.prepared import PreparedTokens
from jaxshare.data.tokenizers import Tokenizer, make_tokenizer


class TokenStream:
  """An in-memory token stream: all documents, each followed by EOS, with the document index and in-document
  position of every token (int32 arrays). ``eval.py ppl`` scores arbitrary text through it; training reads prepared
  shards (:class:`~jaxshare.data.prepared.PreparedTokens`)."""

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

  def __len__(self) -> int:
    return len(self.tokens)

  def read(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(tokens, document ids, positions)`` of tokens ``[start, stop)``, as
    :meth:`~jaxshare.data.prepared.PreparedTokens.read`."""
    return tuple(np.array(x[start:stop]) for x in (self.tokens, self.doc_ids, self.positions))


def token_cache_dir(cfg: DataConfig) -> Path | None:
  """Where corpora read from text, JSONL or TFDS are prepared (None: ``data.token_cache=off``)."""
  if cfg.token_cache == "off":
    return None
  if cfg.token_cache:
    return Path(cfg.token_cache).expanduser()
  return Path(os.environ.get(TOKEN_CACHE_ENV) or Path.home() / ".cache" / "jaxshare" / "tokens")


def prepare_source(cfg: DataConfig) -> tuple[Path, tempfile.TemporaryDirectory | None]:
  """The prepared directory of a text, JSONL or TFDS source: prepared on first use (:func:`~jaxshare.data.prepare.
  prepare`, one worker) under :func:`token_cache_dir`, keyed by the preparation's fingerprint (the source by path,
  size and content hash or TFDS name, the tokenizer's files, the separator, text field and validation share),
  and reused after. The first process to take the entry's lock prepares it; the others on the same filesystem (a
  GPU node's processes, hosts sharing NFS) wait and read the same files. With ``data.token_cache=off``, or a cache
  that is not writable, the corpus is prepared into a temporary directory, returned too: it lasts as long as the
  caller keeps it.

  Returns:
    ``(prepared directory, the temporary directory holding it or None)``.

  Raises:
    DataError: a missing, empty, binary, non-UTF-8 or malformed source, naming it.
  """
  if cfg.source == "tfds":
    source = Input("tfds", f"{cfg.tfds_name}/{cfg.tfds_split}")
  else:
    source = Input(cfg.source, str(source_file(cfg).resolve()))
  options = PrepareOptions(tokenizer=cfg.tokenizer, separator=cfg.document_separator if cfg.source == "text" else "",
                           text_field=cfg.text_field, tfds_data_dir=cfg.tfds_data_dir, val_fraction=cfg.val_fraction)
  progress = jax.process_index() == 0 and sys.stderr.isatty()
  root = token_cache_dir(cfg)
  if root is not None:
    key = root / preparation_fingerprint([source], options)
    try:
      root.mkdir(parents=True, exist_ok=True)
      with open(root / f"{key.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one preparation per filesystem; the others wait here, then read it
        prepare([source], key, options, progress=progress)
      return key, None
    except OSError as e:  # unwritable cache (read-only home, full disk): prepare into scratch, say so
      warnings.warn(f"data.token_cache: {root} is not usable ({e.strerror or e}); preparing into a temporary "
                    "directory")
  scratch = tempfile.TemporaryDirectory(prefix="jaxshare-tokens-")
  prepare([source], Path(scratch.name) / "prepared", options, progress=progress)
  return Path(scratch.name) / "prepared", scratch


class WindowSource:
  """Random-access windows of ``seq_len + 1`` tokens of one split (a grain ``RandomAccessDataSource``).

  Item ``i`` is a dict of int32 ``[seq_len]`` arrays: ``inputs``, ``targets``, ``positions``, ``segment_ids``
  (1-based, per window) and ``loss_mask`` (0 where the target belongs to the next document).
  """

  def __init__(self, stream: TokenStream | PreparedTokens, span: slice, seq_len: int, name: str,
               fix: str = "another data.val_fraction"):
    self.stream, self.start, self.seq_len = stream, span.start, seq_len
    self.n = (span.stop - span.start - 1) // seq_len
    if self.n < 1:
      raise DataError(f"the {name} has {span.stop - span.start} tokens, fewer than data.seq_len + 1 = "
                      f"{seq_len + 1}: use a larger corpus, a smaller data.seq_len or {fix}")

  def __len__(self) -> int:
    return self.n

  def __getitem__(self, i: int) -> dict[str, np.ndarray]:
    a = self.start + int(i) * self.seq_len
    tok, doc, pos = self.stream.read(a, a + self.seq_len + 1)
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


# Batches read ahead of the train step. grain's default (16 threads, 500 elements, here batches) made the first batch
# of a 20 GB prepared dataset read 16,000 windows across every shard (17.8 s, 2.2 GB resident); 8 batches keep the
# loader far ahead of any train step (scripts/bench_data.py) at a bounded cost.
READ_OPTIONS = grain.ReadOptions(num_threads=4, prefetch_buffer_size=8)


@dataclasses.dataclass(frozen=True)
class Component:
  """One prepared corpus of a run's data: its name and mixture weight, its stream and window sources (``val`` None:
  prepared without a validation split)."""

  name: str
  weight: float
  stream: PreparedTokens
  train: WindowSource
  val: WindowSource | None


# How to hold out (more) validation data: of a prepared directory, and of a corpus train.py prepares itself.
_PREPARE_FIX = "a validation split prepared with python -m jaxshare.data prepare --val-docs N (or --val-fraction F)"


def _component(name: str, weight: float, location: str, cfg: DataConfig, prepared: bool) -> Component:
  stream = PreparedTokens(location, cfg.tokenizer)
  where = f" of {name}" if name else (f" of {location}" if prepared else "")
  fix = _PREPARE_FIX if prepared else "another data.val_fraction"
  val_span = stream.split("validation")
  val = (None if prepared and val_span.stop == val_span.start else
         WindowSource(stream, val_span, cfg.seq_len, f"validation split{where}", fix))
  return Component(name, weight, stream, WindowSource(stream, stream.split("train"), cfg.seq_len,
                                                      f"training split{where}", fix), val)


class Datasets:
  """Train and validation pipelines of one corpus, or of a weighted mixture of prepared corpora (``data.mixture``).

  Every global batch of ``batch_size`` sequences is the same whatever the number of processes; each process reads
  only its :attr:`rows` of it (``rows``; default: block ``process_index`` of ``process_count`` equal blocks; the
  training loop passes the rows its devices hold, :func:`jaxshare.parallel.local_batch_rows`). A mixture shuffles
  each component and mixes them by weight with grain's deterministic ``MapDataset.mix``; sequence ``i`` of the run
  comes from component :meth:`component_of` ``(i)``.
  """

  def __init__(self, cfg: DataConfig, batch_size: int, *, tokenizer: Tokenizer | None = None,
               process_index: int | None = None, process_count: int | None = None, rows: slice | None = None):
    self.cfg = cfg
    self.batch_size = batch_size
    self.tokenizer = tokenizer or make_tokenizer(cfg)
    if cfg.mixture:
      entries = [(mixture_name(e), float(e["weight"]),
                  prepared_location(cfg, str(e["path"]), f"data.mixture[{n}].path")) for n, e in enumerate(cfg.mixture)]
    elif cfg.source == "prepared":
      entries = [("", 1.0, prepared_location(cfg, cfg.path, "data.path"))]
    else:  # text, JSONL and TFDS sources are prepared into the token cache on first use: one pipeline for all
      prepared, self._scratch = prepare_source(cfg)
      entries = [("", 1.0, str(prepared))]
    prepared = cfg.source == "prepared"
    self.components = [_component(name, weight, location, cfg, prepared) for name, weight, location in entries]
    self.weights = weights = [c.weight for c in self.components]
    self.train_source = self._mixed([c.train for c in self.components], weights)
    validated = [c for c in self.components if c.val is not None]
    # None: no component was prepared with a validation split, and the run trains without validation
    self.val_source = self._mixed([c.val for c in validated], [c.weight for c in validated]) if validated else None
    # UTF-8 bytes per validation token (bits per byte for any tokenizer), counted when the data was prepared
    self.bytes_per_token = (sum(c.weight * c.stream.validation_bytes_per_token for c in validated)
                            / sum(c.weight for c in validated)) if validated else float("nan")
    # which component each sequence of the mixed order comes from (grain's schedule, read through the same mix)
    self._schedule = grain.MapDataset.mix([grain.MapDataset.source([k]).repeat(None)
                                           for k in range(len(self.components))], weights)
    self._counted, self._counts = 0, np.zeros(len(self.components), np.int64)
    self.rows = rows or batch_rows(jax.process_index() if process_index is None else process_index,
                                   jax.process_count() if process_count is None else process_count, batch_size)
    if self.val_source is not None and len(self.val_source) < batch_size:
      raise DataError(f"the validation split has {len(self.val_source)} sequences, fewer than one batch of "
                      f"{batch_size}: lower train.batch_size or hold out more: "
                      + (_PREPARE_FIX if prepared else "raise data.val_fraction"))

  @property
  def has_validation(self) -> bool:
    """Whether the data has a validation split (a directory prepared with ``--val-fraction 0`` has none)."""
    return self.val_source is not None

  @staticmethod
  def _mixed(sources: list[WindowSource], weights: list[float]) -> WindowSource | grain.MapDataset:
    if len(sources) == 1:
      return sources[0]
    return grain.MapDataset.mix([grain.MapDataset.source(s) for s in sources], weights)

  @property
  def stream(self) -> PreparedTokens:
    """The token stream of a one-corpus run."""
    (only,) = self.components
    return only.stream

  def component_of(self, sequence: int) -> int:
    """The mixture component of sequence ``sequence`` of the run's training order (global batch ``b`` holds
    sequences ``b * batch_size ...``)."""
    return int(self._schedule[sequence])

  def tokens_seen(self, steps: int) -> dict[str, int]:
    """Tokens each mixture component has contributed to the first ``steps`` global batches (``{}`` for one
    corpus); counted incrementally, so calling it at every log line costs one lookup per new sequence."""
    if len(self.components) == 1:
      return {}
    if steps * self.batch_size < self._counted:
      self._counted, self._counts[:] = 0, 0
    for i in range(self._counted, steps * self.batch_size):
      self._counts[self.component_of(i)] += 1
    self._counted = steps * self.batch_size
    return {f"tokens_{c.name}": int(n) * self.cfg.seq_len for c, n in zip(self.components, self._counts)}

  @property
  def local_batch(self) -> int:
    return self.rows.stop - self.rows.start

  def train_iter(self) -> grain.DatasetIterator:
    """Endless, per-epoch reshuffled batches (this process's :attr:`rows` of each global batch);
    ``get_state``/``set_state`` resume exactly."""
    rows = self.rows
    parts = [grain.MapDataset.source(c.train).shuffle(seed=(self.cfg.shuffle_seed + k) % 2**32).repeat(None)
             for k, c in enumerate(self.components)]
    ds = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, self.weights)
    ds = _block_rows(ds, self.batch_size, rows, len(ds) // self.batch_size)
    return iter(ds.batch(rows.stop - rows.start, drop_remainder=True).map(Batch.of).to_iter_dataset(READ_OPTIONS))

  @property
  def val_batch_count(self) -> int:
    """Global batches in the validation split (0 without one)."""
    return 0 if self.val_source is None else len(self.val_source) // self.batch_size

  def val_batches(self, max_batches: int = 0, skip: int = 0) -> Iterator[Batch]:
    """The validation split in order, in global batches (this process's :attr:`rows` of each), from batch ``skip``
    on; ``max_batches`` 0 means all the rest.

    Raises:
      DataError: the data has no validation split (:attr:`has_validation`), or ``skip`` leaves no batch.
    """
    if self.val_source is None:
      raise DataError(f"{self.cfg.path} has no validation split: {_PREPARE_FIX}")
    rows = self.rows
    total = self.val_batch_count
    if skip and skip >= total:
      raise DataError(f"{self.cfg.path}: skipping {skip} validation batches leaves none (the split has {total} "
                      f"batches of {self.batch_size} sequences)")
    n = total - skip if not max_batches else min(max_batches, total - skip)
    ds = _block_rows(grain.MapDataset.source(self.val_source), self.batch_size, rows, skip + n)
    ds = ds.batch(rows.stop - rows.start, drop_remainder=True).map(Batch.of)
    for i in range(skip, skip + n):
      yield ds[i]
