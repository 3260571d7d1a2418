"""The HF-style directory of a model that no HF class can hold (any sharing schedule beyond dense/GQA): every
parameter under its jaxshare path in ``model.safetensors``, and ``config.json`` carrying the whole jaxshare config
(schedule included) under ``jaxshare_config`` and, for head-wise sharing, the run's ties under ``jaxshare_head_ties``.
It re-imports bit-exactly; transformers does not load it."""

from __future__ import annotations

import numpy as np

from jaxshare.config import Config, config_from_yaml_text, to_yaml
from jaxshare.convert.mapping import UnsupportedModelError
from jaxshare.model import params as P
from jaxshare.model.ties import HeadTies
from jaxshare.schedule import Schedule

ARCHITECTURE = "JaxshareForCausalLM"


def flatten(params: dict) -> dict[str, np.ndarray]:
  """``{"segments/0/blocks/.../kernel": array}`` of a pure-dict parameter tree (list-like levels keyed by index)."""
  return {name: np.asarray(v) for name, v in P.flat_leaves(params).items()}


def config_json(cfg: Config, ties: HeadTies | None = None) -> dict:
  """``config.json`` of a native directory: the config, and the head-wise ties when the schedule ties heads."""
  return {"architectures": [ARCHITECTURE], "model_type": "jaxshare", "jaxshare_config": to_yaml(cfg),
          **({"jaxshare_head_ties": ties.to_json()} if ties is not None else {})}


def read_config(config: dict) -> Config:
  """The jaxshare config a native directory carries.

  Raises:
    UnsupportedModelError: ``jaxshare_config`` missing or unreadable.
  """
  text = config.get("jaxshare_config")
  if not isinstance(text, str):
    raise UnsupportedModelError(f"config.json says {ARCHITECTURE} but has no 'jaxshare_config' text")
  return config_from_yaml_text(text)


def read_ties(config: dict, cfg: Config, schedule: Schedule) -> HeadTies | None:
  """The head-wise ties a native directory carries (None when ``schedule``, compiled from ``cfg``, ties no heads).

  Raises:
    UnsupportedModelError: the schedule ties heads and ``jaxshare_head_ties`` is missing (an export written before
      ties were stored with it), malformed, or ties another number of heads (e.g. after a ``schedule.headwise``
      override).
  """
  if not schedule.tied_heads:
    return None
  text = config.get("jaxshare_head_ties")
  if not isinstance(text, str):
    raise UnsupportedModelError(f"config.json ties {schedule.tied_heads} heads but has no 'jaxshare_head_ties' (an "
                                "export written before jaxshare stored head-wise ties): export the run again")
  try:
    ties = HeadTies.from_json(text, "'jaxshare_head_ties' of config.json")
    ties.check(len(schedule.layers), cfg.model.num_heads, schedule.tied_heads, "'jaxshare_head_ties' of config.json")
  except ValueError as e:
    raise UnsupportedModelError(f"{e}: import without overriding schedule.headwise") from None
  return ties


def fill(template: dict, read, names: list[str]) -> dict:
  """``template`` (a tree of writable NumPy arrays) filled in place, every leaf read by its path (shape checked by
  ``read``), one tensor at a time.

  Raises:
    UnsupportedModelError: tensors in the file that the model has no parameter for.
  """
  wanted = P.flat_leaves(template)
  extra = sorted(set(names) - set(wanted))
  if extra:
    raise UnsupportedModelError(f"the file has tensors this jaxshare config has no parameter for: {extra[:8]}")
  for name, arr in wanted.items():
    arr[...] = read(name, arr.shape)
  return template
