"""Loss, the jitted train step (with gradient accumulation) and the eval step."""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

Batch = dict[str, jax.Array]
TrainState = dict[str, Any]  # {"params": pure dict, "opt_state": optax state, "step": int32 scalar}


def token_losses(graphdef: nnx.GraphDef, params: dict, batch: Batch) -> tuple[jax.Array, jax.Array]:
  """Summed next-token cross-entropy (nats) over unmasked targets, and the number of those targets.

  Args:
    batch: ``inputs``, ``targets``, ``positions``, ``segment_ids``, ``loss_mask``; each ``[B, T]`` int32.

  Returns:
    ``(sum_loss float32 scalar, count float32 scalar)``.
  """
  model = nnx.merge(graphdef, params)
  logits = model(batch["inputs"], batch["positions"], batch["segment_ids"])
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  mask = batch["loss_mask"].astype(jnp.float32)
  return jnp.sum(ce * mask), jnp.sum(mask)


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, lr_schedule: optax.Schedule,
                    grad_accum_steps: int) -> Callable[[TrainState, Batch], tuple[TrainState, dict]]:
  """A pure train step ``(state, batch) -> (state, metrics)``, to be wrapped in ``jax.jit``.

  With ``grad_accum_steps = A`` the batch is split into A micro-batches whose gradients are summed in a
  ``lax.scan`` and normalised by the total number of target tokens, so the update equals the one-shot step's.
  """
  grad_fn = jax.value_and_grad(lambda p, b: token_losses(graphdef, p, b), has_aux=True)

  def step(state: TrainState, batch: Batch) -> tuple[TrainState, dict]:
    params = state["params"]
    if grad_accum_steps == 1:
      (loss_sum, count), grads = grad_fn(params, batch)
    else:
      micro = jax.tree.map(lambda x: x.reshape(grad_accum_steps, -1, *x.shape[1:]), batch)

      def body(acc, mb):
        (ls, c), g = grad_fn(params, mb)
        return jax.tree.map(jnp.add, acc, (ls, c, g)), None

      zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
      (loss_sum, count, grads), _ = jax.lax.scan(body, zeros, micro)
    count = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / count, grads)
    updates, opt_state = tx.update(grads, state["opt_state"], params)
    new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state, "step": state["step"] + 1}
    metrics = {"loss": loss_sum / count, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state["step"]),
               "tokens": count}
    return new_state, metrics

  return step


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[dict, Batch], tuple[jax.Array, jax.Array]]:
  """``(params, batch) -> (sum_loss, count)`` for validation."""
  return lambda params, batch: token_losses(graphdef, params, batch)
