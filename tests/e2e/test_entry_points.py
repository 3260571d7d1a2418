"""Every schedule kind through every entry point, as a user runs them: ``train.py`` (a few steps) → ``eval.py`` →
``eval.py generate`` (cached greedy == uncached greedy) → the lm-eval adapter on a tiny local task → ``convert
export`` → ``convert import`` (bit-exact parameters) → resumption (the same losses as the uninterrupted run). Runs
made by ``convert uptrain`` from a trained dense run go through ``eval.py`` and the round trip, their last step being
uptraining (``train.init_from``).

The CLIs' ``main(argv)`` run in this process (their argument parsing, error handling and output included); only
the interpreter start-up is skipped. Each feature's own tests cover it on the schedules it was written for; this
matrix exists because a combination none of them ran (head-wise runs through ``eval.py``) crashed.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import CORPUS, TINY, read_metrics, write_multiple_choice_task
from jaxshare.config.catalogue import schedule_matrix

# One small schedule of every kind (and a composed one) on TINY's 4 layers x 4 heads.
KINDS = schedule_matrix("kinds")
# What `convert uptrain` turns a dense run into: every kind but the source's own (PostShare is a training penalty on
# a dense model; its conversion is head-wise sharing of the pairs it penalised, tested in test_headwise.py).
UPTRAIN_KINDS = [k for k in KINDS if k not in ("dense", "postshare")]

STEPS = ["train.steps=4", "train.checkpoint_every=2", "train.log_every=1", "train.eval_every=4",
         "train.eval_batches=1", "train.warmup_steps=1"]
PROMPT = "ROMEO:"
pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


def cli(main, *argv: str) -> str:
  """Run a CLI's ``main(argv)``; its stdout. Fails with its stderr unless it exits 0."""
  out, err = io.StringIO(), io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    code = main(list(argv))
  assert code == 0, f"{main.__module__} {' '.join(argv)} exited {code}:\n{err.getvalue()[-3000:]}"
  return out.getvalue()


def train_cli(*argv: str) -> str:
  import train

  # flags after the overrides, as a user types them
  return cli(train.main, *TINY, *STEPS, *argv, "--no-eval")


def eval_cli(*argv: str) -> str:
  import eval as eval_py

  return cli(eval_py.main, *argv)


def convert_cli(*argv: str) -> str:
  from jaxshare.convert.__main__ import main

  return cli(main, *argv)


def params_of(path) -> dict[str, np.ndarray]:
  from flax import traverse_util

  from jaxshare.store.runs import load_run

  return {"/".join(map(str, k)): np.asarray(v) for k, v in traverse_util.flatten_dict(load_run(path).params).items()}


@pytest.fixture(scope="module")
def lm_eval_task(tmp_path_factory) -> Path:
  """A 4-document next-line multiple-choice task from the corpus (YAML + JSONL), for lm_eval.simple_evaluate."""
  path = tmp_path_factory.mktemp("task")
  lines = [ln for ln in CORPUS.read_text().splitlines() if len(ln) > 20][:12]
  write_multiple_choice_task(path, "matrix_next_line", [
    {"context": lines[i], "choices": [lines[i + 1], lines[i + 6]], "label": 0} for i in range(4)])
  return path


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory) -> Path:
  """A dense run trained for 4 steps: what ``convert uptrain`` converts."""
  run = tmp_path_factory.mktemp("source") / "dense"
  train_cli(f"train.run_dir={run}")
  return run


def check_eval(run: Path) -> None:
  """``eval.py`` reports a finite loss, the accounting's KV bytes and a greedy sample."""
  from jaxshare import accounting
  from jaxshare.store.runs import load_run

  report = json.loads(eval_cli(str(run), "--json", "--max-batches", "1", "--sample-tokens", "4"))
  assert np.isfinite(report["val_loss"]) and report["sample"], report
  setup = load_run(run)
  cfg = setup.cfg
  assert report["kv_bytes_per_token"] == accounting.kv_cache_bytes_per_token(
    cfg.model, setup.schedule, np.dtype(cfg.model.dtype).itemsize)


