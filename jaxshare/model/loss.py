"""The language-modelling loss: summed next-token cross-entropy over the targets a batch scores."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxshare.data.batch import Batch


def masked_cross_entropy(logits: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """``(summed next-token cross-entropy in nats over targets with loss_mask 1, their count)`` for ``[B, T, V]``
  float32 logits; float32 scalars."""
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
  mask = batch.loss_mask.astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


def token_losses(graphdef: nnx.GraphDef, params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy (nats) over unmasked targets, and the number of those targets.

  Args:
    batch: the windows scored (:class:`~jaxshare.data.batch.Batch`).

  Returns:
    ``(sum_loss float32 scalar, count float32 scalar)``.
  """
  return masked_cross_entropy(nnx.merge(graphdef, params)(batch.inputs, batch.positions, batch.segment_ids),
                              batch)
