"""A decoder layer and a superblock (a producer with the consumers that read its K/V)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig
from jaxshare.model.attention import KV, Attention
from jaxshare.model.layers import MLP, make_norm

_RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(nnx.Module):
  """Pre-norm transformer layer.

  llama: ``h = x + attn(norm1 x); y = h + mlp(norm2 h)``.
  neox (parallel residual, GPT-NeoX/Pythia): ``y = x + attn(norm1 x) + mlp(norm2 x)``.
  """

  def __init__(self, cfg: ModelConfig, *, producer: bool, num_kv_heads: int, mlp_dim: int, attention_impl: str,
               rngs: nnx.Rngs):
    pdtype = jnp.dtype(cfg.param_dtype)
    self.parallel_residual = cfg.flavor == "neox"
    self.norm1 = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.attn = Attention(cfg, producer=producer, num_kv_heads=num_kv_heads, attention_impl=attention_impl,
                          rngs=rngs)
    self.norm2 = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.mlp = MLP(cfg.flavor, cfg.d_model, mlp_dim, std=cfg.init_std,
                   out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), dtype=jnp.dtype(cfg.dtype),
                   param_dtype=pdtype, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
               shared_kv: KV | None) -> tuple[jax.Array, KV]:
    """``x [B,T,D] -> ([B,T,D], (K, V))``; see :meth:`Attention.__call__`."""
    a, kv = self.attn(self.norm1(x), positions, segment_ids, shared_kv)
    if self.parallel_residual:
      y = x + a + self.mlp(self.norm2(x))
    else:
      h = x + a
      y = h + self.mlp(self.norm2(h))
    return parallel.constrain(y.astype(x.dtype), _RESIDUAL), kv


class Superblock(nnx.Module):
  """Consecutive layers closed under K/V references; the unit that is stacked and scanned.

  Args:
    signature: per layer ``(kv_source relative to the superblock start, num_kv_heads)``; a layer whose relative
      source is its own position produces K/V.
  """

  def __init__(self, cfg: ModelConfig, signature: tuple[tuple[int, int], ...], *, mlp_dim: int,
               attention_impl: str, rngs: nnx.Rngs):
    self.sources = tuple(rel for rel, _ in signature)
    self.layers = nnx.List([
      DecoderLayer(cfg, producer=rel == i, num_kv_heads=g, mlp_dim=mlp_dim, attention_impl=attention_impl,
                   rngs=rngs)
      for i, (rel, g) in enumerate(signature)])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    kvs: dict[int, KV] = {}
    for i, (src, layer) in enumerate(zip(self.sources, self.layers)):
      x, kvs[i] = layer(x, positions, segment_ids, None if src == i else kvs[src])
    return x
