"""A run's start (jaxshare.train.start): what it resumes or initialises, and the run files it writes once."""

import pytest

from conftest import tiny_config
from jaxshare.config import ConfigError
from jaxshare.store import runs
from jaxshare.store.runs import PAIRS_FILE, read_stored
from jaxshare.train.loop import train
from jaxshare.train.start import start_run

POSTSHARE = ["train.postshare_gamma=1.0", "train.warmup_steps=1", "train.checkpoint_every=2", "train.eval_every=0",
             "train.log_every=1"]


def test_a_resumed_start_keeps_the_pairs_chosen_when_the_run_began(tmp_path, monkeypatch):
  cfg = tiny_config(*POSTSHARE, "train.steps=2", f"train.run_dir={tmp_path}")
  fresh = start_run(cfg)
  assert fresh.latest is None and fresh.meta == {} and int(fresh.state.step) == 0
  # chosen on the initial weights, written
  assert fresh.pairs is not None and read_stored(tmp_path).pairs() == fresh.pairs
  fresh.ckpt.close()
  written = (tmp_path / PAIRS_FILE).stat().st_mtime_ns
  train(cfg)
  reads = []  # the run directory's own files are read through one store call (its checkpoints by the Checkpointer)
  monkeypatch.setattr(runs, "read_stored", lambda d, read=runs.read_stored: reads.append(d) or read(d))
  monkeypatch.setattr(runs, "read_config", lambda d: pytest.fail(f"a second read of {d}'s config"))
  resumed = start_run(tiny_config(*POSTSHARE, "train.steps=4", f"train.run_dir={tmp_path}"))
  assert [str(d) for d in reads] == [str(tmp_path)]
  assert resumed.latest == 2 and int(resumed.state.step) == 2 and resumed.meta["step"] == 2
  assert resumed.pairs == fresh.pairs and (tmp_path / PAIRS_FILE).stat().st_mtime_ns == written  # read, not rewritten
  assert resumed.notes == () and resumed.init_report == ()
  resumed.ckpt.close()


def test_a_start_refused_creates_nothing(tmp_path):
  run_dir = tmp_path / "run"
  with pytest.raises(ConfigError, match="model.vocab_size=16 is smaller than the tokenizer's vocabulary"):
    start_run(tiny_config("model.vocab_size=16", f"train.run_dir={run_dir}"))
  assert not run_dir.exists()
