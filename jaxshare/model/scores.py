"""Attention scores a layer hands on to the layers that reuse them, and how those layers read them.

Three forms, chosen by ``attention.score_sharing`` and the integrator:

- :class:`ScoreFeatures` (``recompute``): the features whose product *is* the producer's logits, ``scale · q kᵀ``
  computed in float32 from exactly the arrays the producer used, plus the producer's log-sum-exp. A probability
  reuser recomputes ``exp(scale · q kᵀ − lse)``: the producer's own softmax, to float32 rounding, in any compute
  dtype. A LISA chain (LISA_plus, DS) extends the features instead of adding logits: the sum of the low-rank deltas
  is one product of concatenated features ``[q·s_d, q_LR·s_r, …]·[k, k_LR, …]ᵀ`` (float32, scales folded in
  float32), held in a buffer of fixed width so that a chain of identical layers is one scan.
- :class:`AlignerChain` (``recompute`` with full LISA's ``ffn``/``linear`` aligners): the aligners mix heads per
  score cell, so no single product of features gives the chain's logits; the chain hands on the features of its
  source and of every layer's low-rank delta with the aligner weights, and each layer recomputes its logits query
  chunk by query chunk (:func:`chain_attention`), never holding ``[B, H, T, S]`` for the whole sequence.
- :class:`ScoreTensors` (``materialize``): the ``[B, H, T, S]`` logits or probabilities.

Shapes: B batch, T queries, S keys, H query heads, G K/V heads (query head h reads K/V head ``h // (H/G)``), e feature
width.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from flax import struct

from jaxshare import context
from jaxshare.config.choices import Integrator
from jaxshare.kernels import local_queries, reference, ring
from jaxshare.kernels.recompute import recomputed
from jaxshare.model.source_projection import SourceProjection

if TYPE_CHECKING:
  from jaxshare.kernels.dispatch import AttentionOps

LowRank = tuple[jax.Array, jax.Array]  # a LISA layer's delta features: q_LR [B, T, H, r], k_LR [B, S, G, r]


@struct.dataclass
class ScoreFeatures:
  """Logits ``scale · q kᵀ`` (float32) as features.

  Attributes:
    q: ``[B, T, H, e]`` queries (rotated), compute dtype or float32.
    k: ``[B, S, G, e]`` keys (rotated).
    lse: ``[B, H, T]`` float32 log-sum-exp of the masked logits (own-score producers; None in LISA chains).
    scale: the logit scale (static).
    source: what computes ``q`` and ``k`` from the source's input, through which probability reusers send their
      gradient (:mod:`~jaxshare.model.source_projection`; then ``q`` and ``k`` carry none); None: they send it to
      ``q`` and ``k``.
  """

  q: jax.Array
  k: jax.Array
  lse: jax.Array | None
  scale: float = struct.field(pytree_node=False)
  source: SourceProjection | None = None

  def reuse(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype) -> jax.Array:
    """Probability reuse (SA Alg. 1, UniAttn Eq. 3): ``exp(scale · q kᵀ − lse)`` applied to the reuser's
    ``v [B, S, G, d]`` by ``ops.attention_from_lse``, nothing ``[B, H, T, S]`` kept. Returns ``[B, T, H, d]`` in
    ``dtype``."""
    q, k = (self.q, self.k) if self.source is None else self.source.route(self.q, self.k)
    return ops.attention_from_lse(q, k, self.lse, v, segment_ids, segment_ids, scale=self.scale,
                                  window=window).astype(dtype)

  def extend(self, delta: LowRank | None, slot: jax.Array | int, integrator: Integrator,
             weights: tuple[jax.Array, ...]) -> ScoreFeatures:
    """A LISA_plus layer's logits (Eq. 4 with addition: its delta written into the feature slot at offset
    ``slot``); a DS layer's (no delta) are its source's.

    Raises:
      ValueError: an ``ffn``/``linear`` aligner, which mixes heads per logit and so needs an :class:`AlignerChain`
        or materialised logits (:func:`chain_entry` chooses).
    """
    del weights  # addition has none
    if integrator not in (Integrator.ADD, Integrator.NONE):
      raise ValueError(f"the {integrator} aligner mixes materialised logits; see scores.chain_entry")
    return self if delta is None else add_low_rank(self, *delta, slot)

  def attend(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype,
             features_dtype=None) -> jax.Array:
    """A LISA_plus/DS chain's causal attention: one ``ops.attention`` over the concatenated features, read as
    ``features_dtype`` (None: as held, float32) and applied to ``v [B, S, G, d]``. Returns ``[B, T, H, d]`` in
    ``dtype``."""
    q, k = self.q, self.k
    if features_dtype is not None:
      q, k = q.astype(features_dtype), k.astype(features_dtype)
    out = ops.attention(q, k, regroup(v, k.shape[2]), segment_ids, segment_ids, causal=True, scale=self.scale,
                        window=window)
    return out.astype(dtype)


@struct.dataclass
class ScoreTensors:
  """Materialised ``[B, H, T, S]`` float32 unmasked logits and/or masked probabilities (None when not needed)."""

  logits: jax.Array | None = None
  probs: jax.Array | None = None

  def reuse(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype) -> jax.Array:
    """Probability reuse of the materialised probabilities: ``probs · v`` (``v [B, S, G, d]``), ``[B, T, H, d]`` in
    ``dtype`` (the mask and window are already in the probabilities).

    Raises:
      ValueError: these scores were handed on as logits only.
    """
    del segment_ids, window
    if self.probs is None:
      raise ValueError("these scores were handed on as logits only; a probability reuser needs probabilities")
    return ops.apply_probs(self.probs, v, dtype)

  def extend(self, delta: LowRank | None, slot: jax.Array | int, integrator: Integrator,
             weights: tuple[jax.Array, ...]) -> ScoreTensors:
    """A LISA-family layer's logits (LISA Eq. 3-4, :func:`integrate`) from these materialised ones."""
    del slot
    a = logits(self)
    if delta is not None:
      q_lr, k_lr = delta
      a = integrate(integrator, a, reference.scores(q_lr, k_lr, q_lr.shape[-1] ** -0.5), weights)
    return ScoreTensors(logits=a)

  def attend(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype,
             features_dtype=None) -> jax.Array:
    """Causal softmax attention of the materialised logits applied to ``v [B, S, G, d]``: ``[B, T, H, d]`` in
    ``dtype``."""
    del features_dtype
    return ops.logits_attention(logits(self), v, segment_ids, window=window, dtype=dtype)[0]


