"""Stage 1 of a schedule search, no training: a candidate converted from the source is scored on calibration
batches by its next-token loss and by the KL divergence of its next-token distribution from the source's."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxshare.data import Datasets
from jaxshare.data.batch import Batch
from jaxshare.search.budget import SearchError
from jaxshare.store.runs import Run


@dataclasses.dataclass(frozen=True)
class Stage1Score:
  """A converted candidate's score on the calibration batches (nats, means over their scored tokens).

  Attributes:
    loss: next-token cross-entropy, as validation computes it (:func:`~jaxshare.model.loss.masked_cross_entropy`).
    kl: ``KL(p_source || p_candidate)`` of the next-token distributions.
  """

  loss: float
  kl: float


def calibration_batches(src: Run, count: int, reported: bool = False) -> list[Batch]:
  """The first ``count`` validation batches of the source run's data (one process's view: the whole batch): a
  search's selection split. With ``reported``, batches must be left after them for the finals to report on.

  Raises:
    DataError: the data cannot be read, or has no validation split.
    SearchError: ``count`` below one, or (``reported``) leaving no validation batch to report on.
  """
  data = Datasets(src.cfg.data, src.cfg.train.batch_size, process_index=0, process_count=1)
  total = data.val_batch_count
  if count < 1 or (reported and count >= total):
    rest = " and the finals report on the rest" if reported else ""
    raise SearchError(f"--calibration-batches {count} is invalid: the validation split of {src.cfg.data.path} has "
                      f"{total} batches of {src.cfg.train.batch_size} sequences; the first N select{rest}, so N "
                      f"must be 1 to {total - 1 if reported else total}")
  return list(data.val_batches(count))


@functools.partial(jax.jit, static_argnums=0)
def _sums(graphdef: nnx.GraphDef, params: dict, batch: Batch, src_logp: jax.Array) -> tuple[jax.Array, ...]:
  """``(summed cross-entropy, summed KL to the source, scored tokens)`` of one batch; float32 scalars."""
  logits = nnx.merge(graphdef, params)(batch.inputs, batch.positions, batch.segment_ids).astype(jnp.float32)
  mask = batch.loss_mask.astype(jnp.float32)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch.targets)
  kl = jnp.sum(jnp.exp(src_logp) * (src_logp - jax.nn.log_softmax(logits)), axis=-1)
  return jnp.sum(ce * mask), jnp.sum(kl * mask), jnp.sum(mask)


@functools.partial(jax.jit, static_argnums=0)
def _log_probs(graphdef: nnx.GraphDef, params: dict, batch: Batch) -> jax.Array:
  return jax.nn.log_softmax(nnx.merge(graphdef, params)(batch.inputs, batch.positions, batch.segment_ids)
                            .astype(jnp.float32))


class Calibration:
  """The calibration batches and the source's next-token log-probabilities on them (``[B, T, V]`` float32 each),
  computed once for every candidate a search scores."""

  def __init__(self, src: Run, batches: list[Batch]):
    if not batches:
      raise ValueError("a calibration needs at least one batch")
    self.batches = batches
    self.src_log_probs = [_log_probs(src.graphdef, src.params, b) for b in batches]

  def score(self, graphdef: nnx.GraphDef, params: dict) -> Stage1Score:
    """The :class:`Stage1Score` of the model ``(graphdef, params)`` (one compile per model structure)."""
    totals = [0.0, 0.0, 0.0]
    for batch, src_logp in zip(self.batches, self.src_log_probs):
      totals = [t + float(x) for t, x in zip(totals, _sums(graphdef, params, batch, src_logp))]
    ce, kl, count = totals
    return Stage1Score(ce / max(count, 1.0), kl / max(count, 1.0))
