"""Losses and recipes: LISA distillation, PostShare's penalty, UniAttn's two stages, uptraining and freezing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.config import ConfigError
from jaxshare.init.headwise import direct_share
from jaxshare.model.params import layer_params
from jaxshare.schedule import compile_schedule
from jaxshare.store.checkpoint import Checkpointer
from jaxshare.train.loop import train
from jaxshare.train.optimizer import learning_rate_schedule
from jaxshare.init.headwise import compute_ties, fresh_ties
from jaxshare.plan import plan_of
from jaxshare.init.source import initial_params
from jaxshare.store.runs import load_run
from jaxshare.train.state import setup_training, trainable_for
from jaxshare.train.step import distillation_loss, postshare_penalty


def metrics(run_dir):
  return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def params_at(run_dir, step):
  return jax.device_get(load_run(run_dir / "checkpoints" / str(step)).params)


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



def test_distillation_ignores_cells_outside_the_sliding_window():
  rng = np.random.default_rng(0)
  student, teacher = (jnp.asarray(rng.normal(size=(2, 1, 3, 6, 6)), jnp.float32) for _ in range(2))
  seg = jnp.ones((1, 6), jnp.int32)
  t, s = np.arange(6)[:, None], np.arange(6)[None, :]
  cells = (s <= t) & (t - s < 3)  # window 3: the query and the two keys before it
  d = np.abs(np.asarray(student) - np.asarray(teacher))
  huber = np.where(d <= 1.0, 0.5 * d ** 2, d - 0.5)  # Huber, delta 1
  want = huber[..., cells].mean()
  assert float(distillation_loss(student, teacher, seg, 1.0, window=3)) == pytest.approx(want, rel=1e-5)
  assert float(distillation_loss(student, teacher, seg, 1.0)) == pytest.approx(huber[..., s <= t].mean(), rel=1e-5)


def test_lisa_uptraining_with_distillation_trains_only_new_modules(teacher, tmp_path):
  cfg = tiny_config("schedule.kind=lisa", "schedule.lisa.layers=[1,2]", "schedule.lisa.hidden=8",
                    f"train.init_from={teacher}", "train.kd_beta=0.25", "train.trainable=sharing",
                    "train.steps=4", "train.log_every=2", "train.eval_every=4", "train.checkpoint_every=2",
                    "train.keep_checkpoints=4",
                    f"train.run_dir={tmp_path}")
  summary = train(cfg)
  records = metrics(tmp_path)
  assert all(r["kd_loss"] > 0 for r in records)
  setup = setup_training(cfg, trainable=trainable_for(cfg, 0))
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
  setup = setup_training(cfg)
  params = jax.device_get(jax.jit(lambda: initial_params(setup.plan, setup.ties, 0))())
  weights = {m: np.stack([layer_params(params, setup.schedule, l)["attn"][f"{m}_proj"]["kernel"] for l in range(4)])
             for m in "qkv"}
  pairs = direct_share(weights, 6, "qk").pairs  # 6 = the heads alpha = 0.3 ties in this model
  penalty = float(postshare_penalty(params, setup.schedule, pairs))
  expected = np.mean([sum(np.linalg.norm(weights[m][i // 4, :, i % 4] - weights[m][j // 4, :, j % 4])
                          for m in "qkv") for i, j in pairs["q"]])
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
  # the penalised pairs, chosen on the initial weights, are kept in the run ...
  saved = json.loads((tmp_path / "post" / "postshare_pairs.json").read_text())
  assert saved["match"] == "qk" and saved["ratio"] == 0.3
  assert {m: [tuple(p) for p in ps] for m, ps in saved["pairs"].items()} == {m: list(ps) for m, ps in pairs.items()}
  # ... and DirectShare from the post-trained run ties exactly those
  headwise = tiny_config("schedule.kind=headwise", "schedule.headwise.ratio=0.3",
                         f"train.init_from={tmp_path / 'post'}")
  ties = compute_ties(plan_of(headwise), 0, load_run(tmp_path / "post"))
  assert ties.pairs == pairs
  for bad, needle in ((["schedule.headwise.ratio=0.2"], "penalised 6 head pairs"),
                      (["schedule.headwise.match=v"], "were matched with 'qk'")):
    cfg = tiny_config("schedule.kind=headwise", "schedule.headwise.ratio=0.3", *bad,
                      f"train.init_from={tmp_path / 'post'}")
    with pytest.raises(ConfigError, match=needle):
      compute_ties(plan_of(cfg), 0, load_run(tmp_path / "post"))
  assert compute_ties(plan_of(headwise), 0) == fresh_ties(plan_of(headwise), 0)  # no source: a fresh model's


def test_lisa_keep_qk_keeps_the_teachers_projections_frozen(teacher, tmp_path):
  cfg = tiny_config("schedule.kind=lisa_plus", "schedule.lisa.layers=[1,2]", "schedule.lisa.keep_qk=true",
                    f"train.init_from={teacher}", "train.steps=2", "train.warmup_steps=1", "train.eval_every=2",
                    "train.checkpoint_every=2",
                    f"train.run_dir={tmp_path}")
  summary = train(cfg)  # train.trainable=all: everything trains except the kept W_q/W_k
  setup = setup_training(cfg)
  student, dense = params_at(tmp_path, 2), params_at(teacher, 10)
  dense_schedule = compile_schedule(tiny_config().model, tiny_config().schedule)
  for layer in (1, 2):
    s_attn = layer_params(student, setup.schedule, layer)["attn"]
    t_attn = layer_params(dense, dense_schedule, layer)["attn"]
    for name in ("q_proj", "k_proj"):
      np.testing.assert_array_equal(s_attn[name]["kernel"], t_attn[name]["kernel"])
    assert not np.array_equal(s_attn["o_proj"]["kernel"], t_attn["o_proj"]["kernel"])
  kept = 2 * 2 * 32 * 32  # W_q and W_k of two layers, D=32
  assert summary["trainable_params"] == summary["num_params"] - kept


def test_uniattn_compensation_has_no_weight_decay():
  cfg = tiny_config("schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=2")
  setup = setup_training(cfg)
  params = jax.jit(lambda: initial_params(setup.plan, setup.ties, 0))()
  params = jax.tree.map(lambda p: p + 1.0, params)  # W_c starts at zero: give it something to decay
  zero_grads = jax.tree.map(jnp.zeros_like, params)
  _, opt_state = setup.tx.update(zero_grads, setup.tx.init(params), params)  # step 0's lr is 0 (warm-up)
  updates, _ = setup.tx.update(zero_grads, opt_state, params)
  moved = {jax.tree_util.keystr(k) for k, u in jax.tree_util.tree_leaves_with_path(updates) if np.any(np.asarray(u))}
  assert any("mlp" in k for k in moved)  # with zero gradients only weight decay moves parameters
  assert not any("compensation" in k for k in moved)


def test_uniattn_two_stage_recipe_and_resume(tmp_path):
  base = ["schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=2",
          "train.recipe=uniattn_two_stage", "train.stage1_max_steps=4", "train.stage1_patience=100",
          "train.steps=8", "train.log_every=2", "train.eval_every=8", "train.checkpoint_every=2",
          "train.keep_checkpoints=10"]
  cfg = tiny_config(*base, f"train.run_dir={tmp_path / 'a'}")
  summary = train(cfg)
  records = metrics(tmp_path / "a")
  assert [r["stage"] for r in records] == [1, 2, 2, 2]  # stage 1 ends after its 4th step
  # stage 2 restarts the learning-rate schedule: warm-up again, cosine over the 4 remaining steps
  stage2 = learning_rate_schedule(cfg.train, start_step=4)
  for r in records[2:]:
    assert r["lr"] == pytest.approx(float(stage2(r["step"] - 1 - 4)))  # the lr of the record's last update
  assert records[2]["lr"] < records[1]["lr"]
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


def test_uniattn_stage2_steps_gives_stage2_its_own_budget(tmp_path):
  """train.stage2_steps: stage 2 runs exactly that many steps after stage 1 ends (UniAttn Alg. 1, App. D), with its
  learning-rate schedule over them, whatever stage 1's length; resumed, the same curve; a finished run stays so."""
  base = ["schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=2",
          "train.recipe=uniattn_two_stage", "train.stage1_max_steps=3", "train.stage1_patience=100",
          "train.stage2_steps=4", "train.steps=9", "train.warmup_steps=1", "train.log_every=1",
          "train.checkpoint_every=1", "train.keep_checkpoints=20"]
  cfg = tiny_config(*base, f"train.run_dir={tmp_path / 'a'}")
  summary = train(cfg)
  records = metrics(tmp_path / "a")
  # stage 1 ends after its 3rd step (the switching step's record says 2), stage 2 takes 4 more: 7 of train.steps=9
  assert [(r["step"], r["stage"]) for r in records] == [(1, 1), (2, 1), (3, 2), (4, 2), (5, 2), (6, 2), (7, 2)]
  assert summary["step"] == 7 and summary["finished"] and "val_loss" in records[-1]
  stage2 = learning_rate_schedule(cfg.train, start_step=3, end_step=7)  # cosine over the 4 steps of stage 2
  for r in records[3:]:
    assert r["lr"] == pytest.approx(float(stage2(r["step"] - 1 - 3)))
  cfg_b = tiny_config(*base, f"train.run_dir={tmp_path / 'b'}")
  train(cfg_b, stop_after=2)
  assert not train(cfg_b, stop_after=5)["finished"]
  assert train(cfg_b)["step"] == 7
  again = train(cfg_b)  # finished: nothing more is trained
  assert again["step"] == 7 and again["finished"]
  assert [(r["step"], r["loss"], r["stage"]) for r in metrics(tmp_path / "b")] == \
      [(r["step"], r["loss"], r["stage"]) for r in records]