@struct.dataclass
class AlignerChain:
  """A full-LISA chain as features (LISA Eq. 3-4 with the ffn or linear aligner), ``N`` layer slots.

  Attributes:
    q: ``[B, T, H, e]`` float32 source queries, logit scale folded in; k: ``[B, S, G, e]`` float32 source keys.
    q_lr: ``[N, B, T, H, r]`` float32 low-rank queries, ``1/√r`` folded in; k_lr: ``[N, B, S, H, r]`` float32.
    weights: per slot aligner weights: ffn ``(W_in [N, 2H, hidden], W_out [N, hidden, H])``, linear
      ``(W [N, 2H, H],)``.
    last: int32 scalar, the slot whose logits this state stands for (the layer that handed it on; -1: the source).
    integrator: ``ffn`` or ``linear`` (static).
  """

  q: jax.Array
  k: jax.Array
  q_lr: jax.Array
  k_lr: jax.Array
  weights: tuple[jax.Array, ...]
  last: jax.Array
  integrator: str = struct.field(pytree_node=False)

  def reuse(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype) -> jax.Array:
    """Raises ValueError: no schedule reuses a LISA chain's probabilities (the schedule compiler refuses it)."""
    raise ValueError("a LISA chain hands on logits; no layer reuses its probabilities")

  def extend(self, delta: LowRank | None, slot: jax.Array | int, integrator: Integrator,
             weights: tuple[jax.Array, ...]) -> AlignerChain:
    """A full-LISA layer's logits (Eq. 3-4): its delta and aligner written into ``slot`` (:func:`append_aligner`).

    Raises:
      ValueError: a layer without a low-rank delta (every ffn/linear layer has one).
    """
    del integrator  # the chain's own
    if delta is None:
      raise ValueError("a full-LISA aligner chain layer needs its low-rank delta")
    return append_aligner(self, slot, *delta, weights)

  def attend(self, ops: AttentionOps, v: jax.Array, segment_ids: jax.Array, *, window: int, dtype,
             features_dtype=None) -> jax.Array:
    """Causal attention of slot ``last``'s logits, recomputed per query chunk (:func:`chain_attention`):
    ``[B, T, H, d]`` in ``dtype``."""
    del features_dtype  # the chain's logits exist in no kernel's contract: XLA, chunk by chunk
    if context.active():
      attend = _ring_chain_attention if ops.ring else _context_chain_attention
      return attend(self, v, segment_ids, window).astype(dtype)
    return chain_attention(self, v, segment_ids, segment_ids, window).astype(dtype)


