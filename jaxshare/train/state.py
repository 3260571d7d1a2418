"""Everything a run derives from its config: schedule, model graph, mesh, shardings, optimizer, train state."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from etils import epath
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxshare import accounting, distributed, parallel
from jaxshare.config import Config, ConfigError, HeadwiseConfig, MeshConfig, config_from_yaml_text
from jaxshare.headwise import (POSTSHARE_PAIRS_FILE, HeadTies, dense_kernels, direct_share, load_pairs,
                               ties_from_pairs, tied_params_from_dense)
from jaxshare.model import Transformer
from jaxshare.convert.uptrain import convert_kv, init_low_rank, widen_mlp
from jaxshare.model.params import copy_shared_weights
from jaxshare.schedule import Schedule, compile_schedule
from jaxshare.train.checkpoint import CheckpointError, Checkpointer, absolute
from jaxshare.train.optimizer import (SHARING_MODULES, count_trainable, frozen_paths, learning_rate_schedule,
                                      make_optimizer)
from jaxshare.train.step import TrainState


def build_model(cfg: Config, schedule: Schedule, seed: int, ties: HeadTies | None = None) -> Transformer:
  """The NNX model of ``cfg`` with parameters drawn from ``seed`` (``ties``: head-wise sharing's head map)."""
  return Transformer(cfg.model, schedule, mlp_dim=accounting.mlp_dim(cfg.model, schedule,
                                                                    accounting.param_match(cfg.schedule)),
                     attention_impl=cfg.attention.impl, score_sharing=cfg.attention.score_sharing, ties=ties,
                     rngs=nnx.Rngs(seed))


def dense_counterpart(cfg: Config) -> tuple[Config, Schedule]:
  """The same model with a plain dense schedule (what head-wise sharing is selected on and converted from)."""
  dense = dataclasses.replace(cfg, schedule=dataclasses.replace(cfg.schedule, kind="dense", headwise=HeadwiseConfig()))
  return dense, compile_schedule(dense.model, dense.schedule)


def with_match_reference(cfg: Config) -> Config:
  """``cfg`` with ``schedule.match_reference_params`` set to its uptraining source's total parameter count, when it
  matches parameters exactly (``schedule.match_params``) from ``train.init_from`` and the reference is not yet set:
  an uptrained model is matched to the model it came from (a GQA source has fewer K/V parameters than the dense MHA
  model of its config). The count is the source's exact one (:func:`~jaxshare.accounting.param_count`, read from its
  config alone) and stays in the run's config, so the run rebuilds without its source.

  Raises:
    ConfigError: the source is not a run directory, or its config is unreadable.
  """
  s = cfg.schedule
  if not (s.match_params and s.match_formula == "exact" and not s.match_reference_params and cfg.train.init_from):
    return cfg
  src_dir, _ = locate(cfg.train.init_from)
  src = config_from_yaml_text((src_dir / "config.yaml").read_text(), str(src_dir / "config.yaml"))
  src_schedule = compile_schedule(src.model, src.schedule)
  total = accounting.param_count(src.model, src_schedule, accounting.param_match(src.schedule)).total
  return dataclasses.replace(cfg, schedule=dataclasses.replace(s, match_reference_params=total))


def compute_ties(cfg: Config, schedule: Schedule, seed: int, mesh: Mesh | None = None) -> HeadTies | None:
  """DirectShare's head ties (None without head-wise sharing), selected on the dense model the run starts from:
  ``train.init_from`` when set (uptraining), else the dense model initialised from ``seed``. A PostShare run as
  ``init_from`` gives exactly the pairs its penalty pulled together (each component's representative chosen on its
  trained weights).

  Raises:
    ConfigError: ``train.init_from`` is not a dense MHA run, or is a PostShare run whose pairs disagree with
      ``schedule.headwise`` (another count or match function).
  """
  if not schedule.tied_heads:
    return None
  if not cfg.train.init_from:
    dense_cfg, dense_schedule = dense_counterpart(cfg)
    params = nnx.to_pure_dict(nnx.state(build_model(dense_cfg, dense_schedule, seed), nnx.Param))
    return direct_share(dense_kernels(params, dense_schedule, cfg.model.num_layers), schedule.tied_heads,
                        cfg.schedule.headwise.match)
  src_cfg, src_setup, params, _ = load_run(cfg.train.init_from, mesh)
  if src_setup.ties is not None:  # already head-wise (e.g. `convert uptrain`'s output): training goes on with its ties
    if (src_setup.schedule.tied_heads, src_cfg.schedule.headwise.match) != (schedule.tied_heads,
                                                                           cfg.schedule.headwise.match):
      raise ConfigError(f"train.init_from={cfg.train.init_from!r} ties {src_setup.schedule.tied_heads} heads matched "
                        f"by {src_cfg.schedule.headwise.match!r}; schedule.headwise (ratio "
                        f"{cfg.schedule.headwise.ratio}, match {cfg.schedule.headwise.match!r}) would tie "
                        f"{schedule.tied_heads} by {cfg.schedule.headwise.match!r}: set schedule.headwise.ratio="
                        f"{src_cfg.schedule.headwise.ratio} and match={src_cfg.schedule.headwise.match!r}")
    return src_setup.ties
  if src_setup.schedule.kind != "dense":
    raise ConfigError(f"train.init_from={cfg.train.init_from!r} has schedule {src_setup.schedule.kind!r}: "
                      "head-wise sharing is selected on a dense MHA model (or continued from a head-wise one)")
  weights = dense_kernels(distributed.to_host(params), src_setup.schedule, cfg.model.num_layers)
  pairs_file = locate(cfg.train.init_from)[0] / POSTSHARE_PAIRS_FILE
  if not pairs_file.exists():
    return direct_share(weights, schedule.tied_heads, cfg.schedule.headwise.match)
  post = load_pairs(pairs_file)
  if len(post["pairs"]["q"]) != schedule.tied_heads:
    raise ConfigError(f"train.init_from={cfg.train.init_from!r} is a PostShare run that penalised "
                      f"{len(post['pairs']['q'])} head pairs (train.postshare_ratio={post['ratio']}); "
                      f"schedule.headwise.ratio={cfg.schedule.headwise.ratio} would tie {schedule.tied_heads}: set "
                      f"schedule.headwise.ratio={post['ratio']} to tie exactly the penalised pairs")
  if post["match"] != cfg.schedule.headwise.match:
    raise ConfigError(f"schedule.headwise.match={cfg.schedule.headwise.match!r} is invalid with train.init_from="
                      f"{cfg.train.init_from!r}: its PostShare pairs were matched with {post['match']!r}")
  return ties_from_pairs(weights, post["pairs"], post["match"])


def trainable_for(cfg: Config, stage: int) -> tuple[str, ...] | None:
  """Module names the optimizer updates: UniAttn's stage 1 trains W_c only; ``train.trainable=sharing`` the new
  modules; else everything (None)."""
  if cfg.train.recipe == "uniattn_two_stage" and stage == 1:
    return ("compensation",)
  return SHARING_MODULES if cfg.train.trainable == "sharing" else None


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
  trainable: tuple[str, ...] | None = None
  frozen: frozenset[tuple] = frozenset()  # optimizer.frozen_paths: parameters the model marks as never trained

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(self.abstract_params))

  @property
  def num_trainable(self) -> int:
    return count_trainable(nnx.to_pure_dict(self.abstract_params), self.trainable, self.frozen)


def setup_run(cfg: Config, mesh: Mesh | None = None, trainable: tuple[str, ...] | None = None,
              ties: HeadTies | None = None, start_step: int = 0) -> RunSetup:
  """Compile the schedule, trace the model abstractly and derive every sharding (nothing is allocated).

  Args:
    trainable: module names the optimizer updates (None: all); see :func:`trainable_for`.
    ties: head-wise sharing's ties when already known (default: :func:`compute_ties`).
    start_step: where this optimizer's learning-rate schedule starts (a recipe stage's first step).

  Raises:
    ScheduleError / ConfigError: the schedule or mesh does not fit the model or the devices.
  """
  schedule = compile_schedule(cfg.model, cfg.schedule)
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  ties = ties if ties is not None else compute_ties(cfg, schedule, cfg.train.seed, mesh)
  abstract_model = nnx.eval_shape(lambda: build_model(cfg, schedule, 0, ties))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  p_shard = parallel.param_shardings(abstract_params, mesh)
  frozen = frozen_paths(abstract_params)
  tx = make_optimizer(cfg.train, trainable, frozen, start_step)
  abstract_opt = jax.eval_shape(tx.init, nnx.to_pure_dict(abstract_params))
  replicated = NamedSharding(mesh, P())
  empty = optax.MaskedNode  # a frozen parameter's slot in a masked optimizer state: keep it empty
  opt_shard = optax.tree_map_params(tx, lambda x, s: x if isinstance(x, empty) else s, abstract_opt, p_shard,
                                    transform_non_params=lambda _: replicated,
                                    is_leaf=lambda x: isinstance(x, empty))
  batch_axes = tuple(a for a in ("data", "fsdp") if mesh.shape[a] > 1) or None
  lr = learning_rate_schedule(cfg.train, start_step)
  return RunSetup(cfg, schedule, mesh, graphdef, abstract_params, p_shard, tx, lambda step: lr(step - start_step),
                  {"params": p_shard, "opt_state": opt_shard, "step": replicated},
                  NamedSharding(mesh, P(batch_axes, None)), ties, trainable, frozen)


