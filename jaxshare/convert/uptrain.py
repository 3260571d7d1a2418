"""``python -m jaxshare.convert uptrain``: a trained run converted into another schedule, written as a new run
directory, by the rules of :mod:`jaxshare.init` plus what is fitted on calibration batches."""

from __future__ import annotations

import dataclasses
import itertools

import jax
from flax import nnx

from jaxshare.store import runs
from jaxshare.config import Config, ConfigError, ScheduleConfig, apply_overrides
from jaxshare.config.source import with_match_reference
from jaxshare.data import Datasets
from jaxshare.init.compensation import calibrate_compensation, format_fits
from jaxshare.init.headwise import compute_ties
from jaxshare.init.lisa import calibrate_low_rank, fittable_lisa_layers
from jaxshare.init.report import init_report
from jaxshare.init.rules import InitRules
from jaxshare.init.source import check_loadable, initial_params, params_from_source
from jaxshare.model.ties import HeadTies
from jaxshare.plan import ModelPlan, plan_of
from jaxshare.store.teacher import recorded_teacher


@dataclasses.dataclass(frozen=True)
class Conversion:
  """A source run converted into another schedule (:func:`convert`), held in memory.

  Attributes:
    cfg: the target's config (the source's with the overrides, ``train.init_from`` the source).
    plan: its compiled plan.
    ties: its head-wise ties (None without head-wise sharing).
    graphdef / params: the target model (params a pure dict of host or device arrays).
    lines: the conversion's report (one line per rule applied or fitted).
  """

  cfg: Config
  plan: ModelPlan
  ties: HeadTies | None
  graphdef: nnx.GraphDef
  params: dict
  lines: list[str]

  def as_run(self) -> runs.Run:
    """The converted model as a :class:`~jaxshare.store.runs.Run` read from nowhere (step 0), for
    :func:`~jaxshare.store.runs.write_run`."""
    return runs.Run(None, self.cfg, self.plan, self.ties, self.graphdef, self.params, 0, None)


def uptrain_run(src_run, out_run, overrides, *, calibration_batches: int = 8, wc_fit: str = "tokens",
                lisa_steps: int = 200, schedule: ScheduleConfig | None = None) -> list[str]:
  """Convert a run into another schedule (:func:`convert`) and write it as a new run directory (step 0); returns the
  report lines.

  Raises:
    As :func:`convert`. FileExistsError: ``out_run`` not empty.
  """
  src = runs.load_run(src_run)
  out = convert(src, src_run, overrides, calibration_batches=calibration_batches, wc_fit=wc_fit,
                lisa_steps=lisa_steps, schedule=schedule)
  runs.write_run(out_run, out.as_run(), meta={"uptrained_from": str(src_run), "source_step": src.step})
  return [f"{src.schedule.describe()} -> {out.plan.schedule.describe()}", *out.lines, f"written to {out_run}"]


def convert(src: runs.Run, src_run, overrides, *, calibration_batches: int = 8, wc_fit: str = "tokens",
            lisa_steps: int = 200, schedule: ScheduleConfig | None = None) -> Conversion:
  """Convert the loaded run ``src`` (read from ``src_run``) into another schedule, in memory.

  The target config is the source's, with ``schedule`` when given (e.g. a search's frontier config's), with
  ``overrides`` applied (``train.init_from`` set to the source, ``train.kd_teacher`` to the dense model it descends
  from: :func:`~jaxshare.store.teacher.recorded_teacher`), its
  parameters those ``train.py`` would start from with ``train.init_from``, except what is fitted on the first
  ``calibration_batches`` training batches: UniAttn's W_c by least squares (:mod:`jaxshare.init.compensation`; 0
  batches keep them at zero), and with ``train.init_lisa=calibrated`` LISA's low-rank factors, from the ``fit``
  start by ``lisa_steps`` Adam steps (:func:`~jaxshare.init.lisa.calibrate_low_rank`). A head-wise target's ties
  are chosen here, once.

  Raises:
    ConfigError / CheckpointError: unreadable source or invalid overrides, or ``train.init_lisa=calibrated`` with
      no calibration batches. DataError: the calibration data cannot be read. ValueError: invalid ``wc_fit``.
  """
  # the source's own reference (if it was matched) is not the target's: the target is matched to the source
  base = src.cfg if schedule is None else dataclasses.replace(src.cfg, schedule=schedule)
  recorded = recorded_teacher(src)  # distillation's teacher for runs uptrained from this one (train.kd_teacher)
  cfg = with_match_reference(apply_overrides(base, ["schedule.match_reference_params=0", f"train.kd_teacher={recorded}",
                                                    *overrides, f"train.init_from={src_run}"]),
                             src.plan.param_count().total)
  check_loadable(src.cfg.model, cfg.model, str(src_run), src_tokenizer=src.cfg.data.tokenizer,
                 tokenizer=cfg.data.tokenizer)
  start = "fit" if cfg.train.init_lisa == "calibrated" else cfg.train.init_lisa  # calibrated starts from fit
  plan = plan_of(cfg)
  schedule = plan.schedule
  lisa_calibrated = cfg.train.init_lisa == "calibrated" and any(p.has_low_rank for p in schedule.layers)
  fitted = fittable_lisa_layers(src.params, src.schedule, schedule) if lisa_calibrated else []
  if lisa_calibrated and not fitted:
    raise ConfigError("train.init_lisa=calibrated: no LISA layer of the target has its own W_q and W_k, and its "
                      "score source's, in the source model to start from; use train.init_lisa=ds")
  if lisa_calibrated and not calibration_batches:
    raise ConfigError("train.init_lisa=calibrated needs calibration batches: --calibration-batches must be >= 1")
  ties = compute_ties(plan, cfg.train.seed, src)
  graphdef, _ = runs.abstract_params(plan, ties)
  rules = dataclasses.replace(InitRules.of(cfg.train, cfg.schedule.kind), lisa=start)
  params = jax.jit(lambda s: params_from_source(plan, rules, ties, initial_params(plan, ties, cfg.train.seed), s,
                                                src.schedule))(src.params)
  calibrate = bool(calibration_batches) and any(p.compensation for p in schedule.layers)
  lines = init_report(src.params, src.schedule, params, schedule, rules.kv_pool, rules.mlp_widen,
                      wc_fitted=calibrate, lisa_start=start) \
    if ties is None else ["head-wise sharing: DirectShare's tying of the source's heads (jaxshare/init/headwise.py)"]
  if calibrate or lisa_calibrated:
    data = Datasets(cfg.data, cfg.train.batch_size, process_index=0, process_count=1)
    batches = list(itertools.islice(data.train_iter(), calibration_batches))
  if calibrate:
    params, fits, losses = calibrate_compensation((src.graphdef, src.params), (graphdef, params), schedule, batches,
                                                  fit=wc_fit)
    lines += format_fits(fits, losses, wc_fit)
  if lisa_calibrated:
    params, fit = calibrate_low_rank((src.graphdef, src.params), (graphdef, params), schedule, batches, fitted,
                                     window=cfg.model.sliding_window, steps=lisa_steps)
    outcome = "no better: the fit kept" if fit.kept_start else "calibrated"
    lines.append(f"layers {list(fit.layers)} attn/q_lr, k_lr: {lisa_steps} Adam steps from the fit on "
                 f"{len(batches)} calibration batches: squared logit error vs the source's own, relative to plain "
                 f"reuse (DS = 1): fit {fit.start:.4f} -> {outcome} {fit.calibrated:.4f}")
  return Conversion(cfg, plan, ties, graphdef, params, lines)
