"""XLA attention with a FlashAttention-style backward pass: keeps O(T) softmax statistics, not ``[B, H, T, S]``.

Autodiff of :func:`jaxshare.kernels.reference.attention` saves the probabilities and the mask for the backward pass;
under the layer ``scan`` those residuals are stacked per layer (``[L, B, H, T, S]``, zero-filled, then written and
read back), which costs more than the attention math itself on a CPU. Here the forward saves ``q, k, v, out, lse``
and the backward recomputes ``P = exp(s·qkᵀ − lse)`` (FlashAttention-2, Dao 2023, Alg. 2, untiled):

  dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ∘ (dP − D + dlse),   D = rowsum(dO ∘ O),   dQ = s·dS K,   dK = s·dSᵀ Q

where ``dlse`` is the cotangent of the returned log-sum-exp (probability reusers read it: ∂lse/∂S = P). Same forward
numbers as the reference bit for bit; gradients equal to float32 rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxshare.kernels import reference


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attention(q, k, v, q_segment_ids, kv_segment_ids, q_offset, causal, scale, window):
  return _forward(q, k, v, q_segment_ids, kv_segment_ids, q_offset, causal, scale, window)[0]


def _forward(q, k, v, q_segment_ids, kv_segment_ids, q_offset, causal, scale, window):
  mask = reference.attention_mask(q_segment_ids, kv_segment_ids, causal, window, q_start=q_offset)
  probs, lse = reference.masked_softmax(reference.scores(q, k, scale), mask)
  out = reference.apply_probs(probs, v, q.dtype)
  return (out, lse), (q, k, v, q_segment_ids, kv_segment_ids, q_offset, out, lse)


def _backward(causal, scale, window, res, cotangents):
  q, k, v, q_segment_ids, kv_segment_ids, q_offset, out, lse = res
  d_out, d_lse = cotangents
  delta = jnp.einsum("bthd,bthd->bht", d_out.astype(jnp.float32), out.astype(jnp.float32)) - d_lse
  return (*_grads(q, k, v, q_segment_ids, kv_segment_ids, q_offset, lse, delta, d_out, causal, scale, window), None,
          None, None)


def _grads(q, k, v, q_segment_ids, kv_segment_ids, q_offset, lse, delta, d_out, causal, scale, window):
  """``(dQ, dK, dV)`` from the log-sum-exp and ``delta = rowsum(dO ∘ O) - dlse`` (``[B, H, T]`` float32)."""
  b, t, h, _ = q.shape
  s, g = k.shape[1], k.shape[2]
  mask = reference.attention_mask(q_segment_ids, kv_segment_ids, causal, window, q_start=q_offset)
  probs = reference.probs_from_lse(q, k, lse, mask, scale)  # [B, H, T, S] f32, zero where masked
  rows = lambda x: x.reshape(b, g, h // g * t, s)  # noqa: E731  [B, H, T, S] -> [B, G, R·T, S], free
  do_h = reference.heads_major(d_out, g)  # [B, G, R·T, d]
  # dV and dK come out transposed ([B, G, d, S]): contracting the rows of both operands in that order is the
  # orientation XLA's CPU dots run ~2x faster than [B, G, S, d]; the transpose back is needed either way.
  d_vt = jnp.einsum("bgms,bgmd->bgds", rows(probs).astype(v.dtype), do_h.astype(v.dtype),
                    preferred_element_type=jnp.float32)
  d_p = jnp.einsum("bgmd,bgsd->bgms", do_h, v.transpose(0, 2, 1, 3), preferred_element_type=jnp.float32)
  d_s = probs * (d_p.reshape(b, h, t, s) - delta[..., None]) * scale
  d_q = jnp.einsum("bgms,bgse->bgme", rows(d_s).astype(k.dtype), k.transpose(0, 2, 1, 3),
                   preferred_element_type=jnp.float32)
  d_kt = jnp.einsum("bgms,bgme->bges", rows(d_s).astype(q.dtype), reference.heads_major(q, g),
                    preferred_element_type=jnp.float32)
  return (reference.from_heads_major(d_q, t).astype(q.dtype), d_kt.transpose(0, 3, 1, 2).astype(k.dtype),
          d_vt.transpose(0, 3, 1, 2).astype(v.dtype))


_attention.defvjp(_forward, _backward)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
              *, causal: bool = True, scale: float | None = None, window: int = 0,
              return_lse: bool = False, q_offset: jax.Array | int = 0) -> jax.Array | tuple[jax.Array, jax.Array]:
  """Same contract as :func:`jaxshare.kernels.reference.attention` (shapes, GQA grouping, packed segments, sliding
  window, LSE, query offset); only the backward pass differs (see the module docstring)."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  out, lse = _attention(q, k, v, q_segment_ids, kv_segment_ids, jnp.asarray(q_offset, jnp.int32), causal, scale,
                        window)
  return (out, lse) if return_lse else out


def attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                       lse: jax.Array, delta: jax.Array, d_out: jax.Array, *, causal: bool = True,
                       scale: float | None = None, window: int = 0,
                       q_offset: jax.Array | int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
  """The backward pass of :func:`attention` alone: ``(dQ, dK, dV)`` from the log-sum-exp ``lse [B, H, T]``, ``delta =
  rowsum(dO ∘ O) − dlse`` (``[B, H, T]`` float32) and ``d_out [B, T, H, d]``, without the forward pass (the equations
  of the module docstring). Given a whole row's ``lse`` and ``delta`` and a block of its keys, they are that block's
  share of the row's gradients (ring attention, :mod:`jaxshare.kernels.ring`); given another layer's ``lse`` and
  ``delta = 0``, the gradients of probability reuse but for its ``lse``'s."""
  scale = q.shape[-1] ** -0.5 if scale is None else scale
  return _grads(q, k, v, q_segment_ids, kv_segment_ids, jnp.asarray(q_offset, jnp.int32), lse, delta,
                d_out.astype(q.dtype), causal, scale, window)
