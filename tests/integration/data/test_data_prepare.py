"""Preparation (``python -m jaxshare.data prepare``): the same tokens and split as the token stream on Tiny
Shakespeare (byte and BPE), output independent of the worker count, every input kind, resumption after a crash,
bad input named (or skipped and counted), and corrupt, truncated or missing shards and foreign manifests refused."""

import gzip
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from etils import epath

from conftest import TFDS_TEXT_DOCS, write_bpe_tokenizer, write_tfds_text_dataset
from jaxshare.config import DataConfig
from jaxshare.data import ByteTokenizer, DataError, HFTokenizer, TokenStream, load_documents
from jaxshare.data import prepare as prepare_module
from jaxshare.data.__main__ import main
from jaxshare.data.prepare import PrepareOptions, prepare
from jaxshare.data.shards import MANIFEST, read_manifest, read_shard, token_dtype, verify_shard


def stream_of(out) -> tuple[np.ndarray, np.ndarray]:
  """The prepared token stream and its documents' global start offsets, read through the format's reader."""
  m = read_manifest(out)
  tokens, starts, offset = [], [], 0
  for shard in m.shards:
    t, d = read_shard(epath.Path(out), shard, np.dtype(m.dtype))
    tokens.append(np.asarray(t))
    starts.append(np.asarray(d) + offset)
    offset += shard.tokens
  return np.concatenate(tokens), np.concatenate(starts)


def files_of(out) -> dict[str, bytes]:
  return {p.name: p.read_bytes() for p in sorted(epath.Path(out).iterdir())}


@pytest.fixture
def corpus_dir(tmp_path, corpus):
  """A multi-file corpus of every local kind: plain text files, JSONL and gzipped JSONL."""
  text = corpus.read_text()
  lines = [ln for ln in text.split("\n\n") if ln.strip()]
  d = tmp_path / "corpus"
  (d / "books").mkdir(parents=True)
  for i in range(5):
    (d / "books" / f"part{i}.txt").write_text("\n\n".join(lines[i * 40:(i + 1) * 40]))
  (d / "web.jsonl").write_text("".join(json.dumps({"text": t, "id": n}) + "\n" for n, t in enumerate(lines[200:400])))
  with gzip.open(d / "more.jsonl.gz", "wt") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in lines[400:500])
  return d


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_tiny_shakespeare_gives_the_token_streams_tokens_and_split(tmp_path, corpus, tokenizer):
  spec = "byte" if tokenizer == "byte" else str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000]))
  tok = ByteTokenizer() if spec == "byte" else HFTokenizer(spec)
  m = prepare([str(corpus)], tmp_path / "out", PrepareOptions(tokenizer=spec, val_fraction=0.1), progress=False)
  want = TokenStream.from_documents([corpus.read_text()], tok)
  cut = len(want) - round(len(want) * 0.1)  # the token cache's split: the last tenth of the stream
  tokens, starts = stream_of(tmp_path / "out")
  np.testing.assert_array_equal(tokens, want.tokens)
  assert starts.tolist() == [0] and m.splits == {"train": (0, cut), "validation": (cut, len(want))}
  assert m.validation_utf8_bytes == len(tok.decode(want.tokens[cut:].tolist()).encode("utf-8"))
  assert m.dtype == "uint16" and m.vocab_size == tok.vocab_size and m.eos_id == tok.eos_id
  assert m.shards[0].utf8_bytes == len(corpus.read_bytes())


@pytest.mark.parametrize("tokenizer", ["byte", "bpe"])
def test_output_is_the_same_bytes_for_one_and_three_workers(tmp_path, corpus_dir, corpus, tokenizer):
  """BPE workers encode with the Rust backend alone (no transformers): their ids must be the transformers
  tokenizer's that one worker uses in-process. Byte-level tokenization stays in-process whatever the count."""
  spec = "byte" if tokenizer == "byte" else str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000]))
  options = PrepareOptions(tokenizer=spec, separator="\n\n", shard_tokens=8_000, batch_docs=16, val_docs=7)
  one = prepare([str(corpus_dir)], tmp_path / "one", options, workers=1, progress=False)
  three = prepare([str(corpus_dir)], tmp_path / "three", options, workers=3, progress=False)
  assert len(one.shards) > 3 and files_of(tmp_path / "one") == files_of(tmp_path / "three")
  assert three == one


_PREPARE_AND_REPORT = """
import sys
from jaxshare.data.prepare import PrepareOptions, prepare
prepare([sys.argv[1]], sys.argv[2], PrepareOptions(tokenizer=sys.argv[3], separator="\\n\\n", val_fraction=0.1),
        workers=int(sys.argv[4]), progress=False)
print("transformers" in sys.modules)
"""


