"""Splash attention (jax's Pallas TPU kernel, as MaxText runs it) behind the attention contract.

``jax.experimental.pallas.ops.tpu.splash_attention`` takes one sequence at a time, ``q [H, T, e]`` pre-scaled,
``k [G, S, e]``, ``v [G, S, d]`` with query head h reading K/V head ``h // (H/G)`` (GQA without repeating K/V),
per-token segment ids and a static mask (causal, local window) whose all-masked tiles it skips. Here the batch is a
``vmap`` and sequences are padded to its 128-token tiles, the padding given a segment of its own.

Probability reuse runs as attention with the source layer's scores: ``softmax(s·q_src k_srcᵀ) V_consumer`` is
exactly the probabilities a Shared Attention / UniAttn consumer applies (SA Alg. 1, UniAttn Eq. 3), recomputed by
the kernel, whose backward then gives the gradients of the source's Q and K and the consumer's V. The kernel's
log-sum-exp residual has no gradient (``save_residuals`` refuses autodiff), so this path hands on no LSE and its
reuse never reads one.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernel_lib
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib

from jaxshare.kernels import reference

_TILE = 128  # BlockSizes.get_default(): every block 128 tokens


def unsupported(q, k, v) -> str | None:
  """Why splash cannot run ``q [B,T,H,e]``, ``k [B,S,Gk,e]``, ``v [B,S,Gv,d]`` (arrays or shape structs), or None.

  Splash attends a sequence to itself (T = S: the training and prefill roles) with K and V of one head count."""
  return reference.self_attention_unsupported(q, k, v)


def _mask(length: int, heads: int, causal: bool, window: int) -> mask_lib.MultiHeadMask:
  if window:
    one = mask_lib.LocalMask((length, length), (window - 1, 0 if causal else window - 1), offset=0)
  elif causal:
    one = mask_lib.CausalMask((length, length))
  else:
    one = mask_lib.FullMask((length, length))
  return mask_lib.MultiHeadMask([one] * heads)


def _kernel(length: int, heads: int, causal: bool, window: int, interpret: bool):
  """The splash kernel for a (padded length, heads, mask). Built per trace: the kernel holds its mask's tile tables
  as arrays, which a cache kept across traces would leak as tracers."""
  return kernel_lib.make_splash_mha(_mask(length, heads, causal, window), head_shards=1, q_seq_shards=1,
                                    block_sizes=kernel_lib.BlockSizes.get_default(), interpret=interpret)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0, return_lse: bool = False,
              interpret: bool = False) -> jax.Array | tuple[jax.Array, None]:
  """Softmax attention by the splash kernel; the contract of :func:`jaxshare.kernels.reference.attention`
  (``q [B,T,H,e]``, ``k [B,S,G,e]``, ``v [B,S,G,d]``, segment ids ``[B,T]`` int32; output ``[B,T,H,d]`` in q's
  dtype), except that ``return_lse`` returns ``(out, None)``: see the module docstring.

  Args:
    interpret: run the kernel in Pallas interpret mode (any platform; how the CPU tests prove it).

  Raises:
    ValueError: a shape :func:`unsupported` names.
  """
  if reason := unsupported(q, k, v):
    raise ValueError(f"splash attention cannot run these shapes: {reason}")
  b, t, h, e = q.shape
  scale = e ** -0.5 if scale is None else scale
  k, v = reference.same_kv_heads(k, v, h)
  pad = -t % _TILE
  # padded tokens form a segment of their own (one below every real id), so each padded query sees a padded key
  pad_id = jnp.minimum(q_segment_ids.min(), kv_segment_ids.min()) - 1
  widen = lambda x: jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))  # noqa: E731
  seg = lambda s: jnp.pad(s, ((0, 0), (0, pad)), constant_values=pad_id)  # noqa: E731
  heads_major = lambda x: widen(x).transpose(0, 2, 1, 3)  # noqa: E731  [B, T, N, e] -> [B, N, T + pad, e]
  splash = _kernel(t + pad, h, causal, window, interpret)
  one = lambda q, k, v, qs, ks: splash(q, k, v, segment_ids=kernel_lib.SegmentIds(qs, ks))  # noqa: E731
  out = jax.vmap(one)(heads_major(q * jnp.asarray(scale, q.dtype)), heads_major(k), heads_major(v),
                      seg(q_segment_ids), seg(kv_segment_ids))
  out = out.transpose(0, 2, 1, 3)[:, :t].astype(q.dtype)
  return (out, None) if return_lse else out

