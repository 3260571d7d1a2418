"""The decoder-only language model: embeddings, scanned stacks of superblocks, final norm, LM head."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare import context, parallel
from jaxshare.config import ModelConfig
from jaxshare.model import cache as kv_cache
from jaxshare.model import remat
from jaxshare.model.block import MHAActivations, Superblock, superblock_checkpoint, unrolled
from jaxshare.model.cache import DecodeCache, StepContext
from jaxshare.model.layers import DenseGeneral, make_norm, param
from jaxshare.model.scan import scan_or_unroll
from jaxshare.model.ties import MATRICES, HeadTies
from jaxshare.plan import ModelPlan
from jaxshare.schedule import StackPlan


class Stack(nnx.Module):
  """``count`` structurally identical superblocks with parameters stacked on a leading ``layers`` axis.

  Args:
    followed: another stack comes after this one, so its backward pass runs first: this stack's scan makes its
      parameters' gradient stacks when its own backward pass starts
      (:func:`~jaxshare.model.scan.scan_deferring_gradients`).
  """

  def __init__(self, plan: ModelPlan, stack: StackPlan, *, followed: bool = False, rngs: nnx.Rngs):
    self.count, self.scan = stack.count, plan.model.scan_layers and not unrolled(plan, stack.runs)
    self.remat = superblock_checkpoint(plan, stack.runs)
    self.followed = followed

    @nnx.split_rngs(splits=stack.count)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs: nnx.Rngs) -> Superblock:
      return Superblock(plan, stack.runs, rngs=rngs)

    self.blocks = make(rngs)

  def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, capture: str | None = None,
               head_kernels: dict | None = None) -> tuple[jax.Array, list]:
    """Residual stream out and the per-layer captures (``count * superblock_size``; see :class:`Superblock`).

    ``head_kernels``: head-wise sharing's gathered kernels, ``[count, superblock size, D, H, d]`` each.
    """
    def apply(block: Superblock, x: jax.Array, kernels, positions, segment_ids):
      return block(x, positions, segment_ids, capture, kernels)

    if self.remat:  # the superblock's own checkpoint, around its layers' if they have any (jaxshare.model.remat)
      apply = remat.checkpoint(apply, remat.superblock_policy(self.remat))
    x, ys = scan_or_unroll(apply, self.blocks, x, head_kernels, count=self.count, scan=self.scan,
                           consts=(positions, segment_ids), defer_gradients=self.followed)
    return x, [jax.tree.map(lambda a: a[c], y) for c in range(self.count) for y in ys]

  def decode(self, x: jax.Array, ctx: StepContext, buffers: list[kv_cache.Buffers], head_kernels: dict | None = None,
             nf: bool = False) -> tuple[jax.Array, list[kv_cache.Buffers]]:
    """One decode step through the stack's superblocks (scanned like :meth:`__call__`; superblock c reads its
    slice of each run's cache ``{name: [count, length, B, G, S, e]}``). Returns ``x`` and the new rows
    ``{name: [count, length, B, G, n, e]}``."""
    def apply(block: Superblock, x, per_block):
      return block.decode(x, ctx, *per_block, nf)

    return scan_or_unroll(apply, self.blocks, x, (buffers, head_kernels), count=self.count, scan=self.scan)


class HeadTable(nnx.Module):
  """Head-wise sharing's stored heads: ``q``, ``k``, ``v`` kernels ``[rows, D, d]``, and which row each layer's head
  uses (static ``[L][H]`` index tables from :func:`jaxshare.init.headwise.direct_share`)."""

  def __init__(self, cfg: ModelConfig, ties: HeadTies, rngs: nnx.Rngs):
    D, d = cfg.d_model, cfg.resolved_head_dim
    pdtype = jnp.dtype(cfg.param_dtype)
    # Static graph data, hashed with the graphdef wherever a jitted function takes it as a static argument (the
    # decode steps): tuples, not a dict.
    self.index = tuple(ties.index[m] for m in MATRICES)
    self.q = param(rngs, (len(ties.rows["q"]), D, d), ("heads", "embed", "head_dim"), cfg.init_std, pdtype)
    self.k = param(rngs, (len(ties.rows["k"]), D, d), ("heads", "embed", "head_dim"), cfg.init_std, pdtype)
    self.v = param(rngs, (len(ties.rows["v"]), D, d), ("heads", "embed", "head_dim"), cfg.init_std, pdtype)

  def kernels(self) -> dict[str, jax.Array]:
    """Every layer's kernels ``{"q", "k", "v"}: [L, D, H, d]``, gathered from the stored heads."""
    return {m: jnp.take(getattr(self, m)[...], jnp.asarray(index), axis=0).transpose(0, 2, 1, 3)
            for m, index in zip(MATRICES, self.index)}


