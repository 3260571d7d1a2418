"""The K/V family of presets: each expands ``schedule`` knobs into one :class:`LayerPlan` per layer, saying which
layer's K/V it attends with (its own: a producer) and with how many K/V heads."""

from __future__ import annotations

from typing import Sequence

from jaxshare.config import ModelConfig, ScheduleConfig
from jaxshare.schedule.layout import LayerPlan, ScheduleError, is_int


def _kv_heads(model: ModelConfig, sched: ScheduleConfig) -> int:
  g = sched.kv_heads or model.num_heads
  if g < 1 or model.num_heads % g:
    raise ScheduleError(f"schedule.kv_heads={sched.kv_heads!r} is invalid: must divide model.num_heads="
                        f"{model.num_heads} (or be 0 for num_heads)")
  return g


def mlkv_owners(num_layers: int, m: int, placement: str) -> list[int]:
  """The KV-owning layers of MLKV with m owners among L layers (0-based).

  ``paper``: MLKV Eq. 16-17, layer n uses KV set floor(n / (L/m)); each set's owner is its lowest layer.
  ``reference_code``: pythia-mlkv's ``[0] + [int((i+1)*(L/m)) for i in range(m-1)]``, float quotient first as the
  authors wrote it (``int((i+1)*L/m)`` differs for 101 pairs with L <= 128, e.g. L=30, m=22).
  The two placements agree whenever m divides L; for L=12, m=5 they give {0,3,5,8,10} and {0,2,4,7,9}.
  """
  if placement == "paper":
    owners: list[int] = []
    for n in range(num_layers):
      if not owners or (n * m) // num_layers != ((owners[-1] * m) // num_layers):
        owners.append(n)
    return owners
  if placement == "reference_code":
    return [0] + [int((i + 1) * (num_layers / m)) for i in range(m - 1)]
  raise ScheduleError(f"schedule.placement={placement!r} is invalid: must be paper or reference_code")


def _from_producers(producers: Sequence[int], num_layers: int, g: int, field: str) -> list[LayerPlan]:
  producers = list(producers)
  bad = next((p for p in producers if not is_int(p)), None)
  if bad is not None:
    raise ScheduleError(f"{field}={producers!r} is invalid: {bad!r} is not a layer index (integers 0.."
                        f"{num_layers - 1})")
  if not producers or producers[0] != 0:
    raise ScheduleError(f"{field}={producers!r} is invalid: layer 0 must produce K/V (nothing precedes it)")
  if any(b <= a for a, b in zip(producers, producers[1:])):
    raise ScheduleError(f"{field}={producers!r} is invalid: producers must be strictly increasing")
  if producers[-1] >= num_layers:
    raise ScheduleError(f"{field}={producers!r} is invalid: layer {producers[-1]} does not exist "
                        f"(model.num_layers={num_layers})")
  plans, src = [], 0
  for i in range(num_layers):
    if i in producers:
      src = i
    plans.append(LayerPlan(i, src, g))
  return plans


def parse_sources(sources: str, num_layers: int) -> list[int]:
  """Parse an LCKV-style source list ``"0_0_2_2"`` into one K/V source index per layer."""
  parts = sources.replace(",", "_").split("_")
  try:
    src = [int(p) for p in parts]
  except ValueError:
    raise ScheduleError(f"schedule.sources={sources!r} is invalid: expected integers joined by '_', "
                        "e.g. '0_0_2_2'") from None
  if len(src) != num_layers:
    raise ScheduleError(f"schedule.sources={sources!r} is invalid: has {len(src)} entries, model.num_layers="
                        f"{num_layers} (in YAML, quote the list: sources: '0_0_2_2')")
  for i, s in enumerate(src):
    if not 0 <= s <= i:
      raise ScheduleError(f"schedule.sources={sources!r} is invalid at layer {i}: source {s} is not an "
                          f"earlier-or-same layer (allowed 0..{i})")
    if src[s] != s:
      raise ScheduleError(f"schedule.sources={sources!r} is invalid at layer {i}: source layer {s} does not "
                          f"produce K/V itself (it reads layer {src[s]})")
  return src


def dense(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Every layer produces its K/V with ``num_heads`` heads (multi-head attention)."""
  H = model.num_heads
  if sched.kv_heads not in (0, H):
    raise ScheduleError(f"schedule.kv_heads={sched.kv_heads!r} is invalid for kind=dense: dense attention "
                        f"has num_heads={H} K/V heads; use schedule.kind=gqa for fewer")
  return [LayerPlan(i, i, H) for i in range(model.num_layers)]


def mqa(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Every layer produces one K/V head (multi-query attention)."""
  return [LayerPlan(i, i, 1) for i in range(model.num_layers)]


def gqa(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Every layer produces ``schedule.kv_heads`` K/V heads, or per layer ``schedule.kv_heads_per_layer`` (GQA)."""
  L, H = model.num_layers, model.num_heads
  if sched.kv_heads_per_layer:
    per = list(sched.kv_heads_per_layer)
    if len(per) != L:
      raise ScheduleError(f"schedule.kv_heads_per_layer={per!r} is invalid: needs {L} entries "
                          f"(model.num_layers), got {len(per)}")
    for i, g in enumerate(per):
      if not is_int(g) or g < 1 or H % g:
        raise ScheduleError(f"schedule.kv_heads_per_layer[{i}]={g!r} is invalid: must divide "
                            f"model.num_heads={H}")
    return [LayerPlan(i, i, g) for i, g in enumerate(per)]
  return [LayerPlan(i, i, _kv_heads(model, sched)) for i in range(L)]


def cla(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Cross-Layer Attention: every ``schedule.factor``-th layer (or the ``schedule.producers``) produces K/V, the
  layers after it attend with them."""
  L, g = model.num_layers, _kv_heads(model, sched)
  if sched.producers:
    return _from_producers(sched.producers, L, g, "schedule.producers")
  if not 1 <= sched.factor <= L:
    raise ScheduleError(f"schedule.factor={sched.factor!r} is invalid: must be in 1..model.num_layers={L}")
  return _from_producers(range(0, L, sched.factor), L, g, "schedule.factor")


def mlkv(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Multi-Layer KV: ``schedule.kv_layers`` owners placed by ``schedule.placement`` (:func:`mlkv_owners`)."""
  L, m, g = model.num_layers, sched.kv_layers, _kv_heads(model, sched)
  if not 1 <= m <= L:
    raise ScheduleError(f"schedule.kv_layers={m!r} is invalid: MLKV needs 1 <= m <= model.num_layers={L}")
  return _from_producers(mlkv_owners(L, m, sched.placement), L, g, "schedule.kv_layers")


def explicit(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """One K/V source per layer, LCKV style (:func:`parse_sources`)."""
  g = _kv_heads(model, sched)
  if not sched.sources:
    raise ScheduleError("schedule.sources='' is invalid for kind=explicit: give one source per layer, "
                        "e.g. '0_0_2_2'")
  return [LayerPlan(i, s, g) for i, s in enumerate(parse_sources(sched.sources, model.num_layers))]
