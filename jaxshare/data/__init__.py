"""Input pipeline: documents -> token shards -> fixed-length packed windows -> shuffled grain batches.

Documents come from files, directories and globs of UTF-8 text (optionally split at a separator), JSONL, parquet, a
saved ``datasets`` directory or a TFDS split (read with ``tfds.data_source``: ArrayRecord, no TensorFlow). They are
tokenized once, each followed by EOS, into token shards with document offsets and a manifest
(``python -m jaxshare.data prepare``; a text, JSONL or TFDS ``data.source`` is prepared on first use into the token
cache). The stream is split into train and validation (the corpus's last documents), then cut into windows of
``seq_len + 1`` tokens. Each window carries ``segment_ids`` and per-document ``positions`` so documents packed into
one sequence never attend to each other, and ``loss_mask`` drops the target that crosses a document boundary.

The training order is a deterministic grain shuffle, reshuffled each epoch (per component, mixed by weight, for a
mixture); the iterator state is saved in checkpoints so a resumed run sees exactly the batches it would have seen.

The names below load their modules on first use: a tokenizer worker process of ``prepare`` imports
:mod:`jaxshare.data.prepare` without JAX or grain.
"""

import importlib

_EXPORTS = {
  "DataError": "errors",
  "Tokenizer": "tokenizers", "ByteTokenizer": "tokenizers", "HFTokenizer": "tokenizers", "make_tokenizer": "tokenizers",
  "load_documents": "documents", "resolve_path": "paths",
  "Datasets": "pipeline", "TokenStream": "pipeline", "WindowSource": "pipeline", "batch_rows": "pipeline",
  "prepare_source": "pipeline", "token_cache_dir": "pipeline",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
  if name not in _EXPORTS:
    raise AttributeError(f"module 'jaxshare.data' has no attribute {name!r}")
  return getattr(importlib.import_module(f"jaxshare.data.{_EXPORTS[name]}"), name)
