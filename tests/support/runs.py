"""A test's config and parameters as the records the store and the export take (the entry points build them from a
run or a conversion)."""

from __future__ import annotations

from jaxshare.config import Config, to_yaml
from jaxshare.convert.hf_export import export_params
from jaxshare.model.ties import HeadTies
from jaxshare.plan import plan_of
from jaxshare.store.runs import Run, abstract_params


def as_run(cfg: Config, params: dict, ties: HeadTies | None = None) -> Run:
  """``params`` of the model of ``cfg`` as a :class:`Run` read from nowhere (step 0), for ``write_run``."""
  plan = plan_of(cfg)
  return Run(None, cfg, plan, ties, abstract_params(plan, ties)[0], params, 0, None)


def export(cfg: Config, params: dict, out_dir, ties: HeadTies | None = None, **kwargs) -> str:
  """:func:`export_params` of ``params`` of the model of ``cfg``; returns the architecture written."""
  return export_params(plan_of(cfg), params, out_dir, config_yaml=to_yaml(cfg), seq_len=cfg.data.seq_len, ties=ties,
                       **kwargs)
