"""Documents of a corpus: a local text file (optionally split at a separator), a JSONL file, or a TFDS split read
with ``tfds.data_source`` (ArrayRecord, no TensorFlow)."""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import io
import json
from pathlib import Path
from typing import Iterator

from etils import epath

from jaxshare.config import DataConfig
from jaxshare.data.errors import DataError
from jaxshare.data.paths import source_file


def read_text_file(path: Path, where: str, hint: str = "") -> str:
  """The whole UTF-8 text of ``path``; ``where`` names it in errors (``data.path: text file``, ``--text``), and
  ``hint`` says how to point at another file when it is missing. The one check of a text file's contents that every
  reader shares (:func:`_decode`: NUL bytes, invalid UTF-8).

  Raises:
    DataError: missing, not a regular file, unreadable, empty, binary (NUL bytes) or invalid UTF-8, naming the file
      and the byte offset.
  """
  name = f"{where} {str(path)!r}"
  if not path.exists():
    raise DataError(f"{name} does not exist (expected a UTF-8 text file{hint})")
  if not path.is_file():
    raise DataError(f"{name} is not a regular file")
  try:
    raw = path.read_bytes()
  except OSError as e:
    raise DataError(f"{name} is unreadable: {e.strerror}") from e
  if not raw.strip():
    raise DataError(f"{name} is empty (expected UTF-8 text)")
  return _decode(raw, name)


def _read_text(path: Path, what: str) -> str:
  return read_text_file(path, f"data.path: {what}", "; set data.path, data.data_dir or $JAXSHARE_DATA_DIR")


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
    text = _read_text(source_file(cfg), "text file")
    docs = text.split(cfg.document_separator) if cfg.document_separator else [text]
  elif cfg.source == "jsonl":
    docs = _jsonl_documents(source_file(cfg), cfg.text_field)
  elif cfg.source == "tfds":
    docs = _tfds_documents(cfg)
  else:
    raise DataError(f"data.source={cfg.source!r} holds tokens, not documents: read it through Datasets")
  docs = [d for d in docs if d]
  if not docs:
    raise DataError(f"data source {cfg.source!r} yielded no non-empty documents")
  return docs


# Streaming readers of preparation inputs (python -m jaxshare.data prepare): memory is bounded by one document (one
# file of a directory of text files, one JSONL line, one parquet batch), never by the corpus.

TFDS_PREFIX = "tfds:"
_JSONL = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json.gz", ".json.zst", ".ndjson")


@dataclasses.dataclass(frozen=True)
class Input:
  """One preparation input: ``kind`` (text, jsonl, parquet, tfds, hf_datasets) and where it is."""

  kind: str
  path: str


def expand_inputs(specs: list[str | Input]) -> list[Input]:
  """Files, directories (every file below, sorted), globs and ``tfds:NAME/SPLIT`` as an ordered list of inputs; a
  directory written by ``datasets.Dataset.save_to_disk`` is one input; an :class:`Input` stays as it is.

  Raises:
    DataError: a path or glob that matches nothing.
  """
  found: list[Input] = []
  for spec in specs:
    if isinstance(spec, Input) or spec.startswith(TFDS_PREFIX):
      found.append(spec if isinstance(spec, Input) else Input("tfds", spec[len(TFDS_PREFIX):]))
      continue
    path = epath.Path(spec)
    if any(c in spec for c in "*?["):
      parent = epath.Path(spec.split("*")[0].split("?")[0].split("[")[0].rpartition("/")[0] or ".")
      matches = sorted(p for p in parent.glob(spec[len(str(parent)) + 1:] if str(parent) != "." else spec)
                       if p.is_file())
      if not matches:
        raise DataError(f"input {spec!r} matches no file")
      found.extend(_input_of(p) for p in matches)
    elif path.is_dir():
      if (path / "dataset_info.json").exists() and (path / "state.json").exists():
        found.append(Input("hf_datasets", str(path)))
      else:
        files = files_below(path)
        if not files:
          raise DataError(f"input directory {spec!r} holds no file")
        found.extend(_input_of(p) for p in files)
    elif path.exists():
      found.append(_input_of(path))
    else:
      raise DataError(f"input {spec!r} does not exist (expected a file, a directory, a glob or tfds:NAME/SPLIT)")
  return found


def files_below(directory: epath.Path) -> list[epath.Path]:
  """Every file below ``directory`` (hidden ones excluded), sorted by path (epath has no recursive glob)."""
  found = []
  for p in sorted(directory.iterdir()):
    if p.name.startswith("."):
      continue
    found.extend(files_below(p) if p.is_dir() else [p])
  return found


def _input_of(path: epath.Path) -> Input:
  name = path.name.lower()
  if name.endswith(_JSONL):
    return Input("jsonl", str(path))
  if name.endswith(".parquet"):
    return Input("parquet", str(path))
  return Input("text", str(path))


