"""A config started from another run's weights (``train.init_from``, ``convert uptrain``, a search's candidates):
what it takes from that run beyond the :data:`~jaxshare.config.INHERITED` fields."""

from __future__ import annotations

import dataclasses

from jaxshare.config.schema import Config


def with_match_reference(cfg: Config, source_params: int | None) -> Config:
  """``cfg`` with ``schedule.match_reference_params`` set to ``source_params``, the total parameter count of its
  uptraining source (None: it has none), when it matches parameters exactly (``schedule.match_params``) and the
  reference is not yet set: an uptrained model is matched to the model it came from (a GQA source has fewer K/V
  parameters than the dense MHA model of its config). The count stays in the run's config, so the run rebuilds
  without its source. ``cfg`` is not changed.
  """
  s = cfg.schedule
  if not (s.match_params and s.match_formula == "exact" and not s.match_reference_params and source_params):
    return cfg
  return dataclasses.replace(cfg, schedule=dataclasses.replace(s, match_reference_params=source_params))
