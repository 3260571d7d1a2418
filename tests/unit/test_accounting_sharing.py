"""Accounting of the score- and head-sharing methods against the papers' figures."""

import pytest

from jaxshare import accounting
from jaxshare.config import HeadwiseConfig, LisaConfig, LisaGroupConfig, ModelConfig, SAConfig, ScheduleConfig
from jaxshare.schedule import compile_schedule

LLAMA2_7B = ModelConfig(vocab_size=32000, num_layers=32, d_model=4096, num_heads=32, mlp_dim=11008)
LLAMA2_13B = ModelConfig(vocab_size=32000, num_layers=40, d_model=5120, num_heads=40, mlp_dim=13824)
LLAMA3_8B = ModelConfig(vocab_size=128256, num_layers=32, d_model=4096, num_heads=32, mlp_dim=14336)
GEMMA2_9B_LAYERS = ModelConfig(num_layers=42, d_model=3584, num_heads=16, head_dim=256, mlp_dim=14336)


def kv_ratio(model, sched):
  dense = compile_schedule(model, ScheduleConfig(kind="gqa", kv_heads=sched.kv_heads) if sched.kv_heads
                           else ScheduleConfig())
  return (accounting.kv_cache_bytes_per_token(model, compile_schedule(model, sched))
          / accounting.kv_cache_bytes_per_token(model, dense))


def test_uniattn_kv_retained():
  # UniAttn Tables 1/10: top half, b=4 -> 81.3% on 32-layer models, 82.1% on Gemma-2-9B (42 layers).
  assert kv_ratio(LLAMA2_7B, ScheduleConfig(kind="uniattn")) == 52 / 64
  assert round(100 * kv_ratio(LLAMA2_7B, ScheduleConfig(kind="uniattn")), 1) in (81.2, 81.3)  # 81.25
  s = compile_schedule(LLAMA2_7B, ScheduleConfig(kind="uniattn"))
  assert [p.index for p in s.layers if p.score_reuse] == [i for i in range(16, 32) if i % 4]
  assert round(100 * kv_ratio(GEMMA2_9B_LAYERS, ScheduleConfig(kind="uniattn")), 1) == 82.1


def test_sa_kv_saving_llama2_7b():
  # SA 2.4: span 23~30 saves 64 KiB of 512 KiB per token (12.5%) with the reference code, 56 KiB (10.9%) with Alg. 1.
  full = accounting.kv_cache_bytes_per_token(LLAMA2_7B, compile_schedule(LLAMA2_7B, ScheduleConfig()))
  assert full == 512 * 1024
  for semantics, saved in (("reference_code", 64), ("paper", 56)):
    sched = ScheduleConfig(kind="sa", sa=SAConfig(start=23, end=30, semantics=semantics))
    s = compile_schedule(LLAMA2_7B, sched)
    assert full - accounting.kv_cache_bytes_per_token(LLAMA2_7B, s) == saved * 1024
  assert round(1 - kv_ratio(LLAMA2_7B, ScheduleConfig(kind="sa", sa=SAConfig(23, 30, "reference_code"))), 3) == 0.125
  # Llama3-8B (G=8): 128 KiB per token, same share.
  l3 = ScheduleConfig(kind="gqa+sa", kv_heads=8, sa=SAConfig(23, 30, "reference_code"))
  assert kv_ratio(LLAMA3_8B, l3) == 1 - 0.125


LISA_17 = [4, 5] + list(range(16, 31))  # LISA Table 4 layers 5, 6, 17-31 (1-indexed)


def test_lisa17_new_parameters_llama3_8b():
  # LISA 1.2: one L3 LISA layer adds 2,621,440 + 655,360 + 24,576 parameters; x17 = 56.1M ("56 million, 0.7%").
  sched = ScheduleConfig(kind="gqa+lisa", kv_heads=8, lisa=LisaConfig(layers=LISA_17, rank=20, hidden=256))
  s = compile_schedule(LLAMA3_8B, sched)
  counts = accounting.param_count(LLAMA3_8B, s)
  assert counts.sharing == 17 * (2_621_440 + 655_360 + 24_576) == 56_123_392
  dense = accounting.param_count(LLAMA3_8B, compile_schedule(LLAMA3_8B, ScheduleConfig(kind="gqa", kv_heads=8)))
  assert round(100 * counts.sharing / dense.total, 1) == 0.7


@pytest.mark.parametrize("layers, retained", [(LISA_17, 77.6), ([3, 4, 6, 7, 9, 10, 12, 13, 15, 16, 18, 19] +
                                                                   list(range(21, 30)), 72.3),
                                               (list(range(3, 30)), 64.4)])
