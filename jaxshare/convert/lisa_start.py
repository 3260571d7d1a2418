"""LISA's conversion start fitted to the source: low-rank factors whose delta makes a converted layer's logits
approximate its own.

A LISA layer n computes ``A_n = A_s + A_delta`` (LISA Eq. 3, with the aligner at its initial sum), where ``A_s`` are
the logits of its score source s (the previous layer) and ``A_delta = (x W_q^LR)(x W_k^LR)^T / sqrt(r)``. In the
dense source, without RoPE, head h's logits are the bilinear form ``x M x^T`` with ``M = W_q,h W_k,g(h)^T / sqrt(d)``.
The start that brings ``A_n`` closest to the source layer's own logits sets ``W_q^LR W_k^LR^T / sqrt(r)`` to the
difference ``M_n - M_s``: the best rank-r approximation of it (Eckart-Young: truncated SVD), with one K factor per
K/V group, so the query heads of a group are stacked before the SVD. Along a chain the differences telescope
(``A_s`` is itself fitted towards ``M_s``). This is the fit UniAttn does for its W_c (there on activations); LISA
itself prescribes no conversion start. What the fit ignores: RoPE (the source's logits are rotated; the low-rank
path is rotated only with ``schedule.lisa.rope``, at its own width) and that layers n and s see different inputs.
"""

from __future__ import annotations

import jax.numpy as jnp


def fit_low_rank(wq_n, wk_n, wq_s, wk_s, rank: int, kv_heads: int) -> tuple[jnp.ndarray, jnp.ndarray]:
  """LISA's low-rank factors fitted to a source layer's logits (module docstring). Traceable.

  Args:
    wq_n, wk_n: the source's layer n ``W_q [D, H, d]`` and ``W_k [D, G_n, d]`` (G_n dividing H).
    wq_s, wk_s: the same for its score source s (``W_k [D, G_s, d]``).
    rank: r, the LISA rank.
    kv_heads: G, the converted layer's K/V heads (``k_lr``'s), dividing H.

  Returns:
    ``(q_lr [D, H, r], k_lr [D, G, r])`` float32 with ``q_lr_h k_lr_g(h)^T / sqrt(r)`` the best rank-r approximation
    (Frobenius, jointly over each K/V group's query heads) of ``(W_q,n,h W_k,n^T - W_q,s,h W_k,s^T) / sqrt(d)``.

  Raises:
    ValueError: shapes that disagree, or head counts that do not divide H.
  """
  D, H, d = wq_n.shape
  if wq_s.shape != (D, H, d) or wk_n.shape[::2] != (D, d) or wk_s.shape[::2] != (D, d):
    raise ValueError(f"W_q/W_k shapes disagree: {wq_n.shape}, {wk_n.shape}, {wq_s.shape}, {wk_s.shape}")
  if any(H % g for g in (wk_n.shape[1], wk_s.shape[1], kv_heads)):
    raise ValueError(f"K/V head counts {wk_n.shape[1]}, {wk_s.shape[1]}, {kv_heads} must divide {H} query heads")
  f32 = jnp.float32

  def bilinear(wq, wk):  # [H, D, D]
    k = jnp.repeat(wk.astype(f32), H // wk.shape[1], axis=1)
    return jnp.einsum("dhe,fhe->hdf", wq.astype(f32), k) * d ** -0.5

  per_group = H // kv_heads
  delta = (bilinear(wq_n, wk_n) - bilinear(wq_s, wk_s)).reshape(kv_heads, per_group * D, D)
  u, s, vt = jnp.linalg.svd(delta, full_matrices=False)  # [G, hD, k], [G, k], [G, k, D]
  root = jnp.sqrt(s[:, :rank]) * rank ** 0.25  # split sqrt(r) * S_r evenly between the factors
  q_lr = (u[:, :, :rank] * root[:, None]).reshape(kv_heads, per_group, D, rank)
  k_lr = vt[:, :rank].transpose(0, 2, 1) * root[:, None]  # [G, D, r]
  return q_lr.reshape(H, D, rank).transpose(1, 0, 2), k_lr.transpose(1, 0, 2)