def test_a_tokenizer_prepared_with_once_is_not_loaded_through_transformers_again(tmp_path, corpus, monkeypatch):
  """The first preparation with a tokenizer caches its Rust backend; later ones (here in fresh processes, in-process
  and with workers) import neither transformers nor torch and write the same bytes; a damaged entry is rebuilt."""
  monkeypatch.setenv("JAXSHARE_CACHE_DIR", str(tmp_path / "cache"))
  spec = str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000]))
  text = tmp_path / "text.txt"
  text.write_text(corpus.read_text()[:200_000])

  def run(out: str, workers: int) -> bool:
    proc = subprocess.run([sys.executable, "-c", _PREPARE_AND_REPORT, str(text), str(tmp_path / out), spec,
                           str(workers)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[-1] == "True"

  assert run("cold", 1)  # the first use loads through transformers, and caches
  [entry] = (tmp_path / "cache" / "tokenizers").iterdir()
  assert not run("warm", 1) and not run("workers", 2)
  entry.write_text("{not json")
  assert run("rebuilt", 1) and json.loads(entry.read_text())["eos_id"] == HFTokenizer(spec).eos_id
  for out in ("warm", "workers", "rebuilt"):
    assert files_of(tmp_path / out) == files_of(tmp_path / "cold"), out


def test_an_unusable_tokenizer_cache_only_costs_the_transformers_load(tmp_path, corpus, monkeypatch):
  """A cache directory that cannot be created (here a file is in its place) leaves preparation as it was."""
  (tmp_path / "not-a-dir").write_text("")
  monkeypatch.setenv("JAXSHARE_CACHE_DIR", str(tmp_path / "not-a-dir"))
  spec = str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000]))
  m = prepare([str(corpus)], tmp_path / "out", PrepareOptions(tokenizer=spec, val_docs=0), progress=False)
  assert m.num_tokens == len(HFTokenizer(spec).encode(corpus.read_text())) + 1


def test_every_input_is_read_in_order_with_document_boundaries(tmp_path, corpus_dir):
  m = prepare([str(corpus_dir)], tmp_path / "out", PrepareOptions(separator="\n\n", shard_tokens=20_000, val_docs=7),
              progress=False)
  # directory order: books/part0..4.txt, more.jsonl.gz, web.jsonl
  docs = [d for i in range(5) for d in (corpus_dir / "books" / f"part{i}.txt").read_text().split("\n\n") if d]
  with gzip.open(corpus_dir / "more.jsonl.gz", "rt") as f:
    docs += [json.loads(line)["text"] for line in f]
  docs += [json.loads(line)["text"] for line in (corpus_dir / "web.jsonl").read_text().splitlines()]
  want = TokenStream.from_documents(docs, ByteTokenizer())
  tokens, starts = stream_of(tmp_path / "out")
  np.testing.assert_array_equal(tokens, want.tokens)
  np.testing.assert_array_equal(starts, np.flatnonzero(want.positions == 0))
  assert m.num_documents == len(docs) and all(s.tokens >= 20_000 for s in m.shards[:-1])
  assert m.splits["validation"] == (int(starts[-7]), len(tokens))  # the last 7 documents
  assert sum(s.utf8_bytes for s in m.shards) == sum(len(d.encode()) for d in docs)


