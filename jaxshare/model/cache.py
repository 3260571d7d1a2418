"""The decode KV cache: slots only for what later tokens read, laid out like the model's stacks and runs.

A layer stores (names as in the buffers):

- ``k`` and ``v``: a K/V producer that computes its own scores (post-RoPE K, as the layer attends with it);
- ``v`` only: a producer that reuses another layer's probabilities (SA, UniAttn) or logits without a delta (DS);
- ``k_lr`` and ``v``: a LISA layer (its low-rank K, post-RoPE when ``schedule.lisa.rope``; LISA Sec. 1.4);
- nothing: a K/V consumer (CLA, MLKV), which reads its producer's slots.

Logit and probability rows of score-sharing layers are not cached: they pass from the source to the reusing
layers within a decode step (``[B, H, n, S + n]`` for n new tokens). So the buffers' bytes are exactly
:func:`jaxshare.accounting.kv_cache_bytes_per_token` × batch × length.

Rows are left-padded: every row writes its next token into the same slot ``index``; row b's tokens start at slot
``start[b]`` and its RoPE positions count from there.

A step reads the cache and writes nothing while the layers run: each layer attends over two key blocks, the cache
(slots before ``index``) and the step's new rows, and returns its new rows; :func:`write` then puts every layer's
rows into the buffers at once. XLA updates a buffer in place only when nothing reads it after the update, so
writing inside the layer loop (a scan carrying the buffers) made it copy every buffer each step. Buffers are
heads-major, ``[.., B, G, S, e]``, the layout the attention matmuls read without a transpose.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxshare import parallel
from jaxshare.plan import ModelPlan
from jaxshare.schedule import LayerRole

Buffers = dict[str, jax.Array]
# [superblocks, layers of the run, B, G, S, e]: the layer axes mirror the stacked parameters.
_AXES = (None, None, "activation_batch", "activation_kv_heads", "activation_length", None)


def role_entries(role: LayerRole, head_dim: int) -> dict[str, int]:
  """What a layer of this role caches: ``{name: width}``, each ``[B, G, S, width]``."""
  if not role.is_producer:
    return {}
  entries = {"v": head_dim}
  if not role.score_reuse:
    entries["k"] = head_dim
  elif role.has_low_rank:
    entries["k_lr"] = role.lisa_rank
  return entries


@struct.dataclass
class DecodeCache:
  """The KV cache of a batch of sequences.

  Attributes:
    buffers: per stack, per run of its superblock, ``{name: [count, length, B, G, S, e]}`` in the cache dtype
      (see the module docstring for the names).
    index: int32 scalar, the next slot to write (slots written so far, left padding included).
    start: ``[B]`` int32, the first slot of each row's tokens (its left padding ends there).
  """

  buffers: list[list[Buffers]]
  index: jax.Array
  start: jax.Array

  @property
  def max_len(self) -> int:
    """Slots per row S."""
    return next(b.shape[4] for seg in self.buffers for run in seg for b in run.values())

  @property
  def nbytes(self) -> int:
    """Bytes of the K/V buffers (not counting ``index`` and ``start``)."""
    return sum(b.nbytes for b in jax.tree.leaves(self.buffers))


def init_cache(plan: ModelPlan, batch: int, max_len: int, dtype=None, start: jax.Array | None = None
               ) -> DecodeCache:
  """An empty cache for ``batch`` rows of up to ``max_len`` tokens, sharded by the activation rules under the
  ambient mesh (batch over ``data``/``fsdp``, K/V heads over ``tensor``).

  Args:
    plan: the compiled model (the cache layout: each layer's role, grouped into stacks and runs).
    dtype: the cache dtype (default: the compute dtype ``model.dtype``).
    start: ``[batch]`` int32 first slot of each row's prompt (left padding; default 0).

  Raises:
    ValueError: ``batch`` or ``max_len`` < 1.
  """
  if batch < 1 or max_len < 1:
    raise ValueError(f"init_cache: batch={batch} and max_len={max_len} must be >= 1")
  cfg, schedule = plan.model, plan.schedule
  dtype = jnp.dtype(dtype or cfg.dtype)
  d = cfg.resolved_head_dim
  shapes = [[{name: (seg.count, run.length, batch, run.role.num_kv_heads, max_len, width)
              for name, width in role_entries(run.role, d).items()} for run in seg.runs] for seg in schedule.stacks]

  @jax.jit
  def zeros():
    return jax.tree.map(lambda s: parallel.constrain(jnp.zeros(s, dtype), _AXES), shapes,
                        is_leaf=lambda s: isinstance(s, tuple))

  start = jnp.zeros((batch,), jnp.int32) if start is None else jnp.asarray(start, jnp.int32)
  if start.shape != (batch,):
    raise ValueError(f"init_cache: start has shape {start.shape}, expected ({batch},)")
  return DecodeCache(zeros(), jnp.zeros((), jnp.int32), start)


class StepContext(NamedTuple):
  """What every layer of one decode step shares.

  Attributes:
    positions: ``[B, n]`` int32 RoPE positions of the new tokens.
    mask: ``[B, n, S + n]`` bool, new token i of row b may attend cache slot s (the first S columns: the row's
      tokens before ``index``, within the sliding window) or new token j (the last n: j <= i, not padding, within
      the window).
    index: int32 scalar, the slot of the first new token.
  """

  positions: jax.Array
  mask: jax.Array
  index: jax.Array


def step_context(cache: DecodeCache, n: int, window: int = 0) -> StepContext:
  """The context of writing ``n`` new tokens at ``cache.index``."""
  slots = cache.index + jnp.arange(n, dtype=jnp.int32)  # [n]
  keys = jnp.concatenate([jnp.arange(cache.max_len, dtype=jnp.int32), slots])  # [S + n]
  offset = slots[:, None] - keys[None, :]
  written = jnp.concatenate([jnp.arange(cache.max_len) < cache.index, jnp.ones(n, bool)])
  mask = (keys[None, None, :] >= cache.start[:, None, None]) & ((offset >= 0) & written)[None]
  if window:
    mask = mask & (offset < window)[None]
  positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
  return StepContext(positions, mask, cache.index)


def write(cache: DecodeCache, rows: list[list[Buffers]], n: int, after: jax.Array) -> DecodeCache:
  """The cache after a step of ``n`` tokens: every layer's new rows (``rows`` shaped like the buffers, ``[count,
  length, B, G, n, e]``) written at slot ``index``, each buffer updated in place (only n slots move when the cache
  is donated).

  ``after``: a result of the step's last layer (its output). The write must follow every read of the cache, but a
  layer's rows do not depend on its own read, so XLA may order the write first and then copies the buffer to keep
  the read valid; it does for a stack of one superblock, whose buffer the layer reads without a slice. Making
  the slot index depend on ``after`` orders every write after every read. (An optimization barrier does not
  survive XLA's CPU pipeline.)
  """
  first = after.reshape(-1)[0]
  # (first != first) is 0 unless NaN and XLA cannot fold it; the minimum keeps the index exact either way.
  index = jnp.asarray(cache.index, jnp.int32)
  index = jnp.minimum(index, index + (first != first).astype(jnp.int32))
  zero = jnp.zeros((), jnp.int32)
  buffers = jax.tree.map(lambda b, r: jax.lax.dynamic_update_slice(b, r.astype(b.dtype),
                                                                   (zero, zero, zero, zero, index, zero)),
                         cache.buffers, rows)
  return DecodeCache(buffers, cache.index + n, cache.start)
