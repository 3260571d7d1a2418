"""Self-attention of one layer under a sharing schedule.

A layer may own or borrow each of: its K/V (a producer's post-RoPE K/V: CLA, MLKV), its attention scores
(another layer's softmax probabilities: SA, UniAttn; or its pre-softmax logits plus a low-rank delta: LISA,
LISA_plus, DS). Every layer hands a :data:`ScoreState` to the layers above it in its superblock.
"""

from __future__ import annotations

import math
import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig
from jaxshare.kernels import reference
from jaxshare.kernels.dispatch import get_attention
from jaxshare.model.layers import DenseGeneral, param
from jaxshare.model.rope import apply_rope

KV = tuple[jax.Array, jax.Array]
# Scores a layer used, for the layers that reuse them. Keys (all optional):
#   "qf" [B,T,H,e], "kf" [B,S,G,e]: features whose product is the unmasked logits (scale folded into qf);
#   "lse" [B,H,T]: log-sum-exp of the masked logits; "logits" / "probs" [B,H,T,S] materialised (float32).
# Arrays no consumer reads are removed by XLA's dead-code elimination, so offering them costs nothing.
ScoreState = dict[str, jax.Array]

_BTH = ("activation_batch", "activation_length", "activation_heads", None)
_BTG = ("activation_batch", "activation_length", "activation_kv_heads", None)


def source_logits(state: ScoreState) -> jax.Array:
  """The unmasked logits ``[B, H, T, S]`` of a score state (materialised from its features if needed)."""
  if "logits" in state:
    return state["logits"]
  return reference.scores(state["qf"], state["kf"], 1.0)


def source_probs(state: ScoreState, mask: jax.Array) -> jax.Array:
  """The probabilities ``[B, H, T, S]`` of a score state."""
  if "probs" in state:
    return state["probs"]
  if "lse" in state:
    return reference.probs_from_lse(state["qf"], state["kf"], state["lse"], mask, 1.0)
  return reference.masked_softmax(source_logits(state), mask)[0]


