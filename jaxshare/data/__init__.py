"""Input pipeline: documents -> tokens -> fixed-length packed windows -> shuffled grain batches.

Documents come from a local text file (optionally split at a separator), a JSONL file, or a TFDS dataset read
with ``tfds.data_source`` (ArrayRecord, no TensorFlow). Every document is tokenised and followed by EOS; the
token stream is split into train (first ``1 - val_fraction``) and validation (the rest), then cut into windows of
``seq_len + 1`` tokens. Each window carries ``segment_ids`` and per-document ``positions`` so documents packed into
one sequence never attend to each other, and ``loss_mask`` drops the target that crosses a document boundary.

The training order is a deterministic grain shuffle, reshuffled each epoch; the iterator state is saved in
checkpoints so a resumed run sees exactly the batches it would have seen.
"""

from jaxshare.data.documents import load_documents, resolve_path
from jaxshare.data.errors import DataError
from jaxshare.data.pipeline import Datasets, TokenStream, WindowSource, batch_rows, prepare_source, token_cache_dir
from jaxshare.data.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer, make_tokenizer

__all__ = ["ByteTokenizer", "DataError", "Datasets", "HFTokenizer", "TokenStream", "Tokenizer", "WindowSource",
           "batch_rows", "load_documents", "make_tokenizer", "prepare_source", "resolve_path",
           "token_cache_dir"]
