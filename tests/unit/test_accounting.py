"""Accounting against the MLKV paper (Table 1 formulas, Table 2 parameter counts) and the live model."""

import jax
import pytest
from flax import nnx

from jaxshare import accounting
from jaxshare.config import AttentionConfig, ModelConfig, ScheduleConfig
from jaxshare.schedule import compile_schedule
from jaxshare.model import Transformer
from jaxshare.plan import ModelPlan

# Pythia-160M per its HF config (methods-mlkv-sa-headwise.md 1.2).
PYTHIA_160M = ModelConfig(flavor="neox", vocab_size=50304, num_layers=12, d_model=768, num_heads=12, mlp_dim=3072,
                          rotary_pct=0.25, tie_embeddings=False)

# MLKV Table 2: (kind, m, g, #params, widened F'). GQA/MQA rows are MLKV with m = L.
TABLE_2 = [
  ("dense", 12, 12, 162_322_944, 3072),
  ("gqa", 12, 4, 162_316_800, 3584),
  ("mlkv", 4, 12, 162_316_800, 3584),
  ("gqa", 12, 1, 162_332_940, 3777),
  ("mlkv", 4, 3, 162_332_940, 3777),
  ("mlkv", 6, 1, 162_332_556, 3809),
  ("mlkv", 4, 1, 162_320_132, 3819),
  ("mlkv", 2, 1, 162_326_152, 3830),
  ("mlkv", 1, 1, 162_319_940, 3835),
]


def _schedule(kind, m, g):
  if kind == "dense":
    return compile_schedule(PYTHIA_160M, ScheduleConfig(kind="dense"))
  if kind == "gqa":
    return compile_schedule(PYTHIA_160M, ScheduleConfig(kind="gqa", kv_heads=g))
  return compile_schedule(PYTHIA_160M, ScheduleConfig(kind="mlkv", kv_layers=m, kv_heads=g))


@pytest.mark.parametrize("kind, m, g, params, widened", TABLE_2)
def test_mlkv_table2_parameter_counts_exact(kind, m, g, params, widened):
  s = _schedule(kind, m, g)
  match = accounting.ParamMatch("pythia_mlkv")
  assert accounting.mlp_dim(PYTHIA_160M, s, match) == widened
  assert accounting.param_count(PYTHIA_160M, s, match).total == params


@pytest.mark.parametrize("kind, m, g, params, widened", TABLE_2)
def test_mlkv_kv_bytes_per_token_fp16(kind, m, g, params, widened):
  # MLKV 1.4: Pythia-160M in fp16 needs 256*(m*g) bytes per token; the baseline 36 KiB.
  assert accounting.kv_cache_bytes_per_token(PYTHIA_160M, _schedule(kind, m, g), 2) == 256 * m * g


def test_mlkv_table1_kv_cache_formulas_opt175b():
  # Table 1: elements MHA 2bslh*d, GQA 2bslg*d, MQA 2bsl*d, MLKV 2bsmg*d; with b*s = 32768 tokens in fp16,
  # OPT-175B (l=96, h=96, d=128) gives 144 / 36 / 1.5 / 0.375 GiB.
  opt = ModelConfig(num_layers=96, num_heads=96, d_model=12288, vocab_size=50272, mlp_dim=49152)
  gib = 2 ** 30
  rows = [(ScheduleConfig(kind="dense"), 144.0), (ScheduleConfig(kind="gqa", kv_heads=24), 36.0),
          (ScheduleConfig(kind="mqa"), 1.5), (ScheduleConfig(kind="mlkv", kv_layers=24, kv_heads=1), 0.375)]
  for sc, expected in rows:
    s = compile_schedule(opt, sc)
    assert accounting.kv_cache_bytes(opt, s, batch=8, seq_len=4096, bytes_per_element=2) / gib == expected
  # and the formula itself for MLKV: 2*b*s*m*g*d*beta
  s = compile_schedule(opt, ScheduleConfig(kind="mlkv", kv_layers=24, kv_heads=1))
  assert accounting.kv_cache_bytes(opt, s, 3, 5, 2) == 2 * 3 * 5 * 24 * 1 * 128 * 2


@pytest.mark.parametrize("flavor, sc, match", [
  ("llama", ScheduleConfig(kind="cla", factor=2), False),
  ("neox", ScheduleConfig(kind="mlkv", kv_layers=2, kv_heads=2), True),
  ("llama", ScheduleConfig(kind="gqa", kv_heads_per_layer=[4, 2, 1]), True),
])
def test_accounting_equals_live_model(flavor, sc, match):
  cfg = ModelConfig(flavor=flavor, num_layers=3, d_model=32, num_heads=4, mlp_dim=48, vocab_size=64,
                    rotary_pct=0.5, tie_embeddings=flavor == "llama")
  s = compile_schedule(cfg, sc)
  plan = ModelPlan(cfg, s, accounting.mlp_dim(cfg, s, match), None, AttentionConfig(), sc)
  model = nnx.eval_shape(lambda: Transformer(plan, rngs=nnx.Rngs(0)))
  live = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
  assert live == accounting.param_count(cfg, s, match).total


def test_flops_drop_only_by_kv_projections():
  cfg = ModelConfig(num_layers=4, d_model=64, num_heads=4, mlp_dim=128)
  dense = accounting.forward_flops_per_token(cfg, compile_schedule(cfg, ScheduleConfig()), 100)
  cla = accounting.forward_flops_per_token(cfg, compile_schedule(cfg, ScheduleConfig(kind="cla", factor=2)), 100)
  assert dense - cla == 2 * (2 * 64 * 4 * 16 * 2)  # two consumers skip K and V projections
