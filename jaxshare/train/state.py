"""Everything a run derives from its config: schedule, model graph, mesh, shardings, optimizer, train state."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxshare import accounting, parallel
from jaxshare.config import Config
from jaxshare.headwise import HeadTies, dense_kernels, direct_share, tied_params_from_dense
from jaxshare.model import Transformer
from jaxshare.schedule import Schedule, compile_schedule
from jaxshare.train.optimizer import learning_rate_schedule, make_optimizer
from jaxshare.train.step import TrainState


def build_model(cfg: Config, schedule: Schedule, seed: int, ties: HeadTies | None = None) -> Transformer:
  """The NNX model of ``cfg`` with parameters drawn from ``seed`` (``ties``: head-wise sharing's head map)."""
  return Transformer(cfg.model, schedule, mlp_dim=accounting.mlp_dim(cfg.model, schedule, cfg.schedule.match_params),
                     attention_impl=cfg.attention.impl, score_sharing=cfg.attention.score_sharing,
                     sched=cfg.schedule, ties=ties, rngs=nnx.Rngs(seed))


def dense_counterpart(cfg: Config) -> tuple[Config, Schedule]:
  """The same model with a plain dense schedule (what head-wise sharing is selected on and converted from)."""
  dense = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, kind="dense"))
  return dense, compile_schedule(dense.model, dense.schedule)


def compute_ties(cfg: Config, schedule: Schedule, seed: int) -> HeadTies | None:
  """DirectShare's head ties, selected on the dense model initialised from ``seed`` (None without head-wise)."""
  if not schedule.tied_heads:
    return None
  dense_cfg, dense_schedule = dense_counterpart(cfg)
  params = nnx.to_pure_dict(nnx.state(build_model(dense_cfg, dense_schedule, seed), nnx.Param))
  weights = dense_kernels(params, dense_schedule, cfg.model.num_layers)
  return direct_share(weights, schedule.tied_heads, cfg.schedule.headwise.match)


@dataclasses.dataclass
class RunSetup:
  """Static pieces of a run (no arrays)."""

  cfg: Config
  schedule: Schedule
  mesh: Mesh
  graphdef: nnx.GraphDef
  abstract_params: nnx.State
  param_shardings: dict
  tx: optax.GradientTransformation
  lr_schedule: optax.Schedule
  state_shardings: dict
  batch_sharding: NamedSharding
  ties: HeadTies | None = None

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(self.abstract_params))


def setup_run(cfg: Config, mesh: Mesh | None = None) -> RunSetup:
  """Compile the schedule, trace the model abstractly and derive every sharding (nothing is allocated).

  Raises:
    ScheduleError / ConfigError: the schedule or mesh does not fit the model or the devices.
  """
  schedule = compile_schedule(cfg.model, cfg.schedule)
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  ties = compute_ties(cfg, schedule, cfg.train.seed)
  abstract_model = nnx.eval_shape(lambda: build_model(cfg, schedule, 0, ties))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  p_shard = parallel.param_shardings(abstract_params, mesh)
  tx = make_optimizer(cfg.train)
  abstract_opt = jax.eval_shape(tx.init, nnx.to_pure_dict(abstract_params))
  replicated = NamedSharding(mesh, P())
  opt_shard = optax.tree_map_params(tx, lambda _, s: s, abstract_opt, p_shard,
                                    transform_non_params=lambda _: replicated)
  batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
  return RunSetup(cfg, schedule, mesh, graphdef, abstract_params, p_shard, tx, learning_rate_schedule(cfg.train),
                  {"params": p_shard, "opt_state": opt_shard, "step": replicated},
                  NamedSharding(mesh, P(batch_axes, None)), ties)


def initial_params(setup: RunSetup, seed: int) -> dict:
  """Fresh parameters; a head-wise model starts as DirectShare applied to the dense model of the same seed."""
  params = nnx.to_pure_dict(nnx.state(build_model(setup.cfg, setup.schedule, seed, setup.ties), nnx.Param))
  if setup.ties is None:
    return params
  dense_cfg, dense_schedule = dense_counterpart(setup.cfg)
  dense = nnx.to_pure_dict(nnx.state(build_model(dense_cfg, dense_schedule, seed), nnx.Param))
  return tied_params_from_dense(dense, params, setup.ties, dense_schedule)


def _fresh_state(setup: RunSetup, seed: int) -> TrainState:
  params = initial_params(setup, seed)
  return {"params": params, "opt_state": setup.tx.init(params), "step": jnp.zeros((), jnp.int32)}


def init_state(setup: RunSetup, seed: int | None = None) -> TrainState:
  """Fresh parameters (from ``seed``, default ``train.seed``) and optimizer state, created already sharded."""
  seed = setup.cfg.train.seed if seed is None else seed
  with jax.set_mesh(setup.mesh):
    return jax.jit(lambda: _fresh_state(setup, seed), out_shardings=setup.state_shardings)()


def abstract_state(setup: RunSetup) -> Any:
  """``ShapeDtypeStruct`` tree (with shardings) of the train state, the restore target for checkpoints."""
  shapes = jax.eval_shape(lambda: _fresh_state(setup, 0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                      setup.state_shardings)


def shard_batch(setup: RunSetup, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Assemble this process's numpy batch into global arrays sharded over the batch axes."""
  return {k: jax.make_array_from_process_local_data(setup.batch_sharding, np.asarray(v)) for k, v in batch.items()}
