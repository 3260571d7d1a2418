"""A training run's start: everything it holds before its next step, built once from the config and its run
directory (resumed from the newest checkpoint that restores and verifies, or initialised)."""

from __future__ import annotations

import dataclasses
from typing import Any

from etils import epath
from jax.sharding import Mesh

from jaxshare import distributed, parallel
from jaxshare.store import runs
from jaxshare.store.checkpoint import PARAMS_ONLY, Checkpointer
from jaxshare.config import Config, ConfigError, ScorePreset, get_field, to_yaml
from jaxshare.data import Datasets
from jaxshare.files import writable_dir
from jaxshare.init.headwise import compute_ties
from jaxshare.init.report import init_report
from jaxshare.config.source import with_match_reference
from jaxshare.init.source import check_loadable
from jaxshare.plan import plan_of
from jaxshare.schedule import parse_kind
from jaxshare.model.ties import HeadTies, PostSharePairs
from jaxshare.train.recipes import postshare_pairs, stage_of, stage_setup
from jaxshare.store.teacher import resolve_teacher
from jaxshare.train.state import TrainSetup, abstract_state, init_state, state_from_params
from jaxshare.train.step import TrainState

# Fields a resumed run must share with the run that wrote its checkpoints (the rest, e.g. train.steps, may change):
# the model, and what it trains on (another corpus, split or order would turn trained-on windows into validation
# data, or resume a different curve).
_RESUME_FIXED = ("model", "schedule", "data.source", "data.path", "data.text_field", "data.tfds_name",
                 "data.tfds_split", "data.document_separator", "data.tokenizer", "data.seq_len", "data.val_fraction",
                 "data.shuffle_seed", "data.mixture", "train.batch_size")
# Optimizer fields whose change alters the optimizer state's structure, so that no checkpoint can restore into it.
_OPTIMIZER_STRUCTURE = {
  "train.clip_norm": lambda t: t.clip_norm == 0,  # clipping on/off adds or removes a transformation's state
  "train.trainable": lambda t: t.trainable,  # frozen parameters have no moments
  "train.recipe": lambda t: t.recipe,
}


@dataclasses.dataclass(frozen=True)
class RunStart:
  """A training run as it stands before its next step (:func:`start_run`).

  Attributes:
    cfg: the run's config (``schedule.match_reference_params`` set from its source:
      :func:`~jaxshare.config.source.with_match_reference`).
    run_dir: the run directory, absolute; it exists and holds the config, ties and pairs.
    data: the datasets, this process's rows of each global batch.
    source: the ``train.init_from`` run (the uptraining source), or None.
    teacher: distillation's teacher (:func:`~jaxshare.store.teacher.resolve_teacher`; ``source`` itself where it
      is), or None without distillation.
    ckpt: the run's checkpoints.
    setup: the run's static pieces at its recipe stage (``setup.ties``: head-wise sharing's ties).
    state / data_iter: the train state and the data iterator, restored or new.
    pairs: PostShare's penalised head pairs (None without PostShare).
    meta: the resumed checkpoint's metadata (``stage``, ``stage_start``, ``stage1``, ``skipped_steps``); {} on a fresh
      start.
    latest: the checkpoint step resumed from (None: a fresh start).
    notes: what the start found worth a line of the log: unfinished writes removed, newer checkpoints that did not
      restore.
    init_report: how an uptrained model's weights were started (:func:`~jaxshare.init.report.init_report`); empty
      unless it starts from ``train.init_from`` now.
  """

  cfg: Config
  run_dir: epath.Path
  data: Datasets
  source: runs.Run | None
  teacher: runs.Run | None
  ckpt: Checkpointer
  setup: TrainSetup
  state: TrainState
  data_iter: Any
  pairs: PostSharePairs | None
  meta: dict
  latest: int | None
  notes: tuple[str, ...]
  init_report: tuple[str, ...]


