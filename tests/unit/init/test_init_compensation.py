"""UniAttn's W_c initialisation (Thm 3.1 / Alg. 1): the closed form against an SVD computed here, bottom-up order,
both fits, and the MHA activations the model captures."""

import functools
import itertools

import jax
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare.init.compensation import calibrate_compensation, solve_compensation
from jaxshare.data import Datasets
from jaxshare.model import params as P
from jaxshare.train.state import init_state, setup_training

UNIATTN = ("schedule.kind=uniattn", "schedule.uniattn.start=0", "schedule.uniattn.block_size=4")


def _theorem_3_1(x, eps):
  """W_c = V Sigma^+ U^T E(eps), U Sigma V^T = SVD(E(x)), written out."""
  u, s, vt = np.linalg.svd(x, full_matrices=False)
  s_plus = np.where(s > s.max() * max(x.shape) * np.finfo(np.float64).eps, 1 / s, 0.0)
  return vt.T @ np.diag(s_plus) @ u.T @ eps


@pytest.mark.parametrize("n", [40, 6])  # more positions than D, and fewer (rank-deficient: the min-norm solution)
def test_solve_is_theorem_3_1(n):
  rng = np.random.default_rng(n)
  x, eps = rng.normal(size=(n, 16)), rng.normal(size=(n, 16))
  np.testing.assert_allclose(solve_compensation(x, eps), _theorem_3_1(x, eps), atol=1e-10)


def _models(*extra):
  src_setup = setup_training(tiny_config())
  src = init_state(src_setup, seed=3).params
  cfg = tiny_config(*UNIATTN, *extra)
  setup = setup_training(cfg)
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  batches = list(itertools.islice(Datasets(cfg.data, 4, process_index=0, process_count=1).train_iter(), 3))
  return src_setup, src, setup, dst, batches


@functools.cache
def _capture_fn(graphdef):
  return jax.jit(lambda p, b: nnx.merge(graphdef, p).capture_mha(b.inputs, b.positions, b.segment_ids)[1])


def _captured(setup, params, batches, key):
  """Per batch, every layer's captured MHA activation ``key`` ``[L, B, T, D]`` (float64)."""
  fn = _capture_fn(setup.graphdef)
  return [np.asarray(getattr(fn(params, b), key), np.float64) for b in batches]


@pytest.mark.parametrize("extra", [(), ("schedule.uniattn.wc_input=normed",)])
def test_each_wc_fits_the_error_left_by_the_layers_below(extra):
  src_setup, src, setup, dst, batches = _models(*extra)
  layers = [p.index for p in setup.schedule.layers if p.compensation]
  assert layers == [1, 2, 3]
  params, fits, losses = calibrate_compensation((src_setup.graphdef, src), (setup.graphdef, dst), setup.schedule,
                                                batches, fit="mean")
  original = _captured(src_setup, src, batches, "output")
  key = "normed" if extra else "input"
  current = dst
  for fit in fits:  # bottom-up: refit each layer here, with the W_c below it already set and its own zero
    layer = fit.layer
    zero = P.layer_params(current, setup.schedule, layer)
    zero = {**zero, "compensation": {"kernel": np.zeros_like(zero["compensation"]["kernel"])}}
    current = P.replace_layer(current, setup.schedule, layer, zero)
    x = np.mean([a[layer] for a in _captured(setup, current, batches, key)], axis=(0, 1))
    eps = np.mean([o[layer] - u[layer] for o, u in zip(original, _captured(setup, current, batches, "output"))],
                  axis=(0, 1))
    want = _theorem_3_1(x, eps)
    np.testing.assert_allclose(fit.kernel, want, rtol=2e-3, atol=2e-3 * np.abs(want).max(), err_msg=f"layer {layer}")
    assert fit.error_after < 0.5 * fit.error_before
    got = np.asarray(P.layer_params(params, setup.schedule, layer)["compensation"]["kernel"])
    np.testing.assert_allclose(got, fit.kernel.astype(np.float32))
    current = P.replace_layer(current, setup.schedule, layer,
                              {**zero, "compensation": {"kernel": got}})
  assert set(losses) == {"original", "unified", "compensated"}  # on a random model the losses barely differ


def test_token_fit_is_least_squares_over_every_token():
  src_setup, src, setup, dst, batches = _models()
  _, fits, _ = calibrate_compensation((src_setup.graphdef, src), (setup.graphdef, dst), setup.schedule, batches,
                                      fit="tokens")
  original = _captured(src_setup, src, batches, "output")
  x = np.concatenate([a[1].reshape(-1, a.shape[-1]) for a in _captured(setup, dst, batches, "input")])
  eps = np.concatenate([(o[1] - u[1]).reshape(-1, o.shape[-1])
                        for o, u in zip(original, _captured(setup, dst, batches, "output"))])
  want = np.linalg.lstsq(x, eps, rcond=None)[0]
  np.testing.assert_allclose(fits[0].kernel, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_captured_activations_are_the_residual_stream():
  """Layer l's output x' plus its MLP is layer l+1's input (sequential residual), and the first input is the
  embedding; the logits do not change with the capture."""
  src_setup, src, _, _, batches = _models()
  b = batches[0]
  model = nnx.merge(src_setup.graphdef, src)
  logits, mha = model.capture_mha(b.inputs, b.positions, b.segment_ids)
  np.testing.assert_array_equal(np.asarray(logits), np.asarray(model(b.inputs, b.positions, b.segment_ids)))
  np.testing.assert_allclose(np.asarray(mha.input[0]), np.asarray(src["embedding"])[b.inputs], rtol=1e-6)
  for layer in range(3):
    p = P.layer_params(src, src_setup.schedule, layer)
    h = np.asarray(mha.output[layer])
    normed = h / np.sqrt((h ** 2).mean(-1, keepdims=True) + 1e-5) * np.asarray(p["norm2"]["scale"])
    gate = normed @ np.asarray(p["mlp"]["gate"]["kernel"])
    up = normed @ np.asarray(p["mlp"]["up"]["kernel"])
    mlp = (gate / (1 + np.exp(-gate)) * up) @ np.asarray(p["mlp"]["down"]["kernel"])
    np.testing.assert_allclose(np.asarray(mha.input[layer + 1]), h + mlp, rtol=1e-4, atol=1e-5)


def test_bad_calibration_input_is_refused():
  src_setup, src, setup, dst, batches = _models()
  with pytest.raises(ValueError, match="fit='median' is invalid"):
    calibrate_compensation((src_setup.graphdef, src), (setup.graphdef, dst), setup.schedule, batches, fit="median")
  with pytest.raises(ValueError, match="no layer with UniAttn's compensation"):
    calibrate_compensation((src_setup.graphdef, src), (src_setup.graphdef, src), src_setup.schedule, batches)
  with pytest.raises(ValueError, match="at least one batch"):
    calibrate_compensation((src_setup.graphdef, src), (setup.graphdef, dst), setup.schedule, [])