def initial_params(setup: RunSetup, seed: int) -> dict:
  """Fresh parameters; a head-wise model starts as DirectShare applied to the dense model of the same seed."""
  params = nnx.to_pure_dict(nnx.state(build_model(setup.cfg, setup.schedule, seed, setup.ties), nnx.Param))
  if setup.ties is None:
    return params
  dense_cfg, dense_schedule = dense_counterpart(setup.cfg)
  dense = nnx.to_pure_dict(nnx.state(build_model(dense_cfg, dense_schedule, seed), nnx.Param))
  return tied_params_from_dense(dense, params, setup.ties, dense_schedule)


def init_kv_pool(cfg: Config) -> str:
  """``train.init_kv_pool`` resolved (``auto``: the producer's own K/V for CLA, the group mean otherwise)."""
  if cfg.train.init_kv_pool != "auto":
    return cfg.train.init_kv_pool
  return "producer" if "cla" in cfg.schedule.kind.split("+") else "mean"


def _fresh_state(setup: RunSetup, seed: int, from_params: tuple[dict, Schedule] | None = None) -> TrainState:
  params = initial_params(setup, seed)
  if from_params is not None and setup.ties is None:
    params = copy_shared_weights(from_params[0], from_params[1], params, setup.schedule)
    params = convert_kv(from_params[0], from_params[1], params, setup.schedule, kv_pool=init_kv_pool(setup.cfg))
    params = widen_mlp(from_params[0], from_params[1], params, setup.schedule, rule=setup.cfg.train.init_mlp_widen)
    params = init_low_rank(from_params[0], from_params[1], params, setup.schedule, setup.cfg.train.init_lisa)
  elif from_params is not None and "head_table" in from_params[0]:  # a head-wise source with these ties: its weights
    params = {**copy_shared_weights(from_params[0], from_params[1], params, setup.schedule),
              "head_table": from_params[0]["head_table"]}
  elif from_params is not None:  # DirectShare uptraining: the head table from the source's tied heads
    params = tied_params_from_dense(from_params[0], params, setup.ties, from_params[1])
  return _train_state(setup, params, 0)


def _train_state(setup: RunSetup, params: dict, step: int) -> TrainState:
  return {"params": params, "opt_state": setup.tx.init(params), "step": jnp.asarray(step, jnp.int32)}


def state_from_params(setup: RunSetup, params: dict, step: int) -> TrainState:
  """A train state at ``step`` around given parameters with a fresh optimizer, created sharded (a parameters-only
  checkpoint resumed in its own run directory)."""
  with jax.set_mesh(setup.mesh):
    return jax.jit(lambda p: _train_state(setup, p, step), out_shardings=setup.state_shardings)(params)


def init_state(setup: RunSetup, seed: int | None = None,
               from_params: tuple[dict, Schedule] | None = None) -> TrainState:
  """Fresh optimizer state and parameters, created already sharded.

  Args:
    seed: parameter seed (default ``train.seed``).
    from_params: uptraining source ``(params, schedule)``: every shared parameter is copied from it
      (:func:`~jaxshare.model.params.copy_shared_weights`; DirectShare's conversion for head-wise models).
  """
  seed = setup.cfg.train.seed if seed is None else seed
  src_params, src_schedule = from_params if from_params is not None else (None, None)

  def fresh(src: dict | None) -> TrainState:
    return _fresh_state(setup, seed, None if src is None else (src, src_schedule))

  with jax.set_mesh(setup.mesh):
    return jax.jit(fresh, out_shardings=setup.state_shardings)(src_params)


