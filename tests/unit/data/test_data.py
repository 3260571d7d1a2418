"""Data pipeline: determinism, exact resume, packing metadata, tokenizers, sources and clear errors."""

import json

import numpy as np
import pytest

from conftest import write_bpe_tokenizer, write_tfds_text_dataset
from jaxshare.config import DataConfig
from jaxshare.data import ByteTokenizer, DataError, Datasets, HFTokenizer, load_documents


def cfg_for(path, **kw):
  return DataConfig(path=str(path), seq_len=kw.pop("seq_len", 32), **kw)


def take(it, n):
  return [next(it) for _ in range(n)]


def test_real_corpus_split_and_windows(corpus):
  ds = Datasets(cfg_for(corpus, seq_len=128), batch_size=4)
  n = corpus.stat().st_size + 1  # + EOS
  assert len(ds.train_source) == (n - round(n * 0.1) - 1) // 128
  item = ds.train_source[3]
  text = corpus.read_bytes()
  np.testing.assert_array_equal(item["inputs"], np.frombuffer(text[384:512], np.uint8))
  np.testing.assert_array_equal(item["targets"], np.frombuffer(text[385:513], np.uint8))
  np.testing.assert_array_equal(item["positions"], np.arange(384, 512))
  # the validation split is the end of the corpus
  last = ds.val_source[len(ds.val_source) - 1]
  assert bytes(last["inputs"].astype(np.uint8)) in text[-2 * 128:] + b"\0"


def test_deterministic_and_exact_resume(corpus):
  cfg = cfg_for(corpus)
  a = take(Datasets(cfg, 8).train_iter(), 5)
  b = take(Datasets(cfg, 8).train_iter(), 5)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x.inputs, y.inputs)
  it = Datasets(cfg, 8).train_iter()
  take(it, 3)
  state = it.get_state()
  rest = take(it, 2)
  it2 = Datasets(cfg, 8).train_iter()
  it2.set_state(state)
  for x, y in zip(rest, take(it2, 2)):
    np.testing.assert_array_equal(x.inputs, y.inputs)
  other = take(Datasets(cfg_for(corpus, shuffle_seed=1), 8).train_iter(), 1)[0]
  assert not np.array_equal(other.inputs, a[0].inputs)


def test_epochs_reshuffle_and_cover_everything(tmp_path):
  p = tmp_path / "t.txt"
  p.write_text("abcdefghij" * 40)  # 401 tokens with EOS -> 36 train windows of 10 at seq_len 9
  ds = Datasets(cfg_for(p, seq_len=9, val_fraction=0.1), batch_size=4)
  n = len(ds.train_source)
  it = ds.train_iter()
  batches = take(it, 2 * (n // 4))
  firsts = [tuple(b.positions[:, 0]) for b in batches]
  assert n == 40
  epoch1 = sorted(x for f in firsts[:10] for x in f)
  epoch2 = sorted(x for f in firsts[10:] for x in f)
  assert epoch1 == epoch2 == [i * 9 for i in range(40)]  # each epoch visits every window once
  assert firsts[:10] != firsts[10:]  # in a new order


def test_jsonl_documents_are_packed_with_segments(tmp_path):
  p = tmp_path / "d.jsonl"
  p.write_text("\n".join(json.dumps({"text": t}) for t in ["hello", "world!", "abc"] * 20))
  ds = Datasets(cfg_for(p, source="jsonl", seq_len=16), batch_size=2)
  item = ds.train_source[0]
  # "hello<eos>world!<eos>abc<eos>hello..." -> segments 1 (6 tokens), 2 (7 tokens), 3 (4), 4
  np.testing.assert_array_equal(item["segment_ids"], [1] * 6 + [2] * 7 + [3] * 3)
  np.testing.assert_array_equal(item["positions"], list(range(6)) + list(range(7)) + list(range(3)))
  assert item["inputs"][5] == 0 and item["targets"][4] == 0  # EOS closes a document
  mask = item["loss_mask"]
  assert mask[5] == 0 and mask[12] == 0 and mask.sum() == 14  # EOS -> next document's first token is masked


def test_text_document_separator(tmp_path):
  p = tmp_path / "t.txt"
  p.write_text("one\n\ntwo\n\nthree")
  docs = load_documents(cfg_for(p, document_separator="\n\n"))
  assert docs == ["one", "two", "three"]


def test_hf_tokenizer_directory(tmp_path, corpus):
  write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000])
  hf = HFTokenizer(str(tmp_path / "tk"))
  assert hf.vocab_size <= 300 and hf.eos_id == 0
  ds = Datasets(cfg_for(corpus, tokenizer=str(tmp_path / "tk"), seq_len=64), batch_size=2, tokenizer=hf)
  assert ds.bytes_per_token > 1.5  # BPE merges bytes
  assert hf.decode(hf.encode("First Citizen:")) == "First Citizen:"


