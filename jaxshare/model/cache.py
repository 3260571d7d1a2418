"""The decode KV cache: slots only for what later tokens read, laid out like the model's segments and runs.

A layer stores (names as in the buffers):

- ``k`` and ``v``: a K/V producer that computes its own scores (post-RoPE K, as the layer attends with it);
- ``v`` only: a producer that reuses another layer's probabilities (SA, UniAttn) or logits without a delta (DS);
- ``k_lr`` and ``v``: a LISA layer (its low-rank K, post-RoPE when ``schedule.lisa.rope``; LISA Sec. 1.4);
- nothing: a K/V consumer (CLA, MLKV), which reads its producer's slots.

Logit and probability rows of score-sharing layers are not cached: they pass from the source to the reusing
layers within a decode step (``[B, H, n, S]`` for n new tokens). So the buffers' bytes are exactly
:func:`jaxshare.accounting.kv_cache_bytes_per_token` × batch × length.

Rows are left-padded: every row writes its next token into the same slot ``index``; row b's tokens start at slot
``start[b]`` and its RoPE positions count from there.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from jaxshare import parallel
from jaxshare.config import ModelConfig
from jaxshare.schedule import LayerRole, Schedule

Buffers = dict[str, jax.Array]
# [superblocks, layers of the run, B, S, G, e]: the layer axes mirror the stacked parameters.
_AXES = (None, None, "activation_batch", "activation_length", "activation_kv_heads", None)


def role_entries(role: LayerRole, head_dim: int) -> dict[str, int]:
  """What a layer of this role caches: ``{name: width}``, each ``[B, S, G, width]``."""
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
    buffers: per segment, per run of its superblock, ``{name: [count, length, B, S, G, e]}`` in the cache dtype
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
    return next(b.shape[3] for seg in self.buffers for run in seg for b in run.values())

  @property
  def nbytes(self) -> int:
    """Bytes of the K/V buffers (not counting ``index`` and ``start``)."""
    return sum(b.nbytes for b in jax.tree.leaves(self.buffers))


def init_cache(cfg: ModelConfig, schedule: Schedule, batch: int, max_len: int, dtype=None,
               start: jax.Array | None = None) -> DecodeCache:
  """An empty cache for ``batch`` rows of up to ``max_len`` tokens, sharded by the activation rules under the
  ambient mesh (batch over ``data``/``fsdp``, K/V heads over ``tensor``).

  Args:
    cfg / schedule: the model and its compiled schedule.
    dtype: the cache dtype (default: the compute dtype ``cfg.dtype``).
    start: ``[batch]`` int32 first slot of each row's prompt (left padding; default 0).

  Raises:
    ValueError: ``batch`` or ``max_len`` < 1.
  """
  if batch < 1 or max_len < 1:
    raise ValueError(f"init_cache: batch={batch} and max_len={max_len} must be >= 1")
  dtype = jnp.dtype(dtype or cfg.dtype)
  d = cfg.resolved_head_dim
  shapes = [[{name: (seg.count, run.length, batch, max_len, run.role.num_kv_heads, width)
              for name, width in role_entries(run.role, d).items()} for run in seg.runs] for seg in schedule.segments]

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
    mask: ``[B, n, S]`` bool, new token i of row b may attend slot s (the row's tokens up to itself, within the
      sliding window).
    index: int32 scalar, the slot of the first new token.
  """

  positions: jax.Array
  mask: jax.Array
  index: jax.Array


def step_context(cache: DecodeCache, n: int, window: int = 0) -> StepContext:
  """The context of writing ``n`` new tokens at ``cache.index``."""
  slots = cache.index + jnp.arange(n, dtype=jnp.int32)  # [n]
  keys = jnp.arange(cache.max_len, dtype=jnp.int32)  # [S]
  offset = slots[:, None] - keys[None, :]
  mask = (keys[None, None, :] >= cache.start[:, None, None]) & (offset >= 0)[None]
  if window:
    mask = mask & (offset < window)[None]
  positions = jnp.maximum(slots[None, :] - cache.start[:, None], 0)
  return StepContext(positions, mask, cache.index)


def read(buffers: Buffers, superblock: jax.Array | int, layer: jax.Array | int) -> Buffers:
  """One layer's ``{name: [B, S, G, e]}`` from its run's stacked buffers."""
  return {name: b[superblock, layer] for name, b in buffers.items()}


def write(buffers: Buffers, superblock: jax.Array | int, layer: jax.Array | int, index: jax.Array,
          rows: Buffers) -> Buffers:
  """Write one layer's new rows ``{name: [B, n, G, e]}`` at slot ``index``, in place (only n slots move)."""
  zero = jnp.zeros((), jnp.int32)
  at = lambda *i: tuple(jnp.asarray(x, jnp.int32) for x in i)  # noqa: E731
  return {name: jax.lax.dynamic_update_slice(b, rows[name][None, None].astype(b.dtype),
                                             at(superblock, layer, zero, index, zero, zero))
          for name, b in buffers.items()}


def append(view: Buffers, index: jax.Array, rows: Buffers) -> Buffers:
  """A layer's buffers ``[B, S, G, e]`` with its new rows written at ``index`` (what its attention reads)."""
  zero = jnp.zeros((), jnp.int32)
  return {name: jax.lax.dynamic_update_slice(view[name], rows[name].astype(view[name].dtype),
                                             (zero, jnp.asarray(index, jnp.int32), zero, zero)) for name in rows}
