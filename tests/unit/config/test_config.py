import copy
import re

import numpy as np
import pytest

from jaxshare.config import (ConfigError, apply_overrides, config_from_yaml_text, describe_fields, load_config,
                             to_yaml)
from support.runs import as_run


def test_defaults_and_overrides_compose(tmp_path):
  (tmp_path / "m.yaml").write_text("model:\n  num_layers: 6\n  d_model: 64\n")
  (tmp_path / "exp.yaml").write_text("includes: [m.yaml]\nmodel:\n  d_model: 96\ntrain:\n  steps: 300\n")
  cfg = load_config(tmp_path / "exp.yaml", ["train.steps=500", "schedule.kind=mlkv", "schedule.kv_layers=2"])
  assert cfg.model.num_layers == 6          # from the include
  assert cfg.model.d_model == 96            # the experiment overrides its include
  assert cfg.train.steps == 500             # the command line overrides the file
  assert cfg.schedule.kind == "mlkv" and cfg.schedule.kv_layers == 2


def test_repo_experiment_files_load():
  cfg = load_config("configs/experiments/shakespeare_cla2.yaml")
  assert cfg.schedule.kind == "cla" and cfg.data.path == "tinyshakespeare.txt"


@pytest.mark.parametrize("override, needle", [
  (["train.stepz=3"], "stepz"),
  (["model.num_layers=abc"], "num_layers"),
  (["model.flavor=gpt2"], "model.flavor='gpt2' is invalid: must be one of llama, neox"),
  (["train.batch_size=10", "train.grad_accum_steps=3"], "train.grad_accum_steps=3"),
  (["model.num_heads=5"], "model.num_heads=5"),
  (["model.rotary_pct=0.01"], "model.rotary_pct"),
  (["train.steps"], "key=value"),
  (["mesh.data=-1", "mesh.fsdp=-1"], "at most one mesh axis"),
  (["mesh.context=4", "data.seq_len=100"],
   "data.seq_len=100 is invalid: must be a multiple of 2 x the context axis (8: mesh.context=4 x mesh.dcn_context=1)"),
  (["mesh.context=3", "mesh.dcn_context=2", "data.seq_len=30"], "data.seq_len=30 is invalid: must be a multiple of 2 x "
                                                                "the context axis (12"),
  (["mesh.context=2", "attention.score_sharing=materialize"],
   "attention.score_sharing='materialize' is invalid: must be recompute with mesh.context > 1"),
  (["mesh.context=2", "train.kd_beta=0.25", "train.init_from=runs/x"], "train.kd_beta=0.25 is invalid: must be 0 with"),
  (["train.kd_beta=0.25"], "train.kd_beta=0.25 is invalid: distillation needs a teacher: set train.kd_teacher or "
                           "train.init_from"),
  (["mesh.context=0"], "mesh.context=0 is invalid: must be a positive axis size or -1"),
  (["model.remat=selective"], "model.remat='selective' is invalid: must be one of none, full, minimal"),
  (["train.num_vocab_tiling=3"], "train.num_vocab_tiling=3 is invalid: must be a positive divisor of "
                                 "model.vocab_size=256"),
  (["train.recipe=uniattn_two_stage", "train.trainable=sharing"],
   "train.trainable='sharing' is invalid: must be all with train.recipe=uniattn_two_stage"),
  (["train.stage2_steps=5"], "train.stage2_steps=5 is invalid: needs train.recipe=uniattn_two_stage"),
  (["train.recipe=uniattn_two_stage", "train.stage1_max_steps=10", "train.stage2_steps=20", "train.steps=25",
    "train.warmup_steps=2"],
   "train.steps=25 is invalid: must be >= train.stage1_max_steps + train.stage2_steps = 30"),
  (["train.stage2_steps=-1"], "train.stage2_steps=-1 is invalid: must be >= 0"),
  # values that used to be accepted and trained to NaN from step 1
  (["train.lr=inf"], "train.lr=inf is invalid: must be a finite number > 0"),
  (["train.lr=nan"], "train.lr=nan is invalid"),
  (["train.b1=1.5"], "train.b1=1.5 is invalid: must be in [0, 1)"),
  (["train.b2=-0.1"], "train.b2=-0.1 is invalid"),
  (["train.eps=0"], "train.eps=0.0 is invalid"),
  (["train.weight_decay=-5"], "train.weight_decay=-5.0 is invalid: must be a finite number >= 0"),
  (["train.clip_norm=inf"], "train.clip_norm=inf is invalid"),
  (["model.norm_eps=-1"], "model.norm_eps=-1.0 is invalid: must be a finite number > 0"),
  (["model.init_std=inf"], "model.init_std=inf is invalid"),
  (["model.rope_theta=0"], "model.rope_theta=0.0 is invalid"),
  (["schedule.lisa.hidden=-5"], "schedule.lisa.hidden=-5 is invalid: must be >= 0"),
  (["schedule.lisa.rank=-1"], "schedule.lisa.rank=-1 is invalid"),
  # a knob the preset ignores
  (["schedule.kind=mqa", "schedule.kv_heads=2"],
   "schedule.kv_heads=2 is invalid with schedule.kind='mqa', which ignores it: it is read by dense, gqa, cla"),
  (["schedule.kind=cla", "schedule.kv_heads_per_layer=[4,4,4,4]"],
   "schedule.kv_heads_per_layer=[4, 4, 4, 4] is invalid with schedule.kind='cla', which ignores it"),
  (["schedule.kind=dense", "schedule.uniattn.block_size=2"],
   "schedule.uniattn.block_size=2 is invalid with schedule.kind='dense'"),
  (["schedule.kind=gqa", "schedule.kv_heads=2", "schedule.factor=3"], "schedule.factor=3 is invalid with"),
])
def test_invalid_values_name_the_field(override, needle):
  from jaxshare.schedule import compile_schedule

  with pytest.raises(ConfigError) as e:
    cfg = load_config(None, override)
    compile_schedule(cfg.model, cfg.schedule)  # the schedule's own checks (run by every entry point after loading)
  assert needle in str(e.value)


