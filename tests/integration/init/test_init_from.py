"""A run is its own schedule (issue 43): ``train.py train.init_from=RUN`` takes RUN's model, schedule and tokenizer
unless the experiment file or an override sets them; a model that cannot load RUN's weights is refused in one line
naming the fields, before anything is written; the run's first log line says which schedule it trains and where its
weights came from. It used to train the default dense model, re-initialising every K/V projection, with exit 0."""

import pytest

from conftest import TINY, REPO, tiny_config, write_bpe_tokenizer
from jaxshare.train.config import load_train_config
from jaxshare.store.runs import read_config, write_run
from jaxshare.train.state import init_state, setup_training
from support.runs import as_run

NOT_MODEL = [o for o in TINY if not o.startswith("model.")]  # what a user passes besides the model
pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
  """A tiny dense run (``dense``) and the CLA2 run ``convert uptrain`` makes of it (``cla2``)."""
  from jaxshare.convert.__main__ import main as convert_main

  root = tmp_path_factory.mktemp("init_from")
  cfg = tiny_config()
  write_run(root / "dense", as_run(cfg, init_state(setup_training(cfg), seed=3).params))
  assert convert_main(["uptrain", str(root / "dense"), str(root / "cla2"), "schedule.kind=cla"]) == 0
  return root


def test_a_converted_run_trains_as_its_schedule_without_repeating_it(tmp_path, runs_dir, capsys):
  import train as train_py

  source = runs_dir / "cla2"
  assert train_py.main([*NOT_MODEL, "train.steps=3", f"train.init_from={source}", f"train.run_dir={tmp_path / 'up'}",
                        "--no-eval"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].startswith("jaxshare | cla: 2/4 layers produce K/V") and f"weights from {source} (step 0)" in lines[0]
  cfg, src = read_config(tmp_path / "up"), read_config(source)
  assert cfg.schedule == src.schedule and cfg.model == src.model
  assert any(line.startswith("init | ") and "copied" in line for line in lines)


def test_the_file_and_the_overrides_still_set_the_model_and_schedule(runs_dir):
  source = f"train.init_from={runs_dir / 'cla2'}"
  assert load_train_config(None, [source]).schedule.kind == "cla"
  mlkv = load_train_config(None, [source, "schedule.kind=mlkv", "schedule.kv_layers=1", "schedule.kv_heads=1"])
  assert mlkv.schedule.kind == "mlkv" and mlkv.model == read_config(runs_dir / "cla2").model
  from_file = load_train_config(REPO / "configs/experiments/shakespeare_dense.yaml", [source])
  assert from_file.schedule.kind == "dense" and from_file.model.d_model == 128  # the file's, as the user asked


@pytest.mark.parametrize("overrides,named", [
  (["model.d_model=64"], "model.d_model=64 (the source has 32)"),
  (["model.num_layers=6", "model.mlp_dim=96"], "model.num_layers=6 (the source has 4); model.mlp_dim=96 (the "
                                                "source has 64)"),
  (["--config", str(REPO / "configs/experiments/shakespeare_dense.yaml")], "model.d_model=128 (the source has 32)"),
])
def test_a_model_that_cannot_load_the_runs_weights_is_refused_in_one_line(tmp_path, runs_dir, capsys, overrides,
                                                                          named):
  import train as train_py

  run = tmp_path / "refused"
  assert train_py.main([*NOT_MODEL, *overrides, f"train.init_from={runs_dir / 'dense'}", f"train.run_dir={run}"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(f"error: train.init_from='{runs_dir / 'dense'}' cannot load that run's "
                                             "weights into this model: ") and named in err[0], err
  assert not run.exists()


def test_a_runs_own_tokenizer_comes_with_it_and_another_is_refused(tmp_path, runs_dir, corpus, capsys):
  import train as train_py

  tokenizer = write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000])
  cfg = tiny_config("model.vocab_size=300")
  write_run(tmp_path / "bpe", as_run(cfg, init_state(setup_training(cfg), seed=0).params),
            tokenizer_files=sorted(tokenizer.iterdir()))
  inherited = load_train_config(None, [f"train.init_from={tmp_path / 'bpe'}"])
  assert inherited.data.tokenizer == str(tmp_path / "bpe" / "tokenizer") and inherited.model.vocab_size == 300
  assert train_py.main([*NOT_MODEL, "data.tokenizer=byte", f"train.init_from={tmp_path / 'bpe'}",
                        f"train.run_dir={tmp_path / 'x'}"]) == 2
  assert "data.tokenizer='byte' (the source has " in capsys.readouterr().err


def test_convert_uptrain_refuses_a_model_the_source_cannot_fill(tmp_path, runs_dir, capsys):
  from jaxshare.convert.__main__ import main as convert_main

  assert convert_main(["uptrain", str(runs_dir / "dense"), str(tmp_path / "wide"), "model.d_model=64"]) == 2
  assert "model.d_model=64 (the source has 32)" in capsys.readouterr().err and not (tmp_path / "wide").exists()
