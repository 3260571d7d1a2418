"""The conversion rules an uptrained model's parameters start by, narrowed from ``train`` at the door: what
:func:`~jaxshare.init.source.params_from_source` and the init report take instead of a whole config."""

from __future__ import annotations

import dataclasses

from jaxshare.config import KVPreset, TrainConfig
from jaxshare.schedule import parse_kind


@dataclasses.dataclass(frozen=True)
class InitRules:
  """How a model starts from a source model's weights.

  Attributes:
    kv_pool: how a producer's K/V projections are built from the source layers it serves (``train.init_kv_pool``
      resolved: ``auto`` is ``producer`` for CLA, which keeps the producer's own K/V, else ``mean``).
    mlp_widen: how a widened MLP's new hidden units start (``train.init_mlp_widen``).
    lisa: how a LISA layer's low-rank Q/K start (``train.init_lisa``).
  """

  kv_pool: str
  mlp_widen: str
  lisa: str

  @classmethod
  def of(cls, train: TrainConfig, kind: str) -> InitRules:
    """The rules of ``train`` for a target of schedule ``kind`` (``schedule.kind``)."""
    kv_pool = train.init_kv_pool
    if kv_pool == "auto":
      kv_pool = "producer" if parse_kind(kind).has(KVPreset.CLA) else "mean"
    return cls(kv_pool, train.init_mlp_widen, train.init_lisa)
