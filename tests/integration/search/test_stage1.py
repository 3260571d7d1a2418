"""Stage 1 of the search: scores equal an independent recomputation, KVSharer's proposals follow its ranking."""

import jax
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.convert.uptrain import convert
from jaxshare.evaluation.val_loss import make_eval_step
from jaxshare.store.runs import load_run
from jaxshare.search.budget import SearchError
from jaxshare.search.calibration import Calibration, calibration_batches
from jaxshare.search.kvsharer import kvsharer_options, kvsharer_sources, layer_kv_means


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  from jaxshare.train.loop import train

  run_dir = tmp_path_factory.mktemp("dense")
  train(tiny_config(f"train.run_dir={run_dir}"))
  return run_dir, load_run(run_dir)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  z = x - x.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_the_selection_split_leaves_validation_batches_to_report_on(source):
  _, src = source
  total = len(calibration_batches(src, 10**6))  # stage 1 only: the whole split may select
  assert len(calibration_batches(src, total - 1, reported=True)) == total - 1
  with pytest.raises(SearchError, match=f"--calibration-batches {total} is invalid: .* has {total} batches of "
                                        f".* N must be 1 to {total - 1}"):
    calibration_batches(src, total, reported=True)


def test_stage1_scores_equal_an_independent_recomputation(source):
  run_dir, src = source
  batches = calibration_batches(src, 2)
  conv = convert(src, run_dir, ["schedule.kind=cla", "schedule.factor=2"], calibration_batches=0)
  score = Calibration(src, batches).score(conv.graphdef, conv.params)
  # the loss as validation computes it (evaluation's eval step), the KL in float64 NumPy from both models' logits
  eval_step = make_eval_step(conv.graphdef)
  sums = [tuple(map(float, eval_step(conv.params, b))) for b in batches]
  assert score.loss == pytest.approx(sum(s for s, _ in sums) / sum(c for _, c in sums), rel=1e-5)
  kl, count = 0.0, 0.0
  for b in batches:
    p = _log_softmax(np.asarray(src.model()(b.inputs, b.positions, b.segment_ids)))
    q = _log_softmax(np.asarray(jax.device_get(conv.graphdef.apply(conv.params)(b.inputs, b.positions,
                                                                                b.segment_ids)[0])))
    mask = np.asarray(b.loss_mask, np.float64)
    kl += float(((np.exp(p) * (p - q)).sum(-1) * mask).sum())
    count += float(mask.sum())
  assert score.kl == pytest.approx(kl / count, rel=1e-4, abs=1e-7)
  assert score.kl > 0  # CLA's consumers read another layer's K/V: the model changed
  same = convert(src, run_dir, ["schedule.kind=dense"], calibration_batches=0)
  assert Calibration(src, batches).score(same.graphdef, same.params).kl == pytest.approx(0.0, abs=1e-6)


def test_kvsharer_shares_the_most_dissimilar_layers_first():
  means = np.zeros((5, 3))
  means[3] = [10.0, 0, 0]
  means[4] = [0, 3.0, 0]  # 3-4 are the farthest apart (10.4), then 3 from 0, 1, 2 (10), 4 from 0, 1, 2 (3)
  assert kvsharer_sources(means, 1) == [0, 1, 2, 3, 3]  # the later layer reads the earlier's K/V
  # 3 is read now, so it never reads; 4 reads already; the rest are alike (distance 0): the first such pair
  assert kvsharer_sources(means, 2) == [0, 0, 2, 3, 3]
  for n in range(5):
    s = kvsharer_sources(means, n)
    # as asked, except that the greedy order can leave no pair: 3, read by 4, may not read 0 (no chains)
    assert sum(k != v for k, v in enumerate(s)) == min(n, 3)
    assert all(v <= k and s[v] == v for k, v in enumerate(s))  # earlier producers only
  with pytest.raises(ValueError, match="num_shared=5 is invalid"):
    kvsharer_sources(means, 5)


def test_layer_kv_means_are_the_projections_of_the_mean_normed_input(source):
  _, src = source
  batches = calibration_batches(src, 1)
  means = layer_kv_means(src, batches)
  L, H, d = 4, 4, 8
  assert means.shape == (L, 2 * H * d)
  _, mha = src.model().capture_mha(batches[0].inputs, batches[0].positions, batches[0].segment_ids)
  from jaxshare.model.params import layer_params
  for layer in range(L):
    attn = layer_params(jax.device_get(src.params), src.schedule, layer)["attn"]
    k = np.einsum("btd,dgh->btgh", np.asarray(mha.normed[layer], np.float64),
                  np.asarray(attn["k_proj"]["kernel"], np.float64)).mean((0, 1)).ravel()
    np.testing.assert_allclose(means[layer, :H * d], k, rtol=1e-4, atol=1e-6)
  options = kvsharer_options(src, batches)  # a quarter, half, three quarters asked (the greedy may stop short)
  assert [o.name for o in options][:2] == ["kvsharer1", "kvsharer2"]
  for o in options:
    sources = [int(x) for x in o.knobs[0].split("=")[1].split("_")]
    assert o.kind == "explicit" and o.name == f"kvsharer{sum(k != v for k, v in enumerate(sources))}"