def _open_binary(path: str):
  """A binary file object, decompressing ``.gz`` and ``.zst``."""
  raw = epath.Path(path).open("rb")
  if path.endswith(".gz"):
    return gzip.GzipFile(fileobj=raw)
  if path.endswith(".zst"):
    try:
      import zstandard
    except ImportError as e:
      raise DataError(f"input {path!r} is zstd-compressed, which needs the zstandard package: pip install "
                      "zstandard") from e
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True))
  return raw


TEXT_CHUNK_BYTES = 1 << 24


def _text_chunks(path: str) -> Iterator[str]:
  """A UTF-8 file's text in pieces of about TEXT_CHUNK_BYTES bytes (multi-byte characters never split).

  Raises:
    DataError: NUL bytes (binary) or invalid UTF-8, naming the file and the byte offset. OSError: unreadable.
  """
  decoder = codecs.getincrementaldecoder("utf-8")()
  offset = 0
  with _open_binary(path) as f:
    while True:
      raw = f.read(TEXT_CHUNK_BYTES)
      if b"\x00" in raw:
        raise _binary(f"input {path!r}")
      try:
        yield decoder.decode(raw, final=not raw)
      except UnicodeDecodeError as e:
        raise _not_utf8(f"input {path!r}", offset + e.start) from e
      if not raw:
        return
      offset += len(raw)


def _binary(where: str) -> DataError:
  return DataError(f"{where} looks binary (contains NUL bytes); expected UTF-8 text")


def _not_utf8(where: str, byte: int) -> DataError:
  return DataError(f"{where} is not valid UTF-8 text (byte {byte})")


def _decode(raw: bytes, where: str) -> str:
  """``raw`` as UTF-8 text; ``where`` names it in errors.

  Raises:
    DataError: NUL bytes (binary) or invalid UTF-8, with the byte offset.
  """
  if b"\x00" in raw:
    raise _binary(where)
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise _not_utf8(where, e.start) from e


def iter_documents(source: Input, *, separator: str = "", text_field: str = "text", tfds_data_dir: str = "",
                   skip_bad: bool = False) -> Iterator[str | DataError]:
  """The non-empty documents of one input, in order: a text file whole or split at ``separator``; each JSONL line's
  ``text_field``; a parquet column or a saved ``datasets`` column ``text_field``; a TFDS split's feature
  ``text_field`` (read with ``tfds.data_source``, no TensorFlow).

  Raises:
    DataError: unreadable, non-UTF-8 or malformed input, naming it (line numbers for JSONL). With ``skip_bad``, the
      error is yielded in place of the bad document or file instead, and reading goes on.
  """
  def bad(e: DataError) -> DataError:
    if not skip_bad:
      raise e
    return e

  if source.kind == "text":
    try:  # a whole file is checked before any of its documents is yielded: a bad file is skipped whole
      for _ in _text_chunks(source.path):
        pass
    except (OSError, DataError) as e:
      yield bad(e if isinstance(e, DataError) else DataError(f"input {source.path!r} is unreadable: {e}"))
      return
    if not separator:
      text = "".join(_text_chunks(source.path))
      yield from ([text] if text else [])
      return
    rest = ""  # streamed: memory is one chunk and one document, whatever the file's size
    for chunk in _text_chunks(source.path):
      *docs, rest = (rest + chunk).split(separator)
      yield from (d for d in docs if d)
    if rest:
      yield rest
  elif source.kind == "jsonl":
    try:
      with _open_binary(source.path) as f:
        for n, line in enumerate(f, start=1):
          if not line.strip():
            continue
          where = f"input {source.path!r} line {n}"
          try:
            rec = json.loads(_decode(line, where))
          except json.JSONDecodeError as e:
            yield bad(DataError(f"{where} is not valid JSON ({e.msg})"))
            continue
          except DataError as e:
            yield bad(e)
            continue
          if not isinstance(rec, dict) or not isinstance(rec.get(text_field), str):
            yield bad(DataError(f"{where} has no string field {text_field!r} (--text-field)"))
          elif rec[text_field]:
            yield rec[text_field]
    except (OSError, EOFError) as e:
      yield bad(DataError(f"input {source.path!r} is unreadable or truncated: {e}"))
  elif source.kind == "parquet":
    import pyarrow.parquet as pq  # only when asked for

    try:
      table = pq.ParquetFile(source.path)
      for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
        yield from (d for d in batch.column(0).to_pylist() if d)
    except KeyError as e:
      raise DataError(f"input {source.path!r} has no column {text_field!r} (--text-field)") from e
    except OSError as e:
      yield bad(DataError(f"input {source.path!r} is not a readable parquet file: {e}"))
  elif source.kind == "hf_datasets":
    import datasets  # only when asked for

    ds = datasets.load_from_disk(source.path)
    if text_field not in ds.column_names:
      raise DataError(f"input {source.path!r} has no column {text_field!r} (--text-field; columns: "
                      f"{ds.column_names})")
    for batch in ds.iter(batch_size=1024):
      yield from (d for d in batch[text_field] if d)
  else:
    name, _, split = source.path.partition("/")
    cfg = DataConfig(source="tfds", tfds_name=name, tfds_split=split or "train", text_field=text_field,
                     tfds_data_dir=tfds_data_dir)
    yield from _tfds_documents(cfg)
