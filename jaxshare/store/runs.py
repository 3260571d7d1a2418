"""A run directory, read and written in one place.

Layout::

  <run>/config.yaml          the validated config (written atomically)
  <run>/head_ties.json       head-wise sharing's ties, when the schedule ties heads (chosen once, never re-chosen)
  <run>/postshare_pairs.json PostShare's penalised head pairs, when the run trains with PostShare (chosen once)
  <run>/checkpoints/<step>/  orbax checkpoints (:mod:`jaxshare.store.checkpoint`)
  <run>/tokenizer/           the tokenizer files of a converted model (``data.tokenizer`` points here)
  <run>/metrics.jsonl ...    training's logs (:mod:`jaxshare.train.metrics`)

Reading a run needs no optimizer: :func:`load_run` builds the model abstractly and restores only its parameters,
so evaluation, conversion, analysis and sweeps never import the training package.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx
from jax.sharding import Mesh

from jaxshare import parallel
from jaxshare.store.checkpoint import CheckpointError, Checkpointer, finished_steps, save_params
from jaxshare.config import Config, ConfigError, MeshConfig, config_from_yaml_text, to_yaml
from jaxshare.data import Tokenizer, make_tokenizer
from jaxshare.files import absolute, write_atomic
from jaxshare.model import Transformer, build_model
from jaxshare.model.ties import HeadTies, PostSharePairs
from jaxshare.plan import ModelPlan, plan_of
from jaxshare.schedule import Schedule

CONFIG_FILE = "config.yaml"
TIES_FILE = "head_ties.json"
PAIRS_FILE = "postshare_pairs.json"
TOKENIZER_DIR = "tokenizer"


def locate(path: str | os.PathLike) -> tuple[epath.Path, int | None]:
  """``(run_dir, step)`` for a run directory (step None: the latest) or a checkpoint step directory.

  Raises:
    ConfigError: the path holds neither.
  """
  p = absolute(path)
  if (p / CONFIG_FILE).is_file():
    return p, None
  if p.name.isdigit() and (p.parent.parent / CONFIG_FILE).is_file():
    return p.parent.parent, int(p.name)
  raise ConfigError(f"{str(p)!r} is neither a run directory (with {CONFIG_FILE}) nor a checkpoint step directory "
                    "(<run_dir>/checkpoints/<step>)")


def read_config(run_dir: str | os.PathLike) -> Config:
  """The validated config of run directory ``run_dir`` (as :func:`locate` returns it: absolute, local or a URL).

  Raises:
    ConfigError: missing, unreadable or invalid ``config.yaml``.
  """
  run_dir = epath.Path(run_dir)
  return StoredFiles(run_dir, _read_text(run_dir / CONFIG_FILE), None, None).config()


def write_run_files(run_dir: str | os.PathLike, config_yaml: str, ties: HeadTies | None = None,
                    pairs: PostSharePairs | None = None) -> None:
  """Write ``config.yaml`` (``config_yaml``: the run's config as :func:`~jaxshare.config.to_yaml` writes it) and,
  when given, head-wise sharing's ties and PostShare's pairs, each through a temporary file renamed over it: a kill
  mid-write never leaves a torn one."""
  texts = {CONFIG_FILE: config_yaml, TIES_FILE: ties and ties.to_json(), PAIRS_FILE: pairs and pairs.to_json()}
  for name, text in texts.items():
    if text is not None:
      write_atomic(epath.Path(run_dir) / name, text)


def write_ties(run_dir: str | os.PathLike, ties: HeadTies) -> None:
  """Save head-wise sharing's ties beside the run's checkpoints (atomically, as :func:`write_run_files`)."""
  write_atomic(epath.Path(run_dir) / TIES_FILE, ties.to_json())


@dataclasses.dataclass(frozen=True)
class StoredFiles:
  """A run directory's own files (not its checkpoints), read in one call (:func:`read_stored`): what a start, a load
  or a migration needs of the directory.

  Attributes:
    directory: the run directory (absolute, local or a URL).
    config_text: ``config.yaml`` as written (None: not written yet); parsed by :meth:`config`.
    ties_text: head-wise sharing's ties as written (None: none stored); checked against a plan by :meth:`ties`.
    pairs_text: PostShare's penalised head pairs as written (None: none stored); parsed by :meth:`pairs`.
  Each file is parsed only where it is asked for, so that a damaged file fails only what needs it.
  """

  directory: epath.Path
  config_text: str | None
  ties_text: str | None
  pairs_text: str | None

  def config(self) -> Config:
    """The validated saved config.

    Raises:
      ConfigError: none was written, or it is invalid.
    """
    path = self.directory / CONFIG_FILE
    if self.config_text is None:
      raise ConfigError(f"cannot read {str(path)!r}: the run directory has no {CONFIG_FILE}")
    return config_from_yaml_text(self.config_text, str(path))

  def planned(self) -> tuple[Config, ModelPlan]:
    """The validated saved config and its compiled plan (compiled here, once per read of the run).

    Raises:
      ConfigError: as :meth:`config`. ScheduleError: the saved schedule does not fit its model.
    """
    cfg = self.config()
    return cfg, plan_of(cfg)

  def ties(self, plan: ModelPlan) -> HeadTies | None:
    """The stored head-wise ties of the run whose compiled model is ``plan`` (None when its schedule ties no heads).

    Raises:
      CheckpointError: the schedule ties heads and the file is missing (a run written before ties were stored with
        it: the message gives the command that re-creates them), malformed, or ties another number of heads.
    """
    schedule = plan.schedule
    if not schedule.tied_heads:
      return None
    path = self.directory / TIES_FILE
    recreate = f"`python -m jaxshare.convert ties {self.directory}`"
    if self.ties_text is None:
      raise CheckpointError(f"run {str(self.directory)!r} ties {schedule.tied_heads} heads but has no {TIES_FILE} "
                            "(written before jaxshare stored head-wise ties with the run): re-create them once with "
                            f"{recreate}")
    try:
      ties = HeadTies.from_json(self.ties_text, repr(str(path)))
      ties.check(len(schedule.layers), plan.model.num_heads, schedule.tied_heads, repr(str(path)))
    except ValueError as e:
      raise CheckpointError(f"{e}: delete it and re-create it with {recreate}") from None
    return ties

  def pairs(self) -> PostSharePairs | None:
    """PostShare's penalised head pairs (None: none stored: not a PostShare run, or not started yet).

    Raises:
      CheckpointError: the file is malformed.
    """
    if self.pairs_text is None:
      return None
    try:
      return PostSharePairs.from_json(self.pairs_text, repr(str(self.directory / PAIRS_FILE)))
    except ValueError as e:
      raise CheckpointError(f"{e}: restore the file (a resumed run penalises the pairs it started with), or start "
                            "afresh in a new train.run_dir") from None


def read_stored(run_dir: str | os.PathLike) -> StoredFiles:
  """Every file of run directory ``run_dir`` but its checkpoints, read once (parsed when asked for).

  Raises:
    ConfigError: a file exists but cannot be read.
  """
  run_dir = epath.Path(run_dir)
  return StoredFiles(run_dir, *(_read_text(run_dir / name) for name in (CONFIG_FILE, TIES_FILE, PAIRS_FILE)))


def _read_text(path: epath.Path) -> str | None:
  """The text of ``path`` (None: there is no such file).

  Raises:
    ConfigError: the file exists but cannot be read.
  """
  try:
    return path.read_text() if path.exists() else None
  except OSError as e:
    raise ConfigError(f"cannot read {str(path)!r}: {e}") from e


def abstract_params(plan: ModelPlan, ties: HeadTies | None = None, mesh: Mesh | None = None
                    ) -> tuple[nnx.GraphDef, dict]:
  """``(graphdef, parameters)`` of the model traced abstractly (nothing allocated): parameters as a pure dict of
  ``jax.ShapeDtypeStruct``, placed on ``mesh`` by the logical axis rules when one is given."""
  graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(plan, 0, ties)), nnx.Param)
  shapes = nnx.to_pure_dict(state)
  if mesh is None:
    return graphdef, shapes
  return graphdef, jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes,
                                parallel.param_shardings(state, mesh))


@dataclasses.dataclass(frozen=True)
class Run:
  """A run's model at one checkpoint.

  Attributes:
    directory: the run directory (None for a model read from elsewhere, e.g. an HF directory).
    cfg: its config (``mesh`` as loaded).
    plan: the compiled model of ``cfg`` (:func:`~jaxshare.plan.plan_of`), compiled once where the run is read.
    ties: head-wise sharing's ties (None without).
    graphdef / params: the model (``nnx.merge(graphdef, params)``); params a pure dict of arrays.
    step: the checkpoint's step (0 for a converted model).
    mesh: where the parameters are placed (None: host arrays).
    files: the run directory's own files as read (None for a model read from elsewhere).
  """

  directory: epath.Path | None
  cfg: Config
  plan: ModelPlan
  ties: HeadTies | None
  graphdef: nnx.GraphDef
  params: dict
  step: int
  mesh: Mesh | None
  files: StoredFiles | None = None

  @property
  def schedule(self) -> Schedule:
    """The compiled sharing schedule (the plan's)."""
    return self.plan.schedule

  @property
  def num_params(self) -> int:
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.params))

  @property
  def batch_sharding(self):
    """How a ``[B, T]`` batch is placed for this model (:func:`~jaxshare.parallel.batch_sharding`)."""
    return parallel.batch_sharding(self.mesh)

  def tokenizer(self) -> Tokenizer:
    """The run's tokenizer (``data.tokenizer``: bytes, or the HF tokenizer files a converted run carries)."""
    return make_tokenizer(self.cfg.data)

  def model(self) -> Transformer:
    """The NNX module with these parameters."""
    return nnx.merge(self.graphdef, self.params)


def load_run(path: str | os.PathLike, mesh: Mesh | None = None) -> Run:
  """Load a run directory (latest checkpoint) or checkpoint step directory: its parameters only.

  Args:
    mesh: where the parameters land, sharded by the logical rules. Default: one device in a single-process run
      (evaluation, conversion); every device, fully sharded over ``fsdp``, in a multi-process one (a device of one
      process is not addressable from the others).

  Raises:
    ConfigError: bad path or saved config. CheckpointError: no, corrupt or mismatched checkpoint, non-finite
      parameters, or missing head-wise ties (:meth:`StoredFiles.ties`).
  """
  run_dir, step = locate(path)
  files = read_stored(run_dir)
  cfg, plan = files.planned()
  if mesh is None:  # the mesh is no part of the plan
    cfg = dataclasses.replace(cfg, mesh=MeshConfig() if jax.process_count() == 1 else MeshConfig(fsdp=-1))
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:1] if jax.process_count() == 1 else None)
  step = _existing_step(run_dir, step, cfg.train.keep_checkpoints)
  ties = files.ties(plan)
  graphdef, target = abstract_params(plan, ties, mesh)
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)
  try:  # closed either way: an open manager's threads at interpreter exit printed a traceback after the error
    params = ckpt.restore_params(step, target)
  finally:
    ckpt.close()
  if not bool(_all_finite(params)):
    raise CheckpointError(f"checkpoint {run_dir / 'checkpoints' / str(step)} holds non-finite parameters (NaN or inf): "
                          "its run diverged before it was saved; use an earlier checkpoint "
                          f"({run_dir / 'checkpoints'}/<step>)")
  return Run(run_dir, cfg, plan, ties, graphdef, params, int(step), mesh, files)


