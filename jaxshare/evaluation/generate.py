"""Batched text generation: prefill the prompts into the decode cache, then decode in scanned chunks of steps."""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxshare.evaluation.sampling import Sampling, sample
from jaxshare.model.cache import DecodeCache, init_cache
from jaxshare.plan import ModelPlan

PROMPT_BUCKET = 16  # prompts are left-padded to a multiple of this: fewer prefill shapes to compile


class Generator:
  """Generation for one model: left-padded batched prompts, prefill + cached decode (or, as the reference, full
  forward passes like ``use_cache=False`` in transformers).

  Args:
    model: a :class:`~jaxshare.model.Transformer`.
    plan: its compiled model (the cache layout).
    cache_dtype: the decode cache's dtype (default: the compute dtype).
    pad_id: the token written into left padding and after a row stops (never attended to).
  """

  def __init__(self, model: nnx.Module, plan: ModelPlan, *, cache_dtype=None, pad_id: int = 0):
    self.plan, self.cache_dtype, self.pad_id = plan, cache_dtype, pad_id
    self.graphdef, self.params = nnx.split(model)

  def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, sampling: Sampling = Sampling(),
               *, seed: int = 0, stop_tokens: Sequence[int] = (), nf: bool = False, use_cache: bool = True,
               chunk: int = 16, on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None
               ) -> list[list[int]]:
    """Continue every prompt by up to ``max_new_tokens`` tokens.

    Args:
      prompts: token ids per row, each non-empty (lengths may differ).
      max_new_tokens: tokens to generate per row.
      sampling: greedy, temperature, top-k, top-p.
      seed: the sampling PRNG seed; step i draws with ``fold_in(key(seed), i)`` in both decoding paths.
      stop_tokens: a row stops after producing one of these (it is not returned).
      nf: LISA's NF strategy: prefill with the LISA layers' kept original attention, decode with LISA.
      use_cache: False decodes by a full forward pass per token instead (the reference).
      chunk: decode steps per compiled call (streaming granularity).
      on_tokens: called after each chunk with ``(tokens [B, n] int32, live [B, n] bool)``, live marking the
        tokens that belong to the output.

    Returns:
      The generated ids of each row, without the prompt and the stop token.

    Raises:
      ValueError: an empty prompt, ``max_new_tokens`` < 1 or ``chunk`` < 1.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("generate needs at least one prompt and no empty prompt")
    if max_new_tokens < 1 or chunk < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens} and chunk={chunk} must be >= 1")
    chunk = min(chunk, max_new_tokens)
    lengths = np.array([len(p) for p in prompts])
    width = -(-int(lengths.max()) // PROMPT_BUCKET) * PROMPT_BUCKET
    padded = np.full((len(prompts), width), self.pad_id, np.int32)
    for row, p in zip(padded, prompts):
      row[width - len(p):] = p
    steps = -(-max_new_tokens // chunk) * chunk
    start = jnp.asarray(width - lengths, jnp.int32)
    stop = jnp.asarray(list(stop_tokens) or [-1], jnp.int32)
    key = jax.random.key(seed)
    if use_cache:
      cache = init_cache(self.plan, len(prompts), width + steps, self.cache_dtype, start)
      logits, state = prefill(self.graphdef, self.params, jnp.asarray(padded), cache, nf)
      run = functools.partial(decode_steps, self.graphdef, sampling=sampling, chunk=chunk, pad_id=self.pad_id)
    else:
      buf = jnp.pad(jnp.asarray(padded), ((0, 0), (0, steps)), constant_values=self.pad_id)
      logits, state = _forward_last(self.graphdef, self.params, buf, start, jnp.asarray(width - 1)), buf
      run = functools.partial(_decode_uncached, self.graphdef, sampling=sampling, chunk=chunk, pad_id=self.pad_id,
                              start=start, width=width)
    done = jnp.zeros(len(prompts), bool)
    out: list[np.ndarray] = []
    for step in range(0, max_new_tokens, chunk):
      state, logits, done, tokens, live = run(self.params, state, logits, done, key, stop, jnp.asarray(step))
      n = min(chunk, max_new_tokens - step)  # the last chunk may run past max_new_tokens: drop the excess
      tokens, live = np.asarray(tokens).T[:, :n], np.asarray(live).T[:, :n]  # [B, n]
      if on_tokens is not None:
        on_tokens(tokens, live)
      out.append(np.where(live, tokens, -1))
      if bool(done.all()):
        break
    generated = np.concatenate(out, axis=1)
    return [[int(t) for t in row if t >= 0] for row in generated]


@functools.partial(jax.jit, static_argnums=(0, 4), donate_argnums=(3,))
def prefill(graphdef, params, tokens: jax.Array, cache: DecodeCache, nf: bool):
  """Write ``tokens [B, n]`` into the (donated) cache; returns the last position's logits ``[B, V]`` and the
  cache."""
  logits, cache = nnx.merge(graphdef, params).decode(tokens, cache, nf)
  return logits[:, -1], cache


def _sample_step(logits, done, key, stop, step, sampling, pad_id):
  """The token of one step (pad once a row is done), whether it is output, and the rows done after it."""
  token = sample(logits, jax.random.fold_in(key, step), sampling)
  live = ~done & ~jnp.isin(token, stop)
  return jnp.where(done, pad_id, token), live, done | ~live


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("sampling", "chunk", "pad_id"),
                   donate_argnums=(2,))
def decode_steps(graphdef, params, cache: DecodeCache, logits, done, key, stop, step0, *, sampling: Sampling,
                 chunk: int, pad_id: int):
  """``chunk`` decode steps in one scanned call (the cache donated): each samples a token per row from ``logits
  [B, V]`` (step i with ``fold_in(key, step0 + i)``), marks rows ``done`` at a ``stop`` token, and decodes it.

  Returns:
    ``(cache, next logits [B, V], done [B], tokens [chunk, B] int32, live [chunk, B] bool)``.
  """
  def one(carry, i):
    # The parameters ride in the carry: a module merged outside the scan may not enter the layers' nnx.scan.
    params, cache, logits, done = carry
    token, live, done = _sample_step(logits, done, key, stop, step0 + i, sampling, pad_id)
    next_logits, cache = nnx.merge(graphdef, params).decode(token[:, None], cache)
    return (params, cache, next_logits[:, 0], done), (token, live)

  (_, cache, logits, done), (tokens, live) = jax.lax.scan(one, (params, cache, logits, done), jnp.arange(chunk))
  return cache, logits, done, tokens, live


def _segments(buf: jax.Array, start: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Positions and segment ids of a left-padded buffer: padding is its own segment (id 0)."""
  slots = jnp.arange(buf.shape[1], dtype=jnp.int32)[None]
  real = slots >= start[:, None]
  return jnp.maximum(slots - start[:, None], 0), real.astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward_last(graphdef, params, buf, start, last):
  positions, segment_ids = _segments(buf, start)
  logits = nnx.merge(graphdef, params)(buf, positions, segment_ids)
  return jax.lax.dynamic_index_in_dim(logits, last, axis=1, keepdims=False)


@functools.partial(jax.jit, static_argnums=(0,), static_argnames=("sampling", "chunk", "pad_id", "width"))
def _decode_uncached(graphdef, params, buf, logits, done, key, stop, step0, *, sampling, chunk, pad_id, start, width):
  def one(carry, i):
    buf, logits, done = carry
    token, live, done = _sample_step(logits, done, key, stop, step0 + i, sampling, pad_id)
    slot = width + step0 + i
    buf = jax.lax.dynamic_update_index_in_dim(buf, token, slot, axis=1)
    return (buf, _forward_last(graphdef, params, buf, start, slot), done), (token, live)

  (buf, logits, done), (tokens, live) = jax.lax.scan(one, (buf, logits, done), jnp.arange(chunk))
  return buf, logits, done, tokens, live
