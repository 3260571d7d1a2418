"""Head-wise sharing: DirectShare selection, the tied model == the dense model with tied weights, training."""

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import accounting, parallel
from jaxshare.config import MeshConfig, to_yaml
from jaxshare.convert.mapping import UnsupportedModelError
from jaxshare.init.headwise import dense_kernels, direct_share, tie_weights
from jaxshare.init.source import initial_params
from jaxshare.model.params import layer_params, replace_layer
from jaxshare.plan import plan_of
from jaxshare.train.state import setup_training
from support.models import tokens


def random_weights(L=4, D=16, H=4, d=4, seed=0):
  rng = np.random.default_rng(seed)
  return {m: rng.normal(size=(L, D, H, d)) for m in "qkv"}


def test_copied_head_is_matched_and_tied():
  w = random_weights()
  for m in "qk":
    w[m][2, :, 1, :] = 3.0 * w[m][0, :, 3, :]  # same direction: cosine 1
  ties = direct_share(w, 1, "qk")
  assert ties.pairs["q"] == ((2 * 4 + 1, 0 * 4 + 3),)
  assert ties.index["q"][2][1] == ties.index["q"][0][3]
  assert ties.index["v"][2][1] == ties.index["v"][0][3]  # qk matching ties v too
  assert ties.num_rows == 4 * 4 - 1


@pytest.mark.parametrize("match", ["qk", "q", "k", "v", "qkv", "separately"])
@pytest.mark.parametrize("n", [0, 3, 7, 12])
def test_n_pairs_remove_exactly_n_heads(match, n):
  ties = direct_share(random_weights(seed=n), n, match)
  for m in "qkv":
    assert len(ties.rows[m]) == 16 - n
    used = {row for layer in ties.index[m] for row in layer}
    assert used == set(range(16 - n))
    for i, j in ties.pairs[m]:
      assert j // 4 < i // 4  # matched only to strictly earlier layers
  if match == "separately" and n:
    assert ties.pairs["q"] != ties.pairs["v"]


def test_selection_errors():
  with pytest.raises(ValueError, match="match='qq'"):
    direct_share(random_weights(), 1, "qq")
  with pytest.raises(ValueError, match="num_tied=13"):
    direct_share(random_weights(), 13, "qk")


def test_tied_model_equals_dense_model_with_tied_weights():
  cfg = tiny_config("schedule.kind=headwise", "schedule.headwise.ratio=0.3")
  setup = setup_training(cfg, parallel.make_mesh(MeshConfig(), jax.devices()[:1]))
  assert setup.schedule.tied_heads == round(0.3 * 16 * 4 / 3) == 6
  params = jax.jit(lambda: initial_params(setup.plan, setup.ties, 0))()
  assert sum(x.size for x in jax.tree.leaves(params)) == accounting.param_count(cfg.model, setup.schedule).total
  dense_plan = setup.plan.dense_counterpart()
  dense_schedule = dense_plan.schedule
  dense_setup = setup_training(dataclasses.replace(cfg, schedule=dense_plan.schedule_config), setup.mesh)
  dense = jax.device_get(jax.jit(lambda: initial_params(dense_plan, None, 0))())
  # overwrite every tied head of the dense model with its representative's weights
  table = tie_weights(dense_kernels(dense, dense_schedule, 4), setup.ties)
  dense = jax.tree.map(jax.numpy.asarray, dense)
  for l in range(4):
    attn = layer_params(dense, dense_schedule, l)["attn"]
    for m in "qkv":
      kernel = np.array(attn[m + "_proj"]["kernel"])
      for h in range(4):
        kernel[:, h, :] = table[m][setup.ties.index[m][l][h]]
      attn[m + "_proj"]["kernel"] = kernel
    dense = replace_layer(dense, dense_schedule, l, {**layer_params(dense, dense_schedule, l), "attn": attn})
  x = tokens()
  tied_out = nnx.merge(setup.graphdef, params)(x)
  dense_out = nnx.merge(dense_setup.graphdef, dense)(x)
  np.testing.assert_allclose(np.asarray(tied_out), np.asarray(dense_out), atol=1e-5, rtol=1e-5)
  # and the tied model is a real change from the untied dense init
  untied = nnx.merge(dense_setup.graphdef,
                     jax.device_get(jax.jit(lambda: initial_params(dense_plan, None, 0))()))(x)
  assert not np.allclose(np.asarray(untied), np.asarray(dense_out))