def test_distillation_teacher_is_the_dense_source_recorded_at_conversion(teacher, tmp_path):
  """A LISA run uptrained from a converted LISA run distils from the dense model it was converted from (recorded at
  conversion as train.kd_teacher), not from the conversion's own logits: those equal the student's at step 0, so
  the first step's distillation loss is 0 exactly when the conversion teaches (issue 63 part 3)."""
  from jaxshare.convert.uptrain import uptrain_run
  from jaxshare.store.runs import read_config
  from jaxshare.train.start import start_run

  lisa = ["schedule.kind=lisa", "schedule.lisa.layers=[1,2]", "schedule.lisa.hidden=8", "train.init_lisa=ds"]
  converted = tmp_path / "converted"
  uptrain_run(teacher, converted, lisa, calibration_batches=0)
  assert read_config(converted).train.kd_teacher == str(teacher)  # the dense source, recorded
  distil = ["train.kd_beta=0.25", "train.trainable=sharing", "train.steps=1", "train.eval_every=1",
            "train.warmup_steps=0"]
  train(tiny_config(*lisa, *distil, f"train.init_from={converted}", f"train.run_dir={tmp_path / 'student'}"))
  assert metrics(tmp_path / "student")[0]["kd_loss"] > 1e-5  # exactly 0 with the conversion as the teacher

  # a run that was trained, not converted, records no teacher: distilling from it by default is refused ...
  trained = tmp_path / "trained"
  train(tiny_config(*lisa, "train.steps=1", "train.eval_every=1", "train.warmup_steps=0",
                    f"train.init_from={converted}", f"train.run_dir={trained}"))
  refused = tiny_config(*lisa, *distil, f"train.init_from={trained}", f"train.run_dir={tmp_path / 'refused'}")
  with pytest.raises(ConfigError, match=r"train.kd_teacher.*schedule.kind='lisa'.*not dense"):
    start_run(refused)
  assert not (tmp_path / "refused").exists()  # refused before anything was written
  # ... unless it is named
  named = tiny_config(*lisa, *distil, f"train.init_from={trained}", f"train.kd_teacher={trained}",
                      f"train.run_dir={tmp_path / 'named'}")
  assert start_run(named).teacher.directory == trained
  # a teacher of another shape is refused by name
  other = tmp_path / "other"
  train(tiny_config("model.num_heads=2", "train.steps=1", "train.eval_every=1", "train.warmup_steps=0",
                    f"train.run_dir={other}"))
  with pytest.raises(ConfigError, match=r"train.kd_teacher=.*model.num_heads=4 \(the teacher has 2\)"):
    start_run(tiny_config(*lisa, *distil, f"train.init_from={converted}", f"train.kd_teacher={other}",
                          f"train.run_dir={tmp_path / 'other_student'}"))
