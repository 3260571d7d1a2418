"""The batch every consumer of the input pipeline reads: packed windows of token ids with their targets, positions,
document ids and loss mask."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Batch:
  """A batch of ``B`` packed windows of ``T`` tokens (numpy on the host, ``jax.Array`` once placed); a pytree, so
  ``jax.tree.map``, ``jax.device_put`` and ``jax.jit`` take it whole. Every field is ``[B, T]`` int32.

  Attributes:
    inputs: token ids.
    targets: the next token of each input.
    positions: RoPE positions, counted from 0 in each packed document.
    segment_ids: packed-document ids; tokens attend only within their document.
    loss_mask: 1 where the target is scored, 0 where it crosses into the next document.
  """

  inputs: Any
  targets: Any
  positions: Any
  segment_ids: Any
  loss_mask: Any

  @classmethod
  def of(cls, fields: Mapping[str, Any]) -> Batch:
    """The batch of a mapping with exactly the five fields (a collated grain batch).

    Raises:
      KeyError: a field is missing. TypeError: an unknown one is given.
    """
    return cls(**fields)

  @classmethod
  def spec(cls, batch_size: int, seq_len: int, sharding: jax.sharding.Sharding | None = None) -> Batch:
    """The batch's shapes and dtypes (``jax.ShapeDtypeStruct``, placed by ``sharding``): what a train step is traced
    and compiled for ahead of time."""
    struct_ = jax.ShapeDtypeStruct((batch_size, seq_len), jnp.int32, sharding=sharding)
    return cls(struct_, struct_, struct_, struct_, struct_)
