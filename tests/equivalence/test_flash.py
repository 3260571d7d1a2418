"""Pallas flash and probability-reuse kernels (interpret mode) against the XLA reference: values and gradients over
a grid of masks, GQA ratios, packed segments, ragged lengths, widths and dtypes; K/V and scores taken from another
layer with gradients reaching it; and a backward pass that keeps nothing ``[B, H, T, S]``.

Tolerances: float32, 2e-5 of each array's largest magnitude (float32 rounding in a different summation order).
bfloat16: the kernel's error against the float32 reference may be at most twice the XLA reference's own bfloat16
error plus 1e-3 of the largest magnitude (both round P and the outputs to bfloat16, in different places).
"""

import functools
import re

import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from jaxshare.kernels import flash, reference, tuning

# Small blocks so that every case runs several query and key blocks, partial last blocks included.
KERNEL = functools.partial(flash.attention, backend="interpret", block_q=16, block_k=16)
REUSE = functools.partial(flash.attention_from_lse, backend="interpret", block_q=16, block_k=16)


def _inputs(b, t, h, g, e, d, dtype, seed=0):
  k1, k2, k3, k4, k5 = jax.random.split(jax.random.PRNGKey(seed), 5)
  q, k, v = (jax.random.normal(key, s).astype(dtype) for key, s in ((k1, (b, t, h, e)), (k2, (b, t, g, e)),
                                                                    (k3, (b, t, g, d))))
  seg = np.ones((b, t), np.int32)
  seg[0, t // 3:] = 2  # two documents in row 0
  seg[-1, (2 * t) // 3:] = 7
  return q, k, v, jnp.asarray(seg), jax.random.normal(k4, (b, t, h, d)), jax.random.normal(k5, (b, h, t))


def _value_and_grads(fn, args, causal, window):
  q, k, v, seg, w_out, w_lse = args

  def loss(q, k, v):
    out, lse = fn(q, k, v, seg, seg, causal=causal, window=window, return_lse=True)
    return jnp.sum(out.astype(jnp.float32) * w_out) + jnp.sum(lse * w_lse), (out, lse)

  (_, (out, lse)), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)
  return [out, lse, *grads]


def _close(got, want, tol, names, ref_lowp=None):
  for i, name in enumerate(names):
    g, w = np.asarray(got[i], np.float32), np.asarray(want[i], np.float32)
    scale = np.abs(w).max()
    if ref_lowp is None:
      np.testing.assert_allclose(g, w, atol=tol * scale, err_msg=name)
    else:
      budget = 2 * np.abs(np.asarray(ref_lowp[i], np.float32) - w).max() + 1e-3 * scale
      assert np.abs(g - w).max() <= budget, (name, np.abs(g - w).max(), budget)


# Every GQA ratio (1, 2, 4 and all: MQA), causal or not and each dtype, covered pairwise (each pair of values of two
# factors appears in some case).
GRID = [(8, True, jnp.float32), (8, False, jnp.bfloat16), (4, True, jnp.bfloat16), (4, False, jnp.float32),
        (2, True, jnp.float32), (2, False, jnp.bfloat16), (1, True, jnp.bfloat16), (1, False, jnp.float32)]


@pytest.mark.parametrize("groups,causal,dtype", GRID)
def test_flash_matches_reference(groups, causal, dtype):
  # T = 37: three 16-blocks, the last one ragged; segment ids pack documents.
  args = _inputs(2, 37, 8, groups, 16, 16, dtype, seed=groups)
  got = _value_and_grads(KERNEL, args, causal, 0)
  f32 = [a.astype(jnp.float32) if a.dtype == dtype else a for a in args]
  want = _value_and_grads(reference.attention, f32, causal, 0)
  for x, a in zip(got[2:], args[:3]):
    assert x.dtype == a.dtype
  names = ["out", "lse", "dq", "dk", "dv"]
  if dtype == jnp.float32:
    _close(got, want, 2e-5, names)
  else:
    _close(got, want, None, names, ref_lowp=_value_and_grads(reference.attention, args, causal, 0))


@pytest.mark.parametrize("t,window,e,d", [(50, 9, 16, 16), (50, 20, 24, 8), (16, 3, 80, 32), (200, 0, 8, 8)])
def test_flash_windows_widths_and_lengths(t, window, e, d):
  """Sliding windows shorter and longer than a block, query/key widths that are not a power of two (LISA_plus's
  concatenated features, padded), value width ≠ query width, and a long sequence of many blocks."""
  args = _inputs(2, t, 4, 2, e, d, jnp.float32, seed=t + window)
  _close(_value_and_grads(KERNEL, args, True, window), _value_and_grads(reference.attention, args, True, window),
         2e-5, ["out", "lse", "dq", "dk", "dv"])


def test_default_blocks_and_one_block_sequences():
  """The model's shapes: the default 128-blocks shortened to the sequence (one block)."""
  args = _inputs(2, 24, 4, 4, 8, 8, jnp.float32)
  kernel = functools.partial(flash.attention, backend="interpret")
  _close(_value_and_grads(kernel, args, True, 0), _value_and_grads(reference.attention, args, True, 0), 2e-5,
         ["out", "lse", "dq", "dk", "dv"])


@pytest.mark.parametrize("forward,backward", [((64, 32), 16), ((16, 16), 64)], ids=["forward_wider", "backward_wider"])
def test_forward_and_backward_tile_by_their_own_blocks(monkeypatch, forward, backward):
  """Each phase tiles by its own blocks (Triton's forward takes 128 x 64 above width 64, its backward 64 x 64): the
  sequence is padded to both, and values and gradients of attention and probability reuse stay the reference's, with
  packed documents, GQA and a window."""
  monkeypatch.setattr(tuning, "default_forward_blocks", lambda backend, width: forward)
  monkeypatch.setattr(tuning, "default_block", lambda backend: backward)
  geo = tuning.call_geometry(100, 100, tuning.Operands(8, 8, 4, 4, 4, 4), True, 0, 1.0, "interpret", None, None)
  assert (geo.forward().block_q, geo.forward().block_k, geo.block_q) == (*forward, backward)
  assert geo.t_padded == geo.forward().t_padded == 128
  args = _inputs(2, 100, 4, 2, 8, 8, jnp.float32, seed=5)
  kernel = functools.partial(flash.attention, backend="interpret")
  _close(_value_and_grads(kernel, args, True, 30), _value_and_grads(reference.attention, args, True, 30), 2e-5,
         ["out", "lse", "dq", "dk", "dv"])
  q, k, v, seg, _, _ = args
  lse = reference.attention(q, k, v, seg, seg, return_lse=True)[1]
  grad = lambda fn: jax.grad(lambda q, k, v: jnp.sum(fn(q, k, lse, v, seg, seg, scale=0.3) ** 2),  # noqa: E731
                             argnums=(0, 1, 2))(q, k, v)
  _close([*grad(functools.partial(flash.attention_from_lse, backend="interpret"))],
         [*grad(reference.attention_from_lse)], 2e-5, ["dq", "dk", "dv"])


def test_triton_tiles_and_launch_per_phase():
  """The tuned Triton choices (docs/gpu.md): the forward above width 64 with 128 x 64 tiles and 8 warps, 64 x 64
  and 4 warps at or below it; the backward 64 x 64, 3 stages up to width 64 and 2 above; other backends one tile."""
  assert tuning.default_forward_blocks("triton", 128) == (128, 64)
  assert tuning.default_forward_blocks("triton", 64) == (64, 64) and tuning.default_block("triton") == 64
  assert tuning.default_forward_blocks("mosaic_tpu", 128) == (128, 128)
  assert tuning.triton_launch("jaxshare_flash_forward", 128, 128) == (8, 3)
  assert tuning.triton_launch("jaxshare_flash_forward", 128, 64) == (4, 3)  # given 64-row tiles: 4 warps
  assert tuning.triton_launch("jaxshare_flash_forward", 64, 64) == (4, 3)
  assert tuning.triton_launch("jaxshare_flash_dkv", 128) == (4, 2)
  assert tuning.triton_launch("jaxshare_flash_dq", 64) == (4, 3)


def test_triton_tiles_fit_the_devices_shared_memory():
  """Tiles and pipeline depth shrink only where a device's shared memory cannot hold them: LISA_plus's float32
  features (width 176 padded to 256) against bf16 values asked an H100 for 377,344 bytes of its 232,448 with the
  tuned forward (128 x 64, 3 stages). The tuned bf16 launches at widths 64 and 128 stay as tuned on sm_80/90/100."""
  h100, a100 = tuning.shared_memory_limit("NVIDIA H100 80GB HBM3"), tuning.shared_memory_limit("NVIDIA A100-SXM4-80GB")
  assert (h100, a100, tuning.shared_memory_limit("NVIDIA L4")) == (232_448, 166_912, 101_376)
  assert tuning.shared_memory_limit("NVIDIA B200") == tuning.shared_memory_limit("NVIDIA H200 141GB HBM3e") == h100
  features = tuning.Operands(e=256, d=128, q=4, k=4, v=2, o=2)
  assert tuning.triton_shared_memory("jaxshare_flash_forward", 128, 64, features, 3) == 376_832  # the H100 said 377,344
  forward, backward = ("jaxshare_flash_forward",), ("jaxshare_flash_dq", "jaxshare_flash_dkv")
  for limit in (h100, a100):
    bq, bk = tuning.fit_tiles(forward, 128, 64, features, limit)
    assert (bq, bk) != (128, 64) and tuning.triton_shared_memory(forward[0], bq, bk, features, 2) <= limit
    assert tuning.triton_shared_memory(forward[0], bq, bk, features,
                                      tuning.fit_stages(forward[0], bq, bk, features, limit)) <= limit
    for name in backward:
      bq, bk = tuning.fit_tiles(backward, 64, 64, features, limit)
      stages = tuning.fit_stages(name, bq, bk, features, limit)
      assert tuning.triton_shared_memory(name, bq, bk, features, stages) <= limit
    for width in (64, 128):
      tuned = tuning.Operands(e=width, d=width, q=2, k=2, v=2, o=2)
      assert tuning.fit_tiles(forward, *tuning.default_forward_blocks("triton", width), tuned, limit) == \
        tuning.default_forward_blocks("triton", width)
      assert tuning.fit_tiles(backward, 64, 64, tuned, limit) == (64, 64)
      for name in forward + backward:
        assert tuning.fit_stages(name, 64, 64, tuned, limit) == tuning.triton_launch(name, width, 64)[1]


def test_default_backend_is_the_platforms():
  """Called without ``backend``, both kernels take the default device's (interpret mode on this CPU host)."""
  q, k, v, seg, _, _ = _inputs(1, 20, 2, 2, 8, 8, jnp.float32)
  out, lse = flash.attention(q, k, v, seg, seg, return_lse=True)
  np.testing.assert_allclose(out, reference.attention(q, k, v, seg, seg), atol=2e-5)
  reused = flash.attention_from_lse(q, k, lse, v, seg, seg, scale=8 ** -0.5)
  np.testing.assert_allclose(reused, reference.attention_from_lse(q, k, lse, v, seg, seg, scale=8 ** -0.5), atol=2e-5)


@pytest.mark.parametrize("gk,gv", [(2, 2), (1, 4), (4, 1)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_probability_reuse_matches_reference(gk, gv, dtype):
  """A consumer applies its source's probabilities (from the source's q, k, lse) to its own V; gradients reach the
  source's q, k and lse and the consumer's V, with K and V head counts that differ either way."""
  q, k, _, seg, w_out, _ = _inputs(2, 37, 4, gk, 16, 8, dtype, seed=gk)
  v = jax.random.normal(jax.random.PRNGKey(9), (2, 37, gv, 8)).astype(dtype)
  lse = reference.attention(q, k, k, seg, seg, return_lse=True)[1]

  def run(fn, q, k, lse, v):
    def loss(q, k, lse, v):
      out = fn(q, k, lse, v, seg, seg, scale=0.25, window=11)
      return jnp.sum(out.astype(jnp.float32) * w_out), out
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, lse, v)
    return [out, *grads]

  got = run(REUSE, q, k, lse, v)
  want = run(reference.attention_from_lse, *(x.astype(jnp.float32) for x in (q, k, lse, v)))
  names = ["out", "dq", "dk", "dlse", "dv"]
  if dtype == jnp.float32:
    _close(got, want, 2e-5, names)
  else:
    _close(got, want, None, names, ref_lowp=run(reference.attention_from_lse, q, k, lse, v))


def test_gradients_reach_the_kv_and_score_producer():
  """A CLA consumer reads its producer's K/V and an SA consumer its probabilities; the producer's weights get the
  same gradients through the kernels as through the reference."""
  b, t, dm, h, g, d = 2, 29, 12, 4, 2, 8
  keys = jax.random.split(jax.random.PRNGKey(3), 6)
  x = jax.random.normal(keys[0], (b, t, dm))
  w = {n: jax.random.normal(kk, (dm, heads, d)) * 0.3
       for n, kk, heads in (("q", keys[1], h), ("k", keys[2], g), ("v", keys[3], g), ("q2", keys[4], h),
                            ("v3", keys[5], g))}
  seg = jnp.ones((b, t), jnp.int32)

  def model(w, attend, reuse):
    proj = lambda n: jnp.einsum("btd,dhk->bthk", x, w[n])  # noqa: E731
    q, k, v = proj("q"), proj("k"), proj("v")
    out1, lse = attend(q, k, v, seg, seg, return_lse=True)  # producer
    out2 = attend(proj("q2"), k, v, seg, seg)  # K/V consumer (CLA)
    out3 = reuse(q, k, lse, proj("v3"), seg, seg, scale=d ** -0.5)  # probability consumer (SA)
    return jnp.sum(jnp.sin(out1) + out2 ** 2 + jnp.cos(out3))

  got = jax.grad(model)(w, KERNEL, REUSE)
  want = jax.grad(model)(w, reference.attention, reference.attention_from_lse)
  for n in w:
    np.testing.assert_allclose(got[n], want[n], atol=2e-5 * np.abs(want[n]).max(), err_msg=n)


def test_backward_keeps_no_score_sized_residual(capsys):
  b, t, h, e = 2, 40, 4, 8
  q = jnp.ones((b, t, h, e))
  seg = jnp.ones((b, t), jnp.int32)
  lse = jnp.zeros((b, h, t))
  jax.ad_checkpoint.print_saved_residuals(lambda q, k, v: KERNEL(q, k, v, seg, seg).sum(), q, q, q)
  jax.ad_checkpoint.print_saved_residuals(lambda q, k, v: REUSE(q, k, lse, v, seg, seg, scale=1.0).sum(), q, q, q)
  printed = capsys.readouterr().out
  assert "[2,4,48,1]" in printed  # the log-sum-exp is saved ([B, H, T padded to 48, 1])
  assert not re.search(r"\[(\d+,)*4\d,4\d\]", printed), printed  # nothing [.., T, S] (T, S: 40 or padded 48)


def test_bad_backend_and_heads_are_refused():
  q, k, v, seg, _, _ = _inputs(1, 8, 4, 3, 8, 8, jnp.float32)
  with pytest.raises(ValueError, match="K/V heads that divide the query heads"):
    flash.attention(q, k, v, seg, seg, backend="interpret")
  q, k, v, seg, _, _ = _inputs(1, 8, 4, 2, 8, 8, jnp.float32)
  with pytest.raises(ValueError, match="Pallas backend 'cuda' is invalid"):
    flash.attention(q, k, v, seg, seg, backend="cuda")
