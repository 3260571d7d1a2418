"""The config a training run runs: ``train.py``'s file and overrides, composed on its ``train.init_from`` source's
model, schedule and tokenizer, and narrowed under ``JAXSHARE_SMOKE``."""

from __future__ import annotations

import os

from jaxshare import smoke
from jaxshare.store import runs
from jaxshare.config import Config, apply_overrides, load_config


def load_train_config(path: str | os.PathLike | None, overrides: list[str] | tuple[str, ...],
                      fit_check: bool = False) -> Config:
  """The config ``train.py --config path overrides`` runs. With ``train.init_from`` (set in the file or an override)
  it is composed on the source run's own model, schedule and tokenizer (:data:`~jaxshare.config.INHERITED`), which
  the file and the overrides may still set: a run made by ``convert uptrain`` trains as the schedule it was
  converted into, and an imported model with its own tokenizer, without repeating them.

  Under ``JAXSHARE_SMOKE`` the model is the narrow one :mod:`jaxshare.smoke` trains, on its short sequences and small
  batches (a ``fit_check``, ``train.py --compile-only``, keeps the configured batch).

  Raises:
    ConfigError: as :func:`~jaxshare.config.load_config`, or ``train.init_from`` is not a run directory (or
      checkpoint) with a readable config.
  """
  cfg = load_config(path, overrides)
  if cfg.train.init_from:
    cfg = load_config(path, overrides, inherit=runs.read_config(runs.locate(cfg.train.init_from)[0]))
  if smoke.enabled():
    cfg = apply_overrides(cfg, smoke.overrides(cfg.model.num_heads, cfg.train.grad_accum_steps, fit_check))
  return cfg
