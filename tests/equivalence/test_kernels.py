"""Attention implementations against the autodiff reference: same forward bits, same gradients (including through
the log-sum-exp that probability reusers read), and a backward pass that keeps nothing ``[B, H, T, S]``."""

import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshare.kernels import reference, xla

# (B, T, H, G, e, d): MHA, GQA, MQA; e != d is LISA_plus's concatenated-feature attention; d 128 the bf16 scale trap.
SHAPES = [(2, 16, 4, 4, 8, 8), (2, 24, 4, 2, 8, 8), (1, 32, 4, 1, 12, 6), (1, 16, 2, 2, 128, 128)]


def _inputs(shape, dtype, packed):
  b, t, h, g, e, d = shape
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(sum(shape)), 5)
  q, k, v = (jax.random.normal(key, s).astype(dtype) for key, s in ((k1, (b, t, h, e)), (k2, (b, t, g, e)),
                                                                    (k3, (b, t, g, d))))
  seg = np.ones((b, t), np.int32)
  if packed:  # two documents in row 0: cross-document cells must get no probability and no gradient
    seg[0, t // 3:] = 2
  return q, k, v, jnp.asarray(seg), jax.random.normal(k4, (b, t, h, d)), jax.random.normal(k5, (b, h, t))


def _loss(fn, causal, window=0):
  def loss(q, k, v, seg, w_out, w_lse):
    out, lse = fn(q, k, v, seg, seg, causal=causal, window=window, return_lse=True)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse)
  return loss


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 2e-5), (jnp.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal,packed,window", [(True, True, 0), (True, False, 0), (False, True, 0), (True, True, 5)])
def test_xla_matches_reference(shape, dtype, tol, causal, packed, window):
  q, k, v, seg, w_out, w_lse = _inputs(shape, dtype, packed)
  out_x, lse_x = xla.attention(q, k, v, seg, seg, causal=causal, window=window, return_lse=True)
  out_r, lse_r = reference.attention(q, k, v, seg, seg, causal=causal, window=window, return_lse=True)
  np.testing.assert_array_equal(np.asarray(out_x, np.float32), np.asarray(out_r, np.float32))
  np.testing.assert_array_equal(np.asarray(lse_x), np.asarray(lse_r))
  args = (q, k, v, seg, w_out, w_lse)
  grads_x = jax.grad(_loss(xla.attention, causal, window), argnums=(0, 1, 2))(*args)
  grads_r = jax.grad(_loss(reference.attention, causal, window), argnums=(0, 1, 2))(*args)
  for name, gx, gr in zip("qkv", grads_x, grads_r):
    assert gx.dtype == gr.dtype == dtype, name
    gx, gr = np.asarray(gx, np.float32), np.asarray(gr, np.float32)
    np.testing.assert_allclose(gx, gr, atol=tol * np.abs(gr).max(), err_msg=f"d{name}")


def test_sliding_window_mask_is_the_band_within_each_document():
  seg = jnp.asarray([[1, 1, 1, 1, 1, 2, 2, 2]], jnp.int32)
  got = np.asarray(reference.attention_mask(seg, seg, True, 3))[0]
  t, s = np.indices((8, 8))
  want = (t - s >= 0) & (t - s < 3) & (np.asarray(seg)[0][:, None] == np.asarray(seg)[0][None, :])
  np.testing.assert_array_equal(got, want)
  assert got.sum(1).tolist() == [1, 2, 3, 3, 3, 1, 2, 3]


def test_backward_keeps_no_score_sized_residual(capsys):
  b, t, h, e = 2, 40, 4, 8
  q = jnp.ones((b, t, h, e))
  seg = jnp.ones((b, t), jnp.int32)
  score_shaped = re.compile(rf"\[(\d+,)*{t},{t}\]")
  for fn, expect in ((xla.attention, False), (reference.attention, True)):
    jax.ad_checkpoint.print_saved_residuals(lambda q, k, v: fn(q, k, v, seg, seg).sum(), q, q, q)
    printed = capsys.readouterr().out
    assert bool(score_shaped.search(printed)) == expect, printed
