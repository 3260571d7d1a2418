"""XLA reference attention: grouped einsum (no K/V repeat), causal, sliding window, packed-sequence segment ids.

The source of truth every kernel is tested against. Score tensors use the layout ``[B, H, T, S]`` with query head
``h = g * (H/G) + j`` reading K/V head ``g`` (contiguous groups, as in GQA).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, causal: bool = True,
                   window: int = 0, q_start: jax.Array | int = 0) -> jax.Array:
  """Boolean ``[B, T, S]`` mask: query t may attend key s (same segment; s <= t when causal; t - s < window when
  ``window`` > 0, Mistral's sliding window: each query sees itself and the ``window - 1`` keys before it).
  ``q_start``: the position of the first query row (a chunk of the sequence's queries)."""
  mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  t, s = q_segment_ids.shape[1], kv_segment_ids.shape[1]
  offset = (q_start + jnp.arange(t))[:, None] - jnp.arange(s)[None, :]
  if causal:
    mask = mask & (offset >= 0)[None]
  if window:
    mask = mask & (offset < window)[None]
  return mask


def heads_major(x: jax.Array, groups: int) -> jax.Array:
  """``[B, T, H, e]`` -> ``[B, G, (H/G)·T, e]``: query heads grouped by the K/V head they read, each group's heads
  and positions merged into one row dimension.

  Every attention matmul then has one batch, one row and one contracting dimension, the form XLA's CPU dot
  library runs fastest (several row dimensions make XLA transpose an operand first, about 2x slower per matmul).
  """
  b, t, h, e = x.shape
  return x.reshape(b, t, groups, h // groups, e).transpose(0, 2, 3, 1, 4).reshape(b, groups, h // groups * t, e)


def from_heads_major(x: jax.Array, t: int) -> jax.Array:
  """Inverse of :func:`heads_major`: ``[B, G, R·T, e]`` -> ``[B, T, G·R, e]``."""
  b, g, m, e = x.shape
  return x.reshape(b, g, m // t, t, e).transpose(0, 3, 1, 2, 4).reshape(b, t, g * (m // t), e)


def documents_per_row(segment_ids: jax.Array) -> jax.Array:
  """The number of documents in each row of ``segment_ids`` (``[B, T]`` int32, documents in contiguous runs of one
  id): ``[B]`` int32."""
  return 1 + jnp.sum(segment_ids[:, 1:] != segment_ids[:, :-1], axis=1, dtype=jnp.int32)


def documents_fit(segment_ids: jax.Array, max_documents: int) -> jax.Array:
  """Whether every row of ``segment_ids`` (``[B, T]`` int32, documents in contiguous runs) holds at most
  ``max_documents`` documents: a traced scalar bool."""
  return jnp.all(documents_per_row(segment_ids) <= max_documents)


def self_attention_unsupported(q, k, v) -> str | None:
  """Why a library kernel that attends a sequence to itself (T = S: the training and prefill roles) and reads K and V
  by one head index (after :func:`same_kv_heads`) cannot take ``q [B,T,H,e]``, ``k [B,S,Gk,e]``, ``v [B,S,Gv,d]``
  (arrays or shape structs), or None."""
  if q.shape[1] != k.shape[1]:
    return f"queries ({q.shape[1]}) and keys ({k.shape[1]}) differ in length"
  if k.shape[2] != v.shape[2] and not (q.shape[2] % k.shape[2] == 0 and q.shape[2] % v.shape[2] == 0):
    return f"K ({k.shape[2]}) and V ({v.shape[2]}) heads cannot be regrouped to the {q.shape[2]} query heads"
  return None


def same_kv_heads(k: jax.Array, v: jax.Array, heads: int) -> tuple[jax.Array, jax.Array]:
  """``k [B,S,Gk,e]`` and ``v [B,S,Gv,d]`` repeated to one head count, for kernels that read both by one K/V head
  index (a probability reuser's V may have other heads than its source's K): the larger count when it is a multiple
  of the smaller, else ``heads`` (the query heads, a multiple of both). Query head h reads the same K and V rows."""
  gk, gv = k.shape[2], v.shape[2]
  if gk == gv:
    return k, v
  g = max(gk, gv) if max(gk, gv) % min(gk, gv) == 0 else heads
  return jnp.repeat(k, g // gk, axis=2), jnp.repeat(v, g // gv, axis=2)


def scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
  """Unmasked logits ``scale * q kᵀ``.

  Args:
    q: ``[B, T, H, e]``; k: ``[B, S, G, e]`` with G dividing H.

  Returns:
    ``[B, H, T, S]`` float32.
  """
  b, t, h, _ = q.shape
  s, g = k.shape[1], k.shape[2]
  logits = jnp.einsum("bgme,bgse->bgms", heads_major(q, g), k.transpose(0, 2, 1, 3),
                      preferred_element_type=jnp.float32) * scale
  return logits.reshape(b, h, t, s)


def masked_softmax(logits: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Softmax over keys after masking (``mask [B, T, S]``). Returns ``(probs [B,H,T,S], lse [B,H,T])`` in f32."""
  masked = jnp.where(mask[:, None], logits, _MASK_VALUE)
  lse = jax.nn.logsumexp(masked, axis=-1)
  return jnp.exp(masked - lse[..., None]), lse


def apply_probs(probs: jax.Array, v: jax.Array, dtype) -> jax.Array:
  """``[B, H, T, S]`` probabilities times ``[B, S, G, d]`` values -> ``[B, T, H, d]`` in ``dtype``."""
  b, h, t, s = probs.shape
  g = v.shape[2]
  pg = probs.reshape(b, g, h // g * t, s).astype(v.dtype)
  return from_heads_major(jnp.einsum("bgms,bgsd->bgmd", pg, v.transpose(0, 2, 1, 3)), t).astype(dtype)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0,
              return_lse: bool = False, q_offset: jax.Array | int = 0) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Softmax attention with grouped query heads.

  Args:
    q: ``[B, T, H, e]`` queries (already rotated).
    k: ``[B, S, G, e]`` keys (rotated); v: ``[B, S, G, d]`` values; G divides H, query head h reads K/V head
      ``h // (H/G)``. The query/key width e may differ from the value width d (LISA_plus's concatenated features).
    q_segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` int32 document ids of packed sequences; tokens only
      attend within their document.
    causal: mask future keys (key index > query index).
    scale: logit scale; default ``1/sqrt(e)``.
    window: sliding window (0: none); see :func:`attention_mask`.
    return_lse: also return the log-sum-exp of the masked logits, ``[B, H, T]`` float32 (the softmax statistics
      that probability-reusing layers recompute from).
    q_offset: the queries are tokens ``q_offset .. q_offset + T - 1`` of the keys' sequence (int32 scalar, traced
      or not; context parallelism's local query chunks): causal and window masks compare those positions.

  Returns:
    ``[B, T, H, d]`` in q's dtype (and the LSE). Logits and softmax are computed in float32.
  """
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  mask = attention_mask(q_segment_ids, kv_segment_ids, causal, window, q_start=q_offset)
  probs, lse = masked_softmax(scores(q, k, scale), mask)
  out = apply_probs(probs, v, q.dtype)
  return (out, lse) if return_lse else out


def attention_from_lse(q: jax.Array, k: jax.Array, lse: jax.Array, v: jax.Array, q_segment_ids: jax.Array,
                       kv_segment_ids: jax.Array, *, scale: float, causal: bool = True,
                       window: int = 0, q_offset: jax.Array | int = 0) -> jax.Array:
  """Apply another layer's softmax probabilities, recomputed as ``exp(scale q kᵀ - lse)``, to values ``v``.

  Same math as reusing the materialised probabilities (Shared Attention Alg. 1, UniAttn Eq. 3) without a softmax
  reduction; under ``jax.checkpoint`` (as the model uses it) nothing of size ``[B, H, T, S]`` is kept for the
  backward pass. Shapes and ``q_offset`` as :func:`attention`, ``lse [B, H, T]``.
  """
  probs = probs_from_lse(q, k, lse, attention_mask(q_segment_ids, kv_segment_ids, causal, window, q_start=q_offset),
                         scale)
  return apply_probs(probs, v, v.dtype)


def probs_from_lse(q: jax.Array, k: jax.Array, lse: jax.Array, mask: jax.Array, scale: float) -> jax.Array:
  """Softmax probabilities ``[B, H, T, S]`` recomputed from Q, K and the log-sum-exp (no softmax reduction)."""
  return jnp.where(mask[:, None], jnp.exp(scores(q, k, scale) - lse[..., None]), 0.0)
