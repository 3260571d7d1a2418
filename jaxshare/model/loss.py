"""The language-modelling loss: summed next-token cross-entropy over the targets a batch scores, from whole logits or
tile by tile of the vocabulary (MaxText's ``num_vocab_tiling``), never holding ``[B, T, V]`` logits."""

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


def tiled_cross_entropy(hidden: jax.Array, head: jax.Array, batch: Batch, tiles: int) -> tuple[jax.Array, jax.Array]:
  """:func:`masked_cross_entropy` of the logits ``hidden @ head`` computed ``V / tiles`` vocabulary entries at a time:
  a scan over the tiles keeps the running log-sum-exp and the target's logit, each tile's ``[B, T, V / tiles]``
  float32 logits recomputed in the backward pass (``jax.checkpoint``), so no ``[B, T, V]`` array exists. At 128k
  tokens and V = 32000 the whole logits and their gradient are 31 GiB per sequence in float32.

  Args:
    hidden: ``[B, T, D]`` the final norm's output, in the compute dtype.
    head: ``[D, V]`` the LM head in the compute dtype (the embedding transposed when tied).
    batch: targets and loss mask ``[B, T]``.
    tiles: how many tiles; must divide V. Logits are accumulated in float32 from the compute-dtype matmul.

  Returns:
    ``(summed cross-entropy float32 scalar, target count float32 scalar)``.

  Raises:
    ValueError: ``tiles`` does not divide the vocabulary size.
  """
  d, v = head.shape
  if v % tiles:
    raise ValueError(f"train.num_vocab_tiling={tiles} must divide the vocabulary size {v}")
  width = v // tiles
  targets = batch.targets

  @jax.checkpoint
  def tile(w, start):
    logits = jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)
    rel = targets - start
    inside = (rel >= 0) & (rel < width)
    target = jnp.take_along_axis(logits, jnp.clip(rel, 0, width - 1)[..., None], axis=-1)[..., 0]
    top = jax.lax.stop_gradient(jnp.max(logits, axis=-1))  # any finite shift: the log-sum-exp does not depend on it
    return top, jnp.sum(jnp.exp(logits - top[..., None]), axis=-1), jnp.where(inside, target, 0.0)

  def body(carry, xs):
    top, total, target = carry
    t_top, t_total, t_target = tile(*xs)
    new_top = jnp.maximum(top, t_top)
    total = total * jnp.exp(top - new_top) + t_total * jnp.exp(t_top - new_top)
    return (new_top, total, target + t_target), None

  rows = targets.shape
  init = (jnp.full(rows, -jnp.inf, jnp.float32), jnp.zeros(rows, jnp.float32), jnp.zeros(rows, jnp.float32))
  w_tiles = head.reshape(d, tiles, width).transpose(1, 0, 2)
  (top, total, target), _ = jax.lax.scan(body, init, (w_tiles, jnp.arange(tiles, dtype=targets.dtype) * width))
  ce = top + jnp.log(total) - target
  mask = batch.loss_mask.astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


def lm_loss(model: nnx.Module, batch: Batch, vocab_tiles: int = 1) -> tuple[jax.Array, jax.Array]:
  """The summed next-token cross-entropy of a :class:`~jaxshare.model.Transformer` on ``batch`` and the target count
  (float32 scalars): from its whole logits, or with ``vocab_tiles > 1`` tile by tile (:func:`tiled_cross_entropy`)."""
  if vocab_tiles == 1:
    return masked_cross_entropy(model(batch.inputs, batch.positions, batch.segment_ids), batch)
  hidden = model.final_hidden(batch.inputs, batch.positions, batch.segment_ids)
  return tiled_cross_entropy(hidden, model.head_kernel(), batch, vocab_tiles)


def token_losses(graphdef: nnx.GraphDef, params: dict, batch: Batch, vocab_tiles: int = 1
                 ) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy (nats) over unmasked targets, and the number of those targets.

  Args:
    batch: the windows scored (:class:`~jaxshare.data.batch.Batch`).
    vocab_tiles: see :func:`lm_loss`.

  Returns:
    ``(sum_loss float32 scalar, count float32 scalar)``.
  """
  return lm_loss(nnx.merge(graphdef, params), batch, vocab_tiles)
