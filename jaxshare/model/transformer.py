"""The decoder-only language model: embeddings, scanned segments of superblocks, final norm, LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig, ScheduleConfig
from jaxshare.model.block import Superblock
from jaxshare.model.layers import DenseGeneral, make_norm
from jaxshare.schedule import Schedule, Segment


class StackedSegment(nnx.Module):
  """``count`` structurally identical superblocks with parameters stacked on a leading ``layers`` axis."""

  def __init__(self, cfg: ModelConfig, sched: ScheduleConfig, segment: Segment, *, mlp_dim: int,
               attention_impl: str, score_sharing: str, lisa_rank: int, lisa_hidden: int, rngs: nnx.Rngs):
    self.count, self.scan, self.remat = segment.count, cfg.scan_layers, cfg.remat == "full"

    @nnx.split_rngs(splits=segment.count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Superblock:
      return Superblock(cfg, sched, segment.signature, mlp_dim=mlp_dim, attention_impl=attention_impl,
                        score_sharing=score_sharing, lisa_rank=lisa_rank, lisa_hidden=lisa_hidden, rngs=rngs)

    self.blocks = make(rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array,
               capture: bool = False) -> tuple[jax.Array, list[jax.Array]]:
    """Residual stream out and, with ``capture``, the per-layer logits (``count * superblock_size`` arrays)."""
    def apply(block: Superblock, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
      return block(x, positions, segment_ids, capture)

    if self.remat:
      apply = nnx.remat(apply)
    if self.scan:
      body = nnx.scan(apply, in_axes=(0, nnx.Carry, None, None), out_axes=(nnx.Carry, 0))
      x, ys = body(self.blocks, x, positions, segment_ids)
      return x, [y[c] for c in range(self.count) for y in ys]
    graphdef, state = nnx.split(self.blocks)
    captured: list[jax.Array] = []
    for i in range(self.count):
      x, ys = apply(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)), x, positions, segment_ids)
      captured.extend(ys)
    return x, captured


class Transformer(nnx.Module):
  """Decoder-only LM whose attention follows a sharing :class:`~jaxshare.schedule.Schedule`.

  Args:
    cfg: model dimensions and flavour.
    schedule: compiled schedule (which layers produce K/V).
    mlp_dim: MLP width (``accounting.mlp_dim``: the config's, or widened to match parameters).
    attention_impl: ``attention.impl``.
  """

  def __init__(self, cfg: ModelConfig, schedule: Schedule, *, mlp_dim: int | None = None,
               attention_impl: str = "auto", score_sharing: str = "recompute",
               sched: ScheduleConfig | None = None, rngs: nnx.Rngs):
    if len(schedule.layers) != cfg.num_layers:
      raise ValueError(f"schedule has {len(schedule.layers)} layers, model.num_layers={cfg.num_layers}")
    pdtype, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.embedding = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                                                pdtype), logical_axes=("vocab", "embed"))
    sched = sched or ScheduleConfig()
    self.segments = nnx.List([
      StackedSegment(cfg, sched, seg, mlp_dim=mlp_dim or cfg.mlp_dim, attention_impl=attention_impl,
                     score_sharing=score_sharing, lisa_rank=schedule.lisa_rank, lisa_hidden=schedule.lisa_hidden,
                     rngs=rngs)
      for seg in schedule.segments])
    self.final_norm = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.lm_head = None if cfg.tie_embeddings else DenseGeneral(
      "btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std, bias_shape=None,
      dtype=self.dtype, param_dtype=pdtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None,
               capture_attention: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 positions within each packed document (default ``arange(T)``).
      segment_ids: ``[B, T]`` int32 document ids (default: one document).
      capture_attention: also return every layer's pre-softmax attention logits (unmasked, scaled by 1/sqrt(d);
        for a reusing layer the logits it used), for distillation and analysis.

    Returns:
      ``[B, T, V]`` float32 logits; with ``capture_attention`` also ``[L, B, H, T, T]`` float32 attention logits.
    """
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    x = parallel.constrain(x, ("activation_batch", "activation_length", "activation_embed"))
    captured: list[jax.Array] = []
    for seg in self.segments:
      x, ys = seg(x, positions, segment_ids, capture_attention)
      captured.extend(ys)
    x = self.final_norm(x)
    if self.lm_head is None:
      logits = jnp.einsum("btd,vd->btv", x, self.embedding[...].astype(self.dtype))
    else:
      logits = self.lm_head(x)
    logits = parallel.constrain(logits.astype(jnp.float32), ("activation_batch", "activation_length",
                                                              "activation_vocab"))
    return (logits, jnp.stack(captured)) if capture_attention else logits
