"""The train step (with gradient accumulation) and its auxiliary losses: LISA distillation, PostShare's penalty."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct

from jaxshare.kernels.dispatch import knowing
from jaxshare.kernels.reference import attention_mask, documents_per_row
from jaxshare.model.ties import MATRICES
from jaxshare.data.batch import Batch
from jaxshare.model.loss import lm_loss, masked_cross_entropy
from jaxshare.model.params import layer_params
from jaxshare.schedule import Schedule



@struct.dataclass
class TrainState:
  """What a run carries from one step to the next, and checkpoints.

  Attributes:
    params: the model's parameters (pure dict, ``nnx.to_pure_dict``).
    opt_state: the optimizer's state (optax).
    step: int32 scalar, the optimizer steps taken.
  """

  params: Any
  opt_state: Any
  step: Any

  def as_dict(self) -> dict:
    """The state as checkpoints store it: ``{"params", "opt_state", "step"}`` (its checksums name these keys)."""
    return {"params": self.params, "opt_state": self.opt_state, "step": self.step}

  @classmethod
  def of(cls, stored: Mapping[str, Any]) -> TrainState:
    """The state of a restored checkpoint (:meth:`as_dict`'s mapping)."""
    return cls(**stored)


@dataclasses.dataclass(frozen=True)
class Objective:
  """Auxiliary losses added to the language-modelling loss.

  Attributes:
    kd_beta / kd_delta / kd_layers / teacher_graphdef: LISA distillation (Eq. 5-7): ``beta * L_KD + (1 - beta) *
      L_LM`` with ``L_KD`` the Huber loss (delta) between the student's and the frozen teacher's pre-softmax
      attention logits on ``kd_layers``, averaged over causal, same-document cells and layers.
    postshare_gamma / postshare_pairs / schedule: PostShare (Head-wise Shareable Attention, Sec. 4.3): ``gamma *
      L_w``, ``L_w = (1/|N|) sum_{(i,j) in N} sum_{m in q,k,v} ||W_i^m - W_j^m||_F`` over the selected head pairs
      (``{"q", "k", "v"}: ((head, matched earlier head), ...)``, flat indices ``layer * H + head``).
    window: the model's sliding attention window (0: none); the distillation ignores cells outside it.
    vocab_tiles: the language-modelling loss over this many vocabulary tiles (``train.num_vocab_tiling``,
      :func:`~jaxshare.model.loss.tiled_cross_entropy`); 1: from the whole logits.
  """

  kd_beta: float = 0.0
  kd_delta: float = 1.0
  kd_layers: tuple[int, ...] = ()
  teacher_graphdef: Any = None
  postshare_gamma: float = 0.0
  postshare_pairs: dict[str, tuple[tuple[int, int], ...]] | None = None
  schedule: Schedule | None = None
  window: int = 0
  vocab_tiles: int = 1


def _safe_norm(x: jax.Array) -> jax.Array:
  """Frobenius norm with a finite gradient at 0 (identical heads after tying)."""
  sq = jnp.sum(jnp.square(x.astype(jnp.float32)))
  return jnp.sqrt(jnp.maximum(sq, 1e-12))


def postshare_penalty(params: dict, schedule: Schedule, pairs: dict[str, tuple[tuple[int, int], ...]]) -> jax.Array:
  """PostShare's ``L_w`` (float32 scalar) for the pairs chosen by DirectShare; see :class:`Objective`."""
  L = len(schedule.layers)
  total = jnp.zeros((), jnp.float32)
  n = 0
  for m in MATRICES:
    w = jnp.stack([layer_params(params, schedule, layer)["attn"][f"{m}_proj"]["kernel"] for layer in range(L)])
    H = w.shape[2]
    idx = np.asarray(pairs[m], np.int32).reshape(-1, 2)
    for i, j in idx:
      total = total + _safe_norm(w[i // H, :, i % H, :] - w[j // H, :, j % H, :])
    n = max(n, len(idx))
  return total / max(n, 1)


def distillation_loss(student: jax.Array, teacher: jax.Array, segment_ids: jax.Array, delta: float,
                      window: int = 0) -> jax.Array:
  """Huber loss between ``[N, B, H, T, T]`` attention logits, averaged over the cells attention uses: causal,
  same-document and, with a sliding ``window`` > 0 (``model.sliding_window``), within it."""
  mask = attention_mask(segment_ids, segment_ids, True, window)[None, :, None].astype(jnp.float32)
  huber = optax.huber_loss(student, jax.lax.stop_gradient(teacher), delta=delta)
  return jnp.sum(huber * mask) / (jnp.sum(mask) * student.shape[0] * student.shape[2])


def _by_documents(grad_fn: Callable, bounds: tuple[int, ...]) -> Callable:
  """``grad_fn(params, mb, ...)`` traced under each bound on documents per row (:func:`knowing`) and once
  past the last, run by ``lax.switch`` on the most documents a row of ``mb`` holds."""
  branches = [knowing(bound, grad_fn) for bound in (*bounds, sys.maxsize)]

  def call(params, mb, *rest):
    most = jnp.max(documents_per_row(mb.segment_ids))
    return jax.lax.switch(jnp.sum(most > jnp.asarray(bounds)), branches, params, mb, *rest)
  return call


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    grad_accum_steps: int, objective: Objective = Objective(),
                    document_bounds: tuple[int, ...] | None = None
                    ) -> Callable[..., tuple[TrainState, dict]]:
  """A pure train step ``(state, batch[, teacher_params]) -> (state, metrics)``, to be wrapped in ``jax.jit``.

  With ``grad_accum_steps = A`` the batch is split into A micro-batches whose gradients are summed in a
  ``lax.scan``; the LM loss is normalised by the whole batch's target count, so the update equals the one-shot
  step's. ``metrics``: ``loss`` (LM, nats/token), ``objective`` (what was minimised), ``grad_norm``, ``lr``,
  ``tokens``, ``finite`` (the objective and the gradient norm are finite), and ``kd_loss`` / ``postshare_loss`` when
  enabled. A step whose objective or gradient norm is not finite leaves the parameters and optimizer state as they
  were (only the step counter advances): a diverged batch never poisons the state, whatever the loop then does.

  ``document_bounds`` (:func:`jaxshare.kernels.dispatch.document_bounds`; for ``attention.impl=cudnn`` (1, 16)):
  each micro-batch's forward and backward are traced under each bound on documents per row and once past the last
  (:func:`jaxshare.kernels.dispatch.documents_known`: cuDNN sized to the bound, or jaxshare's kernels alone), and
  ``lax.switch`` runs the one the micro-batch's documents allow, so no attention call carries a cond of its own
  through the backward.
  """
  kd = objective.kd_beta > 0
  lm_weight = 1.0 - objective.kd_beta

  def micro_objective(params, mb, total_count, teacher_params):
    model = nnx.merge(graphdef, params)
    if kd:
      logits, attn = model.capture_logits(mb.inputs, mb.positions, mb.segment_ids)
      teacher = nnx.merge(objective.teacher_graphdef, teacher_params)
      _, t_attn = teacher.capture_logits(mb.inputs, mb.positions, mb.segment_ids)
      layers = np.asarray(objective.kd_layers)
      kd_loss = distillation_loss(attn[layers], t_attn[layers], mb.segment_ids, objective.kd_delta,
                                  objective.window)
      lm_sum, _ = masked_cross_entropy(logits, mb)
    else:
      lm_sum, _ = lm_loss(model, mb, objective.vocab_tiles)
      kd_loss = jnp.zeros((), jnp.float32)
    value = lm_weight * lm_sum / total_count + objective.kd_beta * kd_loss / grad_accum_steps
    return value, (lm_sum, kd_loss)

  grad_fn = jax.value_and_grad(micro_objective, has_aux=True)
  if document_bounds:
    grad_fn = _by_documents(grad_fn, document_bounds)

  def step(state: TrainState, batch: Batch, teacher_params: dict | None = None) -> tuple[TrainState, dict]:
    params = state.params
    total_count = jnp.maximum(jnp.sum(batch.loss_mask.astype(jnp.float32)), 1.0)
    if grad_accum_steps == 1:
      (value, (lm_sum, kd_loss)), grads = grad_fn(params, batch, total_count, teacher_params)
    else:
      micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)

      def body(acc, mb):
        (v, (ls, kl)), g = grad_fn(params, mb, total_count, teacher_params)
        return jax.tree.map(jnp.add, acc, (v, ls, kl, g)), None

      zeros = (jnp.zeros((), jnp.float32),) * 3 + (jax.tree.map(jnp.zeros_like, params),)
      (value, lm_sum, kd_loss, grads), _ = jax.lax.scan(body, zeros, micro)
      kd_loss = kd_loss / grad_accum_steps
    metrics = {"loss": lm_sum / total_count, "tokens": total_count}
    if kd:
      metrics["kd_loss"] = kd_loss
    if objective.postshare_gamma > 0:
      penalty, penalty_grads = jax.value_and_grad(postshare_penalty)(params, objective.schedule,
                                                                    objective.postshare_pairs)
      grads = jax.tree.map(lambda g, p: g + objective.postshare_gamma * p, grads, penalty_grads)
      value = value + objective.postshare_gamma * penalty
      metrics["postshare_loss"] = penalty
    updates, opt_state = tx.update(grads, state.opt_state, params)
    grad_norm = optax.tree.norm(grads)
    finite = jnp.isfinite(value) & jnp.isfinite(grad_norm)
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                        {"params": optax.apply_updates(params, updates), "opt_state": opt_state},
                        {"params": params, "opt_state": state.opt_state})
    metrics.update(objective=value, grad_norm=grad_norm, lr=lr_schedule(state.step), finite=finite)
    return TrainState(kept["params"], kept["opt_state"], state.step + 1), metrics

  return step
