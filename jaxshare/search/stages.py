"""A schedule search's stages over its candidates: stage 1 converts each from the source and scores it on
calibration batches (no training); stage 2 uptrains the best by successive halving (the better half of each rung
trained again with twice the steps); the finals run the winner and the best preset at every seed.

The validation split is cut in two: its first ``calibration_batches`` batches select (stage 1 scores on them, the
rungs evaluate on them), the batches after them report (the finals evaluate on those only), so that the loss a
search reports was not read to choose what it reports.

Every stage is an Optuna study of a fixed grid (:mod:`jaxshare.search.study`); the trainings are ``train.py`` and
``eval.py`` runs through the sweep's runner, one per device group at a time.
"""

from __future__ import annotations

import dataclasses
import math
import queue
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from jaxshare.config import to_yaml
from jaxshare.config.choices import WcFit
from jaxshare.store import runs
from jaxshare.convert.uptrain import convert
from jaxshare.search.budget import SearchError
from jaxshare.search.calibration import Calibration
from jaxshare.search.space import Candidate
from jaxshare.search.study import failures, run_grid
from jaxshare.sweep.devices import DeviceGroup
from jaxshare.sweep.runner import execute, say
from jaxshare.sweep.spec import Trial


@dataclasses.dataclass(frozen=True)
class Settings:
  """How a search trains and scores.

  Attributes:
    out: the search directory (converted runs, trained runs, results).
    source: the source run directory.
    steps: S, the uptraining steps of stage 2's first rung (rung r trains ``S * 2**r``).
    trials: stage 2's budget of uptraining runs over all rungs (the finals apart).
    seeds: the finals' seeds.
    lr: uptraining's peak learning rate.
    calibration_batches: training batches a conversion fits on (UniAttn's W_c, a calibrated LISA start), and the
      selection split: the first validation batches, which stage 1 and the rungs score on.
    overrides: more overrides of every uptraining run (e.g. ``train.batch_size=8``).
  """

  out: Path
  source: str
  steps: int
  trials: int
  seeds: int
  lr: float
  calibration_batches: int = 8
  overrides: tuple[str, ...] = ()


class Progress:
  """One line per finished trial: how many of the stage are done, the best so far, and the time left at the mean
  pace so far."""

  def __init__(self, stage: str, total: int):
    self.stage, self.total, self.done, self.start = stage, total, 0, time.monotonic()
    self.best: tuple[float, str] | None = None

  def finished(self, name: str, value: float, detail: str = "") -> None:
    self.done += 1
    if self.best is None or value < self.best[0]:
      self.best = (value, name)
    pace = (time.monotonic() - self.start) / self.done
    left = max(self.total - self.done, 0) * pace
    say(f"[{self.stage} {self.done}/{self.total}] {name}: {value:.4f}{detail} | best {self.best[1]} "
        f"{self.best[0]:.4f} | ~{left / 60:.1f} min left")


def _write_converted(path: Path, conversion, src_run: str) -> None:
  """Write a converted candidate as a run directory, atomically: a worker killed mid-write leaves no half run."""
  if path.exists():
    return
  tmp = path.with_name(path.name + ".partial")
  shutil.rmtree(tmp, ignore_errors=True)
  runs.write_run(tmp, conversion.as_run(), meta={"uptrained_from": src_run})
  # write_run's config names the directory written (train.run_dir): name the one it lands in
  cfg = conversion.cfg
  runs.write_run_files(tmp, to_yaml(dataclasses.replace(cfg, train=dataclasses.replace(
    cfg.train, run_dir=str(path.absolute())))))
  tmp.rename(path)


def stage1(settings: Settings, src: runs.Run, candidates: Sequence[Candidate], calibration: Calibration,
           storage) -> dict:
  """Convert and score every candidate (:class:`~jaxshare.search.calibration.Stage1Score`); each converted run is
  kept in ``<out>/converted/<name>`` for stage 2. Returns the completed trials by candidate name."""
  by_name = {c.name: c for c in candidates}
  progress = Progress("stage 1", len(candidates))

  def objective(name: str) -> tuple[float, dict]:
    cand = by_name[name]
    conversion = convert(src, settings.source, list(cand.overrides),
                         calibration_batches=settings.calibration_batches, wc_fit=cand.wc_fit or WcFit.TOKENS)
    score = calibration.score(conversion.graphdef, conversion.params)
    _write_converted(settings.out / "converted" / name, conversion, settings.source)
    progress.finished(name, score.loss, f" (KL {score.kl:.4f})")
    return score.loss, {"kl": score.kl}

  return run_grid(storage, "stage1", [c.name for c in candidates], objective)


def halving(first: int) -> list[int]:
  """Candidates per rung of successive halving from ``first``: half (rounded up) each rung, down to one."""
  sizes = [first]
  while sizes[-1] > 1:
    sizes.append(math.ceil(sizes[-1] / 2))
  return sizes


def rung_sizes(trials: int, candidates: int) -> list[int]:
  """The longest halving (:func:`halving`) of at most ``candidates`` whose runs in all fit in ``trials``."""
  fitting = [halving(n) for n in range(1, candidates + 1) if sum(halving(n)) <= trials]
  return fitting[-1] if fitting else []


