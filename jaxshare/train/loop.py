"""The training loop: resume, step, log, validate, checkpoint, stop cleanly on Ctrl-C or preemption."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from jaxshare import accounting, distributed, parallel, runs
from jaxshare.checkpoint import PARAMS_ONLY, Checkpointer, absolute
from jaxshare.config import Config, ConfigError
from jaxshare.data import Datasets
from jaxshare.evaluation.val_loss import evaluate_loss, make_eval_step
from jaxshare.init.headwise import compute_ties
from jaxshare.init.report import init_report
from jaxshare.init.source import init_kv_pool, with_match_reference
from jaxshare.schedule import compile_schedule
from jaxshare.train.interrupts import Interrupts
from jaxshare.train.metrics import MetricsLogger, resolve_peak
from jaxshare.train.recipes import Stage1Monitor, build_objective
from jaxshare.train.state import (TrainSetup, abstract_state, init_state, setup_training, state_from_params,
                                  trainable_for)
from jaxshare.train.step import Objective, make_train_step

# Fields a resumed run must share with the run that wrote its checkpoints (the rest, e.g. train.steps, may change):
# the model, and what it trains on (another corpus, split or order would turn trained-on windows into validation
# data, or resume a different curve).
_RESUME_FIXED = ("model", "schedule", "data.source", "data.path", "data.text_field", "data.tfds_name",
                 "data.tfds_split", "data.document_separator", "data.tokenizer", "data.seq_len", "data.val_fraction",
                 "data.shuffle_seed", "train.batch_size")
# Optimizer fields whose change alters the optimizer state's structure, so that no checkpoint can restore into it.
_OPTIMIZER_STRUCTURE = {
  "train.clip_norm": lambda t: t.clip_norm == 0,  # clipping on/off adds or removes a transformation's state
  "train.trainable": lambda t: t.trainable,  # frozen parameters have no moments
  "train.recipe": lambda t: t.recipe,
}


def _get(cfg: Config, dotted: str) -> Any:
  obj = cfg
  for part in dotted.split("."):
    obj = getattr(obj, part)
  return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


class DivergenceError(RuntimeError):
  """Training produced a non-finite loss or gradient norm under ``train.nan_policy=stop`` (exit code 3)."""


def check_resume_compatible(saved: Config, cfg: Config) -> None:
  """Raise ConfigError naming every field that differs from the checkpointed run's and may not change."""
  diffs = []
  for key in _RESUME_FIXED:
    a, b = _get(saved, key), _get(cfg, key)
    if isinstance(a, dict):
      diffs += [f"{key}.{k}: {a[k]!r} -> {b[k]!r}" for k in a if a[k] != b[k]]
    elif a != b:
      diffs.append(f"{key}: {a!r} -> {b!r}")
  diffs += [f"{key}: {_get(saved, key)!r} -> {_get(cfg, key)!r} (changes the optimizer state's structure)"
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
  fn = make_train_step(setup.graphdef, setup.tx, setup.lr_schedule, setup.cfg.train.grad_accum_steps, objective)
  return jax.jit(fn, in_shardings=(setup.state_shardings, setup.batch_sharding, teacher_shardings),
                 out_shardings=(setup.state_shardings, None), donate_argnums=0)


def train(cfg: Config, *, mesh=None, stop_after: int | None = None) -> dict[str, Any]:
  """Train (or resume) the experiment of ``cfg`` in ``cfg.train.run_dir``.

  Args:
    cfg: a validated config.
    mesh: device mesh (default: from ``cfg.mesh``).
    stop_after: stop (with a checkpoint) once this step is reached, as if interrupted — for tests.

  Returns:
    Summary: ``step``, ``loss`` (last logged training loss), ``val_loss``, ``num_params``, ``trainable_params``,
    ``kv_bytes_per_token``, ``tokens_per_sec``, ``stage``, ``run_dir``, ``interrupted`` (the signal that stopped the
    run after saving, e.g. ``"SIGTERM"``; None). See :class:`~jaxshare.train.interrupts.Interrupts`.

  Raises:
    ConfigError / DataError / CheckpointError: bad config, data or run directory (before any training).
    DivergenceError: a non-finite step under ``train.nan_policy=stop``.
    KeyboardInterrupt: a third SIGINT/SIGTERM (the last finished checkpoint is kept).
  """
  cfg = with_match_reference(cfg)
  run_dir = absolute(cfg.train.run_dir)
  mesh = mesh or parallel.make_mesh(cfg.mesh)
  tcfg = cfg.train
  two_stage = tcfg.recipe == "uniattn_two_stage"
  if two_stage and "uniattn" not in cfg.schedule.kind:
    raise ConfigError(f"train.recipe=uniattn_two_stage needs a uniattn schedule, got schedule.kind="
                      f"{cfg.schedule.kind!r}")
  data = Datasets(cfg.data, tcfg.batch_size)
  if data.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's vocabulary "
                      f"({data.tokenizer.vocab_size}); set model.vocab_size >= {data.tokenizer.vocab_size}")
  # Nothing is created in the run directory until the config, data and checkpoint have all been accepted.
  ckpt = Checkpointer(run_dir / "checkpoints", tcfg.keep_checkpoints) if (run_dir / "checkpoints").exists() else None
  if ckpt is not None and ckpt.latest_step() is not None and (run_dir / "config.yaml").exists():
    check_resume_compatible(runs.read_config(run_dir), cfg)
  resuming = ckpt is not None and ckpt.latest_step() is not None
  source = runs.load_run(tcfg.init_from, mesh) if tcfg.init_from else None  # uptraining source, distillation teacher
  # head-wise ties are chosen once, when the run starts, and read back from the run directory ever after
  schedule = compile_schedule(cfg.model, cfg.schedule)
  ties = runs.read_ties(run_dir, cfg, schedule) if resuming else compute_ties(cfg, schedule, tcfg.seed, mesh)

  def stage_of(meta: dict) -> int:
    return meta.get("stage", 0) or (1 if two_stage else 0)

  def prepare(meta: dict) -> tuple[TrainSetup, Any]:
    """The run's setup at the recipe stage ``meta`` records, and a data iterator at the start of the data."""
    setup = setup_training(cfg, mesh, trainable_for(cfg, stage_of(meta)), ties, start_step=meta.get("stage_start", 0))
    data.rows = parallel.local_batch_rows(setup.batch_sharding, tcfg.batch_size)  # what this process's devices hold
    return setup, data.train_iter()

  def resume(step: int) -> tuple[dict, TrainSetup, Any, Any]:
    meta = ckpt.read_meta(step)
    setup, data_iter = prepare(meta)
    if meta.get(PARAMS_ONLY):  # a converted model (convert/run_dir.py): a fresh optimizer
      state = state_from_params(setup, ckpt.restore_params(step, abstract_state(setup)["params"], meta), step)
    else:
      state, _ = ckpt.restore(step, abstract_state(setup), data_iter)
    return meta, setup, data_iter, state

  resumed = ckpt.restore_newest_valid(resume) if ckpt is not None else None
  if resumed is not None:
    latest, (meta, setup, data_iter, state), fallbacks = resumed
  else:
    latest, meta, fallbacks = None, {}, []
    setup, data_iter = prepare(meta)
    state = (init_state(setup, from_params=(source.params, source.schedule)) if source is not None else
             init_state(setup))
  stage = stage_of(meta)
  stage_start = meta.get("stage_start", 0)  # the step the current stage's learning-rate schedule started at
  run_dir.mkdir(parents=True, exist_ok=True)
  ckpt = ckpt or Checkpointer(run_dir / "checkpoints", tcfg.keep_checkpoints)
  if distributed.is_primary():
    runs.write_config(run_dir, cfg)
    if ties is not None:
      runs.write_ties(run_dir, ties)
  start = int(jax.device_get(state["step"]))
  teacher_params = source.params if tcfg.kd_beta > 0 else None
  teacher_shardings = jax.tree.map(lambda x: x.sharding, teacher_params) if teacher_params is not None else None
  objective = build_objective(cfg, setup, source)
  step_fn = jit_train_step(setup, objective, teacher_shardings)
  eval_fn = jax.jit(make_eval_step(setup.graphdef), in_shardings=(setup.param_shardings, setup.batch_sharding))

  n_dev = setup.mesh.size
  flops_per_token = accounting.train_flops_per_token(cfg.model, setup.schedule, cfg.data.seq_len,
                                                     accounting.param_match(cfg.schedule))
  peak = resolve_peak(tcfg.peak_tflops, n_dev, cfg.model.dtype)
  kv_bytes = accounting.kv_cache_bytes_per_token(cfg.model, setup.schedule,
                                                 2 if cfg.model.dtype == "bfloat16" else 4)
  log = MetricsLogger(run_dir, tcfg.steps, start, tcfg.progress_bar)
  log.print(f"jaxshare | {setup.schedule.describe()}")
  if ckpt.cleaned:
    log.print(f"removed {len(ckpt.cleaned)} unfinished checkpoint write(s) an interrupted run left: "
              + ", ".join(ckpt.cleaned))
  for report in fallbacks:
    log.print(f"warning: {report} Resuming from checkpoint {latest}, the newest one that restored and verified.")
  log.print(f"params {setup.num_params:,} ({setup.num_trainable:,} trainable) | KV cache {kv_bytes:,} B/token | "
            f"mesh {dict(setup.mesh.shape)} ({n_dev} {jax.devices()[0].platform}) | train "
            f"{len(data.train_source):,} seqs, val {len(data.val_source):,} seqs of {cfg.data.seq_len} | "
            + (f"resumed at step {start}" if latest is not None else
               f"initialised from {tcfg.init_from}" if source is not None else "fresh start")
            + (f" | recipe {tcfg.recipe}, stage {stage}" if two_stage else ""))
  if source is not None and latest is None and setup.ties is None:
    for line in init_report(source.params, source.schedule, state["params"], setup.schedule, init_kv_pool(cfg),
                            cfg.train.init_mlp_widen):
      log.print(f"init | {line}")
  log.print(f"MFU against {peak.label}; {flops_per_token / 1e6:.2f} MFLOP per trained token (model FLOPs)"
            if peak is not None else "MFU not shown: unknown accelerator peak (set train.peak_tflops)")

  summary: dict[str, Any] = {"run_dir": cfg.train.run_dir, "num_params": setup.num_params,
                             "trainable_params": setup.num_trainable, "kv_bytes_per_token": kv_bytes, "step": start,
                             "mfu_peak": None if peak is None else peak.label}
  monitor = Stage1Monitor(tcfg.stage1_ema, tcfg.stage1_patience, tcfg.stage1_max_steps)
  if "stage1" in meta:  # resume early stopping exactly where it was
    monitor.load(meta["stage1"])
  pending: list[dict] = []
  screened = 0  # how many of pending were already checked for non-finite steps
  skipped = meta.get("skipped_steps", 0)
  t_last, step = time.perf_counter(), start
  end = tcfg.steps if stop_after is None else min(tcfg.steps, stop_after)

  def screen(flags) -> None:
    """Check the steps of pending[screened:] (their ``finite`` flags): stop the run at the first non-finite one, or
    count and report it (train.nan_policy)."""
    nonlocal screened, skipped
    first = step - len(pending) + 1 + screened
    for i, ok in enumerate(flags[screened:]):
      if bool(ok):
        continue
      bad = jax.device_get(pending[screened + i])
      what = f"loss {float(bad['loss'])}, gradient norm {float(bad['grad_norm'])}"
      if tcfg.nan_policy == "skip":
        skipped += 1
        log.print(f"step {first + i}: {what}: skipped, the state is unchanged ({skipped} skipped so far)")
        continue
      ckpt.wait()
      last = ckpt.latest_step()
      raise DivergenceError(
        f"training diverged at step {first + i}: {what}. The state was not updated and nothing after it was saved; "
        + (f"the last good checkpoint is step {last} in {run_dir / 'checkpoints'}" if last is not None else
           "no checkpoint had been written yet")
        + ". Lower train.lr or raise train.warmup_steps and resume, or set train.nan_policy=skip to skip such steps.")
    screened = len(pending)

  def save(step: int) -> None:
    if len(pending) > screened:  # never checkpoint past a step that was not checked
      screen(jax.device_get([m["finite"] for m in pending]))
    ckpt.save(step, state, data_iter, {"step": step, "stage": stage, "stage_start": stage_start,
                                       "stage1": monitor.state(), "skipped_steps": skipped})

  with jax.set_mesh(setup.mesh), Interrupts() as interrupts, _writes_finished_on_error(ckpt):
    while step < end and not interrupts.should_stop(step):
      batch = parallel.shard_batch(setup.batch_sharding, next(data_iter))
      state, metrics = step_fn(state, batch, teacher_params)
      step += 1
      pending.append(metrics)
      log.advance(1)
      if stage == 1 and bool(metrics["finite"]) and monitor.update(float(metrics["loss"])):
        # UniAttn stage 2: everything trains, with a fresh optimizer state and a learning-rate schedule (warm-up,
        # cosine) over the remaining steps
        stage, stage_start = 2, step
        setup = setup_training(cfg, mesh, trainable_for(cfg, stage), ties, start_step=stage_start)
        params = state["params"]
        opt_state = jax.jit(setup.tx.init, out_shardings=setup.state_shardings["opt_state"])(params)
        state = {"params": params, "opt_state": opt_state, "step": state["step"]}
        step_fn = jit_train_step(setup, objective, teacher_shardings)
        summary["trainable_params"] = setup.num_trainable
        log.print(f"stage 1 ended at step {step} (loss EMA {monitor.ema:.4f}); stage 2 trains "
                  f"{setup.num_trainable:,} parameters")
      is_last = step == tcfg.steps
      is_eval = bool(tcfg.eval_every and step % tcfg.eval_every == 0) or is_last
      if step % tcfg.log_every == 0 or is_eval or step == end:
        host = jax.device_get(pending)
        screen([m["finite"] for m in host])
        dt = time.perf_counter() - t_last
        tokens = float(sum(m["tokens"] for m in host))
        tps = tokens / dt
        good = [m for m in host if m["finite"]] or host
        record = {"step": step, "loss": float(np.mean([m["loss"] for m in good])),
                  "lr": float(host[-1]["lr"]), "grad_norm": float(host[-1]["grad_norm"]),
                  "tokens_per_sec": tps, "step_time": dt / len(host),
                  "trainable_params": setup.num_trainable}
        if peak is not None:
          record["mfu"] = flops_per_token * tps / peak.flops_per_sec
        for key in ("kd_loss", "postshare_loss"):
          if key in host[-1]:
            record[key] = float(np.mean([m[key] for m in host]))
        if two_stage:
          record["stage"] = stage
        if skipped:
          record["skipped_steps"] = skipped
        pending, screened, t_last = [], 0, time.perf_counter()
        if is_eval:
          record["val_loss"] = evaluate_loss(eval_fn, setup.batch_sharding, state["params"], data, tcfg.eval_batches)
          summary["val_loss"] = record["val_loss"]
          t_last = time.perf_counter()  # keep validation out of the next interval's throughput
        log.write(record)
        log.advance(0, record["loss"])
        mfu = "" if peak is None else f" | MFU {100 * record['mfu']:.1f}%" + (f" ({peak.tag})" if peak.tag else "")
        log.print(f"step {step:>6}/{tcfg.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                  f"{tps:,.0f} tok/s | {record['step_time'] * 1e3:.0f} ms/step{mfu}"
                  + "".join(f" | {k} {record[k]:.4f}" for k in ("kd_loss", "postshare_loss", "val_loss")
                            if k in record))
        summary.update(loss=record["loss"], tokens_per_sec=tps, mfu=record.get("mfu"))
      if step % tcfg.checkpoint_every == 0 or is_last:
        save(step)
    if step < tcfg.steps and step % tcfg.checkpoint_every:
      save(step)
    ckpt.wait()  # still under the handlers: a second signal cannot cut the write short
    if step < tcfg.steps:
      how = f"interrupted by {interrupts.received[0]}" if interrupts.received else "stopped"
      log.print(f"{how} at step {step}; checkpoint {step} saved, re-run the same command to resume")
  ckpt.close()
  log.close()
  summary.update(step=step, stage=stage, skipped_steps=skipped,
                 interrupted=interrupts.received[0] if interrupts.received else None)
  return summary
