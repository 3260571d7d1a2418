"""Splash attention (``attention.impl=splash``, jax's Pallas TPU kernel) in interpret mode against the XLA
reference: every role in values and gradients, then whole models of every kernel role; probability reuse as attention
over the source layer's Q and K gives the gradients the LSE route gives."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare import parallel
from jaxshare.config import ConfigError, MeshConfig
from jaxshare.kernels import dispatch, reference, splash, tuning
from support.models import abstract_graphdef, assert_model_equals_xla, kernel_loss_and_grads, randomized

CASES = schedule_matrix("kernels")

# (B, T, H, Gk, Gv, e, d): MHA; GQA; MQA with a length off the 128-token tile; LISA_plus's wider features (e != d);
# a consumer whose V heads differ from its source's K heads (UniAttn over GQA).
SHAPES = [(2, 128, 4, 4, 4, 16, 16), (1, 200, 4, 2, 2, 16, 16), (1, 130, 4, 1, 1, 8, 8),
          (1, 128, 2, 2, 2, 40, 16), (1, 128, 4, 1, 2, 16, 16)]
interpret = dict(interpret=True)


def _inputs(shape, packed, dtype=jnp.float32):
  b, t, h, gk, gv, e, d = shape
  k1, k2, k3, k4 = jax.random.split(jax.random.key(sum(shape)), 4)
  q, k, v = (jax.random.normal(key, s).astype(dtype) for key, s in ((k1, (b, t, h, e)), (k2, (b, t, gk, e)),
                                                                    (k3, (b, t, gv, d))))
  seg = np.ones((b, t), np.int32)
  if packed:  # three documents in row 0: cross-document cells get no probability and no gradient
    seg[0, t // 3:] = 2
    seg[0, t // 2:] = 5
  return q, k, v, jnp.asarray(seg), jax.random.normal(k4, (b, t, h, d))


def _close(got, want, tol):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, atol=tol * max(np.abs(w).max(), 1e-3))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal,packed,window", [(True, True, 0), (False, True, 0), (True, False, 9)])
def test_splash_equals_the_reference_in_values_and_gradients(shape, causal, packed, window):
  q, k, v, seg, w = _inputs(shape, packed)
  loss = lambda fn, k_in, v_in: lambda q, k, v: jnp.sum(  # noqa: E731
    fn(q, k_in(k), v_in(v), seg, seg, causal=causal, window=window) * w)
  same = lambda x: x  # noqa: E731
  regroup = lambda x: jnp.repeat(x, q.shape[2] // x.shape[2], axis=2)  # noqa: E731
  # K/V of different head counts: the reference reads them regrouped to the query heads
  ref_k, ref_v = (regroup, regroup) if k.shape[2] != v.shape[2] else (same, same)
  got = jax.grad(loss(lambda *a, **kw: splash.attention(*a, **kw, **interpret), same, same),
                 argnums=(0, 1, 2))(q, k, v)
  want = jax.grad(loss(reference.attention, ref_k, ref_v), argnums=(0, 1, 2))(q, k, v)
  _close(splash.attention(q, k, v, seg, seg, causal=causal, window=window, **interpret),
         reference.attention(q, ref_k(k), ref_v(v), seg, seg, causal=causal, window=window), 2e-6)
  _close(got, want, 2e-5)


def test_bf16_follows_the_reference_to_bf16_rounding():
  q, k, v, seg, w = _inputs(SHAPES[1], True, jnp.bfloat16)
  got = splash.attention(q, k, v, seg, seg, **interpret)
  assert got.dtype == jnp.bfloat16
  _close(got, reference.attention(q, k, v, seg, seg), 2e-2)


def test_probability_reuse_as_attention_gives_the_lse_routes_gradients():
  """A producer and a reuser: splash hands on no LSE and the reuser attends over the producer's Q and K; the loss
  and every gradient (the producer's Q and K through both layers) equal the reference's LSE route."""
  q, k, v, seg, w = _inputs(SHAPES[1], True)
  v2 = v[..., ::-1] * 0.5  # the consumer's own values

  def two_layers(ops):
    def loss(q, k, v, v2):
      out, lse = ops.attention(q, k, v, seg, seg, causal=True, scale=0.3, return_lse=True)
      reused = ops.attention_from_lse(q, k, lse, v2, seg, seg, scale=0.3)
      return jnp.sum(out * w) + jnp.sum(reused * w ** 2)
    return jax.value_and_grad(loss, argnums=(0, 1, 2, 3))(q, k, v, v2)

  got, want = two_layers(dispatch.get_attention("splash_interpret")), two_layers(dispatch.get_attention("reference"))
  _close(got, want, 2e-5)


def test_splash_off_a_tpu_is_refused_and_shapes_it_refuses_run_in_jaxshares_kernels(caplog, monkeypatch):
  q, k, v, seg, _ = _inputs(SHAPES[0], True)
  with pytest.raises(ConfigError, match="attention.impl=splash runs on TPUs; this run compiles for cpu. Use auto, or "
                                        "splash_interpret"):
    dispatch.get_attention("splash").attention(q, k, v, seg, seg)
  monkeypatch.setattr(dispatch, "_warned", set())
  with caplog.at_level("WARNING"):  # queries shorter than the keys: splash attends a sequence to itself only
    got = dispatch.get_attention("splash_interpret").attention(q[:, :64], k, v, seg[:, :64], seg, causal=False)
  _close(got, reference.attention(q[:, :64], k, v, seg[:, :64], seg, causal=False), 2e-6)
  assert "splash_interpret not used (queries (64) and keys (128) differ in length); falling back" in caplog.text


# Every kernel role in a whole model: dense/GQA flash attention, K/V consumers (CLA2, MLKV), probability reuse (SA,
# UniAttn superblocks with compensation, with a window), LISA_plus feature chains, bf16.
MODEL_CASES = ["dense", "cla2", "mlkv_m3", "uniattn", "cla+uniattn", "lisa_plus", "mistral_window+sa", "bf16_lisa_plus",
               "gqa_per_layer+ds", "mqa+sa"]


@pytest.mark.parametrize("name", MODEL_CASES)
def test_model_with_splash_equals_xla(name):
  assert_model_equals_xla(name, "splash_interpret")


def test_splash_per_device_under_a_mesh_matches_single_device_xla():
  """Batch over data x fsdp, heads over tensor (2 K/V heads split like the 4 query heads): the kernels run inside
  shard_map and give single-device xla's loss and gradients."""
  cfg = ["schedule.kind=gqa+sa", "schedule.kv_heads=2"]
  _, graphdef, params = randomized(tiny_config(*cfg, "attention.impl=splash_interpret"))
  lb, gb = kernel_loss_and_grads(abstract_graphdef(tiny_config(*cfg, "attention.impl=xla")), params, batch=4)
  with jax.set_mesh(parallel.make_mesh(MeshConfig(data=2, fsdp=2, tensor=2))):
    la, ga = kernel_loss_and_grads(graphdef, params, batch=4)
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  _close(ga, gb, 1e-5)


def test_auto_on_a_tpu_runs_splash_for_every_softmax_role(monkeypatch):
  """``auto`` compiling for a TPU: every layer of a CLA + UniAttn model (producers, a K/V consumer, probability
  reusers) attends with splash (here in interpret mode, the platform answered as a TPU), with xla's loss and
  gradients. tests/integration/aot/test_aot.py compiles the real kernel for TPUs."""
  calls = []

  def counted(*args, **kwargs):
    calls.append(args[0].shape)
    return splash.attention(*args, **kwargs, interpret=True)

  monkeypatch.setattr(tuning, "platform", lambda: "tpu")
  monkeypatch.setitem(dispatch._LIBRARIES, "splash", dataclasses.replace(dispatch._LIBRARIES["splash"],
                                                                         attention=counted))
  # a model built now, under the patches (randomized() memoises models, whose layers keep the ops they were built with)
  _, graphdef_xla, params = randomized(tiny_config(*CASES["cla+uniattn"], "attention.impl=xla"))
  la, ga = kernel_loss_and_grads(abstract_graphdef(tiny_config(*CASES["cla+uniattn"], "attention.impl=auto")), params)
  lb, gb = kernel_loss_and_grads(graphdef_xla, params)
  assert len(calls) >= 3  # traced once per distinct layer body: attention, a K/V consumer, a reuser
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  _close(ga, gb, 1e-5)
