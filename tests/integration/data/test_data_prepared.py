"""Training from prepared data (``data.source=prepared``): the same windows, batches, validation bytes and losses as
the token cache on Tiny Shakespeare; windows across shard boundaries equal the in-memory stream's; two processes read
disjoint rows making up the global batch; exact resume; a changed tokenizer and a corrupt shard refused in one line."""

import dataclasses
import json

import numpy as np
import pytest

from conftest import TINY, read_metrics, write_bpe_tokenizer
from jaxshare.config import DataConfig, load_config
from jaxshare.data import ByteTokenizer, DataError, Datasets, TokenStream, WindowSource
from jaxshare.data.prepare import PrepareOptions, prepare
from jaxshare.data.prepared import PreparedTokens
from jaxshare.data.shards import read_manifest


def take(it, n):
  return [next(it) for _ in range(n)]


def assert_batches_equal(a, b):
  """Equal windows (dicts) or batches (:class:`~jaxshare.data.batch.Batch`), field by field."""
  assert len(a) == len(b)
  for x, y in zip(a, b):
    x, y = (v if isinstance(v, dict) else dataclasses.asdict(v) for v in (x, y))
    assert sorted(x) == sorted(y)
    for k in x:
      np.testing.assert_array_equal(x[k], y[k], err_msg=k)


@pytest.fixture(scope="module")
def prepared_shakespeare(tmp_path_factory):
  from conftest import CORPUS

  out = tmp_path_factory.mktemp("prepared") / "shakespeare"
  prepare([str(CORPUS)], out, PrepareOptions(val_fraction=0.1), progress=False)
  return out


def test_prepared_shakespeare_gives_the_token_caches_batches(corpus, prepared_shakespeare):
  text = Datasets(DataConfig(path=str(corpus), seq_len=64), batch_size=8)
  prepared = Datasets(DataConfig(source="prepared", path=str(prepared_shakespeare), seq_len=64), batch_size=8)
  assert len(prepared.train_source) == len(text.train_source) and len(prepared.val_source) == len(text.val_source)
  assert_batches_equal(take(prepared.train_iter(), 4), take(text.train_iter(), 4))
  assert_batches_equal(list(prepared.val_batches(3)), list(text.val_batches(3)))
  assert prepared.bytes_per_token == pytest.approx(text.bytes_per_token, rel=1e-12)


def test_validation_batches_after_a_skip_are_the_splits_next_batches(corpus):
  """A search selects on the first validation batches and reports on the rest (eval.py --skip-batches)."""
  data = Datasets(DataConfig(path=str(corpus), seq_len=64), batch_size=8)
  whole = list(data.val_batches())
  assert len(whole) == data.val_batch_count > 3
  assert_batches_equal(list(data.val_batches(2, skip=1)), whole[1:3])
  assert_batches_equal(list(data.val_batches(skip=3)), whole[3:])
  with pytest.raises(DataError, match=f"skipping {len(whole)} validation batches leaves none \\(the split has "
                                      f"{len(whole)} batches of 8 sequences\\)"):
    list(data.val_batches(skip=len(whole)))


def test_bpe_prepared_shakespeare_gives_the_token_caches_windows(tmp_path, corpus):
  tk = str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000]))
  prepare([str(corpus)], tmp_path / "out", PrepareOptions(tokenizer=tk, val_fraction=0.1), progress=False)
  text = Datasets(DataConfig(path=str(corpus), tokenizer=tk, seq_len=32, token_cache="off"), batch_size=4)
  prepared = Datasets(DataConfig(source="prepared", path=str(tmp_path / "out"), tokenizer=tk, seq_len=32),
                      batch_size=4)
  for i in (0, 1, len(text.train_source) - 1):
    assert_batches_equal([prepared.train_source[i]], [text.train_source[i]])
  assert prepared.bytes_per_token == pytest.approx(text.bytes_per_token, rel=1e-3)  # decoded per document


