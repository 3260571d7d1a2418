"""Rotary position embeddings (RoPE), rotate-half layout as in Hugging Face Llama and GPT-NeoX, with the frequency
scalings HF calls ``linear`` (position interpolation, Chen et al. 2023) and ``llama3`` (Llama 3.1's band-wise
interpolation)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxshare.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """How the base frequencies are rescaled for longer contexts (``model.rope_scaling*`` fields).

  Attributes:
    kind: ``none``; ``linear`` (every frequency divided by ``factor``); ``llama3`` (wavelengths longer than
      ``original_max_positions / low_freq_factor`` divided by ``factor``, shorter than ``.../high_freq_factor``
      kept, a linear blend between).
  """

  kind: str = "none"
  factor: float = 1.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_positions: int = 8192

  @classmethod
  def of(cls, model: ModelConfig) -> RopeScaling:
    """The scaling the ``rope_scaling*`` fields of ``model`` describe."""
    return cls(model.rope_scaling, model.rope_scaling_factor, model.rope_low_freq_factor, model.rope_high_freq_factor,
               model.rope_original_max_positions)


def inv_frequencies(rotary_dim: int, theta: float, scaling: RopeScaling = RopeScaling()) -> np.ndarray:
  """``[rotary_dim // 2]`` float32 inverse frequencies ``theta^(-2i/rotary_dim)``, rescaled by ``scaling`` exactly
  as transformers' ``ROPE_INIT_FUNCTIONS`` (``_compute_linear_scaling_rope_parameters``,
  ``_compute_llama3_parameters``) do, in float32."""
  inv = (1.0 / (np.float32(theta) ** (np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim))))
  inv = inv.astype(np.float32)
  if scaling.kind == "linear":
    return (inv / np.float32(scaling.factor)).astype(np.float32)
  if scaling.kind == "llama3":
    factor, low, high = (np.float32(v) for v in (scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor))
    old = np.float32(scaling.original_max_positions)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / high) & ~(wavelen > old / low)
    return np.where(medium, smoothed, scaled).astype(np.float32)
  return inv


def apply_rope(x: jax.Array, positions: jax.Array, theta: float, rotary_dim: int,
               scaling: RopeScaling = RopeScaling()) -> jax.Array:
  """Rotate the first ``rotary_dim`` dims of each head (partial rotary when < head dim, as in Pythia).

  Args:
    x: ``[B, T, N, d]`` queries or keys, any float dtype.
    positions: ``[B, T]`` int32 positions (restart at 0 for each packed document).
    theta: RoPE base.
    rotary_dim: even number of leading dims to rotate.
    scaling: frequency rescaling (:class:`RopeScaling`).

  Returns:
    ``[B, T, N, d]`` in x's dtype; frequencies and rotation in float32.
  """
  half = rotary_dim // 2
  inv_freq = jnp.asarray(inv_frequencies(rotary_dim, theta, scaling))
  angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, half]
  cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  rot, rest = x[..., :rotary_dim].astype(jnp.float32), x[..., rotary_dim:]
  x1, x2 = rot[..., :half], rot[..., half:]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)
  return jnp.concatenate([rotated, rest], axis=-1) if rest.shape[-1] else rotated