ScoreState = ScoreFeatures | ScoreTensors | AlignerChain

QUERY_CHUNK = 128  # rows of a full-LISA layer's logits alive at once: [B, H, 128, S] float32 and the aligner hidden


def integrate(integrator: str, a_prev: jax.Array, a_delta: jax.Array, weights: tuple[jax.Array, ...]) -> jax.Array:
  """LISA Eq. 4 on ``[B, H, T, S]`` float32 logits: ``add`` (LISA_plus) or the aligner mixing heads per (t, s) cell,
  ``linear`` ``[A_{n-1}; A_Δ] W`` or ``ffn`` ``relu([A_{n-1}; A_Δ] W_in) W_out``, before any masking."""
  if integrator == "add":
    return a_prev + a_delta
  z = jnp.concatenate([a_prev, a_delta], axis=1)  # [B, 2H, T, S]
  if integrator == "linear":
    return jnp.einsum("bets,eh->bhts", z, weights[0].astype(jnp.float32))
  hidden = jax.nn.relu(jnp.einsum("bets,ef->bfts", z, weights[0].astype(jnp.float32)))
  return jnp.einsum("bfts,fh->bhts", hidden, weights[1].astype(jnp.float32))


def _chain_rows(state: AlignerChain, q: jax.Array, q_lr: jax.Array) -> jax.Array:
  """Logits ``[B, H, c, S]`` of the chain's slot ``state.last`` for query rows ``q [B, c, H, e]``,
  ``q_lr [N, B, c, H, r]``: the source's, then each slot's aligner in order (later slots pass the logits through)."""
  def slot(a, xs):  # a scan over slots: the program does not grow with the chain's length
    n, q_lr_n, k_lr_n, weights = xs
    integrated = integrate(state.integrator, a, reference.scores(q_lr_n, k_lr_n, 1.0), weights)
    return jnp.where(n <= state.last, integrated, a), None

  slots = jnp.arange(state.q_lr.shape[0])
  a, _ = jax.lax.scan(slot, reference.scores(q, state.k, 1.0), (slots, q_lr, state.k_lr, state.weights))
  return a


def chain_attention(state: AlignerChain, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                    window: int = 0, q_offset: jax.Array | int = 0, return_lse: bool = False
                    ) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Causal softmax attention of the chain's logits (slot ``state.last``) applied to ``v [B, S, G, d]``, computed in
  query chunks of :data:`QUERY_CHUNK` rows, each recomputed in the backward pass
  (:func:`~jaxshare.kernels.recompute.recomputed`: a chunk's logits are never kept, whatever an enclosing
  checkpoint's policy keeps). ``q_segment_ids [B, T]``, ``kv_segment_ids [B, S]``: the documents; the queries are
  tokens ``q_offset ..`` of the keys' sequence (context parallelism's query chunks). Returns ``[B, T, H, d]`` float32
  (and with ``return_lse`` the log-sum-exp ``[B, H, T]`` float32 of the masked logits)."""
  b, t, h, _ = state.q.shape
  chunk = min(QUERY_CHUNK, t)
  n = -(-t // chunk)
  pad = n * chunk - t

  def split(x: jax.Array, axis: int) -> jax.Array:  # [.., T, ..] -> [n, .., chunk, ..]
    x = jnp.pad(x, [(0, pad if i == axis else 0) for i in range(x.ndim)])
    x = x.reshape(*x.shape[:axis], n, chunk, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)

  @recomputed
  def rows(start, q, q_lr, q_seg, state, v, kv_seg):
    mask = reference.attention_mask(q_seg, kv_seg, True, window, q_start=start)
    probs, lse = reference.masked_softmax(_chain_rows(state, q, q_lr), mask)
    return reference.apply_probs(probs, v, jnp.float32), lse

  starts = jnp.arange(n, dtype=jnp.int32) * chunk + jnp.asarray(q_offset, jnp.int32)
  out, lse = jax.lax.map(lambda xs: rows(*xs, state, v, kv_segment_ids),
                         (starts, split(state.q, 1), split(state.q_lr, 2), split(q_segment_ids, 1)))
  out = jnp.moveaxis(out, 0, 1).reshape(b, n * chunk, h, -1)[:, :t]
  if not return_lse:
    return out
  return out, jnp.moveaxis(lse, 0, 2).reshape(b, h, n * chunk)[..., :t]


def _context_chain_attention(state: AlignerChain, v: jax.Array, segment_ids: jax.Array, window: int) -> jax.Array:
  """:func:`chain_attention` under context parallelism: each device's query chunks (``q``, ``q_lr`` in the layout)
  against the chain's gathered keys (:func:`jaxshare.kernels.local_queries.local_queries`), heads whole."""
  q_axes = ("activation_batch", "activation_length", None, None)
  gathered = lambda x: (context.GATHERED[0],) + (None,) * (x.ndim - 1)  # noqa: E731  heads whole
  stacked = lambda x: (None, context.GATHERED[0]) + (None,) * (x.ndim - 2)  # noqa: E731

  def kernel(q, q_lr, k, k_lr, weights, last, v, segments, offset):
    chunk = AlignerChain(q, k, q_lr, k_lr, weights, last, state.integrator)
    q_segments = jax.lax.dynamic_slice_in_dim(segments, offset, q.shape[1], axis=1)
    return chain_attention(chunk, v, q_segments, segments, window, q_offset=offset)

  return local_queries.local_queries(
    kernel, [(state.q, q_axes), (state.q_lr, (None, "activation_batch", "activation_length", None, None))],
    [(state.k, gathered(state.k), 1), (state.k_lr, stacked(state.k_lr), 2), (state.weights, None, None),
     (state.last, (), None), (v, gathered(v), 1), (segment_ids, ("activation_batch", None), None)], q_axes,
    query_axis=(1, 2), out_query_axis=1)


def _ring_chain_attention(state: AlignerChain, v: jax.Array, segment_ids: jax.Array, window: int) -> jax.Array:
  """:func:`chain_attention` round the context ring (:mod:`jaxshare.kernels.ring`): each device's query chunks
  (``q``, ``q_lr``) stay, the chain's keys (``k``, ``k_lr``) and the layer's ``v`` travel (all in the layout, sharded
  along the sequence), heads whole; chunk pairs combine by their log-sum-exp."""
  length = ("activation_batch", "activation_length", None, None)
  stacked = (None, *length, None)

  def block(q_side, kv, extras, q_seg, k_seg, offset):
    (q, q_lr), (k, k_lr, v), (weights, last) = q_side, kv, extras
    chunk = AlignerChain(q, k, q_lr, k_lr, weights, last, state.integrator)
    return chain_attention(chunk, v, q_seg, k_seg, window, q_offset=offset, return_lse=True)

  out, _ = ring.ring_attention(
    block, [(state.q, length, 1), (state.q_lr, stacked, 2)], [(state.k, length, 1), (state.k_lr, stacked, 2),
                                                              (v, length, 1)],
    (state.weights, state.last), segment_ids, (length, ("activation_batch", None, "activation_length")), merge=True,
    window=window)
  return out


