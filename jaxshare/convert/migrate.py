"""Run directories written by an older jaxshare brought up to date, once, with a message saying what was done."""

from __future__ import annotations

import os

from jaxshare.store import runs
from jaxshare.store.checkpoint import CheckpointError
from jaxshare.config import ConfigError
from jaxshare.init.headwise import compute_ties


def store_ties(path: str | os.PathLike) -> str:
  """Choose a head-wise run's ties as the jaxshare that trained it did at every load (DirectShare on its
  ``train.init_from`` source's latest checkpoint, or on the dense model of its ``train.seed``), store them in the
  run directory, and say so. Needs the source run, unchanged since, when the run was uptrained.

  Raises:
    ConfigError: not a head-wise run, valid ties are already stored, or its source is gone or no longer fits.
    CheckpointError: the source run's checkpoint is unreadable.
  """
  run_dir, _ = runs.locate(path)
  files = runs.read_stored(run_dir)
  cfg, plan = files.planned()
  schedule = plan.schedule
  if not schedule.tied_heads:
    raise ConfigError(f"run {str(run_dir)!r} has schedule.kind={cfg.schedule.kind!r}, which ties no heads: it has no "
                      "ties to store")
  if files.ties_text is not None:
    try:
      files.ties(plan)
    except CheckpointError:  # an unreadable file: chosen again below
      pass
    else:
      raise ConfigError(f"run {str(run_dir)!r} already stores its ties ({runs.TIES_FILE}); nothing to do")
  ties = compute_ties(plan, cfg.train.seed, runs.load_run(cfg.train.init_from) if cfg.train.init_from else None)
  runs.write_ties(run_dir, ties)
  origin = (f"its source {cfg.train.init_from} (latest checkpoint)" if cfg.train.init_from else
            f"the dense model of seed {cfg.train.seed}")
  return (f"stored {schedule.tied_heads} tied heads ({ties.num_rows} stored rows), chosen on {origin} as jaxshare "
          f"chose them at every load before, in {run_dir / runs.TIES_FILE}")
