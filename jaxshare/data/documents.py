"""Documents of a corpus: a local text file (optionally split at a separator), a JSONL file, or a TFDS split read
with ``tfds.data_source`` (ArrayRecord, no TensorFlow)."""

from __future__ import annotations

import json
from pathlib import Path

from jaxshare.config import DataConfig, resolve_data_dir
from jaxshare.data.errors import DataError


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
