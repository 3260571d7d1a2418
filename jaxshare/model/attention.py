"""Self-attention of one layer, as producer (own K/V) or consumer (a producer's post-RoPE K/V)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig
from jaxshare.kernels.dispatch import get_attention
from jaxshare.model.layers import DenseGeneral
from jaxshare.model.rope import apply_rope

KV = tuple[jax.Array, jax.Array]


class Attention(nnx.Module):
  """Multi-head attention with GQA (G K/V heads shared by H/G query heads each) and cross-layer K/V reuse.

  A producer owns ``k_proj``/``v_proj`` ([D, G, d]) and returns its rotated K and V ([B, T, G, d]) so that
  consumer layers of its superblock can attend with them (CLA, MLKV Eq. 13-15). A consumer has no K/V
  parameters at all.
  """

  def __init__(self, cfg: ModelConfig, *, producer: bool, num_kv_heads: int, attention_impl: str,
               rngs: nnx.Rngs):
    D, H, d = cfg.d_model, cfg.num_heads, cfg.resolved_head_dim
    dtype, pdtype = jnp.dtype(cfg.dtype), jnp.dtype(cfg.param_dtype)
    bias = cfg.flavor == "neox"
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(2 * cfg.num_layers)
    kw = dict(dtype=dtype, param_dtype=pdtype, rngs=rngs)
    self.theta, self.rotary_dim = cfg.rope_theta, int(d * cfg.rotary_pct)
    self.attend = get_attention(attention_impl)
    self.q_proj = DenseGeneral("btd,dhk->bthk", (D, H, d), ("embed", "heads", "head_dim"), std=std,
                               bias_shape=(H, d) if bias else None, bias_axes=("heads", "head_dim"), **kw)
    if producer:
      kv_kw = dict(std=std, bias_shape=(num_kv_heads, d) if bias else None, bias_axes=("kv_heads", "head_dim"),
                   **kw)
      self.k_proj = DenseGeneral("btd,dgk->btgk", (D, num_kv_heads, d), ("embed", "kv_heads", "head_dim"), **kv_kw)
      self.v_proj = DenseGeneral("btd,dgk->btgk", (D, num_kv_heads, d), ("embed", "kv_heads", "head_dim"), **kv_kw)
    else:
      self.k_proj = self.v_proj = None
    self.o_proj = DenseGeneral("bthk,hkd->btd", (H, d, D), ("heads", "head_dim", "embed"), std=out_std,
                               bias_shape=(D,) if bias else None, bias_axes=("embed",), **kw)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
               shared_kv: KV | None = None) -> tuple[jax.Array, KV]:
    """Attend.

    Args:
      x: ``[B, T, D]`` normalised input.
      positions: ``[B, T]`` int32 RoPE positions.
      segment_ids: ``[B, T]`` int32 packed-document ids.
      shared_kv: for a consumer, the producer's ``(K, V)``, each ``[B, T, G, d]``; None for a producer.

    Returns:
      ``([B, T, D] output, (K, V))`` — the K/V used, for consumers downstream.
    """
    q = apply_rope(self.q_proj(x), positions, self.theta, self.rotary_dim)
    q = parallel.constrain(q, ("activation_batch", "activation_length", "activation_heads", None))
    if self.k_proj is not None:
      if shared_kv is not None:
        raise ValueError("a producer layer computes its own K/V; shared_kv must be None")
      k = apply_rope(self.k_proj(x), positions, self.theta, self.rotary_dim)
      v = self.v_proj(x)
      k = parallel.constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", None))
      v = parallel.constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", None))
    elif shared_kv is None:
      raise ValueError("a consumer layer has no K/V projections and needs its producer's shared_kv")
    else:
      k, v = shared_kv
    out = self.attend(q, k, v, segment_ids, segment_ids, causal=True)
    return self.o_proj(out), (k, v)