def test_compressed_jsonl_gives_the_plain_files_tokens(tmp_path, corpus_dir):
  import zstandard

  plain = (corpus_dir / "web.jsonl").read_bytes()
  (tmp_path / "web.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(plain))
  (tmp_path / "web.jsonl.gz").write_bytes(gzip.compress(plain))
  want = prepare([str(corpus_dir / "web.jsonl")], tmp_path / "plain", progress=False)
  for name in ("web.jsonl.zst", "web.jsonl.gz"):
    assert prepare([str(tmp_path / name)], tmp_path / f"out-{name}", progress=False).shards == want.shards


def test_text_streamed_in_small_chunks_splits_as_the_whole_text(tmp_path, monkeypatch):
  from jaxshare.data import documents

  text = "première ligne||deuxième — ligne|||troisième ünïcödé||||fin é" * 3
  (tmp_path / "t.txt").write_text(text)
  (tmp_path / "bad.txt").write_bytes(text.encode() + b"\xff tail")
  monkeypatch.setattr(documents, "TEXT_CHUNK_BYTES", 7)  # separators and multi-byte characters across chunk edges
  got = list(documents.iter_documents(documents.Input("text", str(tmp_path / "t.txt")), separator="||"))
  assert got == [d for d in text.split("||") if d]
  assert list(documents.iter_documents(documents.Input("text", str(tmp_path / "t.txt")))) == [text]
  with pytest.raises(DataError, match=rf"bad.txt' is not valid UTF-8 text \(byte {len(text.encode())}\)"):
    list(documents.iter_documents(documents.Input("text", str(tmp_path / "bad.txt")), separator="||"))


def test_a_glob_and_a_validation_share_cut_at_a_document_boundary(tmp_path, corpus_dir):
  m = prepare([str(corpus_dir / "books" / "part*.txt")], tmp_path / "out",
              PrepareOptions(separator="\n\n", val_fraction=0.1), progress=False)
  _, starts = stream_of(tmp_path / "out")
  cut = m.splits["validation"][0]
  assert cut in starts and abs(cut - 0.9 * m.num_tokens) < 1000


def test_parquet_and_saved_datasets_inputs(tmp_path):
  datasets = pytest.importorskip("datasets")
  texts = [f"document {i}: " + "to be or not to be " * (i % 5 + 1) for i in range(40)]
  ds = datasets.Dataset.from_dict({"text": texts})
  ds.to_parquet(str(tmp_path / "docs.parquet"))
  ds.save_to_disk(str(tmp_path / "saved"))
  for src in ("docs.parquet", "saved"):
    prepare([str(tmp_path / src)], tmp_path / f"out-{src}", progress=False)
    np.testing.assert_array_equal(stream_of(tmp_path / f"out-{src}")[0],
                                  TokenStream.from_documents(texts, ByteTokenizer()).tokens)


def test_a_tfds_split_is_an_input(tmp_path):
  write_tfds_text_dataset(tmp_path / "tfds")
  prepare(["tfds:tiny_text/train"], tmp_path / "out", PrepareOptions(tfds_data_dir=str(tmp_path / "tfds")),
          progress=False)
  docs = load_documents(DataConfig(source="tfds", tfds_name="tiny_text", tfds_data_dir=str(tmp_path / "tfds")))
  assert sorted(docs) == sorted(TFDS_TEXT_DOCS)
  np.testing.assert_array_equal(stream_of(tmp_path / "out")[0], TokenStream.from_documents(docs, ByteTokenizer()).tokens)


def test_a_crashed_preparation_resumes_keeping_its_finished_shards(tmp_path, corpus_dir, monkeypatch):
  options = PrepareOptions(separator="\n\n", shard_tokens=20_000, val_docs=3)
  want = prepare([str(corpus_dir)], tmp_path / "straight", options, progress=False)
  real_write, written = prepare_module.write_shard, []

  def crash_after_three(directory, name, *args):
    if len(written) == 3:
      raise KeyboardInterrupt  # killed while tokenizing the fourth shard
    written.append(name)
    return real_write(directory, name, *args)

  monkeypatch.setattr(prepare_module, "write_shard", crash_after_three)
  with pytest.raises(KeyboardInterrupt):
    prepare([str(corpus_dir)], tmp_path / "out", options, progress=False)
  assert not (tmp_path / "out" / MANIFEST).exists()
  kept = {n: (tmp_path / "out" / f"{n}.tokens").stat().st_mtime_ns for n in written}
  monkeypatch.setattr(prepare_module, "write_shard", real_write)
  encoded = []
  real_encode = prepare_module._encode
  monkeypatch.setattr(prepare_module, "_encode", lambda docs, *a: encoded.append(len(docs)) or real_encode(docs, *a))
  got = prepare([str(corpus_dir)], tmp_path / "out", options, progress=False)
  assert got == want and files_of(tmp_path / "out") == files_of(tmp_path / "straight")
  assert {n: (tmp_path / "out" / f"{n}.tokens").stat().st_mtime_ns for n in written} == kept
  assert sum(encoded) == want.num_documents - sum(s.documents for s in want.shards[:3])  # only the rest tokenized
  assert prepare([str(corpus_dir)], tmp_path / "out", options, progress=False) == want  # finished: nothing to do


def test_other_inputs_into_a_finished_directory_are_refused(tmp_path, corpus_dir):
  prepare([str(corpus_dir / "web.jsonl")], tmp_path / "out", progress=False)
  with pytest.raises(DataError, match="holds a finished preparation of other inputs or options"):
    prepare([str(corpus_dir / "web.jsonl")], tmp_path / "out", PrepareOptions(val_docs=2), progress=False)


def test_bad_documents_are_named_or_skipped_and_counted(tmp_path):
  d = tmp_path / "in"
  d.mkdir()
  (d / "a.txt").write_text("good text")
  (d / "b.txt").write_bytes(b"\xff\xfe not utf-8")
  (d / "c.jsonl").write_text('{"text": "fine"}\n{"text": 3}\nnot json\n{"text": "also fine"}\n')
  with pytest.raises(DataError, match="b.txt' is not valid UTF-8"):
    prepare([str(d)], tmp_path / "out", progress=False)
  m = prepare([str(d)], tmp_path / "skip", PrepareOptions(skip_bad_docs=True), progress=False)
  assert m.skipped_documents == 3 and m.num_documents == 3
  np.testing.assert_array_equal(stream_of(tmp_path / "skip")[0], TokenStream.from_documents(
    ["good text", "fine", "also fine"], ByteTokenizer()).tokens)
  with pytest.raises(DataError, match=r"c.jsonl' line 2 has no string field 'text'"):
    prepare([str(d / "c.jsonl")], tmp_path / "out2", progress=False)
  with pytest.raises(DataError, match="does not exist"):
    prepare([str(d / "missing.txt")], tmp_path / "out3", progress=False)
  with pytest.raises(DataError, match="matches no file"):
    prepare([str(d / "*.parquet")], tmp_path / "out4", progress=False)
  with pytest.raises(DataError, match="--val-docs=9 holds out every one of the corpus's 1 documents"):
    prepare([str(d / "a.txt")], tmp_path / "out5", PrepareOptions(val_docs=9), progress=False)


def test_corrupt_truncated_and_missing_shards_and_foreign_manifests_are_refused(tmp_path, corpus_dir):
  m = prepare([str(corpus_dir / "web.jsonl")], tmp_path / "out", PrepareOptions(shard_tokens=5000), progress=False)
  out, dtype = epath.Path(tmp_path / "out"), np.dtype(m.dtype)
  first, second, third = m.shards[:3]
  raw = bytearray((out / f"{first.name}.tokens").read_bytes())
  raw[100] ^= 1
  (out / f"{first.name}.tokens").write_bytes(bytes(raw))
  with pytest.raises(DataError, match="does not match its checksum"):
    verify_shard(out, first, dtype)
  (out / f"{second.name}.docs").write_bytes((out / f"{second.name}.docs").read_bytes()[:-8])
  with pytest.raises(DataError, match="is truncated or was replaced"):
    verify_shard(out, second, dtype)
  (out / f"{third.name}.tokens").unlink()
  with pytest.raises(DataError, match="is missing"):
    verify_shard(out, third, dtype)
  manifest = json.loads((out / MANIFEST).read_text())
  (out / MANIFEST).write_text(json.dumps({**manifest, "version": 99}))
  with pytest.raises(DataError, match="has format version 99; this jaxshare reads version 2"):
    read_manifest(out)
  (out / MANIFEST).write_text("{not json")
  with pytest.raises(DataError, match="is not valid JSON"):
    read_manifest(out)
  (out / MANIFEST).unlink()
  with pytest.raises(DataError, match="has no manifest.json"):
    read_manifest(out)


def test_token_dtype_fits_the_vocabulary():
  assert token_dtype(256) == np.uint16 and token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32
  assert token_dtype(151_936) == np.uint32


def test_cli_prepares_and_reports_bad_input_in_one_line(tmp_path, corpus_dir, capsys):
  assert main(["prepare", str(corpus_dir / "web.jsonl"), "--out", str(tmp_path / "out"), "--val-docs", "5",
               "--no-progress"]) == 0
  summary = json.loads(capsys.readouterr().out.split(": ", 1)[1])
  assert summary["documents"] == 200 and summary["validation_tokens"] > 0
  assert main(["prepare", "--out", str(tmp_path / "bad"), str(tmp_path / "nothing.txt"), "--no-progress"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: input ") and "does not exist" in err[0]


# -- what a new user runs into (issue 43) ---------------------------------------------------------------------------

def test_a_validation_split_is_held_out_by_default_and_zero_holds_out_nothing(tmp_path, corpus, capsys):
  """Without --val-docs or --val-fraction, the share train.py holds out of a text file (so the prepared corpus has the
  splits the text has); --val-fraction 0 holds out nothing, and the CLI says what that means for training."""
  assert main(["prepare", "--out", str(tmp_path / "default"), str(corpus), "--no-progress"]) == 0
  captured = capsys.readouterr()
  split = read_manifest(tmp_path / "default").splits
  total = split["validation"][1]
  assert split["validation"][1] - split["validation"][0] == round(total * 0.1) and "warning" not in captured.err
  assert main(["prepare", "--out", str(tmp_path / "none"), str(corpus), "--val-fraction", "0", "--no-progress"]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert read_manifest(tmp_path / "none").splits["validation"] == (total, total)
  assert len(err) == 1 and err[0].startswith("warning: no validation split") and "validation off" in err[0]


def _refused(args: list[str], capsys) -> str:
  """The one stderr line of a prepare command that must exit 2."""
  assert main(["prepare", *args, "--no-progress"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: "), err
  return err[0]


def test_out_that_is_a_file_or_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path, corpus, capsys):
  (tmp_path / "notes.txt").write_text("mine")
  assert "is a file, not a directory" in _refused(["--out", str(tmp_path / "notes.txt"), str(corpus)], capsys)
  assert (tmp_path / "notes.txt").read_text() == "mine"
  (tmp_path / "papers").mkdir()
  (tmp_path / "papers" / "draft.tex").write_text("x")
  line = _refused(["--out", str(tmp_path / "papers"), str(corpus)], capsys)
  assert "is not empty and holds no preparation (draft.tex)" in line
  assert sorted(p.name for p in (tmp_path / "papers").iterdir()) == ["draft.tex"]


def test_a_finished_preparation_is_recognised_by_content_not_modification_time(tmp_path, corpus, capsys):
  src = tmp_path / "play.txt"
  src.write_bytes(corpus.read_bytes())
  args = ["prepare", "--out", str(tmp_path / "out"), str(src), "--no-progress"]
  assert main(args) == 0
  before, first = files_of(tmp_path / "out"), capsys.readouterr().out
  src.touch()  # a new modification time, the same bytes
  os.utime(src, (1, 1))
  assert main(args) == 0 and capsys.readouterr().out == first
  assert files_of(tmp_path / "out") == before
  src.write_text(corpus.read_text()[:-1] + "!")  # same size, other content
  assert "holds a finished preparation of other inputs or options" in _refused(args[1:-1], capsys)


def test_a_resumed_preparation_says_what_it_kept_and_an_error_prints_below_the_bar(tmp_path, corpus_dir, monkeypatch,
                                                                                   capsys):
  real_write, written = prepare_module.write_shard, []

  def crash_after_two(directory, name, *args):
    if len(written) == 2:
      raise KeyboardInterrupt
    written.append(name)
    return real_write(directory, name, *args)

  args = ["prepare", "--out", str(tmp_path / "out"), str(corpus_dir), "--shard-tokens", "20000",
          "--document-separator", "\n\n"]
  monkeypatch.setattr(prepare_module, "write_shard", crash_after_two)
  with pytest.raises(KeyboardInterrupt):
    main([*args, "--no-progress"])
  monkeypatch.setattr(prepare_module, "write_shard", real_write)
  capsys.readouterr()
  assert main([*args, "--no-progress"]) == 0
  err = capsys.readouterr().err.strip().splitlines()
  assert err[0].startswith("resumed: 2 of 2 shards kept in ") and "tokenizing the rest" in err[0]
  (corpus_dir / "books" / "part9.txt").write_bytes(b"\xff\xfe not utf-8")  # a bad file after good ones
  assert main(["prepare", "--out", str(tmp_path / "bad"), str(corpus_dir / "books")]) == 2  # with the bar
  err = capsys.readouterr().err
  assert re.search(r"(^|\n)error: input .*part9.txt' is not valid UTF-8", err), err


def test_a_failed_split_keeps_its_shards_for_the_corrected_command(tmp_path, corpus_dir, monkeypatch):
  """--val-docs larger than the corpus fails after tokenizing: the same command with a valid split finishes from the
  shards it wrote (the split options are not part of the shards' fingerprint)."""
  with pytest.raises(DataError, match="the tokenized shards are kept"):
    prepare([str(corpus_dir / "web.jsonl")], tmp_path / "out", PrepareOptions(val_docs=500), progress=False)
  encoded = []
  real_encode = prepare_module._encode
  monkeypatch.setattr(prepare_module, "_encode", lambda docs, *a: encoded.append(len(docs)) or real_encode(docs, *a))
  m = prepare([str(corpus_dir / "web.jsonl")], tmp_path / "out", PrepareOptions(val_docs=5), progress=False)
  assert not encoded and m == prepare([str(corpus_dir / "web.jsonl")], tmp_path / "fresh",
                                      PrepareOptions(val_docs=5), progress=False)