def test_unknown_key_in_file_and_bad_yaml(tmp_path):
  (tmp_path / "a.yaml").write_text("model:\n  n_layers: 3\n")
  with pytest.raises(ConfigError, match="n_layers"):
    load_config(tmp_path / "a.yaml")
  (tmp_path / "b.yaml").write_text("model: [unclosed\n")
  with pytest.raises(ConfigError, match="not valid YAML"):
    load_config(tmp_path / "b.yaml")
  with pytest.raises(ConfigError, match="does not exist"):
    load_config(tmp_path / "missing.yaml")


def test_yaml_round_trip_and_every_field_documented():
  cfg = load_config(None, ["schedule.kind=cla", "schedule.producers=[0,1,3]"])
  assert config_from_yaml_text(to_yaml(cfg)) == cfg
  text = describe_fields()
  for line in text.splitlines()[1:]:
    if line.startswith("      "):
      assert line.strip(), "a field has no documentation"


def test_string_fields_are_not_parsed_as_yaml_numbers():
  cfg = load_config(None, ["model.num_layers=4", "schedule.kind=explicit", "schedule.sources=0_0_2_2"])
  assert cfg.schedule.sources == "0_0_2_2"


def test_every_repo_config_file_loads():
  from pathlib import Path

  from jaxshare.schedule import compile_schedule

  files = sorted(Path("configs/experiments").glob("*.yaml"))
  assert files
  for f in files:
    cfg = load_config(f)
    compile_schedule(cfg.model, cfg.schedule)
  from omegaconf import OmegaConf

  for f in sorted(Path("configs/schedules").glob("*.yaml")):
    sched = OmegaConf.load(f)["schedule"]
    cfg = load_config(None, [f"schedule.{k}={v}" for k, v in sched.items()])
    compile_schedule(cfg.model, cfg.schedule)


def test_configuration_reference_documents_every_field():
  from pathlib import Path

  from jaxshare.config import documented_fields

  reference = Path("docs/configuration.md").read_text()  # written by scripts/config_reference.py --write
  for _, _, rows in documented_fields():
    for name, _, help_text in rows:
      assert help_text, f"{name} has no documentation"
      assert f"`{name}`" in reference, f"docs/configuration.md lacks {name}: python scripts/config_reference.py --write"


@pytest.mark.parametrize("text, needle", [
  ("", "run/config.yaml is empty"),  # read as the defaults, it blamed fields the user never changed
  ("model: {d_model: [", "run/config.yaml is not valid YAML"),
  ("- a\n- b\n", "run/config.yaml is not a YAML mapping"),
])
def test_a_broken_run_config_is_named(text, needle):
  with pytest.raises(ConfigError, match=re.escape(needle)):
    config_from_yaml_text(text, "run/config.yaml")


def test_configs_are_values(tmp_path):
  """A loaded config is frozen; overrides and write_run make new configs and leave the one given unchanged."""
  import dataclasses

  from jaxshare.store.runs import read_config, write_run

  cfg = load_config(None, ["model.num_layers=2", "train.steps=5", "train.warmup_steps=1"])
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.train.steps = 6
  before = copy.deepcopy(cfg)
  changed = apply_overrides(cfg, ["train.steps=7"])
  assert changed.train.steps == 7 and cfg == before
  (tmp_path / "tok.json").write_text("{}")
  write_run(tmp_path / "run", as_run(cfg, {"w": np.zeros(2, np.float32)}), tokenizer_files=[tmp_path / "tok.json"])
  written = read_config(tmp_path / "run")
  assert written.data.tokenizer == str(tmp_path / "run" / "tokenizer") and written.train.run_dir == str(tmp_path / "run")
  assert cfg == before