def test_headwise_trains_and_resumes_grads_into_the_table(tmp_path):
  from jaxshare.train.loop import train

  cfg = tiny_config("schedule.kind=headwise", "schedule.headwise.ratio=0.3", "train.steps=6",
                    "train.eval_every=6", f"train.run_dir={tmp_path}")
  summary = train(cfg)
  assert summary["num_params"] == accounting.param_count(cfg.model, setup_training(cfg).schedule).total
  assert np.isfinite(summary["val_loss"])


def test_ties_round_trip_as_json_and_malformed_ones_are_refused():
  from jaxshare.model.ties import HeadTies

  ties = direct_share(random_weights(), 5, "separately")
  assert HeadTies.from_json(ties.to_json(), "here") == ties
  text = json.loads(ties.to_json())
  with pytest.raises(ValueError, match="format_version 99"):
    HeadTies.from_json(json.dumps({**text, "format_version": 99}), "here")
  with pytest.raises(ValueError, match="malformed"):
    HeadTies.from_json(json.dumps({**text, "rows": {"q": []}}), "here")
  text["index"]["v"][3][0] = 99
  with pytest.raises(ValueError, match=r"index of \['v'\] points past"):
    HeadTies.from_json(json.dumps(text), "here")


def test_postshare_pairs_round_trip_through_the_run_directory_and_malformed_ones_are_refused(tmp_path):
  from jaxshare.store.checkpoint import CheckpointError
  from jaxshare.model.ties import PostSharePairs
  from jaxshare.store.runs import PAIRS_FILE, read_stored, write_run_files

  pairs = PostSharePairs(direct_share(random_weights(), 5, "qk").pairs, "qk", 0.3)
  assert read_stored(tmp_path).pairs() is None  # a run without PostShare
  write_run_files(tmp_path, to_yaml(tiny_config()), pairs=pairs)
  assert read_stored(tmp_path).pairs() == pairs
  assert json.loads((tmp_path / PAIRS_FILE).read_text())["pairs"]["q"] == [list(p) for p in pairs.pairs["q"]]
  for bad in ("{", json.dumps({"match": "qk", "ratio": 0.3, "pairs": {"q": []}}),
              json.dumps({"match": "qk", "ratio": 0.3, "pairs": {"q": [[1]], "k": [], "v": []}})):
    (tmp_path / PAIRS_FILE).write_text(bad)
    with pytest.raises(CheckpointError, match="PostShare pairs .* unreadable or malformed"):
      read_stored(tmp_path).pairs()


HEADWISE = ["schedule.kind=headwise", "schedule.headwise.ratio=0.3"]
SHORT = ["train.steps=2", "train.warmup_steps=1", "train.checkpoint_every=2", "train.eval_every=0", "train.log_every=1"]