def test_tfds_source_reads_array_record(tmp_path):
  write_tfds_text_dataset(tmp_path)
  cfg = DataConfig(source="tfds", tfds_name="tiny_text", tfds_data_dir=str(tmp_path), seq_len=32)
  docs = load_documents(cfg)
  assert len(docs) == 50 and all(d.startswith("document number") for d in docs)
  # the training split holds rows of seq_len tokens of the documents' bytes, each target the next input
  train = Datasets(cfg, 2).train_source
  rows = [train[i] for i in range(len(train))]
  assert rows and all(r["inputs"].shape == (cfg.seq_len,) for r in rows)
  assert all(np.array_equal(r["targets"][:-1], r["inputs"][1:]) for r in rows)
  assert b"document number" in bytes(rows[0]["inputs"].astype(np.uint8))


@pytest.mark.parametrize("content, needle", [
  (None, "does not exist"),
  (b"", "is empty"),
  (b"\x00\x01\x02binary", "looks binary"),
  (b"\xff\xfe\xfa not utf8", "not valid UTF-8"),
])
def test_bad_text_files(tmp_path, content, needle):
  p = tmp_path / "x.txt"
  if content is not None:
    p.write_bytes(content)
  with pytest.raises(DataError, match=needle):
    Datasets(cfg_for(p), 2)


def test_bad_jsonl_and_tiny_corpus(tmp_path):
  p = tmp_path / "x.jsonl"
  p.write_text('{"text": "ok"}\n{not json}\n')
  with pytest.raises(DataError, match="line 2 is not valid JSON"):
    load_documents(cfg_for(p, source="jsonl"))
  p.write_text('{"body": "ok"}\n')
  with pytest.raises(DataError, match="no string field 'text'"):
    load_documents(cfg_for(p, source="jsonl"))
  q = tmp_path / "small.txt"
  q.write_text("tiny corpus")
  with pytest.raises(DataError, match="fewer than data.seq_len"):
    Datasets(cfg_for(q), 2)


def test_data_dir_resolution(tmp_path, monkeypatch):
  (tmp_path / "c.txt").write_text("x" * 2000)
  monkeypatch.setenv("JAXSHARE_DATA_DIR", str(tmp_path))
  assert load_documents(DataConfig(path="c.txt")) == ["x" * 2000]
  assert ByteTokenizer().decode(ByteTokenizer().encode("héllo")) == "héllo"


def test_token_cache_is_prepared_once_and_memory_mapped(tmp_path):
  text = tmp_path / "corpus.txt"
  text.write_text("To be, or not to be: that is the question.\n" * 40)
  cache = tmp_path / "cache"
  cfg = cfg_for(text, seq_len=16, token_cache=str(cache))
  first = Datasets(cfg, 2)
  (key,) = [p for p in cache.iterdir() if p.is_dir()]
  built = {p.name: p.stat().st_mtime_ns for p in key.iterdir()}
  assert set(built) == {"manifest.json", "shard-00000.tokens", "shard-00000.docs"}
  second = Datasets(cfg, 2)
  assert {p.name: p.stat().st_mtime_ns for p in key.iterdir()} == built  # read from the cache, not prepared again
  second.train_source[0]
  assert isinstance(second.stream._shard(0)[0]._map, np.memmap)
  uncached = Datasets(cfg_for(text, seq_len=16, token_cache="off"), 2)
  for a in (first, second):
    for n in range(len(uncached.train_source)):
      for k, v in uncached.train_source[n].items():
        np.testing.assert_array_equal(a.train_source[n][k], v)
  text.write_text("Something else entirely.\n" * 40)  # a changed source gets its own entry
  Datasets(cfg, 2)
  assert len([p for p in cache.iterdir() if p.is_dir()]) == 2


def test_hf_tokenizer_without_transformers_names_the_extra(tmp_path, monkeypatch):
  import sys

  monkeypatch.setitem(sys.modules, "transformers", None)  # what an install without the hf extra sees
  with pytest.raises(DataError, match=r"pip install 'jaxshare\[hf\]'"):
    HFTokenizer(str(tmp_path))
