"""Sharing schedules: presets -> per-layer plans -> superblocks -> segments.

A *schedule* says, for every layer, where its K/V come from. A **producer** layer projects its own K/V
(``num_kv_heads`` heads, GQA/MQA inside the layer); a **consumer** layer has no K/V parameters and attends with
the post-RoPE K/V of an earlier producer (CLA, MLKV, LCKV-style patterns).

Execution groups layers into **superblocks**: the smallest contiguous layer ranges that no K/V reference crosses.
Only the residual stream flows between superblocks, so each superblock is a self-contained scan body.
Consecutive superblocks with the same structure form a **segment**, run as one ``nnx.scan`` over stacked
parameters; compile time therefore grows with the number of distinct segments, not with depth.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxshare.config import ConfigError, ModelConfig, ScheduleConfig


class ScheduleError(ConfigError):
  """An invalid sharing schedule; the message names the field (and layer) at fault."""


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """What one layer does.

  Attributes:
    index: 0-based layer index.
    kv_source: layer whose K/V this layer attends with; ``== index`` for a producer.
    num_kv_heads: K/V heads G the layer attends with (the producer's count).
  """

  index: int
  kv_source: int
  num_kv_heads: int

  @property
  def is_producer(self) -> bool:
    return self.kv_source == self.index


@dataclasses.dataclass(frozen=True)
class Superblock:
  """Contiguous layers ``start .. start+len(layers)-1`` closed under K/V references."""

  start: int
  layers: tuple[LayerPlan, ...]

  @property
  def signature(self) -> tuple[tuple[int, int], ...]:
    """Structure relative to the superblock start: ``(kv_source - start, num_kv_heads)`` per layer."""
    return tuple((p.kv_source - self.start, p.num_kv_heads) for p in self.layers)


@dataclasses.dataclass(frozen=True)
class Segment:
  """``count`` consecutive superblocks of one structure, stacked and scanned together."""

  start: int
  count: int
  superblock_size: int
  signature: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A compiled, validated schedule."""

  kind: str
  layers: tuple[LayerPlan, ...]
  superblocks: tuple[Superblock, ...]
  segments: tuple[Segment, ...]

  @property
  def producers(self) -> tuple[int, ...]:
    return tuple(p.index for p in self.layers if p.is_producer)

  def describe(self) -> str:
    """One line, e.g. ``cla: producers [0, 2] | segments 2x[P C]``."""
    segs = " + ".join(
      f"{s.count}x[{' '.join('P' if rel == i else f'C{rel}' for i, (rel, _) in enumerate(s.signature))}]"
      for s in self.segments)
    heads = sorted({p.num_kv_heads for p in self.layers})
    return f"{self.kind}: {len(self.producers)}/{len(self.layers)} layers produce K/V (G={heads}) | {segs}"


def _kv_heads(model: ModelConfig, sched: ScheduleConfig) -> int:
  g = sched.kv_heads or model.num_heads
  if g < 1 or model.num_heads % g:
    raise ScheduleError(f"schedule.kv_heads={sched.kv_heads!r} is invalid: must divide model.num_heads="
                        f"{model.num_heads} (or be 0 for num_heads)")
  return g


def mlkv_owners(num_layers: int, m: int, placement: str) -> list[int]:
  """The KV-owning layers of MLKV with m owners among L layers (0-based).

  ``paper``: MLKV Eq. 16-17, layer n uses KV set floor(n / (L/m)); each set's owner is its lowest layer.
  ``reference_code``: pythia-mlkv's ``[0] + [int((i+1)*L/m) for i in range(m-1)]``.
  The two agree whenever m divides L; for L=12, m=5 they give {0,3,5,8,10} and {0,2,4,7,9}.
  """
  if placement == "paper":
    owners: list[int] = []
    for n in range(num_layers):
      if not owners or (n * m) // num_layers != ((owners[-1] * m) // num_layers):
        owners.append(n)
    return owners
  if placement == "reference_code":
    return [0] + [int((i + 1) * num_layers / m) for i in range(m - 1)]
  raise ScheduleError(f"schedule.placement={placement!r} is invalid: must be paper or reference_code")


def _from_producers(producers: Sequence[int], num_layers: int, g: int, field: str) -> list[LayerPlan]:
  producers = list(producers)
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


def layer_plans(model: ModelConfig, sched: ScheduleConfig) -> list[LayerPlan]:
  """Expand a preset into one :class:`LayerPlan` per layer.

  Raises:
    ScheduleError: the preset's knobs do not fit the model (naming the field, value and what is allowed).
  """
  L, H = model.num_layers, model.num_heads
  kind = sched.kind
  if kind == "dense":
    if sched.kv_heads not in (0, H):
      raise ScheduleError(f"schedule.kv_heads={sched.kv_heads!r} is invalid for kind=dense: dense attention "
                          f"has num_heads={H} K/V heads; use schedule.kind=gqa for fewer")
    return [LayerPlan(i, i, H) for i in range(L)]
  if kind == "mqa":
    return [LayerPlan(i, i, 1) for i in range(L)]
  if kind == "gqa":
    if sched.kv_heads_per_layer:
      per = list(sched.kv_heads_per_layer)
      if len(per) != L:
        raise ScheduleError(f"schedule.kv_heads_per_layer={per!r} is invalid: needs {L} entries "
                            f"(model.num_layers), got {len(per)}")
      for i, g in enumerate(per):
        if not isinstance(g, int) or g < 1 or H % g:
          raise ScheduleError(f"schedule.kv_heads_per_layer[{i}]={g!r} is invalid: must divide "
                              f"model.num_heads={H}")
      return [LayerPlan(i, i, g) for i, g in enumerate(per)]
    return [LayerPlan(i, i, _kv_heads(model, sched)) for i in range(L)]
  g = _kv_heads(model, sched)
  if kind == "cla":
    if sched.producers:
      return _from_producers(sched.producers, L, g, "schedule.producers")
    if not 1 <= sched.factor <= L:
      raise ScheduleError(f"schedule.factor={sched.factor!r} is invalid: must be in 1..model.num_layers={L}")
    return _from_producers(range(0, L, sched.factor), L, g, "schedule.factor")
  if kind == "mlkv":
    m = sched.kv_layers
    if not 1 <= m <= L:
      raise ScheduleError(f"schedule.kv_layers={m!r} is invalid: MLKV needs 1 <= m <= model.num_layers={L}")
    return _from_producers(mlkv_owners(L, m, sched.placement), L, g, "schedule.kv_layers")
  if kind == "explicit":
    if not sched.sources:
      raise ScheduleError("schedule.sources='' is invalid for kind=explicit: give one source per layer, "
                          "e.g. '0_0_2_2'")
    return [LayerPlan(i, s, g) for i, s in enumerate(parse_sources(sched.sources, L))]
  raise ScheduleError(f"schedule.kind={kind!r} is invalid: must be one of dense, gqa, mqa, cla, mlkv, explicit")


def group(plans: Sequence[LayerPlan]) -> tuple[tuple[Superblock, ...], tuple[Segment, ...]]:
  """Partition plans into minimal reference-closed superblocks, then runs of equal superblocks (segments)."""
  n = len(plans)
  min_src_from = [0] * (n + 1)
  min_src_from[n] = n
  for i in range(n - 1, -1, -1):
    min_src_from[i] = min(plans[i].kv_source, min_src_from[i + 1])
  cuts = [i for i in range(n) if min_src_from[i] == i] + [n]
  blocks = tuple(Superblock(a, tuple(plans[a:b])) for a, b in zip(cuts, cuts[1:]))
  segments: list[Segment] = []
  for blk in blocks:
    if segments and segments[-1].signature == blk.signature:
      last = segments[-1]
      segments[-1] = dataclasses.replace(last, count=last.count + 1)
    else:
      segments.append(Segment(blk.start, 1, len(blk.layers), blk.signature))
  return blocks, tuple(segments)


def compile_schedule(model: ModelConfig, sched: ScheduleConfig) -> Schedule:
  """Validate a schedule config against the model and compile it.

  Raises:
    ScheduleError: see :func:`layer_plans`.
  """
  plans = layer_plans(model, sched)
  for p in plans:
    src = plans[p.kv_source]
    if not src.is_producer or src.num_kv_heads != p.num_kv_heads:
      raise ScheduleError(f"layer {p.index}: K/V source {p.kv_source} is not a producer with "
                          f"{p.num_kv_heads} K/V heads")
  blocks, segments = group(plans)
  return Schedule(sched.kind, tuple(plans), blocks, segments)