def rung_dir(settings: Settings, rung: int, name: str) -> Path:
  """Where stage 2's rung ``rung`` trains candidate ``name``."""
  return settings.out / f"rung{rung}" / name


def selection_flags(settings: Settings) -> tuple[str, ...]:
  """eval.py's flags for the selection split: the first ``calibration_batches`` validation batches."""
  return ("--max-batches", str(settings.calibration_batches))


def reported_flags(settings: Settings) -> tuple[str, ...]:
  """eval.py's flags for the reported split: the validation batches after the selection split's."""
  return ("--skip-batches", str(settings.calibration_batches))


def _train_objective(settings: Settings, groups: Sequence[DeviceGroup], run_dir: Callable[[str], Path],
                     steps: int, progress: Progress, eval_flags: tuple[str, ...],
                     trained: dict[str, Path] | None = None) -> Callable[[str], tuple[float, dict]]:
  """A trial that uptrains ``point`` (``name`` or ``name@seed<k>``) from its converted run for ``steps`` steps, in a
  free device group, and returns eval.py's validation loss with ``eval_flags`` (the batches it reads). A point in
  ``trained`` (a run already trained so, by the last rung) is evaluated there, not trained again."""
  free: queue.Queue[DeviceGroup] = queue.Queue()
  for g in groups:
    free.put(g)

  def objective(point: str) -> tuple[float, dict]:
    name, _, seed = point.partition("@seed")
    seed = int(seed or 0)
    converted = (settings.out / "converted" / name).absolute()
    overrides = (f"train.init_from={converted}", f"train.steps={steps}", f"train.warmup_steps={max(1, steps // 10)}",
                 f"train.eval_every={steps}", f"train.checkpoint_every={steps}", f"train.lr={settings.lr}",
                 f"train.seed={seed}", f"data.shuffle_seed={seed}", *settings.overrides)
    done = (trained or {}).get(point)
    trial = Trial(name, seed, overrides, done or run_dir(point), eval_flags=eval_flags)
    group = free.get()
    try:
      row = execute(str(converted / runs.CONFIG_FILE), trial, steps, group, evaluate_only=done is not None)
    finally:
      free.put(group)
    if row["status"] != "ok":
      raise RuntimeError(f"{point}: {row['error']} (log: {trial.run_dir / 'sweep.log'})")
    progress.finished(point, float(row["val_loss"]), f" after {steps} steps")
    return float(row["val_loss"]), {"steps": steps}

  return objective


def stage2(settings: Settings, ranked: Sequence[str], presets: set[str], storage,
           groups: Sequence[DeviceGroup]) -> list[dict[str, float]]:
  """Successive halving over ``ranked`` (best stage-1 score first): rung r uptrains its candidates for
  ``S * 2**r`` steps; the better half goes on. The best preset by stage 1 always enters the first rung.

  Returns:
    Per rung, ``{name: validation loss}``.

  Raises:
    SearchError: the trial budget cannot fund even one rung, or every run of a rung failed.
  """
  sizes = rung_sizes(settings.trials, len(ranked))
  if not sizes:
    raise SearchError(f"--trials {settings.trials} is invalid: stage 2 needs at least 1 uptraining run")
  first = list(ranked[:sizes[0]])
  best_preset = next((n for n in ranked if n in presets), None)
  if best_preset is not None and best_preset not in first:
    first[-1] = best_preset
  results, names = [], first
  for r, n in enumerate(sizes):
    steps = settings.steps * 2 ** r
    names = names[:n]
    progress = Progress(f"stage 2 rung {r} ({steps} steps)", len(names))
    objective = _train_objective(settings, groups, lambda p, r=r: rung_dir(settings, r, p), steps, progress,
                                 selection_flags(settings))
    done = run_grid(storage, f"rung{r}", names, objective, workers=len(groups))
    scores = {name: done[name].value for name in names if name in done}
    if not scores:
      raise SearchError(f"every run of stage 2's rung {r} failed: " + "; ".join(
        f"{k}: {v}" for k, v in failures(storage, f"rung{r}").items()))
    results.append(scores)
    names = sorted(scores, key=scores.get)
  return results


def finals(settings: Settings, names: Sequence[str], steps: int, storage, groups: Sequence[DeviceGroup],
           trained: dict[str, Path]) -> dict[str, list[float]]:
  """``names`` uptrained for ``steps`` steps at every seed (``train.seed`` and ``data.shuffle_seed``) and evaluated on
  the reported split; ``trained``: the runs the last rung already trained so, at seed 0, by name (evaluated, not
  trained again). Returns the validation losses by name, in seed order (a failed seed left out)."""
  points = [f"{n}@seed{k}" for n in names for k in range(settings.seeds)]
  progress = Progress(f"finals ({steps} steps)", len(points))
  objective = _train_objective(settings, groups, lambda p: settings.out / "finals" / p.replace("@", "/"), steps,
                               progress, reported_flags(settings), {f"{n}@seed0": d for n, d in trained.items()})
  done = run_grid(storage, "finals", points, objective, workers=len(groups))
  return {n: [done[p].value for p in points if p.startswith(n + "@") and p in done] for n in names}
