"""Pallas decode attention: the new tokens' queries against the KV cache, split over the key axis (flash-decoding:
Dao, Haziza, Massa and Sizov 2023, "Flash-Decoding for long-context inference").

A decode step has one query per row, too little work to fill a device when parallelised over batch and heads
alone. The kernel's grid is (batch, K/V head, key split): each program scores the ``H/G`` query heads that read
its K/V head against one block of cached keys and writes an unnormalised partial output with its
softmax statistics; :func:`cache_attention` then merges the splits exactly (the same log-sum-exp algebra as
FlashAttention's online softmax, done once across splits). GQA and MQA never repeat K/V.

The cache is read where it lies (``[B, G, S, e]``, heads-major as :mod:`jaxshare.model.cache` stores it): no
padding or copying per step, so S must divide into key blocks (see :func:`block_size`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxshare.kernels import tuning
from jaxshare.kernels.flash import _NT
from jaxshare.kernels.reference import _MASK_VALUE, from_heads_major, heads_major

_BLOCKS = (512, 256, 128)  # key-block sizes tried, largest first: multiples of a TPU lane row (128)
_MAX_SINGLE_BLOCK = 2048  # a cache with no such divisor runs as one block up to this length
_TRITON_MIN_ROWS = 16  # tl.dot needs 16 rows: query rows are padded up to it (cheap: one token per row)


def block_size(s: int) -> int | None:
  """The key-block size for a cache of ``s`` slots: the largest of 512, 256, 128 dividing it, else the whole cache
  when ``s`` ≤ 2048, else None (unsupported: the cache length should be a multiple of 128)."""
  for b in _BLOCKS:
    if s % b == 0:
      return b
  return s if s <= _MAX_SINGLE_BLOCK else None


def unsupported(q, k, v, *, backend: str) -> str | None:
  """Why the kernel cannot run ``q [B, n, H, e]`` against cache ``k [B, G, S, e]``, ``v [B, G, S, d]`` on
  ``backend``, or None."""
  s, e, d = k.shape[2], q.shape[3], v.shape[3]
  if block_size(s) is None:
    return f"cache length {s} has no key block (a multiple of 128, or at most {_MAX_SINGLE_BLOCK} slots)"
  if backend == "triton" and any(w & (w - 1) or w < 16 for w in (e, d)):
    return f"head widths {e}/{d} are not powers of two >= 16 (Triton tiles)"
  return None


def _kernel(q_ref, k_ref, v_ref, mask_ref, o_ref, m_ref, l_ref, *, scale: float):
  """One (row, K/V head, key block): partial softmax attention of the M = H/G query heads over the block."""
  s = lax.dot_general(q_ref[...], k_ref[...], _NT, preferred_element_type=jnp.float32) * scale  # [M, bk]
  valid = jnp.broadcast_to(mask_ref[...] != 0, s.shape)  # one mask row for every head (rows padded for Triton too)
  s = jnp.where(valid, s, _MASK_VALUE)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(valid, jnp.exp(s - m), 0.0)
  o_ref[...] = jnp.dot(p.astype(v_ref.dtype), v_ref[...], preferred_element_type=jnp.float32)
  m_ref[...] = m
  l_ref[...] = jnp.sum(p, axis=-1, keepdims=True)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, *, scale: float,
                    block_k: int | None = None, backend: str = "interpret") -> tuple[jax.Array, jax.Array]:
  """Softmax attention of one new token per row over the cache alone.

  Args:
    q: ``[B, 1, H, e]`` queries (post-RoPE). k: ``[B, G, S, e]``, v: ``[B, G, S, d]``, the cache, G dividing H.
    mask: ``[B, 1, S]`` bool, which slots the new token reads.
    scale: the logit scale. block_k: key-block size (default :func:`block_size`), dividing S.
    backend: ``interpret``, ``triton`` or ``mosaic_tpu``.

  Returns:
    ``(out [B, 1, H, d] float32, lse [B, H, 1] float32)``: ``out`` normalised over the cache's valid slots (0 and
    ``lse = -inf`` for a row with none), ready to merge with other key blocks.

  Raises:
    ValueError: more than one new token per row (a prefill runs in XLA: :func:`jaxshare.kernels.decode.attention`),
      ``block_k`` (or the default) does not divide S, or the shapes disagree.
  """
  b, n, h, e = q.shape
  _, g, s, d = v.shape
  if n != 1:
    raise ValueError(f"cache_attention: {n} new tokens per row; the decode kernel takes one (prefill runs in XLA)")
  block_k = block_k or block_size(s)
  if block_k is None or s % block_k:
    raise ValueError(f"cache_attention: key block {block_k} must divide the cache length {s}")
  if k.shape[:3] != (b, g, s) or mask.shape != (b, n, s) or h % g:
    raise ValueError(f"cache_attention: q {q.shape}, k {k.shape}, v {v.shape}, mask {mask.shape} disagree")
  rows = h // g
  qg = heads_major(q, g)  # [B, G, M, e]
  padded_rows = max(rows, _TRITON_MIN_ROWS) if backend == "triton" else rows
  if padded_rows != rows:
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
  splits = s // block_k
  at_block = lambda i, j, c: (i, j, c, 0)  # noqa: E731
  kernel = functools.partial(_kernel, scale=scale)
  stats = jax.ShapeDtypeStruct((b, g, splits, padded_rows, 1), jnp.float32)
  o, m, l = pl.pallas_call(
    kernel,
    grid=(b, g, splits),
    in_specs=[pl.BlockSpec((None, None, padded_rows, e), lambda i, j, c: (i, j, 0, 0)),
              pl.BlockSpec((None, None, block_k, e), at_block),
              pl.BlockSpec((None, None, block_k, d), at_block),
              pl.BlockSpec((None, 1, block_k), lambda i, j, c: (i, 0, c))],
    out_specs=[pl.BlockSpec((None, None, None, padded_rows, d), lambda i, j, c: (i, j, c, 0, 0)),
               pl.BlockSpec((None, None, None, padded_rows, 1), lambda i, j, c: (i, j, c, 0, 0)),
               pl.BlockSpec((None, None, None, padded_rows, 1), lambda i, j, c: (i, j, c, 0, 0))],
    out_shape=[jax.ShapeDtypeStruct((b, g, splits, padded_rows, d), jnp.float32), stats, stats],
    **tuning.pallas_params(backend, "jaxshare_flash_decode", d),
  )(qg, k, v, mask.astype(jnp.int32))
  o, m, l = o[..., :rows, :], m[..., :rows, 0], l[..., :rows, 0]  # [B, G, splits, M, (d)]
  # Merge the splits: weights exp(m_j - max m) · l_j; an all-masked split has l_j = 0 and adds nothing.
  top = jnp.max(m, axis=2)
  w = jnp.exp(m - top[:, :, None])
  total = jnp.sum(w * l, axis=2)  # [B, G, M]
  has = total > 0
  out = jnp.sum(w[..., None] * o, axis=2) / jnp.where(has, total, 1.0)[..., None]
  lse = jnp.where(has, top + jnp.log(jnp.where(has, total, 1.0)), -jnp.inf)
  return from_heads_major(out, n), lse.reshape(b, h, n)