def _existing_step(run_dir: epath.Path, step: int | None, keep: int) -> int:
  """``step`` (None: the latest), once the run is known to have that finished checkpoint; nothing is created.

  Raises:
    CheckpointError: the run has no checkpoint, or none at ``step`` (naming the steps it has).
  """
  steps = finished_steps(run_dir / "checkpoints")
  if not steps:
    raise CheckpointError(f"run directory {str(run_dir)!r} has no checkpoint: no finished step in "
                          f"{str(run_dir / 'checkpoints')!r} (deleted, or the run has not saved one yet)")
  if step is None:
    return steps[-1]
  if step not in steps:
    raise CheckpointError(f"run {str(run_dir)!r} has no checkpoint at step {step}: its checkpoints are at steps "
                          f"{', '.join(map(str, steps))} (a run keeps its last train.keep_checkpoints={keep})")
  return step


@jax.jit
def _all_finite(params) -> jax.Array:
  """Whether every parameter is finite (one compile per parameter structure, however many runs are loaded)."""
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(params)]))


def write_run(run_dir: str | os.PathLike, run: Run, *, tokenizer_files: Sequence[Path] = (),
              meta: dict | None = None) -> epath.Path:
  """Save the model ``run`` holds (its config, ties, and parameters: a pure dict of NumPy or JAX arrays; a model
  read from elsewhere or converted in memory) as run directory ``run_dir`` at step 0 (a parameters-only
  checkpoint: ``train.init_from`` and :func:`load_run` read just the parameters, and a run resumed in this
  directory starts a fresh optimizer), with its head-wise ties when the schedule ties heads.

  The tokenizer files are copied to ``<run_dir>/tokenizer`` and the written config's ``data.tokenizer`` points
  there; without any the run keeps the byte tokenizer, which needs ``model.vocab_size >= 256``. ``run`` itself is
  not changed.

  Raises:
    ConfigError: no tokenizer files and a vocabulary smaller than the byte tokenizer's, or ties given when the
      schedule ties no heads or missing when it ties some.
    FileExistsError: ``run_dir`` exists and is not empty (nothing is overwritten).
  """
  run_dir = absolute(run_dir)
  if run_dir.exists() and any(run_dir.iterdir()):
    raise FileExistsError(f"run directory {str(run_dir)!r} exists and is not empty; choose a new one")
  cfg, ties = run.cfg, run.ties
  if not tokenizer_files and cfg.data.tokenizer == "byte" and cfg.model.vocab_size < 256:
    raise ConfigError(f"the model has no tokenizer files and model.vocab_size={cfg.model.vocab_size} is smaller than "
                      "the byte tokenizer's 256")
  tied = run.plan.tied_heads
  if bool(tied) != (ties is not None):
    raise ConfigError(f"the schedule ties {tied} heads: write_run needs head-wise ties exactly when it ties any")
  run_dir.mkdir(parents=True, exist_ok=True)
  data = cfg.data
  if tokenizer_files:
    (run_dir / TOKENIZER_DIR).mkdir()
    for f in tokenizer_files:  # a few small files, local or on a bucket
      (run_dir / TOKENIZER_DIR / f.name).write_bytes(Path(f).read_bytes())
    data = dataclasses.replace(data, tokenizer=str(run_dir / TOKENIZER_DIR))
  write_run_files(run_dir, to_yaml(dataclasses.replace(cfg, data=data, train=dataclasses.replace(
    cfg.train, run_dir=str(run_dir)))), ties)
  save_params(run_dir / "checkpoints", 0, run.params, {"step": 0, "stage": 0, **(meta or {})})
  return run_dir
