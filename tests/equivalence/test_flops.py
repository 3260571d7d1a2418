"""FLOP accounting: every preset against a hand count and against XLA's cost analysis of the compiled forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from jaxshare import accounting
from jaxshare.config import LisaConfig, ModelConfig, SAConfig, ScheduleConfig, UniAttnConfig
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.plan import plan_of
from jaxshare.schedule import compile_schedule
from jaxshare.model import build_model

# L=4, D=64, H=4, d=16, F=128, V=256; context 10 keys; LISA rank 4, aligner width 32.
from jaxshare.init.headwise import compute_ties

# L=4, D=64, H=4, d=16, F=128, V=256; context 10 keys; LISA rank 4, aligner width 32.
M = ModelConfig(num_layers=4, d_model=64, num_heads=4, mlp_dim=128, vocab_size=256)
D, H, d, F, V, CTX, R, HID = 64, 4, 16, 128, 256, 10, 4, 32
PROJ = 2 * D * H * d           # one full-width Q, K, V or O projection (multiply-adds x 2)
CTX_MM = 2 * H * d * CTX       # QK^T, or AV, over the context
MLP = 2 * 3 * D * F            # SwiGLU: gate, up, down
HEAD = 2 * D * V
DENSE_LAYER = 4 * PROJ + 2 * CTX_MM + MLP
PROB_REUSE_LAYER = 2 * PROJ + CTX_MM + MLP  # V and O projections, AV; no Q, K, QK^T (SA, DS)
LOW_RANK = 2 * D * (H + H) * R + 2 * H * R * CTX  # LISA's W_q^LR, W_k^LR and the rank-r QK^T

HAND_COUNTS = {
  "dense": (ScheduleConfig(), 4 * DENSE_LAYER + HEAD),
  "gqa": (ScheduleConfig(kind="gqa", kv_heads=2), 4 * (2 * PROJ + 2 * (2 * D * 2 * d) + 2 * CTX_MM + MLP) + HEAD),
  "cla2": (ScheduleConfig(kind="cla", factor=2), 2 * DENSE_LAYER + 2 * (2 * PROJ + 2 * CTX_MM + MLP) + HEAD),
  "sa": (ScheduleConfig(kind="sa", sa=SAConfig(start=2, end=3)), 2 * DENSE_LAYER + 2 * PROB_REUSE_LAYER + HEAD),
  "uniattn": (ScheduleConfig(kind="uniattn", uniattn=UniAttnConfig(block_size=2, start=0)),
              2 * DENSE_LAYER + 2 * (PROB_REUSE_LAYER + 2 * D * D) + HEAD),
  "ds": (ScheduleConfig(kind="ds", lisa=LisaConfig(layers=[1, 3])), 2 * DENSE_LAYER + 2 * PROB_REUSE_LAYER + HEAD),
  "lisa_plus": (ScheduleConfig(kind="lisa_plus", lisa=LisaConfig(layers=[1, 3], rank=R)),
                2 * DENSE_LAYER + 2 * (PROB_REUSE_LAYER + LOW_RANK) + HEAD),
  "lisa_linear": (ScheduleConfig(kind="lisa", lisa=LisaConfig(layers=[2], rank=R, integrator="linear")),
                  3 * DENSE_LAYER + PROB_REUSE_LAYER + LOW_RANK + 2 * (2 * H) * H * CTX + HEAD),
  "lisa_ffn": (ScheduleConfig(kind="lisa", lisa=LisaConfig(layers=[2], rank=R, hidden=HID)),
               3 * DENSE_LAYER + PROB_REUSE_LAYER + LOW_RANK + 2 * (2 * H * HID + HID * H) * CTX + HEAD),
  "headwise": (ScheduleConfig(kind="headwise"), 4 * DENSE_LAYER + HEAD),  # tied weights are still applied
}


@pytest.mark.parametrize("name", sorted(HAND_COUNTS))
def test_forward_flops_equal_a_hand_count(name):
  sched, expected = HAND_COUNTS[name]
  assert accounting.forward_flops_per_token(M, compile_schedule(M, sched), CTX) == expected


def test_attention_context_flops_halve_under_probability_reuse():
  """A layer that reuses probabilities (SA, UniAttn, DS) keeps AV and drops QK^T: half the context FLOPs."""
  dense = compile_schedule(M, ScheduleConfig())
  sa = compile_schedule(M, ScheduleConfig(kind="sa", sa=SAConfig(start=2, end=3)))

  def context_term(s):  # FLOPs that grow with the context, per token
    return accounting.forward_flops_per_token(M, s, 2 * CTX) - accounting.forward_flops_per_token(M, s, CTX)

  assert context_term(sa) / context_term(dense) == (2 + 2 * 0.5) / 4


def test_train_flops_average_the_causal_context():
  s = compile_schedule(M, ScheduleConfig())
  seq = 9  # positions see 1..9 keys: 5 on average
  assert accounting.train_flops_per_token(M, s, seq) == 3 * accounting.forward_flops_per_token(M, s, 5)


# The XLA comparison: with T=128 keys and D=128 the context terms are a fifth of the FLOPs, so a context term counted
# twice (+5%) shows through the margin.
XLA_SCHEDULES = schedule_matrix("flops")
XLA_MARGIN = 0.03  # XLA also counts elementwise work (norms, softmax, RoPE, SwiGLU): about 1% of these models


@pytest.mark.parametrize("name", sorted(XLA_SCHEDULES))
def test_forward_flops_match_xla_cost_analysis(name):
  # materialize: every reused tensor is passed on, so XLA executes the method's own FLOPs (no recomputation); unrolled,
  # because XLA's cost analysis counts a while loop's body once
  cfg = tiny_config("model.d_model=128", "model.mlp_dim=512", "data.seq_len=128", "attention.score_sharing=materialize",
                    "model.scan_layers=false", *XLA_SCHEDULES[name])
  schedule = compile_schedule(cfg.model, cfg.schedule)
  model = build_model(plan_of(cfg), 0, compute_ties(plan_of(cfg), 0))
  graphdef, params = nnx.split(model, nnx.Param)
  b, t = 2, cfg.data.seq_len
  tokens = jnp.zeros((b, t), jnp.int32)
  compiled = jax.jit(lambda p, x: nnx.merge(graphdef, p)(x)).lower(params, tokens).compile()
  cost = compiled.cost_analysis()
  xla = (cost[0] if isinstance(cost, list) else cost)["flops"]
  ours = b * t * accounting.forward_flops_per_token(cfg.model, schedule, t)  # the reference computes all T x T cells
  assert abs(xla - ours) / ours < XLA_MARGIN, (xla, ours, np.round(xla / ours, 4))
