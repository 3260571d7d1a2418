"""XLA reference attention: grouped einsum (no K/V repeat), causal, packed-sequence segment ids.

The source of truth every kernel is tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def attention_mask(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, causal: bool = True) -> jax.Array:
  """Boolean ``[B, T, S]`` mask: query t may attend key s (same segment, and s <= t when causal)."""
  mask = q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  if causal:
    t, s = q_segment_ids.shape[1], kv_segment_ids.shape[1]
    mask = mask & (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
  return mask


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True) -> jax.Array:
  """Softmax attention with grouped query heads.

  Args:
    q: ``[B, T, H, d]`` queries (already rotated).
    k, v: ``[B, S, G, d]`` keys (rotated) and values; G divides H, query head h reads K/V head ``h // (H/G)``.
    q_segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` int32 document ids of packed sequences; tokens only
      attend within their document.
    causal: mask future keys (key index > query index).

  Returns:
    ``[B, T, H, d]`` in q's dtype. Logits and softmax are computed in float32 with scale ``1/sqrt(d)``.
  """
  b, t, h, d = q.shape
  g = k.shape[2]
  qg = q.reshape(b, t, g, h // g, d)
  logits = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(float(d))
  mask = attention_mask(q_segment_ids, kv_segment_ids, causal)[:, None, None]
  logits = jnp.where(mask, logits, _MASK_VALUE)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v)
  return out.reshape(b, t, h, d).astype(q.dtype)