def start_run(cfg: Config, mesh: Mesh | None = None) -> RunStart:
  """Start (or resume) the experiment of ``cfg`` in ``cfg.train.run_dir``: everything before the first step.

  Nothing is created in the run directory until the config, the data and the checkpoints have all been accepted;
  then the directory holds the config and, chosen once when the run began, head-wise sharing's ties and PostShare's
  pairs.

  Args:
    cfg: a validated config.
    mesh: device mesh (default: from ``cfg.mesh``).

  Raises:
    ConfigError / DataError / CheckpointError: bad config, data or run directory (checkpoints of another experiment:
      :func:`check_resume_compatible`), a ``train.init_from`` run whose weights this model cannot load, or a
      distillation teacher it cannot use (:func:`~jaxshare.store.teacher.resolve_teacher`).
  """
  run_dir = writable_dir(cfg.train.run_dir, "train.run_dir")
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  source = runs.load_run(cfg.train.init_from, mesh) if cfg.train.init_from else None
  if source is not None:
    cfg = with_match_reference(cfg, source.plan.param_count().total)
    check_loadable(source.cfg.model, cfg.model, cfg.train.init_from, src_tokenizer=source.cfg.data.tokenizer,
                   tokenizer=cfg.data.tokenizer)
  teacher = resolve_teacher(cfg.train, cfg.model, cfg.data.tokenizer, source, mesh)
  data = _open_data(cfg, mesh)
  ckpt = _existing_checkpoints(cfg, run_dir)
  resuming = ckpt is not None and ckpt.latest_step() is not None
  files = runs.read_stored(run_dir)  # the run directory's own files, read once
  if resuming and files.config_text is not None:
    check_resume_compatible(files.config(), cfg)
  plan = plan_of(cfg)
  ties = files.ties(plan) if resuming else compute_ties(plan, cfg.train.seed, source)

  def restore(step: int) -> tuple[dict, TrainSetup, TrainState, Any]:
    meta = ckpt.read_meta(step)
    setup, data_iter = stage_setup(cfg, plan, mesh, ties, *stage_of(cfg, meta)), data.train_iter()
    if meta.get(PARAMS_ONLY):  # a converted model (runs.write_run): a fresh optimizer
      state = state_from_params(setup, ckpt.restore_params(step, abstract_state(setup).params, meta), step)
    else:
      state = TrainState.of(ckpt.restore(step, abstract_state(setup).as_dict(), data_iter)[0])
    return meta, setup, state, data_iter

  resumed = ckpt.restore_newest_valid(restore) if ckpt is not None else None
  if resumed is not None:
    latest, (meta, setup, state, data_iter), fallbacks = resumed
  else:
    latest, meta, fallbacks = None, {}, []
    setup, data_iter = stage_setup(cfg, plan, mesh, ties, *stage_of(cfg, meta)), data.train_iter()
    state = init_state(setup, from_params=None if source is None else (source.params, source.schedule))
  saved_pairs = files.pairs()
  pairs = postshare_pairs(cfg, setup, source, saved_pairs)
  ckpt = _write_run_files(cfg, run_dir, ckpt, None if resuming else ties, None if saved_pairs else pairs)
  notes = [f"warning: {report} Resuming from checkpoint {latest}, the newest one that restored and verified."
           for report in fallbacks]
  if ckpt.cleaned:
    notes.insert(0, f"removed {len(ckpt.cleaned)} unfinished checkpoint write(s) an interrupted run left: "
                 + ", ".join(ckpt.cleaned))
  rules = setup.init_rules
  report = (init_report(source.params, source.schedule, state.params, setup.schedule, rules.kv_pool,
                        rules.mlp_widen) if source is not None and latest is None and ties is None else [])
  return RunStart(cfg, run_dir, data, source, teacher, ckpt, setup, state, data_iter, pairs, meta, latest, tuple(notes),
                  tuple(report))


def check_resume_compatible(saved: Config, cfg: Config) -> None:
  """Raise ConfigError naming every field that differs from the checkpointed run's and may not change."""
  diffs = []
  for key in _RESUME_FIXED:
    a, b = get_field(saved, key), get_field(cfg, key)
    if isinstance(a, dict):
      diffs += [f"{key}.{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
    elif a != b:
      diffs.append(f"{key}: {a!r} -> {b!r}")
  diffs += [f"{key}: {get_field(saved, key)!r} -> {get_field(cfg, key)!r} (changes the optimizer state's structure)"
            for key, structure in _OPTIMIZER_STRUCTURE.items() if structure(saved.train) != structure(cfg.train)]
  if diffs:
    raise ConfigError("the run directory holds checkpoints of a different experiment; these fields changed: "
                      + "; ".join(diffs) + ". Use a new train.run_dir, or restore the old values.")


def _open_data(cfg: Config, mesh: Mesh) -> Datasets:
  """The run's datasets (this process's rows of each global batch), once the recipe and the vocabulary are known
  to fit the model.

  Raises:
    ConfigError: a two-stage recipe without UniAttn, or a tokenizer larger than the vocabulary. DataError: unreadable
      data.
  """
  if cfg.train.recipe == "uniattn_two_stage" and not parse_kind(cfg.schedule.kind).has(ScorePreset.UNIATTN):
    raise ConfigError(f"train.recipe=uniattn_two_stage needs a uniattn schedule, got schedule.kind="
                      f"{cfg.schedule.kind!r}")
  rows = parallel.local_batch_rows(parallel.batch_sharding(mesh), cfg.train.batch_size)
  data = Datasets(cfg.data, cfg.train.batch_size, rows=rows)
  if data.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                      f"({data.tokenizer.vocab_size}); set model.vocab_size >= {data.tokenizer.vocab_size}")
  return data


def _existing_checkpoints(cfg: Config, run_dir: epath.Path) -> Checkpointer | None:
  """The checkpoints of ``run_dir`` (absolute), when it has a checkpoint directory; nothing is created."""
  if not (run_dir / "checkpoints").exists():
    return None
  return Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)


def _write_run_files(cfg: Config, run_dir: epath.Path, ckpt: Checkpointer | None, new_ties: HeadTies | None,
                     new_pairs: PostSharePairs | None) -> Checkpointer:
  """Create the run directory with its config (and the ties and pairs chosen as it began) next to the checkpoints."""
  run_dir.mkdir(parents=True, exist_ok=True)
  if distributed.is_primary():
    runs.write_run_files(run_dir, to_yaml(cfg), new_ties, new_pairs)
  return ckpt or Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)
