"""Next-token sampling: greedy, temperature, top-k and top-p (nucleus)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
  """How the next token is drawn from the logits.

  Attributes:
    temperature: divides the logits; 0 picks the most likely token (greedy).
    top_k: keep only the k most likely tokens (0: all).
    top_p: keep the smallest set of most likely tokens whose probability reaches p (Holtzman et al. 2020; 1: all).

  Raises:
    ValueError: a negative temperature or top_k, or top_p outside (0, 1].
  """

  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0

  def __post_init__(self):
    if self.temperature < 0:
      raise ValueError(f"temperature={self.temperature!r} is invalid: must be >= 0 (0: greedy)")
    if self.top_k < 0:
      raise ValueError(f"top_k={self.top_k!r} is invalid: must be >= 0 (0: no top-k filter)")
    if not 0 < self.top_p <= 1:
      raise ValueError(f"top_p={self.top_p!r} is invalid: must be in (0, 1] (1: no nucleus filter)")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
  """Draw one token per row.

  Args:
    logits: ``[B, V]`` float32 next-token logits.
    key: PRNG key (unused when greedy).
    sampling: the strategy.

  Returns:
    ``[B]`` int32 token ids.
  """
  if sampling.temperature == 0:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  logits = logits.astype(jnp.float32) / sampling.temperature
  if sampling.top_k and sampling.top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if sampling.top_p < 1:
    ordered = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(ordered, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # probability of the strictly more likely tokens
    kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the most likely token is always kept
    logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