class Attention(nnx.Module):
  """Attention of one layer; its role comes from the layer's relative plan (``LayerPlan.relative``).

  Args:
    cfg: model config.
    spec: ``(kv_rel, G, score_rel, score_reuse, compensation, integrator)`` relative to the superblock start.
    position: the layer's position in its superblock (``kv_rel == position``: K/V producer).
    score_sharing: ``recompute`` (consumers recompute reused probabilities from the source's Q, K and LSE, and
      LISA_plus/DS run one attention over concatenated features; nothing ``[B,H,T,T]`` is kept per consumer) or
      ``materialize`` (the probabilities/logits tensors are passed on). Both give the same numbers.
    lisa_rank / lisa_hidden / lisa_rope: LISA's low rank r, aligner width and RoPE switch.

  Parameters (absent when the role does not need them): ``q_proj [D,H,d]``, ``k_proj``/``v_proj [D,G,d]``,
  ``o_proj [H,d,D]``; LISA ``q_lr [D,H,r]``, ``k_lr [D,G,r]``, aligner ``align_in [2H,hidden]`` +
  ``align_out [hidden,H]`` (ffn) or ``align [2H,H]`` (linear).
  """

  def __init__(self, cfg: ModelConfig, spec: tuple, position: int, *, attention_impl: str, score_sharing: str,
               lisa_rank: int, lisa_hidden: int, lisa_rope: bool, tied_qkv: bool = False, rngs: nnx.Rngs):
    kv_rel, g, score_rel, reuse, _, integrator = spec
    D, H, d = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    bias = cfg.flavor == "neox"
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    kw = dict(dtype=dtype, param_dtype=pdtype, rngs=rngs)
    self.head_dim, self.dtype = d, dtype
    self.theta, self.rotary_dim = cfg.rope_theta, int(d * cfg.rotary_pct)
    self.producer, self.reuse, self.integrator = kv_rel == position, reuse, integrator
    self.recompute = score_sharing == "recompute"
    self.attend = get_attention(attention_impl)
    self.rank, self.lisa_rope = lisa_rank, lisa_rope

    def proj(shape_heads: int, axes: str, width: int, s: float) -> DenseGeneral:
      return DenseGeneral("btd,dhk->bthk", (D, shape_heads, width), ("embed", axes, "head_dim"), std=s,
                          bias_shape=(shape_heads, width) if bias and width == d else None,
                          bias_axes=(axes, "head_dim"), **kw)

    own = not tied_qkv  # head-wise sharing: W_q, W_k, W_v come from the model's head table
    self.q_proj = proj(H, "heads", d, std) if own and not reuse else None
    self.k_proj = proj(g, "kv_heads", d, std) if own and self.producer and not reuse else None
    self.v_proj = proj(g, "kv_heads", d, std) if own and self.producer else None
    self.o_proj = DenseGeneral("bthk,hkd->btd", (H, d, D), ("heads", "head_dim", "embed"), std=out_std,
                               bias_shape=(D,) if bias else None, bias_axes=("embed",), **kw)
    low_rank = reuse == "logits" and integrator != "none"
    self.q_lr = proj(H, "heads", lisa_rank, std) if low_rank else None
    self.k_lr = proj(g, "kv_heads", lisa_rank, std) if low_rank else None
    ffn = integrator == "ffn"
    self.align_in = param(rngs, (2 * H, lisa_hidden), ("heads", "mlp"), std, pdtype) if ffn else None
    self.align_out = param(rngs, (lisa_hidden, H), ("mlp", "heads"), std, pdtype) if ffn else None
    # The linear integrator starts as LISA_plus (A_{n-1} + A_delta).
    self.align = nnx.Param(jnp.concatenate([jnp.eye(H), jnp.eye(H)]).astype(pdtype),
                           logical_axes=("heads", None)) if integrator == "linear" else None

  def _project(self, name: str, x: jax.Array, head_kernels: dict | None) -> jax.Array:
    if head_kernels is None:
      return getattr(self, f"{name}_proj")(x)
    return jnp.einsum("btd,dhk->bthk", x.astype(self.dtype), head_kernels[name].astype(self.dtype))

  def _kv(self, x: jax.Array, positions: jax.Array, shared_kv: KV | None, head_kernels: dict | None) -> KV:
    if head_kernels is not None:
      k = apply_rope(self._project("k", x, head_kernels), positions, self.theta, self.rotary_dim)
      return parallel.constrain(k, _BTG), parallel.constrain(self._project("v", x, head_kernels), _BTG)
    if not self.producer:
      if shared_kv is None:
        raise ValueError("a K/V consumer layer needs its producer's shared_kv")
      return shared_kv
    if shared_kv is not None:
      raise ValueError("a K/V producer computes its own K/V; shared_kv must be None")
    k = None
    if self.k_proj is not None:
      k = parallel.constrain(apply_rope(self.k_proj(x), positions, self.theta, self.rotary_dim), _BTG)
    return k, parallel.constrain(self.v_proj(x), _BTG)

  def _low_rank(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    q, k = self.q_lr(x), self.k_lr(x)
    if self.lisa_rope:
      q = apply_rope(q, positions, self.theta, self.rank - self.rank % 2)
      k = apply_rope(k, positions, self.theta, self.rank - self.rank % 2)
    return q, k

  def _integrate(self, a_prev: jax.Array, a_delta: jax.Array) -> jax.Array:
    """LISA Eq. 4 on ``[B,H,T,S]`` logits; the aligner mixes heads per (t, s) cell, before any masking."""
    if self.integrator == "add":
      return a_prev + a_delta
    z = jnp.concatenate([a_prev, a_delta], axis=1)  # [B, 2H, T, S]
    if self.integrator == "linear":
      return jnp.einsum("bets,eh->bhts", z, self.align[...].astype(jnp.float32))
    hidden = jax.nn.relu(jnp.einsum("bets,ef->bfts", z, self.align_in[...].astype(jnp.float32)))
    return jnp.einsum("bfts,fh->bhts", hidden, self.align_out[...].astype(jnp.float32))

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, shared_kv: KV | None = None,
               source: ScoreState | None = None, head_kernels: dict | None = None) -> tuple[jax.Array, KV, ScoreState]:
    """Attend.

    Args:
      x: ``[B, T, D]`` normalised input.
      positions: ``[B, T]`` int32 RoPE positions.
      segment_ids: ``[B, T]`` int32 packed-document ids.
      shared_kv: a K/V consumer's producer ``(K, V)`` (K may be None if the producer reuses scores).
      source: the score state of the layer whose scores this layer reuses (None when it computes its own).
      head_kernels: head-wise sharing: this layer's gathered ``{"q", "k", "v"}`` kernels ``[D, H, d]``.

    Returns:
      ``(output [B, T, D], (K, V) used, ScoreState for reusing layers)``.
    """
    k, v = self._kv(x, positions, shared_kv, head_kernels)
    scale = self.head_dim ** -0.5
    mask = reference.attention_mask(segment_ids, segment_ids, True)
    if not self.reuse:
      q = parallel.constrain(apply_rope(self._project("q", x, head_kernels), positions, self.theta,
                                        self.rotary_dim), _BTH)
      if k is None:
        raise ValueError("this layer computes its own scores but its K/V producer has no K")
      out, lse = self.attend(q, k, v, segment_ids, segment_ids, causal=True, return_lse=True)
      qf = q * jnp.asarray(scale, q.dtype)
      state: ScoreState = {"qf": qf, "kf": k, "lse": lse, "logits": reference.scores(q, k, scale)}
    elif source is None:
      raise ValueError("a score-reusing layer needs its source layer's score state")
    elif self.reuse == "probs":
      if self.recompute and "lse" in source:
        reuse = jax.checkpoint(lambda qf, kf, lse, v: reference.attention_from_lse(
          qf, kf, lse, v, segment_ids, segment_ids, scale=1.0))
        out = reuse(source["qf"], source["kf"], source["lse"], v).astype(self.dtype)
        state = {key: source[key] for key in ("qf", "kf", "lse")}
      else:
        probs = source_probs(source, mask)
        out = reference.apply_probs(probs, v, self.dtype)
        state = {"probs": probs}
      if "logits" in source:
        state["logits"] = source["logits"]
    else:  # LISA family: reuse the previous layer's logits
      if self.recompute and self.integrator in ("add", "none") and "qf" in source:
        qf, kf = source["qf"], source["kf"]
        if self.integrator == "add":  # sum of logits == one product of concatenated features (design.md 3)
          q_lr, k_lr = self._low_rank(x, positions)
          qf = jnp.concatenate([qf, (q_lr * self.rank ** -0.5).astype(qf.dtype)], axis=-1)
          kf = jnp.concatenate([kf, k_lr.astype(kf.dtype)], axis=-1)
        out, lse = self.attend(qf, kf, v, segment_ids, segment_ids, causal=True, scale=1.0, return_lse=True)
        state = {"qf": qf, "kf": kf, "lse": lse, "logits": reference.scores(qf, kf, 1.0)}
      else:
        logits = source_logits(source)
        if self.integrator != "none":
          q_lr, k_lr = self._low_rank(x, positions)
          logits = self._integrate(logits, reference.scores(q_lr, k_lr, self.rank ** -0.5))
        probs, lse = reference.masked_softmax(logits, mask)
        out = reference.apply_probs(probs, v, self.dtype)
        state = {"logits": logits, "probs": probs}
    return self.o_proj(out), (k, v), state