def test_stored_ties_are_what_a_run_loads_and_an_old_run_migrates_once(tmp_path):
  """The ties are chosen when the run starts and read back ever after: a run whose stored ties differ from what its
  config would choose loads the stored ones; a run without them (written before they were stored) is refused in one
  line until `convert ties` stores them, and then loads exactly as before."""
  from jaxshare.store.checkpoint import CheckpointError
  from jaxshare.convert.__main__ import main
  from jaxshare.init.headwise import compute_ties
  from jaxshare.store.runs import TIES_FILE, load_run
  from jaxshare.train.loop import train

  cfg = tiny_config(*HEADWISE, *SHORT, f"train.run_dir={tmp_path / 'hw'}")
  train(cfg)
  run = load_run(tmp_path / "hw")
  assert run.ties == compute_ties(plan_of(cfg), cfg.train.seed)
  stored = (tmp_path / "hw" / TIES_FILE).read_text()

  other = direct_share(random_weights(L=4, D=32, H=4, d=8, seed=5), run.schedule.tied_heads)
  assert other != run.ties
  (tmp_path / "hw" / TIES_FILE).write_text(other.to_json())
  assert load_run(tmp_path / "hw").ties == other  # never chosen again at load

  (tmp_path / "hw" / TIES_FILE).write_text(stored.replace('"rows"', '"rowz"'))
  with pytest.raises(CheckpointError, match=r"malformed.*delete it and re-create it with `python -m jaxshare.convert"):
    load_run(tmp_path / "hw")
  (tmp_path / "hw" / TIES_FILE).unlink()
  with pytest.raises(CheckpointError, match=r"has no head_ties.json .*python -m jaxshare.convert ties"):
    load_run(tmp_path / "hw")
  assert main(["ties", str(tmp_path / "hw")]) == 0
  assert (tmp_path / "hw" / TIES_FILE).read_text() == stored
  again = load_run(tmp_path / "hw")
  assert again.ties == run.ties
  jax.tree.map(np.testing.assert_array_equal, again.params, run.params)
  assert main(["ties", str(tmp_path / "hw")]) == 2  # already stored: nothing to do


def test_uptrained_headwise_run_evaluates_generates_and_exports_without_its_source(tmp_path):
  import shutil

  from jaxshare.convert.hf_export import export_run
  from support.runs import export
  from jaxshare.convert.hf_import import load_hf_model
  from jaxshare.convert.uptrain import uptrain_run
  from jaxshare.evaluation.evaluate import evaluate_run
  from jaxshare.evaluation.generate import Generator
  from jaxshare.init.headwise import compute_ties
  from jaxshare.store.runs import load_run
  from jaxshare.train.loop import train

  src = tmp_path / "dense"
  train(tiny_config(*SHORT, f"train.run_dir={src}"))
  uptrain_run(src, tmp_path / "hw", HEADWISE)
  run = load_run(tmp_path / "hw")
  assert run.ties == compute_ties(run.plan, run.cfg.train.seed, load_run(src))  # chosen on the source, once
  shutil.rmtree(src)

  again = load_run(tmp_path / "hw")
  assert again.ties == run.ties
  assert np.isfinite(evaluate_run(tmp_path / "hw", max_batches=1, sample_tokens=0)["val_loss"])
  tokens = Generator(again.model(), again.plan).generate([[1, 2, 3]], 4)[0]
  assert len(tokens) == 4
  export_run(tmp_path / "hw", tmp_path / "exported")
  imported = load_hf_model(tmp_path / "exported")
  assert imported.ties == run.ties
  jax.tree.map(np.testing.assert_array_equal, imported.params, jax.device_get(run.params))
  with pytest.raises(UnsupportedModelError, match=r"overrides \['schedule.headwise.ratio=0.15'\] change the "
                     "schedule of a remote-code directory.*convert uptrain"):
    load_hf_model(tmp_path / "exported", ["schedule.headwise.ratio=0.15"])
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  damaged = tmp_path / "damaged"
  shutil.copytree(tmp_path / "exported", damaged)
  ties = json.loads(config["jaxshare_head_ties"])
  (damaged / "config.json").write_text(json.dumps({**config, "jaxshare_head_ties": json.dumps(
    {**ties, "index": {m: rows[:-1] for m, rows in ties["index"].items()}})}))
  with pytest.raises(UnsupportedModelError, match=r"jaxshare_head_ties.*\(edited by hand\?\): export the run again"):
    load_hf_model(damaged)
  with pytest.raises(ValueError, match="needs head-wise ties exactly when it ties any"):
    export(run.cfg, run.params, tmp_path / "no_ties")
  config = json.loads((tmp_path / "exported" / "config.json").read_text())
  del config["jaxshare_head_ties"]  # an export written before ties were stored with it
  (tmp_path / "exported" / "config.json").write_text(json.dumps(config))
  with pytest.raises(UnsupportedModelError, match="no 'jaxshare_head_ties'.*export the run again"):
    load_hf_model(tmp_path / "exported")