def check_generate(run: Path) -> None:
  """Greedy generation with the decode cache gives the tokens of full forward passes."""
  cached = eval_cli("generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "12", "--stop", "-1")
  uncached = eval_cli("generate", str(run), "--prompt", PROMPT, "--max-new-tokens", "12", "--stop", "-1",
                      "--no-cache")
  assert cached == uncached
  assert cached.startswith(PROMPT) and len(cached) > len(PROMPT) + 1


def check_lm_eval(run: Path, task: Path) -> None:
  """The harness scores the task through the adapter, and the adapter's choice equals jaxshare's own scoring."""
  from lm_eval import simple_evaluate
  from lm_eval.tasks import TaskManager

  from jaxshare.evaluation.lm_eval_harness import JaxshareLM

  # the adapter instance itself (its registration and model_args parsing: tests/unit/evaluation/test_lm_eval.py)
  lm = JaxshareLM(run=str(run), batch_size=4)
  results = simple_evaluate(model=lm, tasks=["matrix_next_line"],
                            task_manager=TaskManager(include_path=str(task), include_defaults=False))
  acc = results["results"]["matrix_next_line"]["acc,none"]

  class Request:
    def __init__(self, *args):
      self.args = args

  docs = [json.loads(line) for line in (task / "matrix_next_line.jsonl").read_text().splitlines()]
  own = [np.argmax([lp for lp, _ in lm.loglikelihood([Request(d["context"] + "\n", " " + c) for c in d["choices"]])])
         == d["label"] for d in docs]
  assert acc == pytest.approx(np.mean(own))


def check_round_trip(run: Path, tmp: Path) -> None:
  """``convert export`` then ``convert import`` gives back every parameter bit for bit."""
  convert_cli("export", str(run), str(tmp / "hf"))
  convert_cli("import", str(tmp / "hf"), str(tmp / "imported"))
  want, got = params_of(run), params_of(tmp / "imported")
  assert sorted(got) == sorted(want)
  for name, value in want.items():
    np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_trained_run_through_every_entry_point(kind, tmp_path, lm_eval_task):
  run = tmp_path / "run"
  train_cli(*KINDS[kind], f"train.run_dir={run}")
  straight = {r["step"]: r["loss"] for r in read_metrics(run)}
  assert sorted(straight) == [1, 2, 3, 4] and all(np.isfinite(list(straight.values())))

  check_eval(run)
  check_generate(run)
  check_lm_eval(run, lm_eval_task)
  check_round_trip(run, tmp_path)

  # Resumption: drop the last checkpoint and its metrics; the re-run resumes at step 2 on the same curve.
  resumed = tmp_path / "resumed"
  shutil.copytree(run, resumed)
  shutil.rmtree(resumed / "checkpoints" / "4")
  shutil.rmtree(resumed / "tensorboard", ignore_errors=True)
  (resumed / "metrics.jsonl").write_text("".join(
    line + "\n" for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 2))
  train_cli(*KINDS[kind], f"train.run_dir={resumed}")
  again = {r["step"]: r["loss"] for r in read_metrics(resumed)}
  assert again == straight


@pytest.mark.slow
@pytest.mark.parametrize("kind", UPTRAIN_KINDS)
def test_uptrained_run_through_every_entry_point(kind, tmp_path, dense_source, lm_eval_task):
  converted = tmp_path / "converted"
  convert_cli("uptrain", str(dense_source), str(converted), *KINDS[kind], "--calibration-batches", "1")

  # Generation and lm-eval scoring read a converted run through the same load_run and model as a trained run of
  # its kind, which the trained matrix generates from and scores: here the conversion's own output is checked.
  check_eval(converted)
  check_round_trip(converted, tmp_path)

  uptrained = tmp_path / "uptrained"
  train_cli(*KINDS[kind], f"train.init_from={converted}", f"train.run_dir={uptrained}")
  losses = [r["loss"] for r in read_metrics(uptrained)]
  assert len(losses) == 4 and np.all(np.isfinite(losses))
