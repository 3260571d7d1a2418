"""Pure accounting of a model under a schedule: KV-cache bytes, parameters, FLOPs.

All functions are pure in (model config, compiled schedule) and are unit-tested against the papers' own figures
(MLKV Table 1 formulas and Table 2 parameter counts).
"""

from __future__ import annotations

import dataclasses

from jaxshare.config import ModelConfig, ScheduleConfig
from jaxshare.schedule import Schedule, compile_schedule


def _has_bias(model: ModelConfig) -> bool:
  """Q/K/V projection biases."""
  return model.features.qkv_biases


def _mlp_matrices(model: ModelConfig) -> int:
  return 3 if model.features.activation == "swiglu" else 2  # SwiGLU: gate, up, down; GELU: up, down


def kv_cache_bytes_per_token(model: ModelConfig, schedule: Schedule, bytes_per_element: int = 2) -> int:
  """KV-cache bytes one token occupies (one sequence).

  Only K/V producers store anything (MLKV Table 1 generalised: ``sum 2·G·d·β``). A producer that reuses
  probabilities (SA, UniAttn) or logits without a delta (DS) stores V only; a LISA layer stores V and its low-rank
  K (``G·(d + r)``; LISA Sec. 5.1 stores K_LR instead of K).
  """
  d, r = model.resolved_head_dim, schedule.lisa_rank
  total = 0
  for p in schedule.layers:
    if not p.is_producer:
      continue
    k_width = d if p.has_query_key else (r if p.has_low_rank else 0)
    total += p.num_kv_heads * (d + k_width) * bytes_per_element
  return total


def kv_cache_bytes(model: ModelConfig, schedule: Schedule, batch: int, seq_len: int,
                   bytes_per_element: int = 2) -> int:
  """KV-cache bytes for ``batch`` sequences of ``seq_len`` tokens."""
  return batch * seq_len * kv_cache_bytes_per_token(model, schedule, bytes_per_element)


def _kv_params_per_head(model: ModelConfig) -> int:
  d = model.resolved_head_dim
  return 2 * model.d_model * d + (2 * d if _has_bias(model) else 0)


@dataclasses.dataclass(frozen=True)
class ParamMatch:
  """How ``schedule.match_params`` sizes the MLPs.

  Attributes:
    formula: ``exact`` (the reference's total parameter count) or ``pythia_mlkv`` (pythia-mlkv's formula).
    reference: ``exact``: the total parameter count to match; 0 means the dense MHA model of the same config.
  """

  formula: str = "exact"
  reference: int = 0


def param_match(schedule_cfg: ScheduleConfig) -> ParamMatch | None:
  """The config's parameter matching (None without ``schedule.match_params``)."""
  if not schedule_cfg.match_params:
    return None
  return ParamMatch(schedule_cfg.match_formula, schedule_cfg.match_reference_params)


def _as_match(match: ParamMatch | bool | None) -> ParamMatch | None:
  return ParamMatch() if match is True else (match or None)


def params_per_mlp_neuron(model: ModelConfig) -> int:
  """Parameters one hidden unit adds to every layer's MLP: its input and output weights (and input bias, GELU)."""
  return model.num_layers * (_mlp_matrices(model) * model.d_model + (1 if model.features.dense_biases else 0))


