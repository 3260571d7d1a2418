"""Training recipes beyond plain LM pretraining: the auxiliary objective (LISA distillation, PostShare) and UniAttn's
two-stage schedule."""

from __future__ import annotations

from jax.sharding import Mesh

from jaxshare import distributed
from jaxshare.config import Config, ConfigError, ScoreReuse
from jaxshare.init.headwise import dense_kernels, direct_share
from jaxshare.init.source import initial_params
from jaxshare.model.ties import HeadTies, PostSharePairs
from jaxshare.plan import ModelPlan
from jaxshare.store.runs import Run
from jaxshare.schedule import tied_head_count
from jaxshare.train.state import TrainSetup, setup_training, trainable_for
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


def end_step(cfg: Config, stage: int, stage_start: int) -> int:
  """The step a run ends at: ``train.steps``, or, in UniAttn's stage 2 under ``train.stage2_steps``, that many steps
  after stage 1 ended at ``stage_start`` (UniAttn Alg. 1: fine-tuning gets its own budget)."""
  t = cfg.train
  return stage_start + t.stage2_steps if stage == 2 and t.stage2_steps else t.steps


def stage_of(cfg: Config, meta: dict) -> tuple[int, int]:
  """``(stage, stage_start)`` of a run whose newest checkpoint's metadata is ``meta`` ({} for a fresh start): UniAttn's
  recipe stage (0 without the two-stage recipe) and the step its learning-rate schedule began."""
  return meta.get("stage", 0) or (1 if cfg.train.recipe == "uniattn_two_stage" else 0), meta.get("stage_start", 0)


def stage_setup(cfg: Config, plan: ModelPlan, mesh: Mesh, ties: HeadTies | None, stage: int, stage_start: int
                ) -> TrainSetup:
  """The setup of the run of ``cfg`` (compiled: ``plan``) in recipe stage ``stage`` begun at ``stage_start``: what
  trains (:func:`trainable_for`) and the learning-rate schedule from ``stage_start`` to :func:`end_step`."""
  return setup_training(cfg, mesh, trainable_for(cfg, stage), ties, start_step=stage_start,
                        end_step=end_step(cfg, stage, stage_start), plan=plan)


def postshare_pairs(cfg: Config, setup: TrainSetup, teacher: Run | None, saved: PostSharePairs | None
                    ) -> PostSharePairs | None:
  """PostShare's head pairs (None without PostShare): ``saved``, the run directory's
  (:meth:`jaxshare.store.runs.StoredFiles.pairs`) when it has them, else chosen by DirectShare's matching (Head-wise
  Shareable Attention, Sec. 4.3) on the pretrained weights (``init_from``) or, from scratch, on the initial ones.

  Chosen once and stored with the run (:func:`jaxshare.store.runs.write_run_files`): a resumed run penalises the same
  pairs, and a head-wise run initialised from this one ties exactly them (:func:`jaxshare.init.headwise.compute_ties`).

  Raises:
    ConfigError: PostShare on a model that is not an untied dense MHA model.
  """
  t = cfg.train
  if t.postshare_gamma <= 0:
    return None
  if any(not (p.is_producer and p.has_query_key and p.num_kv_heads == cfg.model.num_heads)
         for p in setup.schedule.layers) or setup.ties is not None:
    raise ConfigError(f"train.postshare_gamma={t.postshare_gamma} needs an untied dense MHA model; schedule.kind="
                      f"{cfg.schedule.kind!r} is not")
  if saved is not None:
    return saved
  source = (teacher.params, teacher.schedule) if teacher is not None else (
    initial_params(setup.plan, setup.ties, t.seed), setup.schedule)
  weights = dense_kernels(distributed.to_host(source[0]), source[1], cfg.model.num_layers)
  match = cfg.schedule.headwise.match
  return PostSharePairs(direct_share(weights, tied_head_count(cfg.model, t.postshare_ratio), match).pairs, match,
                        t.postshare_ratio)


def build_objective(cfg: Config, setup: TrainSetup, teacher: Run | None, pairs: PostSharePairs | None) -> Objective:
  """The auxiliary losses of ``cfg`` (``teacher``: distillation's, :func:`~jaxshare.store.teacher.resolve_teacher`;
  ``pairs``: PostShare's, from :func:`postshare_pairs`).

  Raises:
    ConfigError: distillation without LISA layers.
  """
  t = cfg.train
  kd_layers = tuple(p.index for p in setup.schedule.layers if p.score_reuse == ScoreReuse.LOGITS)
  if t.kd_beta > 0 and not kd_layers:
    raise ConfigError(f"train.kd_beta={t.kd_beta} distils attention logits on LISA layers, but schedule.kind="
                      f"{cfg.schedule.kind!r} has none")
  return Objective(kd_beta=t.kd_beta, kd_delta=t.kd_delta, kd_layers=kd_layers,
                   teacher_graphdef=teacher.graphdef if teacher is not None else None,
                   postshare_gamma=t.postshare_gamma, postshare_pairs=None if pairs is None else pairs.pairs,
                   schedule=setup.schedule, window=cfg.model.sliding_window, vocab_tiles=t.num_vocab_tiling)
