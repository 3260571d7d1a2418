"""Head-wise sharing: DirectShare selection, the tied model == the dense model with tied weights, training."""

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import accounting, parallel
from jaxshare.config import MeshConfig
from jaxshare.headwise import dense_kernels, direct_share, tie_weights
from jaxshare.model.params import layer_params, replace_layer
from jaxshare.train.state import dense_counterpart, initial_params, setup_run
from test_model import tokens


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
  setup = setup_run(cfg, parallel.make_mesh(MeshConfig(), jax.devices()[:1]))
  assert setup.schedule.tied_heads == round(0.3 * 16 * 4 / 3) == 6
  params = jax.jit(lambda: initial_params(setup, 0))()
  assert sum(x.size for x in jax.tree.leaves(params)) == accounting.param_count(cfg.model, setup.schedule).total
  dense_cfg, dense_schedule = dense_counterpart(cfg)
  dense_setup = setup_run(dense_cfg, setup.mesh)
  dense = jax.device_get(jax.jit(lambda: initial_params(dense_setup, 0))())
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
  untied = nnx.merge(dense_setup.graphdef, jax.device_get(jax.jit(lambda: initial_params(dense_setup, 0))()))(x)
  assert not np.allclose(np.asarray(untied), np.asarray(dense_out))


def test_headwise_trains_and_resumes_grads_into_the_table(tmp_path):
  from jaxshare.train.loop import train

  cfg = tiny_config("schedule.kind=headwise", "schedule.headwise.ratio=0.3", "train.steps=6",
                    "train.eval_every=6", f"train.run_dir={tmp_path}")
  summary = train(cfg)
  assert summary["num_params"] == accounting.param_count(cfg.model, setup_run(cfg).schedule).total
  assert np.isfinite(summary["val_loss"])
