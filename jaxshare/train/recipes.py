"""Training recipes beyond plain LM pretraining: the auxiliary objective (LISA distillation, PostShare) and UniAttn's
two-stage schedule."""

from __future__ import annotations

import jax

from jaxshare.config import Config, ConfigError
from jaxshare.headwise import dense_kernels, direct_share
from jaxshare.schedule import tied_head_count
from jaxshare.train.state import RunSetup, initial_params
from jaxshare.train.step import Objective


class Stage1Monitor:
  """UniAttn stage 1's early stopping: an EMA of the training loss that must keep reaching new minima."""

  def __init__(self, decay: float, patience: int, max_steps: int):
    self.decay, self.patience, self.max_steps = decay, patience, max_steps
    self.ema: float | None = None
    self.best, self.since_best, self.steps = float("inf"), 0, 0

  def state(self) -> dict:
    return {"ema": self.ema, "best": self.best, "since_best": self.since_best, "steps": self.steps}

  def load(self, state: dict) -> None:
    self.ema, self.best = state["ema"], state["best"]
    self.since_best, self.steps = state["since_best"], state["steps"]

  def update(self, loss: float) -> bool:
    """Record one step's loss; True when stage 1 should end."""
    self.ema = loss if self.ema is None else self.decay * self.ema + (1 - self.decay) * loss
    self.steps += 1
    if self.ema < self.best:
      self.best, self.since_best = self.ema, 0
    else:
      self.since_best += 1
    return self.since_best >= self.patience or self.steps >= self.max_steps


def build_objective(cfg: Config, setup: RunSetup, teacher: RunSetup | None, teacher_params: dict | None) -> Objective:
  """The auxiliary losses of ``cfg``; PostShare's pairs are selected on the pretrained weights (``init_from``) or,
  from scratch, on the initial ones."""
  t = cfg.train
  kd_layers = tuple(p.index for p in setup.schedule.layers if p.score_reuse == "logits")
  if t.kd_beta > 0 and not kd_layers:
    raise ConfigError(f"train.kd_beta={t.kd_beta} distils attention logits on LISA layers, but schedule.kind="
                      f"{cfg.schedule.kind!r} has none")
  pairs = None
  if t.postshare_gamma > 0:
    if any(not (p.is_producer and p.has_query_key and p.num_kv_heads == cfg.model.num_heads)
           for p in setup.schedule.layers) or setup.ties is not None:
      raise ConfigError(f"train.postshare_gamma={t.postshare_gamma} needs an untied dense MHA model; schedule.kind="
                        f"{cfg.schedule.kind!r} is not")
    n = tied_head_count(cfg.model, t.postshare_ratio)
    if teacher is not None:
      weights = dense_kernels(jax.device_get(teacher_params), teacher.schedule, cfg.model.num_layers)
    else:
      weights = dense_kernels(jax.device_get(initial_params(setup, t.seed)), setup.schedule, cfg.model.num_layers)
    pairs = direct_share(weights, n, cfg.schedule.headwise.match)
  return Objective(kd_beta=t.kd_beta, kd_delta=t.kd_delta, kd_layers=kd_layers,
                   teacher_graphdef=teacher.graphdef if teacher is not None else None,
                   postshare_gamma=t.postshare_gamma, postshare_pairs=pairs, schedule=setup.schedule)
