"""Training: sharded == single device, gradient accumulation, exact resume, checkpoint errors, real run."""

import dataclasses
import json
import re

import jax
import numpy as np
import pytest

from conftest import read_metrics, tiny_config
from jaxshare import parallel
from jaxshare.config import ConfigError, MeshConfig
from jaxshare.store.checkpoint import CheckpointError
from jaxshare.data.tokenizers import make_tokenizer
from jaxshare.evaluation.generate import Generator
from jaxshare.store.runs import load_run
from jaxshare.train.loop import train
from jaxshare.train.state import init_state, setup_training
from jaxshare.parallel import shard_batch
from jaxshare.train.step import make_train_step


def run_steps(cfg, mesh, batches):
  setup = setup_training(cfg, mesh)
  state = init_state(setup)
  step = jax.jit(make_train_step(setup.graphdef, setup.tx, setup.lr_schedule, cfg.train.grad_accum_steps),
                 in_shardings=(setup.state_shardings, setup.batch_sharding),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)
  losses = []
  with jax.set_mesh(setup.mesh):
    for b in batches:
      state, m = step(state, shard_batch(setup.batch_sharding, b))
      losses.append(float(m["loss"]))
  return losses, jax.device_get(state.params), setup


def test_gradient_accumulation_equals_full_batch(batches):
  mesh = parallel.make_mesh(MeshConfig(), jax.devices()[:1])
  full, p_full, _ = run_steps(tiny_config(), mesh, batches[:2])
  acc, p_acc, _ = run_steps(tiny_config("train.grad_accum_steps=4"), mesh, batches[:2])
  np.testing.assert_allclose(acc, full, rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p_acc), jax.tree.leaves(p_full)):
    np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-4)


def test_resume_reproduces_uninterrupted_losses(straight_run, tmp_path):
  cfg, straight_dir, _ = straight_run
  cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(tmp_path)))
  first = train(cfg, stop_after=10)
  assert first["step"] == 10
  second = train(cfg)
  assert second["step"] == 20
  a, b = read_metrics(straight_dir), read_metrics(tmp_path)
  assert [r["step"] for r in a] == [r["step"] for r in b] == [5, 10, 15, 20]
  for ra, rb in zip(a, b):
    assert ra["loss"] == rb["loss"], (ra, rb)  # bit-exact continuation
    assert ra.get("val_loss") == rb.get("val_loss")
  assert (tmp_path / "config.yaml").is_file() and any((tmp_path / "tensorboard").iterdir())


def test_resume_with_a_different_model_is_refused(straight_run, tmp_path):
  cfg, straight_dir, _ = straight_run
  other = tiny_config("schedule.kind=mlkv", "schedule.kv_layers=4", f"train.run_dir={straight_dir}",
                      "train.steps=30")
  with pytest.raises(ConfigError, match="schedule.kv_layers: 2 -> 4"):
    train(other)


@pytest.mark.parametrize("change, needle", [
  ("data.val_fraction=0.2", "data.val_fraction: 0.1 -> 0.2"),  # trained-on windows would become validation data
  ("data.shuffle_seed=1", "data.shuffle_seed: 0 -> 1"),
  ("train.clip_norm=0", "train.clip_norm: 1.0 -> 0.0 (changes the optimizer state's structure)"),
  ("train.trainable=sharing", "train.trainable: 'all' -> 'sharing' (changes the optimizer state's structure)"),
])
def test_resume_with_other_data_or_optimizer_structure_is_refused(straight_run, change, needle):
  _, straight_dir, _ = straight_run
  with pytest.raises(ConfigError, match=re.escape(needle)):
    train(tiny_config("schedule.kind=mlkv", "schedule.kv_layers=2", f"train.run_dir={straight_dir}", change))


def test_refused_runs_leave_the_run_directory_as_it_was(straight_run, tmp_path):
  import shutil

  with pytest.raises(ConfigError, match="model.vocab_size=100"):
    train(tiny_config("model.vocab_size=100", f"train.run_dir={tmp_path / 'new'}"))
  assert not (tmp_path / "new").exists()  # no empty run directory behind
  _, straight_dir, _ = straight_run
  shutil.copytree(straight_dir, tmp_path / "run")
  (tmp_path / "run" / "config.yaml").unlink()  # nothing to compare with: the restore is what fails
  with pytest.raises(CheckpointError):
    train(tiny_config("schedule.kind=mlkv", "schedule.kv_layers=2", "model.d_model=64",
                      f"train.run_dir={tmp_path / 'run'}"))
  assert not (tmp_path / "run" / "config.yaml").exists()  # the wrong config was not written over the run


def test_eval_cli_reports_json(straight_run, capsys):
  import eval as eval_cli

  _, run_dir, summary = straight_run
  assert eval_cli.main([str(run_dir), "--json", "--sample-tokens", "8", "--max-batches", "2"]) == 0
  report = json.loads(capsys.readouterr().out)
  assert report["step"] == 20 and report["num_params"] == summary["num_params"]
  assert report["kv_bytes_per_token"] == 2 * 2 * 4 * 8 * 4  # 2 producers x (K,V) x 4 heads x d=8 x fp32
  assert abs(report["val_loss"] - summary["val_loss"]) < 1e-4  # same batches as the training run's last pass
  assert report["perplexity"] == pytest.approx(np.exp(report["val_loss"]))
  # the sample is the greedy continuation of the prompt, recomputed here by full forward passes (no cache)
  run = load_run(run_dir)
  tokenizer = make_tokenizer(run.cfg.data)
  greedy = Generator(run.model(), run.plan).generate([tokenizer.encode("ROMEO:\n")], 8, use_cache=False)[0]
  assert len(greedy) == 8 and report["sample"] == tokenizer.decode(greedy)
  assert eval_cli.main([str(run_dir / "checkpoints" / "10"), "--json", "--sample-tokens", "0",
                        "--max-batches", "2"]) == 0
  assert json.loads(capsys.readouterr().out)["step"] == 10
  assert eval_cli.main([str(run_dir / "nothing")]) == 2
  assert "neither a run directory" in capsys.readouterr().err


