"""Attention scores a layer hands on to the layers that reuse them, and how those layers read them.

Two forms, chosen by ``attention.score_sharing``:

- :class:`ScoreFeatures` (``recompute``): the features whose product *is* the producer's logits, ``scale · q kᵀ``
  computed in float32 from exactly the arrays the producer used, plus the producer's log-sum-exp. A probability
  reuser recomputes ``exp(scale · q kᵀ − lse)``: the producer's own softmax, to float32 rounding, in any compute
  dtype. A LISA chain (LISA_plus, DS) extends the features instead of adding logits: the sum of the low-rank deltas
  is one product of concatenated features ``[q·s_d, q_LR·s_r, …]·[k, k_LR, …]ᵀ`` (float32, scales folded in
  float32), held in a buffer of fixed width so that a chain of identical layers is one scan.
- :class:`ScoreTensors` (``materialize``, and the full LISA aligners): the ``[B, H, T, S]`` logits or probabilities.

Shapes: B batch, T queries, S keys, H query heads, G K/V heads (query head h reads K/V head ``h // (H/G)``), e feature
width.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from jaxshare.kernels import reference


@struct.dataclass
class ScoreFeatures:
  """Logits ``scale · q kᵀ`` (float32) as features.

  Attributes:
    q: ``[B, T, H, e]`` queries (rotated), compute dtype or float32.
    k: ``[B, S, G, e]`` keys (rotated).
    lse: ``[B, H, T]`` float32 log-sum-exp of the masked logits (own-score producers; None in LISA chains).
    scale: the logit scale (static).
  """

  q: jax.Array
  k: jax.Array
  lse: jax.Array | None
  scale: float = struct.field(pytree_node=False)


@struct.dataclass
class ScoreTensors:
  """Materialised ``[B, H, T, S]`` float32 unmasked logits and/or masked probabilities (None when not needed)."""

  logits: jax.Array | None = None
  probs: jax.Array | None = None


ScoreState = ScoreFeatures | ScoreTensors


def logits(state: ScoreState) -> jax.Array:
  """The unmasked logits ``[B, H, T, S]`` (float32) of a score state."""
  if isinstance(state, ScoreTensors):
    if state.logits is None:
      raise ValueError("these scores were handed on as probabilities only; their logits are not available")
    return state.logits
  return reference.scores(state.q, state.k, state.scale)


def probs(state: ScoreState, mask: jax.Array) -> jax.Array:
  """The masked probabilities ``[B, H, T, S]`` (float32); ``mask [B, T, S]``. From features with an LSE they are
  ``exp(logits − lse)`` (Shared Attention Alg. 1 / UniAttn Eq. 3 without a softmax reduction)."""
  if isinstance(state, ScoreTensors) and state.probs is not None:
    return state.probs
  if isinstance(state, ScoreFeatures) and state.lse is not None:
    return reference.probs_from_lse(state.q, state.k, state.lse, mask, state.scale)
  return reference.masked_softmax(logits(state), mask)[0]


def regroup(x: jax.Array, num_heads: int) -> jax.Array:
  """``[B, S, G, e]`` K or V heads repeated to ``num_heads`` (a multiple of G): query head h reads the same head
  under either grouping."""
  g = x.shape[2]
  if num_heads % g:
    raise ValueError(f"cannot regroup {g} K/V heads into {num_heads}")
  return x if g == num_heads else jnp.repeat(x, num_heads // g, axis=2)


def chain_entry(state: ScoreState, *, integrator: str, num_kv_heads: int, slots: int, rank: int,
                recompute: bool) -> ScoreState:
  """The carry a run of ``slots`` LISA-family layers (``integrator``, ``num_kv_heads`` K/V heads) starts from, given
  the state of the layer before the run.

  With ``recompute`` and features in hand, LISA_plus and DS chains stay features: K is regrouped to
  ``lcm(G_in, G)`` heads (per-layer GQA), and LISA_plus appends ``slots`` zero slots of width ``rank`` that the run's
  layers fill in order, after folding every scale into float32 features (so the chain's logits equal the
  materialised sum of logits to float32 rounding in bf16 too). Otherwise the chain carries materialised logits.
  """
  if not (recompute and isinstance(state, ScoreFeatures) and integrator in ("add", "none")):
    return ScoreTensors(logits=logits(state))
  heads = math.lcm(state.k.shape[2], num_kv_heads)
  k = regroup(state.k, heads)
  if integrator == "none":
    return ScoreFeatures(state.q, k, None, state.scale)
  q = state.q.astype(jnp.float32) * jnp.float32(state.scale)
  width = slots * rank
  q = jnp.concatenate([q, jnp.zeros((*q.shape[:-1], width), jnp.float32)], axis=-1)
  k = jnp.concatenate([k.astype(jnp.float32), jnp.zeros((*k.shape[:-1], width), jnp.float32)], axis=-1)
  return ScoreFeatures(q, k, None, 1.0)


def add_low_rank(state: ScoreFeatures, q_lr: jax.Array, k_lr: jax.Array, offset: jax.Array | int) -> ScoreFeatures:
  """LISA_plus (Eq. 4 with addition): ``A_n = A_{n-1} + q_LR k_LRᵀ/√r`` written into the chain's feature slot at
  ``offset`` (``q_lr [B,T,H,r]``, ``k_lr [B,S,G,r]``; the slot's scale ``1/√r`` folded into q in float32)."""
  rank = q_lr.shape[-1]
  q_slot = q_lr.astype(jnp.float32) * jnp.float32(rank ** -0.5)
  k_slot = regroup(k_lr, state.k.shape[2]).astype(jnp.float32)
  zero = jnp.zeros((), jnp.int32)
  offset = jnp.asarray(offset, jnp.int32)
  q = jax.lax.dynamic_update_slice(state.q, q_slot, (zero, zero, zero, offset))
  k = jax.lax.dynamic_update_slice(state.k, k_slot, (zero, zero, zero, offset))
  return ScoreFeatures(q, k, None, state.scale)
