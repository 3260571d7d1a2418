"""Numerical faults: a diverging run stops with a diagnostic and keeps its last good checkpoint, or skips the bad
steps (train.nan_policy=skip); a diverged step never updates the state; non-finite parameters are refused on load."""

import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.store.checkpoint import CheckpointError, Checkpointer, save_params
from jaxshare.train.loop import DivergenceError, train
from jaxshare.store.runs import load_run

# A learning rate that is finite (so validation accepts it) but blows the weights up within a few steps.
DIVERGING = ["train.lr=1e30", "train.warmup_steps=1", "train.steps=12", "train.log_every=4", "train.eval_every=0",
             "train.checkpoint_every=1", "train.keep_checkpoints=2"]


def _all_finite(tree):
  return all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(tree))


def test_divergence_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  with pytest.raises(DivergenceError) as e:
    train(tiny_config(*DIVERGING, f"train.run_dir={tmp_path}"))
  msg = str(e.value)
  bad = int(msg.split("training diverged at step ")[1].split(":")[0])
  ckpt = Checkpointer(tmp_path / "checkpoints", 2)
  assert ckpt.latest_step() == bad - 1  # checkpoint_every=1: every step before the bad one was saved, none after
  assert f"the last good checkpoint is step {bad - 1}" in msg and "train.nan_policy=skip" in msg
  ckpt.close()
  run = load_run(tmp_path)  # finite, so it loads
  params, step = run.params, run.step
  assert step == bad - 1 and _all_finite(params)


def test_skip_policy_skips_counts_and_goes_on(tmp_path):
  summary = train(tiny_config(*DIVERGING, "train.nan_policy=skip", f"train.run_dir={tmp_path}"))
  assert summary["step"] == 12 and summary["skipped_steps"] > 0
  records = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  assert records[-1]["skipped_steps"] == summary["skipped_steps"]
  run = load_run(tmp_path)  # skipped steps left the state as it was: still finite
  params = run.params
  assert _all_finite(params)


def test_non_finite_parameters_are_refused_on_load(tmp_path):
  train(tiny_config(f"train.run_dir={tmp_path}", "train.steps=2", "train.warmup_steps=1", "train.eval_every=0"))
  run = load_run(tmp_path)
  params = run.params
  params = jax.tree.map(np.array, params)  # writable copies
  jax.tree.leaves(params)[0].flat[0] = np.nan
  save_params(tmp_path / "checkpoints", 3, params, {"step": 3})
  with pytest.raises(CheckpointError, match="holds non-finite parameters"):
    load_run(tmp_path)  # what eval.py, the analysis and the converters load through
