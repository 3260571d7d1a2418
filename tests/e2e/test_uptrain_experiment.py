"""The uptraining experiment's cells (scripts/uptrain_experiment.py) are the ones its README table claims, checked
before anyone spends two CPU hours on them: every cell is a valid config of the 8-layer source; the MLKV ladder has
fewer K/V heads in all than layers (the regime MLKV's Table 2 is about); the matched variants have the dense model's
parameter count and the unmatched ones do not; each pair differs only in schedule.match_params."""

import importlib.util

import pytest

from conftest import REPO
from jaxshare import accounting
from jaxshare.config import load_config
from jaxshare.schedule import compile_schedule

_spec = importlib.util.spec_from_file_location("uptrain_experiment", REPO / "scripts" / "uptrain_experiment.py")
experiment = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(experiment)


def _cell(name: str):
  conversion, uptraining, _ = experiment.SCHEDULES[name]
  source = f"train.init_from=runs/uptrain/converted_{experiment.CONVERSION.get(name, name)}"  # as the experiment's
  cfg = load_config(REPO / experiment.EXPERIMENT, [*conversion, *uptraining, source])
  return cfg, compile_schedule(cfg.model, cfg.schedule)


def _params(cfg, schedule) -> int:
  return accounting.param_count(cfg.model, schedule, accounting.param_match(cfg.schedule)).total


@pytest.mark.parametrize("name", list(experiment.SCHEDULES))
def test_every_cell_is_a_valid_config(name):
  cfg, schedule = _cell(name)
  assert cfg.model.num_layers >= 8
  assert schedule.layers  # compiled: the schedule is valid on this model


def test_mlkv_ladder_has_fewer_kv_heads_than_layers():
  ladder = {name: _cell(name) for name in experiment.SCHEDULES if name.startswith("mlkv") and "_" not in name}
  totals = {name: sum(p.num_kv_heads for p in s.layers if p.is_producer) for name, (cfg, s) in ladder.items()}
  assert sorted(totals.values()) == [1, 2, 4]
  assert all(total < cfg.model.num_layers for (cfg, _), total in zip(ladder.values(), totals.values()))


def test_matched_cells_have_the_dense_parameter_count():
  dense = _params(*_cell("dense"))
  matched = [name for name in experiment.SCHEDULES if name.endswith("_m")]
  assert matched
  for name in matched:
    unmatched = name[:-2]
    assert experiment.SCHEDULES[name][0] == [*experiment.SCHEDULES[unmatched][0], *experiment.MATCHED]
    cfg, schedule = _cell(name)
    per_neuron = accounting.params_per_mlp_neuron(cfg.model) * cfg.model.num_layers
    assert abs(_params(cfg, schedule) - dense) <= per_neuron / 2, name
    assert _params(*_cell(unmatched)) < dense - per_neuron, unmatched


def test_recipe_rows_change_one_thing_against_the_row_they_name():
  """The papers' recipes (issue 46) change one thing each against their twin, listed above them; LISA's recipe is
  three such rows from its DS start, the paper's the last (issue 63 part 3)."""
  rows, order = experiment.SCHEDULES, list(experiment.SCHEDULES)
  changes = {}
  for name, (twin, convert, uptrain, flags) in experiment.RECIPES.items():
    assert order.index(twin) < order.index(name), name
    assert rows[name][0] == [*rows[twin][0], *convert] and rows[name][1] == [*rows[twin][1], *uptrain], name
    # one field, or the two-stage recipe's own (its stage-1 cap is a field of that recipe)
    fields = {o.split("=")[0] for o in (*convert, *uptrain)} - {"train.stage1_max_steps"} | set(flags[:1])
    assert len(fields) == 1, (name, fields)
    changes[name] = (twin, fields.pop())
    # a row that changes only the uptraining uptrains its twin's conversion, whose converted cell it does not copy
    assert (experiment.CONVERSION.get(name) is not None) == (not convert and not flags)
  assert changes["lisa_frozen"] == ("lisa_ds", "train.trainable")
  assert changes["lisa_frozen_kd"] == ("lisa_frozen", "train.kd_beta")
  assert changes["lisa_paper"] == ("lisa_frozen_kd", "train.lr")
  assert order[order.index("lisa_ds"):order.index("lisa_ds") + 4] == ["lisa_ds", "lisa_frozen", "lisa_frozen_kd",
                                                                      "lisa_paper"]
  assert {experiment.CONVERSION[n] for n in ("lisa_frozen", "lisa_frozen_kd", "lisa_paper")} == {"lisa_ds"}
  cfg, _ = _cell("lisa_paper")
  assert (cfg.train.trainable, cfg.train.kd_beta, cfg.train.lr) == ("sharing", 0.25, 3e-4)
  assert experiment.CONVERSION_FLAGS == {"uniattn_wcmean": ["--wc-fit", "mean"]}
  assert _params(*_cell("mlkv4_m_dup")) == _params(*_cell("mlkv4_m"))


