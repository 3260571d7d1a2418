"""The training loop: resume, step, log, validate, checkpoint, stop cleanly on Ctrl-C or preemption."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import numpy as np

from jaxshare import distributed, parallel, runs
from jaxshare.checkpoint import PARAMS_ONLY, Checkpointer
from jaxshare.config import Config, ConfigError, get_field
from jaxshare.data import Datasets
from jaxshare.evaluation.val_loss import evaluate_loss, make_eval_step
from jaxshare.files import absolute
from jaxshare.init.headwise import compute_ties
from jaxshare.init.report import init_report
from jaxshare.init.source import check_loadable, init_kv_pool, with_match_reference
from jaxshare.kernels.dispatch import document_bounds
from jaxshare.train.interrupts import Interrupts
from jaxshare.train.metrics import MetricsLogger, resolve_peak
from jaxshare.train.recipes import (Stage1Monitor, build_objective, end_step, postshare_pairs,
                                    write_postshare_pairs)
from jaxshare.train.state import (TrainSetup, abstract_state, init_state, setup_training, state_from_params,
                                  trainable_for)
from jaxshare.train.step import Objective, TrainState, make_train_step

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


class DivergenceError(RuntimeError):
  """Training produced a non-finite loss or gradient norm under ``train.nan_policy=stop`` (exit code 3)."""


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


@contextlib.contextmanager
def _writes_finished_on_error(ckpt: Checkpointer):
  """An error in the loop (not a third interrupt, which means "now") first lets a checkpoint write in flight finish:
  exiting mid-write would lose it."""
  try:
    yield
  except KeyboardInterrupt:
    raise
  except BaseException:
    with contextlib.suppress(Exception):
      ckpt.wait()
    raise


def jit_train_step(setup: TrainSetup, objective: Objective, teacher_shardings):
  """The run's train step jitted as training runs it: state and batch sharded by ``setup``, the state donated."""
  # cuDNN's packed layout holds a bounded number of documents per row: decided once per micro-batch, not per call
  fn = make_train_step(setup.graphdef, setup.tx, setup.lr_schedule, setup.cfg.train.grad_accum_steps, objective,
                       document_bounds(setup.cfg.attention.impl, setup.cfg.model.dtype,
                                       setup.mesh.devices.flat[0].platform))
  return jax.jit(fn, in_shardings=(setup.state_shardings, setup.batch_sharding, teacher_shardings),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)


def train(cfg: Config, *, mesh=None, stop_after: int | None = None) -> dict[str, Any]:
  """Train (or resume) the experiment of ``cfg`` in ``cfg.train.run_dir``.

  Args:
    cfg: a validated config.
    mesh: device mesh (default: from ``cfg.mesh``).
    stop_after: stop (with a checkpoint) once this step is reached, as if interrupted — for tests.

  Returns:
    Summary: ``step``, ``finished`` (the run reached its last step: ``train.steps``, or stage 2's end under
    ``train.stage2_steps``), ``loss`` (last logged training loss), ``val_loss``, ``num_params``, ``trainable_params``,
    ``kv_bytes_per_token``, ``tokens_per_sec``, ``stage``, ``run_dir``, ``interrupted`` (the signal that stopped the
    run after saving, e.g. ``"SIGTERM"``; None). See :class:`~jaxshare.train.interrupts.Interrupts`.

  Raises:
    ConfigError / DataError / CheckpointError: bad config, data or run directory, or a ``train.init_from`` run
      whose weights this model cannot load (before any training).
    DivergenceError: a non-finite step under ``train.nan_policy=stop``.
    KeyboardInterrupt: a third SIGINT/SIGTERM (the last finished checkpoint is kept).
  """
  source_cfg = runs.read_config(runs.locate(cfg.train.init_from)[0]) if cfg.train.init_from else None
  cfg = with_match_reference(cfg, source_cfg)
  if source_cfg is not None:
    check_loadable(source_cfg, cfg, cfg.train.init_from)
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  run_dir = absolute(cfg.train.run_dir)
  # Nothing is created in the run directory until the config, data and checkpoint have all been accepted.
  data = _open_data(cfg, parallel.local_batch_rows(parallel.batch_sharding(mesh), cfg.train.batch_size))
  ckpt = _existing_checkpoints(cfg, run_dir)
  trainer = _Trainer(cfg, mesh, data, run_dir)
  trainer.start(ckpt)
  trainer.write_run_files()
  trainer.compile()
  trainer.announce()
  trainer.run(cfg.train.steps if stop_after is None else min(cfg.train.steps, stop_after))
  return trainer.summary


def _open_data(cfg: Config, rows: slice) -> Datasets:
  """The run's datasets (this process's ``rows`` of each global batch), once the recipe and the vocabulary are known
  to fit the model.

  Raises:
    ConfigError: a two-stage recipe without UniAttn, or a tokenizer larger than the vocabulary. DataError: unreadable
      data.
  """
  if cfg.train.recipe == "uniattn_two_stage" and "uniattn" not in cfg.schedule.kind:
    raise ConfigError(f"train.recipe=uniattn_two_stage needs a uniattn schedule, got schedule.kind="
                      f"{cfg.schedule.kind!r}")
  data = Datasets(cfg.data, cfg.train.batch_size, rows=rows)
  if data.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                      f"({data.tokenizer.vocab_size}); set model.vocab_size >= {data.tokenizer.vocab_size}")
  return data


def _existing_checkpoints(cfg: Config, run_dir) -> Checkpointer | None:
  """The checkpoints of ``run_dir`` (absolute), when it has some, once it is known to hold this experiment.

  Raises:
    ConfigError: the saved config differs in a field a resumed run may not change (:func:`check_resume_compatible`).
  """
  if not (run_dir / "checkpoints").exists():
    return None
  ckpt = Checkpointer(run_dir / "checkpoints", cfg.train.keep_checkpoints)
  if ckpt.latest_step() is not None and (run_dir / runs.CONFIG_FILE).exists():
    check_resume_compatible(runs.read_config(run_dir), cfg)
  return ckpt


class _Trainer:
  """One training run's phases, in the order :func:`train` calls them: :meth:`start` (resume the newest valid
  checkpoint, or initialise), :meth:`write_run_files`, :meth:`compile` (the objective and the jitted steps),
  :meth:`announce` (what runs, logged), :meth:`run` (steps, logging, validation, checkpoints, UniAttn's stage
  switch, non-finite steps); :attr:`summary` is the result."""

  def __init__(self, cfg: Config, mesh, data: Datasets, run_dir):
    self.cfg, self.tcfg, self.mesh, self.data, self.run_dir = cfg, cfg.train, mesh, data, run_dir
    self.two_stage = cfg.train.recipe == "uniattn_two_stage"
    # the train.init_from run: uptraining source and distillation teacher
    self.source = runs.load_run(cfg.train.init_from, mesh) if cfg.train.init_from else None
    self.teacher_params = self.source.params if cfg.train.kd_beta > 0 else None
    self.pending: list[dict] = []  # metrics of the steps since the last log line
    self.screened = 0  # how many of pending were already checked for non-finite steps

  # -- start --------------------------------------------------------------------------------------------------

  def start(self, ckpt: Checkpointer | None) -> None:
    """Resume from the newest checkpoint that restores and verifies, or initialise (from ``train.init_from`` when
    set). Head-wise ties and PostShare's pairs are chosen here once, when the run starts, and read back from the run
    directory ever after."""
    cfg = self.cfg
    resuming = ckpt is not None and ckpt.latest_step() is not None
    self.ties = (runs.read_ties(self.run_dir, cfg) if resuming else
                 compute_ties(cfg, self.tcfg.seed, self.mesh, source=self.source))
    self.ties_are_new = not resuming
    self.ckpt = ckpt
    resumed = ckpt.restore_newest_valid(self._resume_from) if ckpt is not None else None
    if resumed is not None:
      self.latest, (self.meta, self.setup, self.data_iter, self.state), self.fallbacks = resumed
    else:
      self.latest, self.meta, self.fallbacks = None, {}, []
      self.setup, self.data_iter = self._prepare(self.meta)
      self.state = init_state(self.setup, from_params=None if self.source is None else (self.source.params,
                                                                                         self.source.schedule))
    self.pairs, self.pairs_are_new = postshare_pairs(cfg, self.setup, self.source, self.run_dir)
    self.stage = self._stage_of(self.meta)
    self.stage_start = self.meta.get("stage_start", 0)  # the step the current stage's learning-rate schedule began
    self.end = end_step(self.cfg, self.stage, self.stage_start)
    self.skipped = self.meta.get("skipped_steps", 0)
    self.monitor = Stage1Monitor(self.tcfg.stage1_ema, self.tcfg.stage1_patience, self.tcfg.stage1_max_steps)
    if "stage1" in self.meta:  # resume early stopping exactly where it was
      self.monitor.load(self.meta["stage1"])
    self.step = int(jax.device_get(self.state.step))

  def _stage_of(self, meta: dict) -> int:
    return meta.get("stage", 0) or (1 if self.two_stage else 0)

  def _prepare(self, meta: dict) -> tuple[TrainSetup, Any]:
    """The run's setup at the recipe stage ``meta`` records, and a data iterator at the start of the data."""
    stage, stage_start = self._stage_of(meta), meta.get("stage_start", 0)
    setup = setup_training(self.cfg, self.mesh, trainable_for(self.cfg, stage), self.ties, start_step=stage_start,
                           end_step=end_step(self.cfg, stage, stage_start))
    return setup, self.data.train_iter()

  def _resume_from(self, step: int) -> tuple[dict, TrainSetup, Any, Any]:
    meta = self.ckpt.read_meta(step)
    setup, data_iter = self._prepare(meta)
    if meta.get(PARAMS_ONLY):  # a converted model (runs.write_run): a fresh optimizer
      params = self.ckpt.restore_params(step, abstract_state(setup).params, meta)
      state = state_from_params(setup, params, step)
    else:
      stored, _ = self.ckpt.restore(step, abstract_state(setup).as_dict(), data_iter)
      state = TrainState.of(stored)
    return meta, setup, data_iter, state

  # -- the run directory, the compiled steps, the announcement --------------------------------------------------

  def write_run_files(self) -> None:
    """Create the run directory with its config (and head-wise ties, PostShare's pairs) next to the checkpoints."""
    self.run_dir.mkdir(parents=True, exist_ok=True)
    self.ckpt = self.ckpt or Checkpointer(self.run_dir / "checkpoints", self.tcfg.keep_checkpoints)
    if distributed.is_primary():
      runs.write_config(self.run_dir, self.cfg)
      if self.ties is not None and self.ties_are_new:
        runs.write_ties(self.run_dir, self.ties)
      if self.pairs is not None and self.pairs_are_new:
        write_postshare_pairs(self.cfg, self.run_dir, self.pairs)

  def compile(self) -> None:
    """The auxiliary objective and the jitted steps."""
    self.objective = build_objective(self.cfg, self.setup, self.source, self.pairs)
    self.teacher_shardings = (jax.tree.map(lambda x: x.sharding, self.teacher_params)
                              if self.teacher_params is not None else None)
    self.step_fn = jit_train_step(self.setup, self.objective, self.teacher_shardings)
    self.eval_fn = jax.jit(make_eval_step(self.setup.graphdef),
                           in_shardings=(self.setup.param_shardings, self.setup.batch_sharding))

  def announce(self) -> None:
    """Open the metrics log and say what runs: schedule, sizes, mesh, data, how it starts, the MFU reference."""
    cfg, tcfg, setup = self.cfg, self.tcfg, self.setup
    n_dev = setup.mesh.size
    self.flops_per_token = setup.plan.train_flops_per_token(cfg.data.seq_len)
    self.peak = resolve_peak(tcfg.peak_tflops, n_dev, cfg.model.dtype)
    kv_bytes = setup.plan.kv_cache_bytes_per_token(2 if cfg.model.dtype == "bfloat16" else 4)
    self.log = log = MetricsLogger(self.run_dir, tcfg.steps, self.step, tcfg.progress_bar)
    start = (f"resumed at step {self.step}" if self.latest is not None else
             f"weights from {tcfg.init_from} (step {self.source.step})" if self.source is not None else
             f"fresh start (seed {tcfg.seed})")
    log.print(f"jaxshare | {setup.schedule.describe()} | {start}")
    if self.ckpt.cleaned:
      log.print(f"removed {len(self.ckpt.cleaned)} unfinished checkpoint write(s) an interrupted run left: "
                + ", ".join(self.ckpt.cleaned))
    for report in self.fallbacks:
      log.print(f"warning: {report} Resuming from checkpoint {self.latest}, the newest one that restored and "
                "verified.")
    val_seqs = f"{len(self.data.val_source):,}" if self.data.has_validation else "no"
    log.print(f"params {setup.num_params:,} ({setup.num_trainable:,} trainable) | KV cache {kv_bytes:,} B/token | "
              f"mesh {dict(setup.mesh.shape)} ({n_dev} {jax.devices()[0].platform}) | train "
              f"{len(self.data.train_source):,} seqs, val {val_seqs} seqs of {cfg.data.seq_len}"
              + (f" | recipe {tcfg.recipe}, stage {self.stage}" if self.two_stage else ""))
    if not self.data.has_validation:
      log.print(f"warning: {cfg.data.path} has no validation split: training runs with validation off (prepare the "
                "data with python -m jaxshare.data prepare --val-docs N, or --val-fraction F, to validate)")
    if len(self.data.components) > 1:
      total = sum(c.weight for c in self.data.components)
      log.print("mixture: " + ", ".join(f"{c.name} {100 * c.weight / total:.0f}% ({len(c.train):,} train seqs)"
                                        for c in self.data.components))
    if self.source is not None and self.latest is None and setup.ties is None:
      for line in init_report(self.source.params, self.source.schedule, self.state.params, setup.schedule,
                              init_kv_pool(cfg), cfg.train.init_mlp_widen):
        log.print(f"init | {line}")
    log.print(f"MFU against {self.peak.label}; {self.flops_per_token / 1e6:.2f} MFLOP per trained token (model "
              "FLOPs)" if self.peak is not None else "MFU not shown: unknown accelerator peak (set train.peak_tflops)")
    self.summary: dict[str, Any] = {"run_dir": cfg.train.run_dir, "num_params": setup.num_params,
                                    "trainable_params": setup.num_trainable, "kv_bytes_per_token": kv_bytes,
                                    "step": self.step, "mfu_peak": None if self.peak is None else self.peak.label}

  # -- the loop -----------------------------------------------------------------------------------------------

  def run(self, end: int) -> None:
    """Step until ``end`` (or a stop request), logging, validating and checkpointing on the configured cadence; a
    stopped run saves where it stopped; UniAttn's stage 2 may end the run sooner (``train.stage2_steps``)."""
    tcfg = self.tcfg
    self.t_last = time.perf_counter()
    with jax.set_mesh(self.setup.mesh), Interrupts() as interrupts, _writes_finished_on_error(self.ckpt):
      while self.step < min(end, self.end) and not interrupts.should_stop(self.step):
        batch = parallel.shard_batch(self.setup.batch_sharding, next(self.data_iter))
        self.state, metrics = self.step_fn(self.state, batch, self.teacher_params)
        self.step += 1
        self.pending.append(metrics)
        self.log.advance(1)
        if self.stage == 1 and bool(metrics["finite"]) and self.monitor.update(float(metrics["loss"])):
          self._begin_stage2()
        is_last = self.step == self.end
        is_eval = self.data.has_validation and (bool(tcfg.eval_every and self.step % tcfg.eval_every == 0) or is_last)
        if self.step % tcfg.log_every == 0 or is_eval or self.step == min(end, self.end):
          self._log_interval(is_eval)
        if self.step % tcfg.checkpoint_every == 0 or is_last:
          self._save()
      if self.step < self.end and self.step % tcfg.checkpoint_every:
        self._save()
      self.ckpt.wait()  # still under the handlers: a second signal cannot cut the write short
      if self.step < self.end:
        how = f"interrupted by {interrupts.received[0]}" if interrupts.received else "stopped"
        self.log.print(f"{how} at step {self.step}; checkpoint {self.step} saved, re-run the same command to resume")
    self.ckpt.close()
    self.log.close()
    self.summary.update(step=self.step, finished=self.step >= self.end, stage=self.stage, skipped_steps=self.skipped,
                        interrupted=interrupts.received[0] if interrupts.received else None)

  def _begin_stage2(self) -> None:
    """UniAttn stage 2: everything trains, with a fresh optimizer state and a learning-rate schedule (warm-up,
    cosine) over the remaining steps (or ``train.stage2_steps``)."""
    self.stage, self.stage_start = 2, self.step
    self.end = end_step(self.cfg, 2, self.step)
    self.setup = setup_training(self.cfg, self.mesh, trainable_for(self.cfg, 2), self.ties, start_step=self.step,
                                end_step=self.end)
    opt_state = jax.jit(self.setup.tx.init, out_shardings=self.setup.state_shardings.opt_state)(self.state.params)
    self.state = self.state.replace(opt_state=opt_state)
    self.step_fn = jit_train_step(self.setup, self.objective, self.teacher_shardings)
    self.summary["trainable_params"] = self.setup.num_trainable
    self.log.print(f"stage 1 ended at step {self.step} (loss EMA {self.monitor.ema:.4f}); stage 2 trains "
                   f"{self.setup.num_trainable:,} parameters until step {self.end}")

  def _screen(self, flags) -> None:
    """Check the steps of pending[screened:] (their ``finite`` flags): stop the run at the first non-finite one, or
    count and report it (train.nan_policy).

    Raises:
      DivergenceError: a non-finite step under ``train.nan_policy=stop``.
    """
    first = self.step - len(self.pending) + 1 + self.screened
    for i, ok in enumerate(flags[self.screened:]):
      if bool(ok):
        continue
      bad = jax.device_get(self.pending[self.screened + i])
      what = f"loss {float(bad['loss'])}, gradient norm {float(bad['grad_norm'])}"
      if self.tcfg.nan_policy == "skip":
        self.skipped += 1
        self.log.print(f"step {first + i}: {what}: skipped, the state is unchanged ({self.skipped} skipped so far)")
        continue
      self.ckpt.wait()
      last = self.ckpt.latest_step()
      raise DivergenceError(
        f"training diverged at step {first + i}: {what}. The state was not updated and nothing after it was saved; "
        + (f"the last good checkpoint is step {last} in {self.run_dir / 'checkpoints'}" if last is not None else
           "no checkpoint had been written yet")
        + ". Lower train.lr or raise train.warmup_steps and resume, or set train.nan_policy=skip to skip such steps.")
    self.screened = len(self.pending)

  def _save(self) -> None:
    if len(self.pending) > self.screened:  # never checkpoint past a step that was not checked
      self._screen(jax.device_get([m["finite"] for m in self.pending]))
    self.ckpt.save(self.step, self.state.as_dict(), self.data_iter,
                   {"step": self.step, "stage": self.stage, "stage_start": self.stage_start,
                    "stage1": self.monitor.state(), "skipped_steps": self.skipped})

  def _log_interval(self, is_eval: bool) -> None:
    """Write the metrics of the steps since the last log line (and the validation loss when ``is_eval``)."""
    host = jax.device_get(self.pending)
    self._screen([m["finite"] for m in host])
    dt = time.perf_counter() - self.t_last
    tokens = float(sum(m["tokens"] for m in host))
    tps = tokens / dt
    good = [m for m in host if m["finite"]] or host
    record = {"step": self.step, "loss": float(np.mean([m["loss"] for m in good])),
              "lr": float(host[-1]["lr"]), "grad_norm": float(host[-1]["grad_norm"]),
              "tokens_per_sec": tps, "step_time": dt / len(host),
              "trainable_params": self.setup.num_trainable}
    if self.peak is not None:
      record["mfu"] = self.flops_per_token * tps / self.peak.flops_per_sec
    for key in ("kd_loss", "postshare_loss"):
      if key in host[-1]:
        record[key] = float(np.mean([m[key] for m in host]))
    if self.two_stage:
      record["stage"] = self.stage
    if self.skipped:
      record["skipped_steps"] = self.skipped
    record.update(self.data.tokens_seen(self.step))  # a mixture's tokens per component
    self.pending, self.screened, self.t_last = [], 0, time.perf_counter()
    if is_eval:
      record["val_loss"] = evaluate_loss(self.eval_fn, self.setup.batch_sharding, self.state.params, self.data,
                                         self.tcfg.eval_batches)
      self.summary["val_loss"] = record["val_loss"]
      self.t_last = time.perf_counter()  # keep validation out of the next interval's throughput
    self.log.write(record)
    self.log.advance(0, record["loss"])
    peak = self.peak
    mfu = "" if peak is None else f" | MFU {100 * record['mfu']:.1f}%" + (f" ({peak.tag})" if peak.tag else "")
    self.log.print(f"step {self.step:>6}/{self.end} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                   f"{tps:,.0f} tok/s | {record['step_time'] * 1e3:.0f} ms/step{mfu}"
                   + "".join(f" | {k} {record[k]:.4f}" for k in ("kd_loss", "postshare_loss", "val_loss")
                             if k in record))
    self.summary.update(loss=record["loss"], tokens_per_sec=tps, mfu=record.get("mfu"))
