"""Decode attention: queries of the new tokens against two key blocks, the cache and the new rows.

A decode step attends over the cache (``[B, G, S, e]``, heads-major as :mod:`jaxshare.model.cache` stores it)
and the step's own rows (``[B, G, n, e]``) without joining them into one array, which would copy the cache. Logits
and probabilities span both blocks, ``[B, H, n, S + n]`` (cache columns first), and are what score-sharing layers
hand on within the step. :func:`attention` is the XLA computation; :func:`split_attention` runs the cache block
in the Pallas decode kernel (:mod:`jaxshare.kernels.flash_decode`) and merges the new rows in by log-sum-exp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxshare.kernels import flash_decode
from jaxshare.kernels.reference import from_heads_major, heads_major, masked_softmax

Blocks = tuple[jax.Array, ...]  # key or value blocks [B, G, S_i, e]: (cache, new rows)


def scores(q: jax.Array, k: Blocks, scale: float) -> jax.Array:
  """Unmasked logits ``scale · q kᵀ`` over the key blocks, concatenated.

  Args:
    q: ``[B, n, H, e]``; k: blocks ``[B, G, S_i, e]`` with G dividing H.

  Returns:
    ``[B, H, n, Σ S_i]`` float32.
  """
  b, n, h, _ = q.shape
  qg = heads_major(q, k[0].shape[1])
  logits = jnp.concatenate([jnp.einsum("bgme,bgse->bgms", qg, block, preferred_element_type=jnp.float32)
                            for block in k], axis=-1) * scale
  return logits.reshape(b, h, n, -1)


def apply_probs(probs: jax.Array, v: Blocks, dtype) -> jax.Array:
  """``[B, H, n, Σ S_i]`` probabilities times the value blocks ``[B, G, S_i, d]`` -> ``[B, n, H, d]`` in
  ``dtype`` (accumulated in float32)."""
  b, h, n, _ = probs.shape
  g = v[0].shape[1]
  pg = probs.reshape(b, g, h // g * n, -1)
  out, at = 0.0, 0
  for block in v:
    size = block.shape[2]
    out = out + jnp.einsum("bgms,bgsd->bgmd", pg[..., at:at + size].astype(block.dtype), block,
                           preferred_element_type=jnp.float32)
    at += size
  return from_heads_major(out, n).astype(dtype)


def attention(q: jax.Array, k: Blocks, v: Blocks, mask: jax.Array, *, scale: float, dtype) -> jax.Array:
  """Softmax attention of the new tokens over the blocks: ``q [B, n, H, e]``, ``mask [B, n, Σ S_i]`` bool (see
  :class:`jaxshare.model.cache.StepContext`) -> ``[B, n, H, d]`` in ``dtype``."""
  probs, _ = masked_softmax(scores(q, k, scale), mask)
  return apply_probs(probs, v, dtype)


def split_attention(q: jax.Array, k: Blocks, v: Blocks, mask: jax.Array, *, scale: float, dtype,
                    backend: str = "interpret", block_k: int | None = None) -> jax.Array:
  """:func:`attention` over ``(cache, new rows)`` with the cache block in the Pallas decode kernel: the two blocks'
  normalised outputs are merged by their log-sum-exps, ``o = Σ_i exp(lse_i − lse) o_i`` with ``lse =
  logaddexp(lse_cache, lse_new)`` (FlashAttention's online softmax over two blocks). A prefill (more than one new
  token per row) runs :func:`attention`: one matmul-bound pass that a split over keys does not help.

  Args: as :func:`attention`, plus the kernel's ``backend`` and key-block size (see
  :func:`jaxshare.kernels.flash_decode.cache_attention`).
  """
  if q.shape[1] != 1:
    return attention(q, k, v, mask, scale=scale, dtype=dtype)
  s = k[0].shape[2]
  out_c, lse_c = flash_decode.cache_attention(q, k[0], v[0], mask[..., :s], scale=scale, block_k=block_k,
                                              backend=backend)
  probs, lse_n = masked_softmax(scores(q, k[1:], scale), mask[..., s:])
  out_n = apply_probs(probs, v[1:], jnp.float32)
  lse = jnp.logaddexp(lse_c, lse_n)  # [B, H, n]
  weight = lambda part: jnp.exp(part - lse).transpose(0, 2, 1)[..., None]  # noqa: E731  [B, n, H, 1]
  return (weight(lse_c) * out_c + weight(lse_n) * out_n).astype(dtype)
