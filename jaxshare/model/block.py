"""A decoder layer and a superblock (layers closed under K/V and score references)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig, ScheduleConfig
from jaxshare.model.attention import KV, Attention, ScoreState, source_logits
from jaxshare.model.layers import MLP, DenseGeneral, make_norm

_RESIDUAL = ("activation_batch", "activation_length", "activation_embed")


class DecoderLayer(nnx.Module):
  """Pre-norm transformer layer.

  llama: ``h = x + attn(norm1 x); y = h + mlp(norm2 h)``.
  neox (parallel residual, GPT-NeoX/Pythia): ``y = x + attn(norm1 x) + mlp(norm2 x)``.
  With UniAttn's compensation the attention output gains ``x W_c`` (Eq. 5; ``W_c [D, D]``, no bias, zero-initialised
  so that training starts from plain probability reuse), its input being the residual ``x`` or ``norm1 x``.
  """

  def __init__(self, cfg: ModelConfig, sched: ScheduleConfig, spec: tuple, position: int, *, mlp_dim: int,
               attention_impl: str, score_sharing: str, lisa_rank: int, lisa_hidden: int, tied_qkv: bool,
               rngs: nnx.Rngs):
    pdtype = jnp.dtype(cfg.param_dtype)
    self.parallel_residual = cfg.flavor == "neox"
    self.norm1 = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.attn = Attention(cfg, spec, position, attention_impl=attention_impl, score_sharing=score_sharing,
                          lisa_rank=lisa_rank, lisa_hidden=lisa_hidden, lisa_rope=sched.lisa.rope,
                          tied_qkv=tied_qkv, rngs=rngs)
    self.wc_normed = sched.uniattn.wc_input == "normed"
    self.compensation = DenseGeneral(
      "btd,de->bte", (cfg.d_model, cfg.d_model), ("embed", None), std=None, bias_shape=None,
      dtype=jnp.dtype(cfg.dtype), param_dtype=pdtype, rngs=rngs) if spec[4] else None
    self.norm2 = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.mlp = MLP(cfg.flavor, cfg.d_model, mlp_dim, std=cfg.init_std,
                   out_std=cfg.init_std / math.sqrt(2 * cfg.num_layers), dtype=jnp.dtype(cfg.dtype),
                   param_dtype=pdtype, rngs=rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, shared_kv: KV | None,
               source: ScoreState | None, head_kernels: dict | None = None) -> tuple[jax.Array, KV, ScoreState]:
    """``x [B,T,D] -> ([B,T,D], (K, V), score state)``; see :meth:`Attention.__call__`."""
    h = self.norm1(x)
    a, kv, state = self.attn(h, positions, segment_ids, shared_kv, source, head_kernels)
    if self.compensation is not None:
      a = a + self.compensation(h if self.wc_normed else x)
    if self.parallel_residual:
      y = x + a + self.mlp(self.norm2(x))
    else:
      y = x + a
      y = y + self.mlp(self.norm2(y))
    return parallel.constrain(y.astype(x.dtype), _RESIDUAL), kv, state


class Superblock(nnx.Module):
  """Consecutive layers closed under K/V and score references; the unit that is stacked and scanned.

  Args:
    signature: per layer, its plan relative to the superblock start (``LayerPlan.relative``).
  """

  def __init__(self, cfg: ModelConfig, sched: ScheduleConfig, signature: tuple[tuple, ...], *, mlp_dim: int,
               attention_impl: str, score_sharing: str, lisa_rank: int, lisa_hidden: int, tied_qkv: bool = False,
               rngs: nnx.Rngs):
    self.specs = tuple(signature)
    self.layers = nnx.List([
      DecoderLayer(cfg, sched, spec, i, mlp_dim=mlp_dim, attention_impl=attention_impl, score_sharing=score_sharing,
                   lisa_rank=lisa_rank, lisa_hidden=lisa_hidden, tied_qkv=tied_qkv, rngs=rngs)
      for i, spec in enumerate(signature)])

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, capture: bool = False,
               head_kernels: dict | None = None) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Returns the residual stream and, with ``capture``, each layer's pre-softmax logits ``[B,H,T,T]`` (f32).

    ``head_kernels`` (head-wise sharing): ``{"q", "k", "v"}`` kernels ``[superblock size, D, H, d]``.
    """
    kvs: dict[int, KV] = {}
    states: dict[int, ScoreState] = {}
    captured = []
    for i, (spec, layer) in enumerate(zip(self.specs, self.layers)):
      kv_rel, _, score_rel, reuse = spec[:4]
      kernels = None if head_kernels is None else {m: w[i] for m, w in head_kernels.items()}
      x, kvs[i], states[i] = layer(x, positions, segment_ids, None if kv_rel == i else kvs[kv_rel],
                                   states[score_rel] if reuse else None, kernels)
      if capture:
        captured.append(source_logits(states[i]))
    return x, tuple(captured)
