"""Execution grouping: a schedule's layers partitioned into superblocks closed under K/V and score references,
each split into runs of equal :class:`LayerRole`s, and equal superblocks gathered into stacks (see
:mod:`jaxshare.schedule`)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxshare.config import Integrator, ScoreReuse
from jaxshare.schedule.layout import LayerPlan, LayerRole, RunPlan, StackPlan, SuperblockPlan


@dataclasses.dataclass(frozen=True)
class RoleSettings:
  """Schedule-wide knobs that roles carry (from :class:`~jaxshare.config.ScheduleConfig`)."""

  lisa_rank: int = 0
  lisa_hidden: int = 0
  lisa_rope: bool = False
  wc_normed: bool = False
  tied_qkv: bool = False


def layer_roles(plans: Sequence[LayerPlan], start: int, settings: RoleSettings = RoleSettings()
                ) -> tuple[LayerRole, ...]:
  """The roles of one superblock's layers (references become positions relative to ``start``)."""
  feeds = {p.score_source - start: p.score_reuse for p in plans if p.score_reuse}
  roles = []
  for i, p in enumerate(plans):
    low_rank = p.has_low_rank
    roles.append(LayerRole(
      kv_from=None if p.is_producer else p.kv_source - start, num_kv_heads=p.num_kv_heads,
      score_reuse=p.score_reuse, score_from=p.score_source - start if p.score_reuse == ScoreReuse.PROBS else None,
      feeds=ScoreReuse.NONE if p.score_reuse else feeds.get(i, ScoreReuse.NONE), integrator=p.integrator,
      lisa_rank=settings.lisa_rank if low_rank else 0,
      lisa_hidden=settings.lisa_hidden if p.integrator == Integrator.FFN else 0,
      lisa_rope=settings.lisa_rope and low_rank, keep_qk=p.keep_qk, compensation=p.compensation,
      wc_normed=settings.wc_normed and p.compensation, tied_qkv=settings.tied_qkv))
  return tuple(roles)


def layer_runs(roles: Sequence[LayerRole]) -> tuple[RunPlan, ...]:
  """Maximal runs of consecutive layers with equal roles.

  A layer stays alone when a later layer reads its K/V or probabilities by position (a scan hands on only its
  last carry), or when the next layer reuses its logits and it is not itself a LISA layer (only LISA layers
  carry their logits through a scan).
  """
  referenced = {r.kv_from for r in roles} | {r.score_from for r in roles}
  alone = [i in referenced or (i + 1 < len(roles) and roles[i + 1].score_reuse == ScoreReuse.LOGITS
                               and role.score_reuse != ScoreReuse.LOGITS) for i, role in enumerate(roles)]
  runs: list[RunPlan] = []
  for i, role in enumerate(roles):
    last = runs[-1] if runs else None
    if last is not None and last.role == role and not alone[i] and not alone[last.start + last.length - 1]:
      runs[-1] = dataclasses.replace(last, length=last.length + 1)
    else:
      runs.append(RunPlan(i, 1, role))
  return tuple(runs)


def group(plans: Sequence[LayerPlan], settings: RoleSettings = RoleSettings()
          ) -> tuple[tuple[SuperblockPlan, ...], tuple[StackPlan, ...]]:
  """Partition plans into minimal reference-closed superblocks (each split into runs), then group runs of equal
  superblocks into stacks (the scanned units)."""
  n = len(plans)
  min_src_from = [0] * (n + 1)
  min_src_from[n] = n
  for i in range(n - 1, -1, -1):
    min_src_from[i] = min(plans[i].kv_source, plans[i].score_source, min_src_from[i + 1])
  cuts = [i for i in range(n) if min_src_from[i] == i] + [n]
  blocks = tuple(SuperblockPlan(a, tuple(plans[a:b]), layer_runs(layer_roles(plans[a:b], a, settings)))
                 for a, b in zip(cuts, cuts[1:]))
  stacks: list[StackPlan] = []
  for blk in blocks:
    if stacks and stacks[-1].runs == blk.runs and stacks[-1].superblock_size == len(blk.layers):
      last = stacks[-1]
      stacks[-1] = dataclasses.replace(last, count=last.count + 1)
    else:
      stacks.append(StackPlan(blk.start, 1, len(blk.layers), blk.runs))
  return blocks, tuple(stacks)