def mlp_dim(model: ModelConfig, schedule: Schedule, match: ParamMatch | bool | None = None) -> int:
  """MLP width F' used by the model.

  Without ``match`` (None or False), ``model.mlp_dim``. ``exact`` (``True`` is ``ParamMatch()``): the width whose
  model has the reference's total parameter count within half a neuron's worth (:func:`params_per_mlp_neuron`),
  counting everything the schedule drops or adds (K/V and Q/K projections, tied heads, W_c, LISA's low-rank
  projections and aligners). ``pythia_mlkv``, pythia-mlkv's formula, which reproduces every MLKV Table 2 count:
  ``P_lost = (L·H - Σ G_producers)·(2Dd + 2d)``, ``F' = F + round(floor(P_lost / L) / D) // k``, k = 2 weight matrices
  per neuron for the GELU MLP (k = 3 for SwiGLU, our generalisation); it counts only K/V heads dropped relative to
  dense MHA.

  Raises:
    ValueError: an unknown formula, or a reference so small that no MLP width reaches it.
  """
  match = _as_match(match)
  if match is None:
    return model.mlp_dim
  if match.formula == "pythia_mlkv":
    dropped_heads = model.num_layers * model.num_heads - sum(
      p.num_kv_heads for p in schedule.layers if p.is_producer)
    p_lost = dropped_heads * _kv_params_per_head(model)
    return model.mlp_dim + round((p_lost // model.num_layers) / model.d_model) // _mlp_matrices(model)
  if match.formula != "exact":
    raise ValueError(f"schedule.match_formula={match.formula!r} is invalid: must be exact or pythia_mlkv")
  reference = match.reference or param_count(model, compile_schedule(model, ScheduleConfig())).total
  width = model.mlp_dim + round((reference - param_count(model, schedule).total) / params_per_mlp_neuron(model))
  if width < 1:
    raise ValueError(f"schedule.match_reference_params={reference} is invalid for this model: matching it would "
                     f"need an MLP width of {width} (< 1)")
  return width


@dataclasses.dataclass(frozen=True)
class ParamCount:
  """Parameter counts by part (units: parameters).

  ``sharing`` holds the modules the sharing methods add: LISA's low-rank Q/K and aligner, UniAttn's W_c.
  """

  embedding: int
  attention: int
  mlp: int
  norms: int
  output: int
  sharing: int = 0

  @property
  def total(self) -> int:
    return self.embedding + self.attention + self.mlp + self.norms + self.output + self.sharing

  @property
  def non_embedding(self) -> int:
    return self.attention + self.mlp + self.norms + self.sharing


def sharing_params(model: ModelConfig, schedule: Schedule, p) -> int:
  """Parameters a layer's sharing modules add: W_c (D², UniAttn Eq. 5); LISA's W_q^LR (D×H·r), W_k^LR (D×G·r)
  and aligner (ffn: 2H×hidden + hidden×H; linear: 2H×H), all without biases."""
  D, H, r = model.d_model, model.num_heads, schedule.lisa_rank
  n = D * D if p.compensation else 0
  if p.has_low_rank:
    n += D * H * r + D * p.num_kv_heads * r
    if p.integrator == "ffn":
      n += 2 * H * schedule.lisa_hidden + schedule.lisa_hidden * H
    elif p.integrator == "linear":
      n += 2 * H * H
  return n


def param_count(model: ModelConfig, schedule: Schedule, match: ParamMatch | bool | None = None) -> ParamCount:
  """Exact parameter count of :class:`jaxshare.model.Transformer` built from (model, schedule).

  K/V consumers have no K/V projections; layers that reuse scores have no W_q/W_k (LISA layers with ``keep_qk`` keep
  them, untrained, for NF decoding); head-wise sharing removes the
  W_q, W_k, W_v (and biases) of ``schedule.tied_heads`` heads. Reproduces MLKV Table 2 (Pythia-160M,
  ``ParamMatch("pythia_mlkv")``) and head-wise Table 3 exactly.
  """
  D, H, d = model.d_model, model.num_heads, model.resolved_head_dim
  bias, out_bias = _has_bias(model), model.features.dense_biases
  F = mlp_dim(model, schedule, match)
  attn = sharing = 0
  for p in schedule.layers:
    full_qk = p.has_query_key or p.keep_qk
    attn += H * d * D + (D if out_bias else 0)  # o projection
    if full_qk:
      attn += D * H * d + (H * d if bias else 0)
    if p.is_producer:
      g = p.num_kv_heads
      attn += (D * g * d + (g * d if bias else 0)) * (2 if full_qk else 1)
    sharing += sharing_params(model, schedule, p)
  attn -= schedule.tied_heads * 3 * (D * d + (d if bias else 0))
  per_mlp = _mlp_matrices(model) * D * F + ((F + D) if out_bias else 0)
  norm_size = 2 * D if model.features.norm == "layernorm" else D  # LayerNorm has a bias
  return ParamCount(
    embedding=model.vocab_size * D,
    attention=attn,
    mlp=model.num_layers * per_mlp,
    norms=(2 * model.num_layers + 1) * norm_size,
    output=0 if model.tie_embeddings else model.vocab_size * D,
    sharing=sharing,
  )


def forward_flops_per_token(model: ModelConfig, schedule: Schedule, context_len: float,
                            match: ParamMatch | bool | None = None) -> float:
  """Forward matmul FLOPs for one token attending to ``context_len`` keys (2 FLOPs per multiply-add; elementwise
  work such as norms, RoPE and the softmax is not counted).

  Per layer: the O projection and the product of the probabilities with V (``2·H·d·ctx``) always; the V projection
  on K/V producers; the Q projection, the K projection (producers) and QKᵀ (``2·H·d·ctx``) on layers that compute
  their own scores. K/V consumers skip the K/V projections (MLKV Sec. 3); probability reuse skips Q, K and QKᵀ,
  halving the context term, and adds W_c (UniAttn Eq. 5); LISA adds rank-r projections, a rank-r QKᵀ and, for the
  ffn/linear integrators, the aligner applied to every score cell (LISA Eq. 3-4).
  """
  D, H, d = model.d_model, model.num_heads, model.resolved_head_dim
  r, hid = schedule.lisa_rank, schedule.lisa_hidden
  F = mlp_dim(model, schedule, match)
  flops = 2 * model.vocab_size * D  # output projection
  for p in schedule.layers:
    g = p.num_kv_heads
    flops += 2 * H * d * D + 2 * H * d * context_len  # O projection, probabilities x V
    if p.is_producer:
      flops += 2 * D * g * d  # V
    if p.has_query_key:
      flops += 2 * D * H * d + 2 * H * d * context_len + (2 * D * g * d if p.is_producer else 0)
    if p.has_low_rank:
      flops += 2 * D * (H + g) * r + 2 * H * r * context_len
      if p.integrator == "ffn":
        flops += 2 * 3 * H * hid * context_len
      elif p.integrator == "linear":
        flops += 2 * 2 * H * H * context_len
    if p.compensation:
      flops += 2 * D * D
    flops += 2 * _mlp_matrices(model) * D * F
  return flops


def train_flops_per_token(model: ModelConfig, schedule: Schedule, seq_len: int,
                          match: ParamMatch | bool | None = None) -> float:
  """Training FLOPs per token (forward + backward = 3x forward), causal attention averaged over positions.

  Used for MFU (model FLOPs: recomputation under remat or ``score_sharing=recompute`` is not counted). Like PaLM's
  6N + 12·L·H·d·T but with the causal average context (T+1)/2 and the schedule's actual projections.
  """
  return 3 * forward_flops_per_token(model, schedule, (seq_len + 1) / 2, match)


def lisa_memory_saving_bytes(model: ModelConfig, schedule: Schedule, seq_len: int, phase: str,
                             heads: str = "paper", bytes_per_element: int = 2) -> int:
  """LISA's net memory saving for one sequence (LISA Sec. 5.1 formulas, fp16 by default).

  ``prefill``: ``h·l·(N(d_k − r) − l)·β`` — the K-cache shrinks from d_k to r in N LISA layers, but an ``h×l×l``
  logits tensor is carried between layers. ``decode``: ``h·l·(N(d_k − r) − 1)·β`` — only an ``h×l`` row is carried.
  The paper uses the query-head count h even under GQA (``heads="paper"``); ``heads="kv"`` uses G for the cache
  term, which is what a GQA cache really saves.

  Raises:
    ValueError: unknown phase or heads option.
  """
  if phase not in ("prefill", "decode") or heads not in ("paper", "kv"):
    raise ValueError(f"phase={phase!r} / heads={heads!r}: allowed prefill|decode and paper|kv")
  n = sum(1 for p in schedule.layers if p.has_low_rank)
  d, r, h, l = model.resolved_head_dim, schedule.lisa_rank, model.num_heads, seq_len
  g = h if heads == "paper" else max((p.num_kv_heads for p in schedule.layers if p.has_low_rank), default=h)
  carried = l if phase == "prefill" else 1
  return (g * l * n * (d - r) - h * l * carried) * bytes_per_element
