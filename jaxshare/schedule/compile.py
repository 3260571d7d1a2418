"""Compiling a schedule: ``schedule.kind``'s presets expanded into layer plans, every cross-preset rule checked, and
the plans grouped for execution."""

from __future__ import annotations

import dataclasses

from jaxshare.config import LISA_PRESETS, ModelConfig, ScheduleConfig
from jaxshare.schedule.grouping import RoleSettings, group
from jaxshare.schedule.layout import LayerPlan, Schedule, ScheduleError
from jaxshare.schedule.presets import Kind, parse_kind, readers

# The knobs some preset reads, in ScheduleConfig's order (the first one set in vain is named).
_KNOBS = tuple(f.name for f in dataclasses.fields(ScheduleConfig) if readers(f.name))


def _check_ignored_knobs(sched: ScheduleConfig, kind: Kind) -> None:
  """A knob set away from its default under presets that all ignore it is an error: a typo or a misunderstanding
  would otherwise train something else than asked, silently."""
  defaults = ScheduleConfig()
  for knob in _KNOBS:
    value, default, read_by = getattr(sched, knob), getattr(defaults, knob), readers(knob)
    if value == default or any(p.name in read_by for p in kind.presets):
      continue
    if dataclasses.is_dataclass(value):  # name the sub-field that was set
      sub = next(f.name for f in dataclasses.fields(value) if getattr(value, f.name) != getattr(default, f.name))
      knob, value = f"{knob}.{sub}", getattr(value, sub)
    raise ScheduleError(f"schedule.{knob}={value!r} is invalid with schedule.kind={sched.kind!r}, which ignores it: "
                        f"it is read by {', '.join(read_by)}; remove it or choose one of those presets")


def _with_score_reuse(sched: ScheduleConfig, plans: list[LayerPlan], updates: dict[int, dict]) -> list[LayerPlan]:
  """``plans`` with a score preset's updates applied; a reusing layer must produce K/V (it needs its own V)."""
  plans = list(plans)
  for i, upd in updates.items():
    p = plans[i]
    if not p.is_producer:
      raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid at layer {i}: it reuses attention scores and "
                          f"so needs its own V, but the K/V preset makes it read layer {p.kv_source}'s K/V; "
                          "reuse scores only on K/V-producing layers")
    plans[i] = dataclasses.replace(p, **upd)
  for p in plans:
    if p.has_query_key and not plans[p.kv_source].has_query_key:
      raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid at layer {p.index}: it computes its own scores "
                          f"with the K of layer {p.kv_source}, which reuses scores and so projects no K")
  return plans


def tied_head_count(model: ModelConfig, ratio: float) -> int:
  """Heads N tied by head-wise sharing at ratio alpha: ``round(alpha * 4*L*H / 3)`` (removed W_q,W_k,W_v of N heads
  over all MHA parameters q,k,v,o; reproduces Table 3's 6.74B -> 6.09B for Llama2-7B at 30%)."""
  return round(ratio * 4 * model.num_layers * model.num_heads / 3)


def _tied_heads(model: ModelConfig, sched: ScheduleConfig, plans: list[LayerPlan], kind: Kind) -> int:
  """Head-wise sharing's tied head count N, once the layers are known to be plain MHA."""
  ratio = sched.headwise.ratio
  if not 0.0 <= ratio < 0.75:
    raise ScheduleError(f"schedule.headwise.ratio={ratio!r} is invalid: must be in [0, 0.75) (all q,k,v of the "
                        "layers after the first removed is 0.75 * (L-1)/L)")
  if any(not p.is_producer or p.num_kv_heads != model.num_heads for p in plans) or kind.score is not None:
    raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid: head-wise sharing is defined for MHA layers "
                        "that compute their own scores (every layer dense); combine it with no GQA/MQA/CLA/MLKV "
                        "or score-sharing preset")
  if model.features.dense_biases:
    raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid for model.flavor={model.flavor!r}: head-wise "
                        "sharing ties bias-free projections; use model.flavor=llama")
  if model.qkv_bias:
    raise ScheduleError(f"model.qkv_bias=True is invalid with schedule.kind={sched.kind!r}: head-wise sharing "
                        "ties bias-free Q/K/V projections (the biases would be dropped); set model.qkv_bias=false")
  tied = tied_head_count(model, ratio)
  if tied > (model.num_layers - 1) * model.num_heads:
    raise ScheduleError(f"schedule.headwise.ratio={ratio!r} ties {tied} heads, more than the "
                        f"{(model.num_layers - 1) * model.num_heads} heads outside layer 0")
  return tied


def compile_schedule(model: ModelConfig, sched: ScheduleConfig) -> Schedule:
  """Validate a schedule config against the model and compile it.

  Raises:
    ScheduleError: a preset's knobs that do not fit the model (:mod:`jaxshare.schedule.kv`,
      :mod:`jaxshare.schedule.scores`), a knob no chosen preset reads, a layer that reuses scores without producing
      K/V; head-wise sharing on GQA models, with K/V consumers, together with score sharing (undefined in the paper)
      or with Q/K/V biases (the tied projections have none); a ratio outside [0, 0.75).
  """
  kind = parse_kind(sched.kind)
  _check_ignored_knobs(sched, kind)
  plans = kind.kv.expand(model, sched)
  for p in plans:
    src = plans[p.kv_source]
    if not src.is_producer or src.num_kv_heads != p.num_kv_heads:
      raise ScheduleError(f"layer {p.index}: K/V source {p.kv_source} is not a producer with "
                          f"{p.num_kv_heads} K/V heads")
  if kind.score is not None:
    plans = _with_score_reuse(sched, plans, kind.score.expand(model, sched))
  tied = _tied_heads(model, sched, plans, kind) if kind.head is not None else 0
  lisa = kind.score is not None and kind.score.name in LISA_PRESETS
  rank = sched.lisa.rank if lisa else 0
  hidden = (sched.lisa.hidden or 8 * model.num_heads) if lisa else 0
  blocks, stacks = group(plans, RoleSettings(lisa_rank=rank, lisa_hidden=hidden, lisa_rope=sched.lisa.rope,
                                               wc_normed=sched.uniattn.wc_input == "normed", tied_qkv=tied > 0))
  return Schedule(sched.kind, tuple(plans), blocks, stacks, tied, lisa_rank=rank, lisa_hidden=hidden)
