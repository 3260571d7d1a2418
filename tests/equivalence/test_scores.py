"""Score reuse is exact in bf16: reused probabilities are the producer's softmax, LISA chains' logits the materialised
sum. bf16 at head_dim 128 is the case that matters: 1/sqrt(128) is not a power of two, so a scale folded into bf16
features rounds (with head_dim 64 the scale 1/8 is exact and a rounding bug hides)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.kernels import reference
from jaxshare.model import scores
from jaxshare.model.attention import Attention
from jaxshare.model.scores import ScoreFeatures, ScoreTensors
from jaxshare.plan import plan_of

T = 256
BF16_D128 = ["model.dtype=bfloat16", "model.head_dim=128", "model.d_model=64", "model.num_heads=2",
             "model.init_std=0.3", f"data.seq_len={T}"]  # init_std 0.3: logits of a few units, as in trained models
SCHEDULES = schedule_matrix("score_states")


def producer_and_reuser(name, mode):
  """The first superblock's producer and its first reusing layer, as built by the model (same seeds in both modes)."""
  cfg = tiny_config(*BF16_D128, *SCHEDULES[name], "attention.impl=xla", f"attention.score_sharing={mode}")
  plan = plan_of(cfg)
  runs = plan.schedule.superblocks[0].runs
  build = lambda role, seed: Attention(plan, role, rngs=nnx.Rngs(seed))  # noqa: E731
  return cfg, build(runs[0].role, 0), build(runs[1].role, 1), runs[1].role


def inputs(cfg):
  x = jax.random.normal(jax.random.key(0), (2, T, cfg.model.d_model)).astype(jnp.bfloat16)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (2, T))
  segments = jnp.ones((2, T), jnp.int32).at[1, T // 2:].set(2)  # two packed documents in the second row
  return x, positions, segments


def float64_softmax(logits, mask):
  a = np.where(mask[:, None], logits, -np.inf)
  e = np.exp(a - a.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def float64_logits(q, k, scale):
  q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
  k = np.repeat(k, q.shape[2] // k.shape[2], axis=2)
  return scale * np.einsum("bthe,bshe->bhts", q, k)


@pytest.mark.parametrize("name", ["sa", "uniattn"])
def test_reused_probabilities_are_the_producers_softmax_in_bf16(name):
  cfg, producer, _, _ = producer_and_reuser(name, "recompute")
  x, pos, seg = inputs(cfg)
  mask = reference.attention_mask(seg, seg, True)
  state = producer(x, pos, seg, producer.prepare(x, pos)).handed
  assert isinstance(state, ScoreFeatures) and state.q.dtype == jnp.bfloat16
  reused = np.asarray(scores.probs(state, mask))  # what every probability reuser applies to its V
  np.testing.assert_allclose(reused.sum(-1), 1.0, atol=2e-5)
  expected = float64_softmax(float64_logits(state.q, state.k, state.scale), np.asarray(mask))
  assert np.abs(expected).max() > 0.5  # peaked rows: a scale error would show
  np.testing.assert_allclose(reused, expected, atol=2e-5)
  # the materialising producer hands on the same probabilities
  _, producer_m, _, _ = producer_and_reuser(name, "materialize")
  state_m = producer_m(x, pos, seg, producer_m.prepare(x, pos)).handed
  assert isinstance(state_m, ScoreTensors)
  np.testing.assert_allclose(np.asarray(state_m.probs), reused, atol=2e-5)


@pytest.mark.parametrize("name", ["lisa_plus", "ds", "gqa_per_layer_lisa_plus"])
def test_lisa_chain_logits_are_the_materialised_sum_in_bf16(name):
  out = {}
  for mode in ("recompute", "materialize"):
    cfg, producer, layer, role = producer_and_reuser(name, mode)
    x, pos, seg = inputs(cfg)
    state = producer(x, pos, seg, producer.prepare(x, pos)).handed
    chain = scores.chain_entry(state, integrator=role.integrator, num_kv_heads=role.num_kv_heads, slots=1,
                               rank=role.lisa_rank, recompute=mode == "recompute")
    slot = chain.q.shape[-1] - role.lisa_rank if isinstance(chain, ScoreFeatures) else 0
    h = x  # the layer's normalised input; any bf16 input shows the arithmetic
    att = layer(h, pos, seg, layer.prepare(h, pos, None, chain, slot))
    y, chain_out = att.y, att.handed
    out[mode] = (np.asarray(scores.logits(chain_out)), np.asarray(y, np.float32), state, layer, h)
  logits_r, y_r, state, layer, h = out["recompute"]
  expected = float64_logits(state.q, state.k, state.scale)
  if layer.q_lr is not None:
    q_lr, k_lr = layer._low_rank(h, inputs(cfg)[1])
    expected = expected + float64_logits(q_lr, k_lr, role.lisa_rank ** -0.5)
  mask = np.asarray(reference.attention_mask(seg, seg, True))[:, None]
  assert np.abs(np.where(mask, expected, 0)).max() > 3  # logits large enough for a rounded scale to show
  np.testing.assert_allclose(np.where(mask, logits_r, 0), np.where(mask, expected, 0), atol=2e-5 * 8, rtol=1e-5)
  logits_m, y_m = out["materialize"][:2]
  np.testing.assert_allclose(np.where(mask, logits_m, 0), np.where(mask, logits_r, 0), atol=1e-4, rtol=1e-5)
  np.testing.assert_allclose(y_m, y_r, atol=2e-2, rtol=2e-2)  # bf16 outputs of the two paths
