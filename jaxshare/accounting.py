"""Pure accounting of a model under a schedule: KV-cache bytes, parameters, FLOPs.

All functions are pure in (model config, compiled schedule) and are unit-tested against the papers' own figures
(MLKV Table 1 formulas and Table 2 parameter counts).
"""

from __future__ import annotations

import dataclasses

from jaxshare.config import ModelConfig
from jaxshare.schedule import Schedule


def _has_bias(model: ModelConfig) -> bool:
  return model.flavor == "neox"


def _mlp_matrices(model: ModelConfig) -> int:
  return 3 if model.flavor == "llama" else 2  # SwiGLU: gate, up, down; GELU: up, down


def kv_cache_bytes_per_token(model: ModelConfig, schedule: Schedule, bytes_per_element: int = 2) -> int:
  """KV-cache bytes one token occupies (one sequence): only producers store K and V.

  MLKV Table 1 (elements 2·b·s·m·g·d_k) generalised to per-layer head counts: ``sum_producers 2·G·d·β``.
  """
  d = model.resolved_head_dim
  return sum(2 * p.num_kv_heads * d * bytes_per_element for p in schedule.layers if p.is_producer)


def kv_cache_bytes(model: ModelConfig, schedule: Schedule, batch: int, seq_len: int,
                   bytes_per_element: int = 2) -> int:
  """KV-cache bytes for ``batch`` sequences of ``seq_len`` tokens."""
  return batch * seq_len * kv_cache_bytes_per_token(model, schedule, bytes_per_element)


def _kv_params_per_head(model: ModelConfig) -> int:
  d = model.resolved_head_dim
  return 2 * model.d_model * d + (2 * d if _has_bias(model) else 0)


def mlp_dim(model: ModelConfig, schedule: Schedule, match_params: bool) -> int:
  """MLP width F' used by the model.

  With ``match_params`` the K/V parameters the schedule drops, relative to dense MHA, are given back by widening
  every layer's MLP. pythia-mlkv's formula (reproduces every MLKV Table 2 count):
  ``P_lost = (L·H - Σ G_producers)·(2Dd + 2d)``, ``F' = F + round(floor(P_lost / L) / D) // k``, with k = 2 weight
  matrices per neuron for the GELU MLP; k = 3 for SwiGLU (our generalisation).
  """
  if not match_params:
    return model.mlp_dim
  dropped_heads = model.num_layers * model.num_heads - sum(
    p.num_kv_heads for p in schedule.layers if p.is_producer)
  p_lost = dropped_heads * _kv_params_per_head(model)
  return model.mlp_dim + round((p_lost // model.num_layers) / model.d_model) // _mlp_matrices(model)


@dataclasses.dataclass(frozen=True)
class ParamCount:
  """Parameter counts by part (units: parameters)."""

  embedding: int
  attention: int
  mlp: int
  norms: int
  output: int

  @property
  def total(self) -> int:
    return self.embedding + self.attention + self.mlp + self.norms + self.output

  @property
  def non_embedding(self) -> int:
    return self.attention + self.mlp + self.norms


def param_count(model: ModelConfig, schedule: Schedule, match_params: bool = False) -> ParamCount:
  """Exact parameter count of :class:`jaxshare.model.Transformer` built from (model, schedule).

  Consumers have no K/V projections. Reproduces MLKV Table 2 (Pythia-160M, ``match_params``) exactly.
  """
  D, H, d = model.d_model, model.num_heads, model.resolved_head_dim
  bias = _has_bias(model)
  F = mlp_dim(model, schedule, match_params)
  attn = 0
  for p in schedule.layers:
    attn += D * H * d + H * d * D + ((H * d + D) if bias else 0)  # q and o projections
    if p.is_producer:
      attn += p.num_kv_heads * _kv_params_per_head(model)
  per_mlp = _mlp_matrices(model) * D * F + ((F + D) if bias else 0)
  norm_size = 2 * D if model.flavor == "neox" else D  # LayerNorm has a bias
  embedding = model.vocab_size * D
  return ParamCount(
    embedding=embedding,
    attention=attn,
    mlp=model.num_layers * per_mlp,
    norms=(2 * model.num_layers + 1) * norm_size,
    output=0 if model.tie_embeddings else model.vocab_size * D,
  )


def forward_flops_per_token(model: ModelConfig, schedule: Schedule, context_len: int,
                            match_params: bool = False) -> int:
  """Forward matmul FLOPs for one token attending to ``context_len`` keys (2 FLOPs per multiply-add).

  Consumers skip the K/V projections; QKᵀ and AV cost the same in every layer (MLKV Sec. 1.4).
  """
  D, H, d = model.d_model, model.num_heads, model.resolved_head_dim
  F = mlp_dim(model, schedule, match_params)
  flops = 2 * model.vocab_size * D  # output projection
  for p in schedule.layers:
    flops += 2 * D * H * d * 2  # q and o projections
    if p.is_producer:
      flops += 2 * D * p.num_kv_heads * d * 2
    flops += 2 * 2 * H * d * context_len  # QK^T and AV
    flops += 2 * _mlp_matrices(model) * D * F
  return flops


def train_flops_per_token(model: ModelConfig, schedule: Schedule, seq_len: int, match_params: bool = False) -> int:
  """Training FLOPs per token (forward + backward = 3x forward), causal attention averaged over positions.

  Used for MFU. Like PaLM's 6N + 12·L·H·d·T but with the causal average context (T+1)/2 and the schedule's
  actual projections.
  """
  return 3 * forward_flops_per_token(model, schedule, (seq_len + 1) // 2, match_params)
