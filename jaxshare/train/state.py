"""What training derives from a config: schedule, model graph, mesh, shardings, optimizer and the train state."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxshare import parallel
from jaxshare.config import Config
from jaxshare.init.headwise import fresh_ties
from jaxshare.init.rules import InitRules
from jaxshare.init.source import initial_params, params_from_source
from jaxshare.model import build_model, remat
from jaxshare.model.ties import HeadTies
from jaxshare.plan import ModelPlan, plan_of
from jaxshare.schedule import Schedule
from jaxshare.train.optimizer import (SHARING_MODULES, count_trainable, frozen_paths, learning_rate_schedule,
                                      make_optimizer)
from jaxshare.train.step import TrainState


def trainable_for(cfg: Config, stage: int) -> tuple[str, ...] | None:
  """Module names the optimizer updates: UniAttn's stage 1 trains W_c only; ``train.trainable=sharing`` the new
  modules; else everything (None)."""
  if cfg.train.recipe == "uniattn_two_stage" and stage == 1:
    return ("compensation",)
  return SHARING_MODULES if cfg.train.trainable == "sharing" else None


@dataclasses.dataclass
class TrainSetup:
  """Static pieces of a run (no arrays)."""

  cfg: Config
  plan: ModelPlan
  mesh: Mesh
  graphdef: nnx.GraphDef
  abstract_params: nnx.State
  param_shardings: dict
  tx: optax.GradientTransformation
  lr_schedule: optax.Schedule
  state_shardings: TrainState
  batch_sharding: NamedSharding
  ties: HeadTies | None = None
  trainable: tuple[str, ...] | None = None
  frozen: frozenset[tuple] = frozenset()  # optimizer.frozen_paths: parameters the model marks as never trained
  init_rules: InitRules | None = None  # how parameters start from an uptraining source (train.init_*)

  @property
  def schedule(self) -> Schedule:
    return self.plan.schedule

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(self.abstract_params))

  @property
  def num_trainable(self) -> int:
    return count_trainable(nnx.to_pure_dict(self.abstract_params), self.trainable, self.frozen)


# ``setup_training``'s default ties: chosen afresh (None means "no ties", which a schedule that ties heads refuses).
FRESH_TIES = "fresh"


def setup_training(cfg: Config, mesh: Mesh | None = None, trainable: tuple[str, ...] | None = None,
                   ties: HeadTies | None | str = FRESH_TIES, start_step: int = 0, end_step: int | None = None,
                   plan: ModelPlan | None = None) -> TrainSetup:
  """Compile the schedule, trace the model abstractly and derive every sharding (nothing is allocated).

  Args:
    trainable: module names the optimizer updates (None: all); see :func:`trainable_for`.
    ties: head-wise sharing's ties (a run's stored ones, or those of its ``train.init_from`` source:
      :func:`~jaxshare.init.headwise.compute_ties`); None for a schedule that ties no heads; :data:`FRESH_TIES`
      (the default): chosen afresh, :func:`~jaxshare.init.headwise.fresh_ties`, which fixes the same shapes.
    start_step, end_step: where this optimizer's learning-rate schedule starts (a recipe stage's first step) and
      ends (None: ``train.steps``).
    plan: ``cfg``'s compiled plan where the caller holds it (a run's start); None: compiled here, where a setup
      starts from a config alone (the fit check, a benchmark).

  Raises:
    ScheduleError / ConfigError: the schedule or mesh does not fit the model or the devices; a remat policy the
      devices' platform lacks.
    ValueError: ``ties`` is None for a schedule that ties heads.
  """
  plan = plan_of(cfg) if plan is None else plan
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  remat.check_platform(cfg.model.remat, mesh.devices.flat[0].platform)
  if ties is None and plan.tied_heads:
    raise ValueError(f"setup_training: schedule.kind={cfg.schedule.kind!r} ties {plan.tied_heads} heads, but "
                     "ties=None; pass the run's ties (jaxshare.store.runs.StoredFiles.ties, compute_ties) or "
                     "FRESH_TIES")
  if isinstance(ties, str):
    if ties != FRESH_TIES:
      raise ValueError(f"setup_training: ties={ties!r}: pass HeadTies, None or FRESH_TIES ({FRESH_TIES!r})")
    ties = fresh_ties(plan, cfg.train.seed)
  abstract_model = nnx.eval_shape(lambda: build_model(plan, 0, ties))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  p_shard = parallel.param_shardings(abstract_params, mesh)
  frozen = frozen_paths(abstract_params)
  tx = make_optimizer(cfg.train, trainable, frozen, start_step, end_step)
  abstract_opt = jax.eval_shape(tx.init, nnx.to_pure_dict(abstract_params))
  replicated = NamedSharding(mesh, P())
  empty = optax.MaskedNode  # a frozen parameter's slot in a masked optimizer state: keep it empty
  opt_shard = optax.tree_map_params(tx, lambda x, s: x if isinstance(x, empty) else s, abstract_opt, p_shard,
                                    transform_non_params=lambda _: replicated,
                                    is_leaf=lambda x: isinstance(x, empty))
  lr = learning_rate_schedule(cfg.train, start_step, end_step)
  return TrainSetup(cfg, plan, mesh, graphdef, abstract_params, p_shard, tx, lambda step: lr(step - start_step),
                    TrainState(p_shard, opt_shard, replicated), parallel.batch_sharding(mesh),
                    ties, trainable, frozen, InitRules.of(cfg.train, cfg.schedule.kind))


def _fresh_state(setup: TrainSetup, seed: int, from_params: tuple[dict, Schedule] | None = None) -> TrainState:
  params = initial_params(setup.plan, setup.ties, seed)
  if from_params is not None:
    params = params_from_source(setup.plan, setup.init_rules, setup.ties, params, *from_params)
  return _train_state(setup, params, 0)


def _train_state(setup: TrainSetup, params: dict, step: int) -> TrainState:
  return TrainState(params, setup.tx.init(params), jnp.asarray(step, jnp.int32))


def state_from_params(setup: TrainSetup, params: dict, step: int) -> TrainState:
  """A train state at ``step`` around given parameters with a fresh optimizer, created sharded (a parameters-only
  checkpoint resumed in its own run directory)."""
  with jax.set_mesh(setup.mesh):
    return jax.jit(lambda p: _train_state(setup, p, step), out_shardings=setup.state_shardings)(params)


def init_state(setup: TrainSetup, seed: int | None = None,
               from_params: tuple[dict, Schedule] | None = None) -> TrainState:
  """Fresh optimizer state and parameters, created already sharded.

  Args:
    seed: parameter seed (default ``train.seed``).
    from_params: uptraining source ``(params, schedule)``: every shared parameter is copied from it
      by the rules of :func:`~jaxshare.init.source.params_from_source`.
  """
  seed = setup.cfg.train.seed if seed is None else seed
  src_params, src_schedule = from_params if from_params is not None else (None, None)

  def fresh(src: dict | None) -> TrainState:
    return _fresh_state(setup, seed, None if src is None else (src, src_schedule))

  with jax.set_mesh(setup.mesh):
    return jax.jit(fresh, out_shardings=setup.state_shardings)(src_params)


def abstract_state(setup: TrainSetup) -> TrainState:
  """The train state's ``ShapeDtypeStruct`` values (with shardings), the restore target for checkpoints."""
  shapes = jax.eval_shape(lambda: _fresh_state(setup, 0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                      setup.state_shardings)
