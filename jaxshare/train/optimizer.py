"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax
from flax import nnx

from jaxshare.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig, start_step: int = 0, end_step: int | None = None) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio`` at
  ``end_step`` (default ``train.steps``), as a function of the steps taken since ``start_step`` (a recipe stage
  restarts it there, e.g. UniAttn's stage 2; the warm-up shrinks to fit a short remainder)."""
  remaining = max((cfg.steps if end_step is None else end_step) - start_step, 1)
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=cfg.lr, warmup_steps=min(cfg.warmup_steps, remaining - 1), decay_steps=remaining,
    end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params) -> object:
  """Weight decay on matrices only: not on norms, biases (ndim < 2), the embedding table, or UniAttn's W_c (the paper
  trains it with weight decay 0, UniAttn Sec. 4)."""
  def mask(path, p) -> bool:
    return p.ndim >= 2 and not any(getattr(k, "key", None) in ("embedding", "compensation") for k in path)
  return jax.tree_util.tree_map_with_path(mask, params)


# Parameter names of the modules the sharing methods add (LISA's low-rank Q/K and aligner, UniAttn's W_c).
SHARING_MODULES = ("compensation", "q_lr", "k_lr", "align_in", "align_out", "align")


def frozen_paths(abstract_params: nnx.State) -> frozenset[tuple]:
  """Key paths (as in ``nnx.to_pure_dict(params)``) of the parameters the model marks as never trained
  (``trainable=False`` metadata: LISA's kept W_q/W_k)."""
  return frozenset(tuple(path) for path, var in nnx.to_flat_state(abstract_params)
                   if not var.get_metadata().get("trainable", True))


def _keys(path) -> tuple:
  return tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)


def trainable_labels(params, trainable: tuple[str, ...] | None, frozen: frozenset[tuple] = frozenset()):
  """``"train"`` for leaves under a module named in ``trainable`` (all leaves when None) and not in ``frozen``
  (:func:`frozen_paths`), else ``"frozen"``."""
  def label(path, _) -> str:
    names = {getattr(k, "key", None) for k in path}
    chosen = trainable is None or names & set(trainable)
    return "train" if chosen and _keys(path) not in frozen else "frozen"
  return jax.tree_util.tree_map_with_path(label, params)


def count_trainable(params, trainable: tuple[str, ...] | None, frozen: frozenset[tuple] = frozenset()) -> int:
  labels = trainable_labels(params, trainable, frozen)
  return sum(int(p.size) for p, lab in zip(jax.tree.leaves(params), jax.tree.leaves(labels)) if lab == "train")


def make_optimizer(cfg: TrainConfig, trainable: tuple[str, ...] | None = None,
                   frozen: frozenset[tuple] = frozenset(), start_step: int = 0,
                   end_step: int | None = None) -> optax.GradientTransformation:
  """The optimizer of :class:`~jaxshare.config.TrainConfig`; parameters are a pure dict pytree.

  Args:
    trainable: module names whose parameters are updated (None: all); see :func:`trainable_labels`.
    frozen: :func:`frozen_paths`; those parameters are never updated.
    start_step, end_step: the global steps this optimizer's learning-rate schedule starts at (it restarts there) and
      ends at (None: ``train.steps``); see :func:`learning_rate_schedule`.

  Frozen parameters go through an optax ``multi_transform`` whose frozen partition is ``set_to_zero`` (and holds no
  optimizer state).
  """
  chain = []
  if cfg.clip_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.clip_norm))
  chain.append(optax.adamw(learning_rate_schedule(cfg, start_step, end_step), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask))
  tx = optax.chain(*chain)
  if trainable is None and not frozen:
    return tx
  return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                               lambda params: trainable_labels(params, trainable, frozen))
