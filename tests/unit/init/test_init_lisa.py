"""LISA's fitted conversion start: the factors reproduce the logit difference they fit (exactly at full rank, as the
best rank-r approximation below it, one K factor per K/V group), and a converted layer's logits follow. The
calibrated start brings the logits the converted layers use closer to the source's own than plain reuse and the
weight fit, by the error it reports, changing nothing but the factors; it is refused where no data is read."""

import jax
import numpy as np
import pytest

from jaxshare.init.lisa import fit_low_rank
from support.runs import as_run


def _weights(D, H, G, d, seed):
  keys = jax.random.split(jax.random.key(seed), 4)
  return (jax.random.normal(keys[0], (D, H, d)), jax.random.normal(keys[1], (D, G, d)),
          jax.random.normal(keys[2], (D, H, d)), jax.random.normal(keys[3], (D, G, d)))


def _bilinear(wq, wk, d):
  H = wq.shape[1]
  return np.einsum("dhe,fhe->hdf", wq, np.repeat(wk, H // wk.shape[1], axis=1)) / np.sqrt(d)


@pytest.mark.parametrize("G_src, G", [(4, 4), (2, 2), (4, 2), (1, 1)])
def test_full_rank_factors_reproduce_the_logit_difference(G_src, G):
  D, H, d = 12, 4, 3
  wq_n, wk_n, wq_s, wk_s = _weights(D, H, G_src, d, 0)
  want = _bilinear(wq_n, wk_n, d) - _bilinear(wq_s, wk_s, d)
  r = D  # a group's stacked difference has rank <= D
  q_lr, k_lr = fit_low_rank(wq_n, wk_n, wq_s, wk_s, r, G)
  assert q_lr.shape == (D, H, r) and k_lr.shape == (D, G, r)
  got = np.einsum("dhr,fhr->hdf", q_lr, np.repeat(k_lr, H // G, axis=1)) / np.sqrt(r)
  np.testing.assert_allclose(got, want, atol=2e-4 * np.abs(want).max())
  # on activations: A_s + A_delta equals the source layer's own (unrotated) logits
  x = np.asarray(jax.random.normal(jax.random.key(9), (5, D)))
  a_n = np.einsum("td,hdf,sf->hts", x, _bilinear(wq_n, wk_n, d), x)
  a_s = np.einsum("td,hdf,sf->hts", x, _bilinear(wq_s, wk_s, d), x)
  a_delta = np.einsum("thr,shr->hts", np.einsum("td,dhr->thr", x, q_lr),
                      np.einsum("sd,dhr->shr", x, np.repeat(k_lr, H // G, axis=1))) / np.sqrt(r)
  np.testing.assert_allclose(a_s + a_delta, a_n, atol=1e-3 * np.abs(a_n).max())


@pytest.mark.parametrize("r", [1, 3, 6])
def test_low_rank_factors_are_the_best_rank_r_approximation(r):
  """Eckart-Young: the residual's squared norm is the sum of the discarded squared singular values."""
  D, H, G, d = 10, 4, 2, 3
  wq_n, wk_n, wq_s, wk_s = _weights(D, H, G, d, 1)
  want = (_bilinear(wq_n, wk_n, d) - _bilinear(wq_s, wk_s, d)).reshape(G, H // G * D, D)
  q_lr, k_lr = fit_low_rank(wq_n, wk_n, wq_s, wk_s, r, G)
  got = np.einsum("dhr,fhr->hdf", q_lr, np.repeat(k_lr, H // G, axis=1)).reshape(G, H // G * D, D) / np.sqrt(r)
  for g in range(G):
    s = np.linalg.svd(want[g], compute_uv=False)
    assert np.sum((want[g] - got[g]) ** 2) == pytest.approx(np.sum(s[r:] ** 2), rel=1e-3, abs=1e-6 * np.sum(s ** 2))


def test_bad_shapes_are_refused():
  wq_n, wk_n, wq_s, wk_s = _weights(8, 4, 2, 2, 0)
  with pytest.raises(ValueError, match="must divide"):
    fit_low_rank(wq_n, wk_n, wq_s, wk_s, 2, 3)
  with pytest.raises(ValueError, match="disagree"):
    fit_low_rank(wq_n, wk_n, wq_s[:, :2], wk_s, 2, 2)


@pytest.mark.parametrize("start", ["ds", "fit"])
def test_uptraining_starts_lisa_layers_as_asked(start):
  """train.init_lisa through the uptraining path (what `convert uptrain` and train.init_from run): ``fit`` sets every
  converted layer's factors to the fit of the source's own W_q, W_k and its score source's; ``ds`` zeroes k_lr."""
  from conftest import tiny_config
  from jaxshare.init.report import init_report
  from jaxshare.model.params import layer_params
  from jaxshare.train.state import init_state, setup_training
  from support.models import randomized

  src_cfg = tiny_config("schedule.kind=gqa", "schedule.kv_heads=2")
  src_schedule, _, src_params = randomized(src_cfg)
  cfg = tiny_config("schedule.kind=gqa+lisa_plus", "schedule.kv_heads=2", "schedule.lisa.layers=[2,3]",
                    "schedule.lisa.rank=4", f"train.init_lisa={start}")
  setup = setup_training(cfg)
  params = init_state(setup, from_params=(src_params, src_schedule)).params
  for n in (2, 3):
    got = layer_params(params, setup.schedule, n)["attn"]
    if start == "ds":
      assert not np.any(np.asarray(got["k_lr"]["kernel"]))
      continue
    own, prev = (layer_params(src_params, src_schedule, i)["attn"] for i in (n, n - 1))
    q_lr, k_lr = fit_low_rank(own["q_proj"]["kernel"], own["k_proj"]["kernel"], prev["q_proj"]["kernel"],
                              prev["k_proj"]["kernel"], 4, 2)
    # the bilinear form the factors make (an SVD's factors are defined up to sign; jit and eager round differently)
    def product(q, k):
      return np.einsum("dhr,fhr->hdf", q, np.repeat(k, q.shape[1] // k.shape[1], axis=1))
    want = product(q_lr, k_lr)
    np.testing.assert_allclose(product(got["q_lr"]["kernel"], got["k_lr"]["kernel"]), want,
                               atol=1e-4 * np.abs(want).max())
  report = "\n".join(init_report(src_params, src_schedule, params, setup.schedule, "mean", lisa_start=start))
  assert ("fitted" in report) == (start == "fit") and ("A_delta = 0" in report) == (start == "ds")


def _lisa_conversion(start):
  from conftest import tiny_config
  from jaxshare.train.state import init_state, setup_training
  from support.models import randomized

  src_cfg = tiny_config("schedule.kind=gqa", "schedule.kv_heads=2")
  src = randomized(src_cfg)
  cfg = tiny_config("schedule.kind=gqa+lisa_plus", "schedule.kv_heads=2", "schedule.lisa.layers=[2,3]",
                    "schedule.lisa.rank=4", f"train.init_lisa={start}")
  setup = setup_training(cfg)
  return src_cfg, src, cfg, setup, lambda: init_state(setup, from_params=(src[2], src[0])).params


def test_calibrated_factors_bring_the_logits_closer_than_reuse_and_the_fit(batches):
  from flax import nnx

  from jaxshare.init.lisa import calibrate_low_rank
  from jaxshare.model.params import flat_leaves, layer_params, replace_layer

  _, (src_schedule, src_graphdef, src_params), _, setup, init = _lisa_conversion("fit")
  params = init()
  out, fit = calibrate_low_rank((src_graphdef, src_params), (setup.graphdef, params), setup.schedule, batches,
                                steps=100)
  assert fit.layers == (2, 3)

  def logits(graphdef, p, b):  # layers 2 and 3: [2, B, H, T, T]
    return np.asarray(nnx.merge(graphdef, p).capture_logits(b.inputs, b.positions, b.segment_ids)[1])[[2, 3]]

  def error(graphdef, p, batch, target):  # squared error over causal positions, computed here independently
    seg, t = np.asarray(batch.segment_ids), batch.inputs.shape[1]
    visible = (seg[:, :, None] == seg[:, None, :]) & np.tril(np.ones((t, t), bool))
    return float(np.sum(visible[:, None] * (logits(graphdef, p, batch) - target) ** 2))

  def total(p):
    targets = [logits(src_graphdef, src_params, b) for b in batches]
    return sum(error(setup.graphdef, p, b, t) for b, t in zip(batches, targets))

  reuse = params
  for n in (2, 3):
    old = layer_params(reuse, setup.schedule, n)
    attn = {**old["attn"], "k_lr": {"kernel": np.zeros_like(old["attn"]["k_lr"]["kernel"])}}
    reuse = replace_layer(reuse, setup.schedule, n, {**old, "attn": attn})
  baseline = total(reuse)
  assert total(params) / baseline == pytest.approx(fit.start, rel=1e-3)
  assert total(out) / baseline == pytest.approx(fit.calibrated, rel=1e-3)
  assert fit.calibrated < min(1.0, fit.start) and not fit.kept_start  # better than plain reuse and the weight fit
  changed = {k for k, v in flat_leaves(out).items() if not np.array_equal(np.asarray(v), np.asarray(
    flat_leaves(params)[k]))}
  assert changed and all(k.rsplit("/", 2)[-2] in ("q_lr", "k_lr") for k in changed), changed


def test_calibrated_start_needs_calibration_batches(tmp_path):
  """train.init_from cannot read data for it: refused with a message naming the field and the way out; convert
  uptrain with --calibration-batches 0 likewise."""
  from jaxshare.config import ConfigError
  from jaxshare.store.runs import write_run
  from jaxshare.convert.uptrain import uptrain_run

  src_cfg, src, _, _, init = _lisa_conversion("calibrated")
  with pytest.raises(ConfigError, match="train.init_lisa=calibrated needs calibration batches"):
    init()
  write_run(tmp_path / "src", as_run(src_cfg, src[2]))
  with pytest.raises(ConfigError, match="--calibration-batches must be >= 1"):
    uptrain_run(tmp_path / "src", tmp_path / "out", ["schedule.kind=gqa+lisa_plus", "schedule.lisa.layers=[2,3]",
                                                      "train.init_lisa=calibrated"], calibration_batches=0)
  assert not (tmp_path / "out").exists()