def test_lisa_kv_retained(layers, retained):
  # methods-lisa-uniattn.md 1.4: a LISA layer stores G(r + d) of 2Gd (57.8% at r=20); LISA(17/21/27) keep
  # 77.6 / 72.3 / 64.4% of the KV cache.
  assert len(layers) in (17, 21, 27)
  sched = ScheduleConfig(kind="gqa+lisa", kv_heads=8, lisa=LisaConfig(layers=layers, rank=20, hidden=256))
  assert round(100 * kv_ratio(LLAMA3_8B, sched), 1) == retained


def test_lisa_memory_formulas_match_the_cache_accounting():
  mha = ModelConfig(num_layers=8, d_model=256, num_heads=4, mlp_dim=512)
  s = compile_schedule(mha, ScheduleConfig(kind="lisa", lisa=LisaConfig(layers=[2, 3, 5], rank=8)))
  dense = compile_schedule(mha, ScheduleConfig())
  l, beta = 100, 2
  cache_saving = l * (accounting.kv_cache_bytes_per_token(mha, dense, beta)
                      - accounting.kv_cache_bytes_per_token(mha, s, beta))
  assert accounting.lisa_memory_saving_bytes(mha, s, l, "prefill") == cache_saving - 4 * l * l * beta
  assert accounting.lisa_memory_saving_bytes(mha, s, l, "decode") == cache_saving - 4 * l * beta
  # the formula's sign change: prefill loses once l > N(d_k - r) = 3 * 56
  assert accounting.lisa_memory_saving_bytes(mha, s, 3 * 56 + 1, "prefill") < 0 < \
      accounting.lisa_memory_saving_bytes(mha, s, 3 * 56 - 1, "prefill")


@pytest.mark.parametrize("model, before, after", [(LLAMA2_7B, 6.74, 6.09), (LLAMA2_13B, 13.02, 11.76)])
def test_headwise_parameter_counts_table3(model, before, after):
  # Head-wise Shareable Attention Table 3: 30% MHA sharing.
  dense = accounting.param_count(model, compile_schedule(model, ScheduleConfig())).total
  s = compile_schedule(model, ScheduleConfig(kind="headwise", headwise=HeadwiseConfig(ratio=0.3)))
  assert s.tied_heads == {32: 410, 40: 640}[model.num_layers]
  assert round(dense / 1e9, 2) == before
  assert round(accounting.param_count(model, s).total / 1e9, 2) == after
  assert accounting.kv_cache_bytes_per_token(model, s) == accounting.kv_cache_bytes_per_token(
    model, compile_schedule(model, ScheduleConfig()))


def test_lisa_sl_7_plus_10_mixes_linear_and_direct_sharing_llama3_8b():
  # LISA Table 4's LISA_SL(7+10): LISA_SL (r=32, aligner 2H x H) on 5, 6, 17-21 and DS on 22-31 (1-based).
  groups = [LisaGroupConfig(layers=[4, 5, 16, 17, 18, 19, 20], integrator="linear"),
            LisaGroupConfig(layers=list(range(21, 31)), integrator="none")]
  sched = ScheduleConfig(kind="gqa+lisa", kv_heads=8, lisa=LisaConfig(groups=groups, rank=32))
  s = compile_schedule(LLAMA3_8B, sched)
  # per LISA_SL layer: W_LR^Q 4096x1024 + W_LR^K 4096x256 (LISA 1.2) + the 64x32 linear aligner; DS adds nothing
  assert accounting.param_count(LLAMA3_8B, s).sharing == 7 * (4096 * 1024 + 4096 * 256 + 64 * 32)
  # KV elements per token: 15 full layers 2*G*d, 7 LISA_SL layers G*(d + r), 10 DS layers G*d (V only)
  retained = (15 * 2 * 8 * 128 + 7 * 8 * (128 + 32) + 10 * 8 * 128) / (32 * 2 * 8 * 128)
  assert kv_ratio(LLAMA3_8B, sched) == retained
  assert round(100 * retained, 1) == 76.2


def test_lisa_keep_qk_keeps_the_projections_not_the_cache():
  base = dict(kind="gqa+lisa", kv_heads=8)
  lisa = compile_schedule(LLAMA3_8B, ScheduleConfig(**base, lisa=LisaConfig(layers=LISA_17, rank=20, hidden=256)))
  kept = compile_schedule(LLAMA3_8B, ScheduleConfig(**base, lisa=LisaConfig(layers=LISA_17, rank=20, hidden=256,
                                                                           keep_qk=True)))
  extra = accounting.param_count(LLAMA3_8B, kept).total - accounting.param_count(LLAMA3_8B, lisa).total
  assert extra == 17 * (4096 * 4096 + 4096 * 1024)  # W_q and W_k (8 K/V heads) of the 17 LISA layers
  assert accounting.kv_cache_bytes_per_token(LLAMA3_8B, kept) == accounting.kv_cache_bytes_per_token(LLAMA3_8B, lisa)
