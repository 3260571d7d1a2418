"""Validation loss: the eval step and its sums over batches, shared by training's periodic validation and
``eval.py``."""

from __future__ import annotations

import functools
from typing import Callable, Iterable

import jax
from flax import nnx
from jax.sharding import NamedSharding

from jaxshare import parallel
from jaxshare.data import Datasets
from jaxshare.model.loss import token_losses


def make_eval_step(graphdef: nnx.GraphDef, vocab_tiles: int = 1) -> Callable[[dict, dict], tuple[jax.Array, jax.Array]]:
  """``(params, batch) -> (sum_loss, count)`` for validation (:func:`~jaxshare.model.loss.token_losses`, over
  ``vocab_tiles`` vocabulary tiles)."""
  return functools.partial(token_losses, graphdef, vocab_tiles=vocab_tiles)


def loss_sums(eval_fn, batch_sharding: NamedSharding, params, batches: Iterable[dict]) -> tuple[float, float]:
  """``(summed loss in nats, scored tokens)`` of ``eval_fn`` over batches (host arrays, placed by
  ``batch_sharding``)."""
  total, count = 0.0, 0.0
  for batch in batches:
    s, c = eval_fn(params, parallel.shard_batch(batch_sharding, batch))
    total, count = total + float(s), count + float(c)
  return total, count


def evaluate_loss(eval_fn, batch_sharding: NamedSharding, params, data: Datasets, max_batches: int,
                  skip: int = 0) -> float:
  """Mean validation loss in nats per token over up to ``max_batches`` global batches (0: all) after the first
  ``skip``."""
  total, count = loss_sums(eval_fn, batch_sharding, params, data.val_batches(max_batches, skip))
  return total / max(count, 1.0)