def test_each_paired_comparison_names_the_one_field_its_rows_differ_in():
  """The rendered one-change table compares a row only with a row it differs from in one field (the two-stage
  recipe's cap aside), and names that field; every recipe, matched and LISA-start row has such a twin."""
  compared = {name: experiment.against(name) for name in experiment.SCHEDULES if experiment.against(name)}
  assert set(experiment.RECIPES) | {n for n in experiment.SCHEDULES if n.endswith("_m")} | {"lisa_fit",
                                                                                           "lisa_cal"} == set(compared)
  for name, twin in compared.items():
    changed = experiment.change(name, twin)
    fields = {o.split("=")[0] for o in changed if "=" in o} - {"train.stage1_max_steps"}
    flags = {f for f in changed if f.startswith("--")}
    assert len(fields | flags) == 1, (name, twin, changed)
    if fields:  # an override: the configs differ (a convert flag changes the conversion, not the config)
      assert _cell(name)[0] != _cell(twin)[0], name
  assert experiment.change("lisa_cal", "lisa_fit") == ["train.init_lisa=calibrated"]
  assert experiment.change("uniattn_wcmean", "uniattn") == ["--wc-fit", "mean"]
  assert experiment.against("dense") is None and experiment.against("mlkv1") is None


def test_a_conversions_fits_are_kept_without_its_tensor_rules():
  printed = ("dense: 8/8 layers produce K/V | 8x[P] -> uniattn: 8/8 layers produce K/V | 4x[P] + 2x[P Pp0+Wc]\n"
             "96 tensors copied (same layer, name and shape)\n"
             "layer 0 k_proj/v_proj: from layer 0, 4 heads\n"
             "W_c by least squares on calibration batches (UniAttn Thm 3.1 / Alg. 1, bottom-up, fit=mean):\n"
             "  layer 5 compensation: error ||E(x)W_c - E(eps)|| 37.01 -> 2.422e-11 (0.0%)\n"
             "  calibration loss: original 1.5734, unified 2.1729, with W_c 6.3329 nats/token\n"
             "layers [3, 4, 5] attn/q_lr, k_lr: fitted, the rank-r truncated SVD of the source layer's W_q W_k^T\n"
             "layers [3, 4, 5] attn/q_lr, k_lr: 200 Adam steps from the fit on 8 calibration batches: squared logit "
             "error vs the source's own, relative to plain reuse (DS = 1): fit 1.5176 -> calibrated 0.3949\n"
             "written to /tmp/x\n")
  lines = printed.splitlines()
  assert experiment.fit_lines(printed) == [*lines[3:6], lines[7]]


def test_two_stage_row_gets_the_standard_fine_tuning_budget(tmp_path):
  """UniAttn's stage 1 runs before the --steps every row gets (train.stage2_steps), and its length is read back."""
  from conftest import tiny_config
  from jaxshare.train.loop import train

  assert experiment.TWO_STAGE == {"uniattn_2stage"}
  cfg, _ = _cell("uniattn_2stage")
  assert (cfg.train.recipe, cfg.train.stage1_max_steps) == ("uniattn_two_stage", experiment.STAGE1_MAX_STEPS)
  run_dir = tmp_path / "run"
  train(tiny_config("schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=2",
                    "train.recipe=uniattn_two_stage", "train.stage1_max_steps=2", "train.stage1_patience=100",
                    "train.stage2_steps=3", "train.steps=6", "train.warmup_steps=1", "train.checkpoint_every=1",
                    f"train.run_dir={run_dir}"))
  assert experiment.stage1_steps(run_dir) == 2