def test_eval_cli_generates_and_scores_text(straight_run, capsys, tmp_path):
  """``generate`` streams the same greedy text with and without the cache; ``ppl`` on the validation split's text
  gives the report's validation loss (same windows, same batches)."""
  import eval as eval_cli
  from jaxshare.data import Datasets

  cfg, run_dir, _ = straight_run
  capsys.readouterr()  # the fixture's training log, when this test sets it up
  args = ["generate", str(run_dir), "--prompt", "ROMEO:", "--max-new-tokens", "12"]
  assert eval_cli.main(args) == 0
  cached = capsys.readouterr().out
  assert eval_cli.main(args + ["--no-cache"]) == 0
  assert capsys.readouterr().out == cached and cached.startswith("ROMEO:") and len(cached) > len("ROMEO:\n")
  data = Datasets(cfg.data, cfg.train.batch_size)
  val_span = data.stream.split("validation")
  val = data.stream.read(val_span.start, val_span.stop)[0].tolist()
  assert val[-1] == data.tokenizer.eos_id  # the corpus's EOS: ppl appends it again
  text = tmp_path / "val.txt"
  text.write_text(data.tokenizer.decode(val[:-1]), encoding="utf-8")
  assert eval_cli.main(["ppl", str(run_dir), "--text", str(text), "--max-batches", "2", "--json"]) == 0
  ppl = json.loads(capsys.readouterr().out)
  assert eval_cli.main([str(run_dir), "--json", "--sample-tokens", "0", "--max-batches", "2"]) == 0
  assert ppl["loss"] == pytest.approx(json.loads(capsys.readouterr().out)["val_loss"], abs=1e-5)
  assert ppl["tokens"] == 2 * cfg.train.batch_size * cfg.data.seq_len
  assert eval_cli.main(["ppl", str(run_dir), "--text", str(tmp_path / "none.txt")]) == 2
  assert "does not exist" in capsys.readouterr().err
  assert eval_cli.main(["generate", str(run_dir), "--prompt", "a", "--top-p", "2"]) == 2
  assert "top_p=2.0 is invalid" in capsys.readouterr().err


def test_eval_cli_efficiency(straight_run, capsys):
  """The largest batch is the most rows whose live cache fits the budget; the timed figures are measured."""
  import eval as eval_cli

  _, run_dir, _ = straight_run
  capsys.readouterr()
  budget = 0.001  # GiB
  assert eval_cli.main(["efficiency", str(run_dir), "--context", "32", "--batch", "2", "--steps", "4",
                        "--max-batch-context", "128", "--budget-gib", str(budget), "--json"]) == 0
  r = json.loads(capsys.readouterr().out)
  assert r["kv_bytes_per_token"] == r["kv_bytes_per_token_measured"] == 2 * 2 * 4 * 8 * 4
  big = r["max_batch_decode"]
  assert big["batch"] == r["max_batch"] == int(budget * 2 ** 30) // (r["kv_bytes_per_token"] * 128)
  assert big["cache_bytes"] <= budget * 2 ** 30 < big["cache_bytes"] * (r["max_batch"] + 1) / r["max_batch"]
  assert r["decode"][0]["tokens_per_s"] > 0 and r["prefill_s"] > 0 and r["decode"][0]["peak_bytes"] > 0


def test_train_cli_rejects_bad_input_before_compiling(capsys, tmp_path):
  import train as train_cli

  assert train_cli.main(["train.stepz=3"]) == 2
  assert "stepz" in capsys.readouterr().err
  assert train_cli.main([f"data.path={tmp_path}/none.txt", f"train.run_dir={tmp_path}/r"]) == 2
  assert "does not exist" in capsys.readouterr().err


@pytest.mark.slow
def test_short_real_run_lowers_loss(tmp_path, corpus, capsys):
  cfg = tiny_config("schedule.kind=cla", "model.d_model=64", "data.seq_len=64", "train.batch_size=16",
                    "train.steps=150", "train.warmup_steps=10", "train.eval_every=150", "train.eval_batches=8",
                    "train.log_every=10", "train.peak_tflops=0", f"train.run_dir={tmp_path}")
  summary = train(cfg)
  records = read_metrics(tmp_path)
  assert records[0]["loss"] > 3.5            # ~ln(256) = 5.5 at initialisation
  assert summary["val_loss"] < 2.7           # the model has learned character statistics
  assert records[-1]["loss"] < records[0]["loss"] - 1.5
  assert all(r["tokens_per_sec"] > 0 and 0 < r["mfu"] < 1 for r in records)  # against the host's measured roofline
  out = capsys.readouterr().out
  assert "MFU against host matmul roofline" in out and "(host roofline)" in out
