"""AdamW with linear warm-up, cosine decay and global-norm clipping (optax)."""

from __future__ import annotations

import jax
import optax

from jaxshare.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warm-up from 0 to ``lr`` over ``warmup_steps``, then cosine decay to ``lr * min_lr_ratio``."""
  return optax.warmup_cosine_decay_schedule(
    init_value=0.0, peak_value=cfg.lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
    end_value=cfg.lr * cfg.min_lr_ratio)


def decay_mask(params) -> object:
  """Weight decay on matrices only: not on norms, biases (ndim < 2) or the embedding table."""
  def mask(path, p) -> bool:
    return p.ndim >= 2 and not any(getattr(k, "key", None) == "embedding" for k in path)
  return jax.tree_util.tree_map_with_path(mask, params)


# Parameter names of the modules the sharing methods add (LISA's low-rank Q/K and aligner, UniAttn's W_c).
SHARING_MODULES = ("compensation", "q_lr", "k_lr", "align_in", "align_out", "align")


def trainable_labels(params, trainable: tuple[str, ...] | None):
  """``"train"`` for leaves under a module named in ``trainable`` (all leaves when None), else ``"frozen"``."""
  def label(path, _) -> str:
    names = {getattr(k, "key", None) for k in path}
    return "train" if trainable is None or names & set(trainable) else "frozen"
  return jax.tree_util.tree_map_with_path(label, params)


def count_trainable(params, trainable: tuple[str, ...] | None) -> int:
  labels = trainable_labels(params, trainable)
  return sum(int(p.size) for p, lab in zip(jax.tree.leaves(params), jax.tree.leaves(labels)) if lab == "train")


def make_optimizer(cfg: TrainConfig, trainable: tuple[str, ...] | None = None) -> optax.GradientTransformation:
  """The optimizer of :class:`~jaxshare.config.TrainConfig`; parameters are a pure dict pytree.

  Args:
    trainable: module names whose parameters are updated; the others are frozen through an optax
      ``multi_transform`` whose frozen partition is ``set_to_zero`` (and holds no optimizer state). None: all.
  """
  chain = []
  if cfg.clip_norm > 0:
    chain.append(optax.clip_by_global_norm(cfg.clip_norm))
  chain.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                           weight_decay=cfg.weight_decay, mask=decay_mask))
  tx = optax.chain(*chain)
  if trainable is None:
    return tx
  return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                               lambda params: trainable_labels(params, trainable))