class Transformer(nnx.Module):
  """Decoder-only LM whose attention follows a sharing :class:`~jaxshare.schedule.Schedule`.

  Args:
    plan: the compiled model (:class:`~jaxshare.plan.ModelPlan`): dimensions and flavour, every layer's role grouped
      into superblocks, runs and stacks, the MLP width and the attention settings (``attention.impl``,
      ``score_sharing``, ``chain_dtype``: see :class:`~jaxshare.model.attention.Attention`).
    ties: head-wise sharing's head map, exactly when the schedule ties heads.

  Raises:
    ValueError: ``ties`` disagrees with the schedule.
  """

  def __init__(self, plan: ModelPlan, *, ties: HeadTies | None = None, rngs: nnx.Rngs):
    cfg, schedule = plan.model, plan.schedule
    pdtype, self.dtype = jnp.dtype(cfg.param_dtype), jnp.dtype(cfg.dtype)
    self.window = cfg.sliding_window
    self.embedding = nnx.Param(cfg.init_std * jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model),
                                                                pdtype), logical_axes=("vocab", "embed"))
    if (ties is None) != (schedule.tied_heads == 0):
      raise ValueError(f"schedule ties {schedule.tied_heads} heads; pass ties exactly when it ties any")
    self.head_table = HeadTable(cfg, ties, rngs) if ties is not None else None
    self.stacks = nnx.List([Stack(plan, stack, followed=i < len(schedule.stacks) - 1, rngs=rngs)
                            for i, stack in enumerate(schedule.stacks)])
    self.stack_plans = schedule.stacks
    self.final_norm = make_norm(cfg.features.norm, cfg.d_model, cfg.norm_eps, pdtype)
    self.lm_head = None if cfg.tie_embeddings else DenseGeneral(
      "btd,dv->btv", (cfg.d_model, cfg.vocab_size), ("embed", "vocab"), std=cfg.init_std, bias_shape=None,
      dtype=self.dtype, param_dtype=pdtype, rngs=rngs)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, segment_ids: jax.Array | None = None
               ) -> jax.Array:
    """Next-token logits.

    Args:
      tokens: ``[B, T]`` int32 token ids.
      positions: ``[B, T]`` int32 positions within each packed document (default ``arange(T)``).
      segment_ids: ``[B, T]`` int32 document ids (default: one document).

    Returns:
      ``[B, T, V]`` float32 logits.
    """
    return self._forward(tokens, positions, segment_ids, None)[0]

  def capture_logits(self, tokens: jax.Array, positions: jax.Array | None = None,
                     segment_ids: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Next-token logits and every layer's pre-softmax attention logits (unmasked, scaled by 1/sqrt(d); for a
    reusing layer the logits it used), for distillation and analysis. Arguments as :meth:`__call__`.

    Returns:
      ``([B, T, V] float32, [L, B, H, T, T] float32)``.
    """
    return self._forward(tokens, positions, segment_ids, "logits")

  def capture_mha(self, tokens: jax.Array, positions: jax.Array | None = None,
                  segment_ids: jax.Array | None = None) -> tuple[jax.Array, MHAActivations]:
    """Next-token logits and every layer's attention block in residual-stream terms (UniAttn's calibration).
    Arguments as :meth:`__call__`.

    Returns:
      ``([B, T, V] float32, MHAActivations of [L, B, T, D] arrays in the compute dtype)``.
    """
    return self._forward(tokens, positions, segment_ids, "mha")

  def capture_kv(self, tokens: jax.Array, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Next-token logits and the K/V every layer attended with, as its KV cache holds them (K after RoPE; a K/V
    consumer's are its producer's): KVSharer's calibration. Arguments as :meth:`__call__`; every layer must
    compute its own scores (a probability reuser has no K).

    Returns:
      ``([B, T, V] float32, (K, V) each [L, B, T, G, d] in the compute dtype)``.
    """
    return self._forward(tokens, positions, segment_ids, "kv")

  def final_hidden(self, tokens: jax.Array, positions: jax.Array | None = None,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """The final norm's output ``[B, T, D]`` in the compute dtype, which the LM head (:meth:`head_kernel`) maps to
    logits: for losses that never hold ``[B, T, V]`` (:func:`jaxshare.model.loss.tiled_cross_entropy`). Arguments
    as :meth:`__call__`."""
    return self.final_norm(self._forward(tokens, positions, segment_ids, None, hidden=True)[0]).astype(self.dtype)

  def head_kernel(self) -> jax.Array:
    """The LM head ``[D, V]`` in the compute dtype (the embedding transposed when tied), its embed dimension gathered
    as FSDP gathers a weight before use: left sharded, XLA contracts over the shards and all-reduces whole-sequence
    logits (2 GiB of float32 per 4000-entry tile at 128k tokens) instead of keeping them sharded by token."""
    w = self.embedding[...].T if self.lm_head is None else self.lm_head.kernel[...]
    return parallel.constrain(w, (None, "vocab")).astype(self.dtype)

  def _forward(self, tokens: jax.Array, positions: jax.Array | None, segment_ids: jax.Array | None,
               capture: str | None, hidden: bool = False) -> tuple[jax.Array, jax.Array | MHAActivations | None]:
    b, t = tokens.shape
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    if segment_ids is None:
      segment_ids = jnp.ones((b, t), jnp.int32)
    if context.active():  # the tokens in the load-balanced layout, every layer's keys read in order
      if capture:
        raise ValueError(f"capturing {capture} is not available under context parallelism (mesh.context > 1): "
                         "it would materialise every layer's [B, H, T, T] scores")
      tokens, positions = context.to_layout(tokens), context.to_layout(positions)
      segment_ids = context.whole_sequence(segment_ids)
    x = self._embed(tokens)
    captured: list[jax.Array] = []
    for stack, kernels in zip(self.stacks, self._stack_kernels()):
      x, ys = stack(x, positions, segment_ids, capture, kernels)
      captured.extend(ys)
    x = context.from_layout(x)
    out = x if hidden else self._logits(x)
    return out, (jax.tree.map(lambda *a: jnp.stack(a), *captured) if capture else None)

  def decode(self, tokens: jax.Array, cache: DecodeCache, nf: bool = False) -> tuple[jax.Array, DecodeCache]:
    """Append ``n`` tokens to the cache and return their next-token logits: prefill (the prompt, ``n`` = its
    padded length) and decode (``n = 1``) are the same computation.

    Args:
      tokens: ``[B, n]`` int32; row b's tokens before ``cache.start[b]`` are left padding.
      cache: :class:`~jaxshare.model.cache.DecodeCache` from :func:`~jaxshare.model.cache.init_cache`.
      nf: LISA's NF prefill (see :meth:`~jaxshare.model.attention.Attention.decode`): only on an empty cache.

    Returns:
      ``([B, n, V] float32 logits, the cache with the tokens written and its index advanced by n)``.
    """
    ctx = kv_cache.step_context(cache, tokens.shape[1], self.window)
    x = self._embed(tokens)
    rows = []
    for stack, bufs, kernels in zip(self.stacks, cache.buffers, self._stack_kernels()):
      x, new = stack.decode(x, ctx, bufs, kernels, nf)
      rows.append(new)
    return self._logits(x), kv_cache.write(cache, rows, tokens.shape[1], after=x)

  def _embed(self, tokens: jax.Array) -> jax.Array:
    # Gather the table's embed dimension first (FSDP's all-gather of a weight before use): a lookup straight from the
    # fsdp-sharded table gives rows sharded over embed, and the backward then cannot move the batch-sharded cotangent
    # there except by replicating all of it on every device (XLA's "involuntary full rematerialization").
    table = parallel.constrain(self.embedding[...], ("vocab", None))
    x = jnp.take(table, tokens, axis=0).astype(self.dtype)
    return parallel.constrain(x, ("activation_batch", "activation_length", "activation_embed"))

  def _stack_kernels(self) -> list[dict | None]:
    """Head-wise sharing's gathered kernels per stack, ``[count, superblock size, D, H, d]`` (None without)."""
    if self.head_table is None:
      return [None] * len(self.stacks)
    kernels = self.head_table.kernels()
    return [{m: w[p.start:p.start + p.count * p.superblock_size].reshape(p.count, p.superblock_size, *w.shape[1:])
             for m, w in kernels.items()} for p in self.stack_plans]

  def _logits(self, x: jax.Array) -> jax.Array:
    x = self.final_norm(x)
    if self.lm_head is None:
      logits = jnp.einsum("btd,vd->btv", x, self.embedding[...].astype(self.dtype))
    else:
      logits = self.lm_head(x)
    return parallel.constrain(logits.astype(jnp.float32), ("activation_batch", "activation_length",
                                                           "activation_vocab"))


def build_model(plan: ModelPlan, seed: int, ties: HeadTies | None = None) -> Transformer:
  """The NNX model of ``plan`` with parameters drawn from ``seed`` (``ties``: head-wise sharing's head map)."""
  return Transformer(plan, ties=ties, rngs=nnx.Rngs(seed))
