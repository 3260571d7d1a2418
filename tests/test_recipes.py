"""Losses and recipes: LISA distillation, PostShare's penalty, UniAttn's two stages, uptraining and freezing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.headwise import direct_share
from jaxshare.model.params import layer_params
from jaxshare.schedule import compile_schedule
from jaxshare.train.checkpoint import Checkpointer
from jaxshare.train.loop import train
from jaxshare.train.state import initial_params, load_run, setup_run, trainable_for
from jaxshare.train.step import distillation_loss, postshare_penalty


def metrics(run_dir):
  return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params_at(run_dir, step):
  return jax.device_get(load_run(run_dir / "checkpoints" / str(step))[2])


def changed_modules(before, after):
  """Names of the leaves (as key paths) that moved."""
  flat_b = dict(jax.tree_util.tree_leaves_with_path(before))
  return {jax.tree_util.keystr(k) for k, v in jax.tree_util.tree_leaves_with_path(after)
          if not np.array_equal(np.asarray(v), np.asarray(flat_b[k]))}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("teacher")
  train(tiny_config("train.steps=10", "train.eval_every=10", f"train.run_dir={run_dir}"))
  return run_dir


def test_distillation_loss_values():
  a = jnp.zeros((1, 1, 1, 2, 2))
  seg = jnp.ones((1, 2), jnp.int32)
  assert float(distillation_loss(a, a, seg, 1.0)) == 0.0
  b = a.at[..., 1, 0].set(3.0).at[..., 0, 1].set(100.0)  # (0,1) is a future cell: ignored
  # causal cells (0,0), (1,0), (1,1); Huber(3, delta 1) = 3 - 0.5
  assert float(distillation_loss(b, a, seg, 1.0)) == pytest.approx(2.5 / 3)


def test_lisa_uptraining_with_distillation_trains_only_new_modules(teacher, tmp_path):
  cfg = tiny_config("schedule.kind=lisa", "schedule.lisa.layers=[1,2]", "schedule.lisa.hidden=8",
                    f"train.init_from={teacher}", "train.kd_beta=0.25", "train.trainable=sharing",
                    "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=2",
                    "train.keep_checkpoints=4",
                    f"train.run_dir={tmp_path}")
  summary = train(cfg)
  records = metrics(tmp_path)
  assert all(r["kd_loss"] > 0 for r in records)
  setup = setup_run(cfg, trainable=trainable_for(cfg, 0))
  new_module_size = sum(x.size for k, x in jax.tree_util.tree_leaves_with_path(params_at(tmp_path, 2))
                        if any(n in jax.tree_util.keystr(k) for n in ("q_lr", "k_lr", "align")))
  assert summary["trainable_params"] == records[0]["trainable_params"] == new_module_size == setup.num_trainable
  moved = changed_modules(params_at(tmp_path, 2), params_at(tmp_path, 4))
  assert moved and all(any(n in k for n in ("q_lr", "k_lr", "align_in", "align_out")) for k in moved)
  # the frozen weights are the teacher's
  student, dense = params_at(tmp_path, 4), params_at(teacher, 10)
  dense_schedule = compile_schedule(tiny_config().model, tiny_config().schedule)
  for layer in range(4):
    np.testing.assert_array_equal(layer_params(student, setup.schedule, layer)["mlp"]["up"]["kernel"],
                                  layer_params(dense, dense_schedule, layer)["mlp"]["up"]["kernel"])
  np.testing.assert_array_equal(student["embedding"], dense["embedding"])


def test_postshare_penalty_pulls_matched_heads_together(tmp_path):
  cfg = tiny_config()
  setup = setup_run(cfg)
  params = jax.device_get(jax.jit(lambda: initial_params(setup, 0))())
  weights = {m: np.stack([layer_params(params, setup.schedule, l)["attn"][f"{m}_proj"]["kernel"] for l in range(4)])
             for m in "qkv"}
  pairs = direct_share(weights, 3, "qk")
  penalty = float(postshare_penalty(params, setup.schedule, pairs))
  expected = np.mean([sum(np.linalg.norm(weights[m][i // 4, :, i % 4] - weights[m][j // 4, :, j % 4])
                          for m in "qkv") for i, j in pairs.pairs["q"]])
  assert penalty == pytest.approx(expected, rel=1e-5)
  grads = jax.grad(postshare_penalty)(params, setup.schedule, pairs)
  assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))

  def run(gamma, name):
    d = tmp_path / name
    train(tiny_config(f"train.postshare_gamma={gamma}", "train.steps=6", "train.eval_every=6",
                      "train.log_every=3", "train.lr=1e-2", f"train.run_dir={d}"))
    p = params_at(d, 6)
    return float(postshare_penalty(p, setup.schedule, pairs)), metrics(d)

  with_penalty, recs = run(5.0, "post")
  without, _ = run(0.0, "plain")
  assert "postshare_loss" in recs[0]
  assert with_penalty < without


def test_uniattn_two_stage_recipe_and_resume(tmp_path):
  base = ["schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=2",
          "train.recipe=uniattn_two_stage", "train.stage1_max_steps=4", "train.stage1_patience=100",
          "train.steps=8", "train.log_every=2", "train.eval_every=8", "train.checkpoint_every=2",
          "train.keep_checkpoints=10"]
  cfg = tiny_config(*base, f"train.run_dir={tmp_path / 'a'}")
  summary = train(cfg)
  records = metrics(tmp_path / "a")
  assert [r["stage"] for r in records] == [1, 2, 2, 2]  # stage 1 ends after its 4th step
  assert records[0]["trainable_params"] < records[-1]["trainable_params"] == summary["num_params"]
  moved_stage1 = changed_modules(params_at(tmp_path / "a", 2), params_at(tmp_path / "a", 4))
  assert moved_stage1 and all("compensation" in k for k in moved_stage1)
  moved_stage2 = changed_modules(params_at(tmp_path / "a", 6), params_at(tmp_path / "a", 8))
  assert any("mlp" in k for k in moved_stage2) and any("compensation" in k for k in moved_stage2)
  # interrupted in stage 1 and in stage 2, resumed: the same curve
  cfg_b = tiny_config(*base, f"train.run_dir={tmp_path / 'b'}")
  train(cfg_b, stop_after=2)
  train(cfg_b, stop_after=6)
  train(cfg_b)
  assert [(r["step"], r["loss"], r["stage"]) for r in metrics(tmp_path / "b")] == \
      [(r["step"], r["loss"], r["stage"]) for r in records]
  ckpt = Checkpointer(tmp_path / "b" / "checkpoints", 2)
  assert ckpt.read_meta(8)["stage"] == 2
  ckpt.close()
