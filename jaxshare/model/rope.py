"""Rotary position embeddings (RoPE), rotate-half layout as in Hugging Face Llama and GPT-NeoX."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int) -> jax.Array:
  """Rotate the first ``rotary_dim`` dims of each head (partial rotary when < head dim, as in Pythia).

  Args:
    x: ``[B, T, N, d]`` queries or keys, any float dtype.
    positions: ``[B, T]`` int32 positions (restart at 0 for each packed document).
    theta: RoPE base.
    rotary_dim: even number of leading dims to rotate.

  Returns:
    ``[B, T, N, d]`` in x's dtype; frequencies and rotation in float32.
  """
  half = rotary_dim // 2
  inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / rotary_dim))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
  x1, x2 = rot[..., :half], rot[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated
