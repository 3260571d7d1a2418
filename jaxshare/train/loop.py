"""The training loop: resume, step, log, validate, checkpoint, stop cleanly on Ctrl-C or preemption."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import numpy as np

from jaxshare import parallel
from jaxshare.store.checkpoint import Checkpointer
from jaxshare.config import Config
from jaxshare.evaluation.val_loss import evaluate_loss, make_eval_step
from jaxshare.files import StorageUnavailable
from jaxshare.kernels.dispatch import document_bounds
from jaxshare.train.interrupts import Interrupts
from jaxshare.train.metrics import MetricsLogger, resolve_peak
from jaxshare.train.recipes import Stage1Monitor, build_objective, end_step, stage_of, stage_setup
from jaxshare.train.start import RunStart, start_run
from jaxshare.train.state import TrainSetup
from jaxshare.train.step import Objective, make_train_step


class DivergenceError(RuntimeError):
  """Training produced a non-finite loss or gradient norm under ``train.nan_policy=stop`` (exit code 3)."""


@contextlib.contextmanager
def _writes_finished_on_error(ckpt: Checkpointer, patience_s: float):
  """An error in the loop (not a third interrupt, which means "now") first lets a checkpoint write in flight finish:
  exiting mid-write would lose it. A bucket's outage (:class:`StorageUnavailable`) waits ``patience_s`` seconds at
  most: the write in flight goes to the same unreachable bucket."""
  try:
    yield
  except KeyboardInterrupt:
    raise
  except BaseException as e:
    with contextlib.suppress(Exception):
      ckpt.wait(patience_s if isinstance(e, StorageUnavailable) else None)
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
  trainer = _Trainer(start_run(cfg, mesh))
  trainer.compile()
  trainer.announce()
  trainer.run(cfg.train.steps if stop_after is None else min(cfg.train.steps, stop_after))
  return trainer.summary


class _Trainer:
  """One training run from its start (:func:`~jaxshare.train.start.start_run`), in the phases :func:`train` calls:
  :meth:`compile` (the objective and the jitted steps), :meth:`announce` (what runs, logged), :meth:`run` (steps,
  logging, validation, checkpoints, UniAttn's stage switch, non-finite steps); :attr:`summary` is the result."""

  def __init__(self, start: RunStart):
    self.start, self.cfg, self.tcfg = start, start.cfg, start.cfg.train
    self.run_dir, self.data, self.source, self.ckpt = start.run_dir, start.data, start.source, start.ckpt
    self.setup, self.state, self.data_iter = start.setup, start.state, start.data_iter
    self.two_stage = self.tcfg.recipe == "uniattn_two_stage"
    self.teacher = start.teacher
    self.teacher_params = None if self.teacher is None else self.teacher.params
    self.stage, self.stage_start = stage_of(self.cfg, start.meta)  # stage_start: where its lr schedule began
    self.end = end_step(self.cfg, self.stage, self.stage_start)
    self.skipped = start.meta.get("skipped_steps", 0)
    self.monitor = Stage1Monitor(self.tcfg.stage1_ema, self.tcfg.stage1_patience, self.tcfg.stage1_max_steps)
    if "stage1" in start.meta:  # resume early stopping exactly where it was
      self.monitor.load(start.meta["stage1"])
    self.step = int(jax.device_get(self.state.step))
    self.pending: list[dict] = []  # metrics of the steps since the last log line
    self.screened = 0  # how many of pending were already checked for non-finite steps

  # -- the compiled steps, the announcement -------------------------------------------------------------------

  def compile(self) -> None:
    """The auxiliary objective and the jitted steps."""
    self.objective = build_objective(self.cfg, self.setup, self.teacher, self.start.pairs)
    self.teacher_shardings = (jax.tree.map(lambda x: x.sharding, self.teacher_params)
                              if self.teacher_params is not None else None)
    self.step_fn = jit_train_step(self.setup, self.objective, self.teacher_shardings)
    self.eval_fn = jax.jit(make_eval_step(self.setup.graphdef, self.cfg.train.num_vocab_tiling),
                           in_shardings=(self.setup.param_shardings, self.setup.batch_sharding))

  def announce(self) -> None:
    """Open the metrics log and say what runs: schedule, sizes, mesh, data, how it starts, the MFU reference."""
    cfg, tcfg, setup = self.cfg, self.tcfg, self.setup
    n_dev = setup.mesh.size
    self.flops_per_token = setup.plan.train_flops_per_token(cfg.data.seq_len)
    self.peak = resolve_peak(tcfg.peak_tflops, n_dev, cfg.model.dtype)
    kv_bytes = setup.plan.kv_cache_bytes_per_token(2 if cfg.model.dtype == "bfloat16" else 4)
    self.log = log = MetricsLogger(self.run_dir, tcfg.steps, self.step, tcfg.progress_bar, tcfg.storage_patience_s)
    start = (f"resumed at step {self.step}" if self.start.latest is not None else
             f"weights from {tcfg.init_from} (step {self.source.step})" if self.source is not None else
             f"fresh start (seed {tcfg.seed})")
    log.print(f"jaxshare | {setup.schedule.describe()} | {start}")
    for note in self.start.notes:
      log.print(note)
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
    for line in self.start.init_report:
      log.print(f"init | {line}")
    if self.teacher is not None:
      log.print(f"distillation (kd_beta {tcfg.kd_beta}) from {self.teacher.directory} "
                f"({self.teacher.schedule.describe()}, step {self.teacher.step})")
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
    finishing = _writes_finished_on_error(self.ckpt, tcfg.storage_patience_s)
    with jax.set_mesh(self.setup.mesh), Interrupts() as interrupts, finishing:
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
    self.setup = stage_setup(self.cfg, self.setup.plan, self.setup.mesh, self.setup.ties, 2, self.step)
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