def test_windows_across_shards_equal_the_in_memory_streams(tmp_path, corpus):
  docs = [d for d in corpus.read_text().split("\n\n") if d][:300]
  (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
  m = prepare([str(tmp_path / "docs.jsonl")], tmp_path / "out", PrepareOptions(shard_tokens=3000, val_docs=20),
              progress=False)
  assert len(m.shards) > 5
  want = TokenStream.from_documents(docs, ByteTokenizer())
  got = PreparedTokens(tmp_path / "out", "byte")
  for a, b in ((0, len(want)), (2990, 3100), (len(want) - 50, len(want))):
    for x, y in zip(got.read(a, b), want.read(a, b)):
      np.testing.assert_array_equal(x, y)
  span = got.split("train")
  ours, theirs = WindowSource(got, span, 48, "training"), WindowSource(want, span, 48, "training")
  assert_batches_equal([ours[i] for i in range(len(ours))], [theirs[i] for i in range(len(theirs))])


def assert_rows_split_by_process_and_resume_exactly(cfg: DataConfig) -> None:
  """Two processes' rows of each global batch of 8 make up one process's batch; an iterator restored from the state
  after 3 batches gives the next 2, also when the run resumes on two processes."""
  whole = take(Datasets(cfg, 8, process_index=0, process_count=1).train_iter(), 3)
  halves = [take(Datasets(cfg, 8, process_index=i, process_count=2).train_iter(), 3) for i in range(2)]
  for n, batch in enumerate(whole):
    np.testing.assert_array_equal(np.concatenate([halves[0][n].inputs, halves[1][n].inputs]), batch.inputs)
  it = Datasets(cfg, 8).train_iter()
  take(it, 3)
  state, rest = it.get_state(), take(it, 2)
  again = Datasets(cfg, 8).train_iter()
  again.set_state(state)
  assert_batches_equal(take(again, 2), rest)
  on_two = []
  for i in range(2):
    half = Datasets(cfg, 8, process_index=i, process_count=2).train_iter()
    half.set_state(state)
    on_two.append(take(half, 2))
  for n, batch in enumerate(rest):
    np.testing.assert_array_equal(np.concatenate([on_two[0][n].inputs, on_two[1][n].inputs]), batch.inputs)


def test_two_processes_read_disjoint_rows_of_the_global_batch_and_resume_exactly(prepared_shakespeare):
  assert_rows_split_by_process_and_resume_exactly(DataConfig(source="prepared", path=str(prepared_shakespeare),
                                                             seq_len=32))


def test_another_tokenizer_and_a_corrupt_shard_are_refused_in_one_line(tmp_path, corpus, prepared_shakespeare):
  tk = str(write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:5000]))
  with pytest.raises(DataError, match=r"is not the tokenizer .* was prepared with \('byte'"):
    Datasets(DataConfig(source="prepared", path=str(prepared_shakespeare), tokenizer=tk, seq_len=32), 4)
  (tmp_path / "play3.txt").write_text(corpus.read_text() * 3)  # 6.7 MB of uint16 tokens: two checksum chunks
  m = prepare([str(tmp_path / "play3.txt")], tmp_path / "out", PrepareOptions(val_fraction=0.1), progress=False)
  tokens = tmp_path / "out" / f"{m.shards[0].name}.tokens"
  raw = bytearray(tokens.read_bytes())
  raw[5_000_000] ^= 1  # a flipped bit in the second 4 MiB chunk
  tokens.write_bytes(bytes(raw))
  ds = Datasets(DataConfig(source="prepared", path=str(tmp_path / "out"), seq_len=32), 4)  # opens the manifest only
  ds.train_source[0]  # the first chunk is intact
  with pytest.raises(DataError, match=r"does not match its checksum in the manifest at bytes \[4194304, 6692366\)"):
    ds.train_source[5_000_000 // 2 // 32]
  tokens.write_bytes(b"\0" * 64)
  with pytest.raises(DataError, match="has 64 bytes, the manifest says"):
    Datasets(DataConfig(source="prepared", path=str(tmp_path / "out"), seq_len=32), 4).train_source[0]


@pytest.mark.slow
def test_a_run_on_prepared_data_has_the_losses_of_the_same_run_on_the_text(tmp_path, prepared_shakespeare):
  from jaxshare.train.loop import train

  steps = ["train.steps=3", "train.log_every=1", "train.eval_every=3", "train.eval_batches=2"]
  text = train(load_config(None, [*TINY, *steps, f"train.run_dir={tmp_path / 'text'}"]))
  prepared = train(load_config(None, [*TINY, *steps, f"train.run_dir={tmp_path / 'prepared'}", "data.source=prepared",
                                      f"data.path={prepared_shakespeare}"]))
  assert [r["loss"] for r in read_metrics(tmp_path / "prepared")] == [r["loss"] for r in read_metrics(tmp_path / "text")]
  assert prepared["val_loss"] == text["val_loss"]
  assert read_manifest(prepared_shakespeare).splits["validation"][0] > 0


@pytest.fixture(scope="module")
def two_corpora(tmp_path_factory, prepared_shakespeare):
  """Prepared Tiny Shakespeare and a corpus of digits (no byte in common with the play's letters)."""
  root = tmp_path_factory.mktemp("digits")
  rng = np.random.default_rng(0)
  (root / "digits.txt").write_text("\n\n".join(" ".join(map(str, rng.integers(0, 10**6, 200))) for _ in range(300)))
  prepare([str(root / "digits.txt")], root / "digits", PrepareOptions(separator="\n\n", val_docs=30), progress=False)
  return [{"path": str(prepared_shakespeare), "weight": 0.7, "name": "play"},
          {"path": str(root / "digits"), "weight": 0.3}]


def test_a_mixture_follows_its_weights_counts_tokens_and_resumes_exactly(two_corpora):
  cfg = DataConfig(source="prepared", mixture=two_corpora, seq_len=32)
  data = Datasets(cfg, 8)
  assert [c.name for c in data.components] == ["play", "digits"]
  batches = take(data.train_iter(), 50)
  from_digits = [bool(np.all(np.isin(row, list(b"0123456789 \n\0")))) for b in batches for row in b.inputs]
  assert from_digits == [data.component_of(i) == 1 for i in range(400)]  # the schedule says where each row came from
  assert abs(np.mean(from_digits) - 0.3) < 0.02
  assert data.tokens_seen(50) == {"tokens_play": 32 * from_digits.count(False), "tokens_digits": 32 * sum(from_digits)}
  assert_rows_split_by_process_and_resume_exactly(cfg)


def test_a_mixture_needs_prepared_data_and_valid_entries():
  with pytest.raises(Exception, match="data.mixture.*needs data.source=prepared"):
    load_config(None, ["data.mixture=[{path: a, weight: 1}]"])
  with pytest.raises(Exception, match=r"data.mixture\[1\].weight=0 is invalid"):
    load_config(None, ["data.source=prepared", "data.mixture=[{path: a, weight: 1}, {path: b, weight: 0}]"])
  with pytest.raises(Exception, match="names its components twice"):
    load_config(None, ["data.source=prepared", "data.mixture=[{path: x/a, weight: 1}, {path: y/a, weight: 1}]"])


@pytest.mark.slow
def test_an_interrupted_run_on_a_mixture_resumes_on_the_same_losses(tmp_path, two_corpora):
  from jaxshare.train.loop import train

  mixture = "[" + ", ".join("{" + ", ".join(f"{k}: {v}" for k, v in e.items()) + "}" for e in two_corpora) + "]"
  run = [*TINY, "train.steps=8", "train.log_every=1", "train.checkpoint_every=4", "train.eval_every=8",
         "data.source=prepared", f"data.mixture={mixture}"]
  train(load_config(None, [*run, f"train.run_dir={tmp_path / 'straight'}"]))
  train(load_config(None, [*run, f"train.run_dir={tmp_path / 'resumed'}"]), stop_after=4)
  train(load_config(None, [*run, f"train.run_dir={tmp_path / 'resumed'}"]))
  straight, resumed = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
  assert [r["loss"] for r in resumed] == [r["loss"] for r in straight] and len(straight) == 8
  assert [(r["tokens_play"], r["tokens_digits"]) for r in resumed] == [
    (r["tokens_play"], r["tokens_digits"]) for r in straight]
  assert all(r["tokens_play"] + r["tokens_digits"] == r["step"] * 8 * 32 for r in straight)


def test_gs_inputs_and_outputs_prepare_and_train_like_local_ones(gcs, corpus, prepared_shakespeare):
  """Read from and written to a real GCS server (the gcs fixture): the same shards, batches and bytes per token."""
  from etils import epath

  epath.Path("gs://runs/raw/play.txt").write_bytes(corpus.read_bytes())
  m = prepare(["gs://runs/raw/play.txt"], "gs://runs/prepared", PrepareOptions(val_fraction=0.1), progress=False)
  assert m.shards == read_manifest(prepared_shakespeare).shards
  local_files = sorted(str(p.relative_to(prepared_shakespeare)) for p in prepared_shakespeare.rglob("*") if p.is_file())
  assert sorted(n.removeprefix("prepared/") for n in gcs.objects("runs", "prepared/")) == local_files  # no temporaries
  remote = Datasets(DataConfig(source="prepared", path="gs://runs/prepared", seq_len=64), 8)
  local = Datasets(DataConfig(source="prepared", path=str(prepared_shakespeare), seq_len=64), 8)
  assert_batches_equal(take(remote.train_iter(), 3), take(local.train_iter(), 3))
  assert remote.bytes_per_token == local.bytes_per_token


def test_a_changed_or_truncated_shard_on_a_bucket_is_refused_in_one_line(gcs, corpus):
  from etils import epath

  m = prepare([str(corpus)], "gs://runs/damaged", PrepareOptions(val_fraction=0.1), progress=False)
  shard = epath.Path(f"gs://runs/damaged/{m.shards[0].name}.tokens")
  raw = bytearray(shard.read_bytes())
  raw[1000] ^= 1
  shard.write_bytes(bytes(raw))
  ds = Datasets(DataConfig(source="prepared", path="gs://runs/damaged", seq_len=32), 4)
  with pytest.raises(DataError, match=rf"does not match its checksum in the manifest at bytes \[0, {len(raw)}\)"):
    ds.train_source[0]
  shard.write_bytes(bytes(raw[:64]))  # an object cut short (a bucket never shows a half-finished upload)
  with pytest.raises(DataError, match="has 64 bytes, the manifest says"):
    Datasets(DataConfig(source="prepared", path="gs://runs/damaged", seq_len=32), 4).train_source[0]


def test_data_prepared_without_a_validation_split_trains_with_validation_off_and_says_so(tmp_path, corpus, capsys,
                                                                                         keep_signal_handlers):
  """issue 43: it used to exit 2 ("the validation split split has 0 tokens ... data.val_fraction"), even with
  --no-eval and train.eval_every=0, naming a field prepared data does not read."""
  import eval as eval_py
  import train as train_py
  from jaxshare.data.__main__ import main as data_main

  assert data_main(["prepare", "--out", str(tmp_path / "all"), str(corpus), "--val-fraction", "0",
                    "--no-progress"]) == 0
  capsys.readouterr()
  run = tmp_path / "run"
  assert train_py.main([*TINY, "train.steps=4", "train.eval_every=2", f"train.run_dir={run}", "data.source=prepared",
                        f"data.path={tmp_path / 'all'}"]) == 0
  out = capsys.readouterr().out
  warnings = [line for line in out.splitlines() if "warning" in line]
  assert len(warnings) == 1 and "has no validation split: training runs with validation off" in warnings[0]
  assert "--val-docs N" in warnings[0]
  assert all("val_loss" not in r for r in read_metrics(run))
  assert "val loss          none: the data has no validation split" in out  # train.py's closing evaluation
  assert eval_py.main([str(run), "--json", "--sample-tokens", "0"]) == 0
  assert json.loads(capsys.readouterr().out)["val_loss"] is None


def test_a_validation_split_smaller_than_a_batch_names_the_prepare_flag(tmp_path, corpus):
  prepare([str(corpus)], tmp_path / "out", PrepareOptions(val_fraction=0.001), progress=False)
  with pytest.raises(DataError, match=r"fewer than one batch of 32: lower train.batch_size or hold out more: "
                                      r"a validation split prepared with python -m jaxshare.data prepare --val-docs N"):
    Datasets(DataConfig(source="prepared", path=str(tmp_path / "out")), 32)
