"""JAXSHARE_SMOKE (jaxshare/smoke.py), which tests/e2e/test_readme.py runs every documented command under: the narrow
model keeps what commands and docs name (steps, checkpoints, depth, heads, schedule, vocabulary) and changes only
widths, sequence length and the training batch; a fit check keeps its batch; drivers cut to their first variant."""

import pytest

from conftest import REPO
from jaxshare import smoke
from jaxshare.train.config import load_train_config
from jaxshare.schedule import compile_schedule

EXPERIMENTS = ["shakespeare_cla2", "uptrain_neox", "llama_1b_h100", "llama_1b_pod", "sharing_base"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_the_narrow_model_keeps_what_commands_name(monkeypatch, name):
  path = REPO / "configs" / "experiments" / f"{name}.yaml"
  full = load_train_config(path, [])
  monkeypatch.setenv(smoke.ENV, "1")
  small, fit = load_train_config(path, []), load_train_config(path, [], fit_check=True)
  assert small.train.steps == full.train.steps and small.train.checkpoint_every == full.train.checkpoint_every
  for field in ("num_layers", "num_heads", "vocab_size", "flavor", "rotary_pct"):
    assert getattr(small.model, field) == getattr(full.model, field)
  assert small.schedule == full.schedule and small.model.resolved_head_dim == smoke.HEAD_DIM
  assert [p.kv_source for p in compile_schedule(small.model, small.schedule).layers] == \
         [p.kv_source for p in compile_schedule(full.model, full.schedule).layers]
  assert small.data.seq_len == smoke.SEQ_LEN and small.train.batch_size == smoke.BATCH
  assert fit.train.batch_size == full.train.batch_size and fit.model == small.model


def test_drivers_and_measurements_are_cut_only_under_smoke(monkeypatch):
  monkeypatch.delenv(smoke.ENV, raising=False)
  assert smoke.first([1, 2, 3]) == [1, 2, 3] and smoke.cache_sizes(4.0, 8192, [512, 2048]) == (4.0, 8192, [512, 2048])
  for off in ("", "0"):
    monkeypatch.setenv(smoke.ENV, off)
    assert not smoke.enabled()
  monkeypatch.setenv(smoke.ENV, "1")
  assert smoke.first([1, 2, 3]) == [1] and smoke.first([1, 2, 3], 2) == [1, 2]
  assert smoke.cache_sizes(4.0, 8192, [512, 2048]) == (smoke.BUDGET_GIB, smoke.CONTEXT, [smoke.CONTEXT])