def abstract_state(setup: RunSetup) -> Any:
  """``ShapeDtypeStruct`` tree (with shardings) of the train state, the restore target for checkpoints."""
  shapes = jax.eval_shape(lambda: _fresh_state(setup, 0))
  return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                      setup.state_shardings)


def local_batch_rows(sharding: NamedSharding, batch_size: int) -> slice:
  """The rows of a ``[batch_size, ...]`` global batch that this process's devices hold under ``sharding``: what
  this process must feed (:class:`~jaxshare.data.Datasets` reads only those).

  Raises:
    ConfigError: the rows are not one contiguous block of ``batch_size / process_count`` (a mesh whose batch axes do
      not follow the processes' devices).
  """
  spans = {idx[0].indices(batch_size)[:2] for idx in sharding.addressable_devices_indices_map((batch_size,)).values()}
  start, stop = min(a for a, _ in spans), max(b for _, b in spans)
  covered = set().union(*(range(a, b) for a, b in spans))
  if covered != set(range(start, stop)) or (stop - start) * jax.process_count() != batch_size:
    raise ConfigError(f"this process's devices hold batch rows {sorted(spans)} of {batch_size}: the mesh's batch axes "
                      f"(data, fsdp) must give each of the {jax.process_count()} processes one contiguous block; put "
                      "the process split on mesh.dcn_data or on the data/fsdp sizes")
  return slice(start, stop)


def shard_batch(setup: RunSetup, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
  """Assemble this process's numpy batch into global arrays sharded over the batch axes."""
  if jax.process_count() == 1:  # one transfer call for the whole batch: ~10x less host time than assembling per array
    return jax.device_put({k: np.asarray(v) for k, v in batch.items()}, setup.batch_sharding)
  return {k: jax.make_array_from_process_local_data(setup.batch_sharding, np.asarray(v)) for k, v in batch.items()}


def locate(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
  """``(run_dir, step)`` for a run directory (latest step) or a checkpoint step directory.

  Raises:
    ConfigError: the path holds neither.
  """
  p = absolute(path)
  if (p / "config.yaml").is_file():
    return p, None
  if p.name.isdigit() and (p.parent.parent / "config.yaml").is_file():
    return p.parent.parent, int(p.name)
  raise ConfigError(f"{str(p)!r} is neither a run directory (with config.yaml) nor a checkpoint step directory "
                    "(<run_dir>/checkpoints/<step>)")


def load_run(path: str | os.PathLike, mesh: Mesh | None = None) -> tuple[Config, RunSetup, dict, int]:
  """Load a run directory (latest checkpoint) or checkpoint step directory.

  Args:
    mesh: where the parameters land, sharded by the logical rules. Default: one device in a single-process run
      (evaluation, conversion); every device, fully sharded over ``fsdp``, in a multi-process one (a device of one
      process is not addressable from the others).

  Returns:
    ``(config, run setup, params pure dict, step)``.

  Raises:
    ConfigError: bad path or saved config. CheckpointError: no, corrupt or mismatched checkpoint.
  """
  run_dir, step = locate(path)
  cfg: Config = config_from_yaml_text((run_dir / "config.yaml").read_text(), str(run_dir / "config.yaml"))
  if mesh is None:
    cfg.mesh = MeshConfig() if jax.process_count() == 1 else MeshConfig(fsdp=-1)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:1] if jax.process_count() == 1 else None)
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)
  step = ckpt.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f"run directory {str(run_dir)!r} has no checkpoint yet")
  meta = ckpt.read_meta(step)
  setup = setup_run(cfg, mesh, trainable_for(cfg, meta.get("stage", 0)))
  params = ckpt.restore_params(step, abstract_state(setup)["params"], meta)
  ckpt.close()
  if not bool(jax.jit(lambda p: jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(p)])))(params)):
    raise CheckpointError(f"checkpoint {run_dir / 'checkpoints' / str(step)} holds non-finite parameters (NaN or inf): "
                          "its run diverged before it was saved; use an earlier checkpoint "
                          f"({run_dir / 'checkpoints'}/<step>)")
  return cfg, setup, params, int(step)