def append_aligner(state: AlignerChain, slot: jax.Array | int, q_lr: jax.Array, k_lr: jax.Array,
                   weights: tuple[jax.Array, ...]) -> AlignerChain:
  """Write a layer's low-rank features (``q_lr [B,T,H,r]``, ``k_lr [B,S,G,r]``) and aligner weights into ``slot``;
  the state then stands for that layer's logits."""
  rank = q_lr.shape[-1]
  put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x.astype(buf.dtype), slot, 0)  # noqa: E731
  return AlignerChain(state.q, state.k, put(state.q_lr, q_lr.astype(jnp.float32) * jnp.float32(rank ** -0.5)),
                      put(state.k_lr, regroup(k_lr, state.q.shape[2])),
                      tuple(put(buf, w) for buf, w in zip(state.weights, weights)), jnp.asarray(slot, jnp.int32),
                      state.integrator)


def logits(state: ScoreState) -> jax.Array:
  """The unmasked logits ``[B, H, T, S]`` (float32) of a score state."""
  if isinstance(state, AlignerChain):  # materialised: all rows at once
    return _chain_rows(state, state.q, state.q_lr)
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


def chain_entry(state: ScoreState, *, integrator: str, num_kv_heads: int, slots: int, rank: int, recompute: bool,
                hidden: int = 0) -> ScoreState:
  """The carry a run of ``slots`` LISA-family layers (``integrator``, ``num_kv_heads`` K/V heads, rank, aligner
  ``hidden`` width) starts from, given the state of the layer before the run.

  With ``recompute`` and features in hand, LISA_plus and DS chains stay features: K is regrouped to
  ``lcm(G_in, G)`` heads (per-layer GQA), and LISA_plus appends ``slots`` zero slots of width ``rank`` that the run's
  layers fill in order, after folding every scale into float32 features (so the chain's logits equal the
  materialised sum of logits to float32 rounding in bf16 too). Full LISA chains (ffn/linear) become, or extend, an
  :class:`AlignerChain` with ``slots`` empty slots. Otherwise the chain carries materialised logits.
  """
  if recompute and integrator in ("ffn", "linear") and isinstance(state, (ScoreFeatures, AlignerChain)):
    return _aligner_entry(state, integrator, slots, rank, hidden)
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


def _aligner_entry(state: ScoreFeatures | AlignerChain, integrator: str, slots: int, rank: int,
                   hidden: int) -> ScoreState:
  if isinstance(state, AlignerChain) and state.integrator != integrator:  # another aligner kind: materialise
    return ScoreTensors(logits=logits(state))
  if isinstance(state, ScoreFeatures):
    state = AlignerChain(state.q.astype(jnp.float32) * jnp.float32(state.scale), state.k.astype(jnp.float32),
                         *_empty_slots(state.q, state.k, 0, rank, hidden, integrator), jnp.asarray(-1, jnp.int32),
                         integrator)
  q_lr, k_lr, weights = _empty_slots(state.q, state.k, slots, rank, hidden, integrator)
  join = lambda a, b: jnp.concatenate([a, b])  # noqa: E731
  return AlignerChain(state.q, state.k, join(state.q_lr, q_lr), join(state.k_lr, k_lr),
                      tuple(join(a, b) for a, b in zip(state.weights, weights)), state.last, integrator)


def _empty_slots(q: jax.Array, k: jax.Array, slots: int, rank: int, hidden: int, integrator: str):
  """Zero query and key slots (the keys' batch and length are the keys' own: gathered copies under context
  parallelism, :func:`jaxshare.context.gather_keys`) and aligner weights."""
  b, t, h, _ = q.shape
  shapes = [(2 * h, hidden), (hidden, h)] if integrator == "ffn" else [(2 * h, h)]
  return (jnp.zeros((slots, b, t, h, rank), jnp.float32), jnp.zeros((slots, k.shape[0], k.shape[1], h, rank),
                                                                     jnp.float32),
          tuple(jnp.zeros((slots, *shape), jnp.float32) for shape in shapes))


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
