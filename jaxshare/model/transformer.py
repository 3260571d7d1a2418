"""The decoder-only language model: embeddings, scanned segments of superblocks, final norm, LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import parallel
from jaxshare.config import ModelConfig
from jaxshare.model.block import Superblock
from jaxshare.model.layers import DenseGeneral, make_norm
from jaxshare.schedule import Schedule, Segment


class StackedSegment(nnx.Module):
  """``count`` structurally identical superblocks with parameters stacked on a leading ``layers`` axis."""

  def __init__(self, cfg: ModelConfig, segment: Segment, *, mlp_dim: int, attention_impl: str, rngs: nnx.Rngs):
    self.count, self.scan, self.remat = segment.count, cfg.scan_layers, cfg.remat == "full"

    @nnx.split_rngs(splits=segment.count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Superblock:
      return Superblock(cfg, segment.signature, mlp_dim=mlp_dim, attention_impl=attention_impl, rngs=rngs)

    self.blocks = make(rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    def apply(block: Superblock, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
      return block(x, positions, segment_ids)

    if self.remat:
      apply = nnx.remat(apply)
    if self.scan:
      body = nnx.scan(apply, in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)
      return body(self.blocks, x, positions, segment_ids)
    graphdef, state = nnx.split(self.blocks)
    for i in range(self.count):
      x = apply(nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state)), x, positions, segment_ids)
    return x


class Transformer(nnx.Module):
  """Decoder-only LM whose attention follows a sharing :class:`~jaxshare.schedule.Schedule`.

  Args:
    cfg: model dimensions and flavour.
    schedule: compiled schedule (which layers produce K/V).
    mlp_dim: MLP width (``accounting.mlp_dim``: the config's, or widened to match parameters).
    attention_impl: ``attention.impl``.
  """

  def __init__(self, cfg: ModelConfig, schedule: Schedule, *, mlp_dim: int | None = None,
               attention_impl: str = "auto", rngs: nnx.Rngs):
    if len(schedule.layers) != cfg.num_layers:
      raise ValueError(f"schedule has {len(schedule.layers)} layers, model.num_layers={cfg.num_layers}")
    pdtype, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.embedding = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                                                pdtype), logical_axes=("vocab", "embed"))
    self.segments = nnx.List([
      StackedSegment(cfg, seg, mlp_dim=mlp_dim or cfg.mlp_dim, attention_impl=attention_impl, rngs=rngs)
      for seg in schedule.segments])
    self.final_norm = make_norm(cfg.flavor, cfg.d_model, cfg.norm_eps, pdtype)
    self.lm_head = None if cfg.tie_embeddings else DenseGeneral(
      "btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std, bias_shape=None,
      dtype=self.dtype, param_dtype=pdtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None,
               segment_ids: jax.Array | None = None) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 positions within each packed document (default ``arange(T)``).
      segment_ids: ``[B, T]`` int32 document ids (default: one document).

    Returns:
      ``[B, T, V]`` float32 logits.
    """
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    x = jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)
    x = parallel.constrain(x, ("activation_batch", "activation_length", "activation_embed"))
    for seg in self.segments:
      x = seg(x, positions, segment_ids)
    x = self.final_norm(x)
    if self.lm_head is None:
      logits = jnp.einsum("btd,vd->btv", x, self.embedding[...].astype(self.dtype))
    else:
      logits = self.lm_head(x)
    return parallel.constrain(logits.astype(jnp.float32), ("activation_batch", "activation_length",
                                                            "activation_vocab"))
