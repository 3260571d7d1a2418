"""The preset registry: every preset of ``schedule.kind`` described once, with its family, the
:class:`~jaxshare.config.ScheduleConfig` knobs it reads and the function that expands it."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

from jaxshare.config import HeadPreset, KVPreset, ScorePreset
from jaxshare.schedule import kv, scores
from jaxshare.schedule.layout import ScheduleError

KV, SCORE, HEAD = "K/V", "score", "head"


@dataclasses.dataclass(frozen=True)
class Preset:
  """One preset of ``schedule.kind``.

  Attributes:
    name: its name in ``schedule.kind``.
    family: ``K/V`` (``expand(model, sched)`` returns one :class:`~jaxshare.schedule.layout.LayerPlan` per layer),
      ``score`` (``expand(model, sched)`` returns ``{layer: LayerPlan field updates}``) or ``head`` (no expansion:
      head-wise ties are chosen from weights, :mod:`jaxshare.init.headwise`).
    reads: the ``schedule`` knobs the preset reads; a knob set under presets that all ignore it is refused.
    expand: see ``family``.
  """

  name: str
  family: str
  reads: tuple[str, ...]
  expand: Callable | None = None


PRESETS: dict[str, Preset] = {p.name: p for p in (
  Preset(KVPreset.DENSE, KV, ("kv_heads",), kv.dense),
  Preset(KVPreset.GQA, KV, ("kv_heads", "kv_heads_per_layer"), kv.gqa),
  Preset(KVPreset.MQA, KV, (), kv.mqa),
  Preset(KVPreset.CLA, KV, ("kv_heads", "factor", "producers"), kv.cla),
  Preset(KVPreset.MLKV, KV, ("kv_heads", "kv_layers", "placement"), kv.mlkv),
  Preset(KVPreset.EXPLICIT, KV, ("kv_heads", "sources"), kv.explicit),
  Preset(ScorePreset.SA, SCORE, ("sa",), scores.sa),
  Preset(ScorePreset.UNIATTN, SCORE, ("uniattn",), scores.uniattn),
  *(Preset(p, SCORE, ("lisa",), functools.partial(scores.lisa_family, preset=p))
    for p in (ScorePreset.LISA, ScorePreset.LISA_PLUS, ScorePreset.DS)),
  Preset(HeadPreset.HEADWISE, HEAD, ("headwise",)),
)}


@dataclasses.dataclass(frozen=True)
class Kind:
  """``schedule.kind`` parsed: at most one preset of each family (the K/V one defaults to dense)."""

  kv: Preset
  score: Preset | None
  head: Preset | None

  @property
  def presets(self) -> tuple[Preset, ...]:
    return tuple(p for p in (self.kv, self.score, self.head) if p is not None)

  @property
  def dense(self) -> bool:
    """Whether the kind shares nothing: ``dense`` alone."""
    return self.presets == (PRESETS[KVPreset.DENSE],)

  def has(self, preset: str) -> bool:
    """Whether ``preset`` (a :class:`~jaxshare.config.KVPreset`, :class:`~jaxshare.config.ScorePreset` or
    :class:`~jaxshare.config.HeadPreset`) is one of the kind's presets."""
    return any(p.name == preset for p in self.presets)


def parse_kind(kind: str) -> Kind:
  """``"mlkv+uniattn"`` -> its presets.

  Raises:
    ScheduleError: an unknown preset, two of one family, or none.
  """
  parts = [p.strip() for p in kind.split("+") if p.strip()]
  picked: dict[str, Preset] = {}
  for p in parts:
    if p not in PRESETS:
      raise ScheduleError(f"schedule.kind={kind!r} is invalid: {p!r} is not a preset; allowed: "
                          f"{', '.join(PRESETS)}, joined by '+'")
    fam = PRESETS[p].family
    if fam in picked:
      raise ScheduleError(f"schedule.kind={kind!r} is invalid: two {fam} presets ({str(picked[fam].name)!r}, {p!r}); "
                          "combine at most one of each family")
    picked[fam] = PRESETS[p]
  if not parts:
    raise ScheduleError("schedule.kind='' is invalid: name a preset, e.g. dense")
  return Kind(picked.get(KV, PRESETS[KVPreset.DENSE]), picked.get(SCORE), picked.get(HEAD))


def readers(knob: str) -> tuple[str, ...]:
  """The presets that read ``knob``, in registry order."""
  return tuple(name for name, p in PRESETS.items() if knob in p.reads)
