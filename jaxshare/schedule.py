"""Sharing schedules: presets -> per-layer plans -> superblocks -> runs and stacks.

A *schedule* says, for every layer, where its K/V come from. A **producer** layer projects its own K/V
(``num_kv_heads`` heads, GQA/MQA inside the layer); a **consumer** layer has no K/V parameters and attends with
the post-RoPE K/V of an earlier producer (CLA, MLKV, LCKV-style patterns). Score sharing lets a layer reuse an
earlier layer's softmax probabilities (SA, UniAttn) or pre-softmax logits (LISA family).

Execution groups layers into **superblocks**: the smallest contiguous layer ranges that no K/V or score reference
crosses. Only the residual stream flows between superblocks, so each superblock is a self-contained scan body.
Inside a superblock every layer gets a :class:`LayerRole` (what it does, with references as positions in the
superblock), and consecutive layers with equal roles form a **run**, scanned over stacked parameters: the K/V
consumers of one producer (MLKV, CLA with factor > 2), the probability reusers of one source (SA, UniAttn) and LISA
chains (each layer reads the previous one's logits through a fixed-shape carry). Consecutive superblocks with the
same runs form a **stack**, run as one ``nnx.scan``. Compile time therefore grows with the number of distinct
runs and stacks, not with depth.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from jaxshare.config import (HEAD_PRESETS, INTEGRATORS, KV_PRESETS, SCORE_PRESETS, ConfigError, ModelConfig,
                             ScheduleConfig)


class ScheduleError(ConfigError):
  """An invalid sharing schedule; the message names the field (and layer) at fault."""


@dataclasses.dataclass(frozen=True)
class LayerPlan:
  """What one layer does, with references as absolute layer indices.

  Attributes:
    index: 0-based layer index.
    kv_source: layer whose K/V this layer attends with; ``== index`` for a K/V producer.
    num_kv_heads: K/V heads G the layer attends with (the producer's count).
    score_source: layer whose attention scores this layer reuses; ``== index`` when it computes its own.
    score_reuse: ``""`` (own scores), ``"probs"`` (post-softmax probabilities: SA, UniAttn) or ``"logits"``
      (pre-softmax logits of the previous layer: LISA family).
    compensation: UniAttn's linear compensation ``x W_c`` (Eq. 5) is added to the attention output.
    integrator: for ``"logits"`` reuse, how the source's logits and the low-rank delta combine: ``none`` (DS),
      ``add`` (LISA_plus), ``linear`` (LISA_SL) or ``ffn`` (LISA's head aligner).
    keep_qk: a logits-reusing layer keeps its (frozen, unused in training) full-width W_q/W_k for LISA's NF
      decoding, which prefills with the original attention (LISA Sec. 5.1).
  """

  index: int
  kv_source: int
  num_kv_heads: int
  score_source: int = -1
  score_reuse: str = ""
  compensation: bool = False
  integrator: str = ""
  keep_qk: bool = False

  def __post_init__(self):
    if self.score_source < 0:
      object.__setattr__(self, "score_source", self.index)

  @property
  def is_producer(self) -> bool:
    """Projects its own V (and its own K unless it reuses scores)."""
    return self.kv_source == self.index

  @property
  def has_query_key(self) -> bool:
    """Computes its own scores with full-width W_q (and W_k if a producer)."""
    return not self.score_reuse

  @property
  def has_low_rank(self) -> bool:
    """Owns LISA's low-rank W_q^LR / W_k^LR."""
    return self.score_reuse == "logits" and self.integrator != "none"


@dataclasses.dataclass(frozen=True)
class LayerRole:
  """Everything one layer's modules need, with references as positions inside its superblock (hashable).

  Two layers with equal roles have identical parameters and code, so consecutive ones are stacked and scanned.

  Attributes:
    kv_from: position of the K/V producer this layer attends with; None when it projects its own K/V.
    num_kv_heads: K/V heads G of the layer (its producer's).
    score_reuse: ``""``, ``"probs"`` or ``"logits"`` (see :class:`LayerPlan`).
    score_from: position of the probability source (``"probs"``); None otherwise (a ``"logits"`` layer always
      reads the layer before it).
    feeds: what later layers reuse from this layer's own scores: ``""``, ``"probs"`` or ``"logits"``.
    integrator / lisa_rank / lisa_hidden / lisa_rope / keep_qk: LISA's integrator, rank r, aligner width, RoPE on
      the low-rank Q/K and kept W_q/W_k (0 / False where they do not apply).
    compensation / wc_normed: UniAttn's ``W_c`` and whether it reads Norm(x) instead of x.
    tied_qkv: head-wise sharing: W_q, W_k, W_v come from the model's head table.
  """

  kv_from: int | None
  num_kv_heads: int
  score_reuse: str = ""
  score_from: int | None = None
  feeds: str = ""
  integrator: str = ""
  lisa_rank: int = 0
  lisa_hidden: int = 0
  lisa_rope: bool = False
  keep_qk: bool = False
  compensation: bool = False
  wc_normed: bool = False
  tied_qkv: bool = False

  @property
  def is_producer(self) -> bool:
    return self.kv_from is None

  @property
  def has_low_rank(self) -> bool:
    return self.score_reuse == "logits" and self.integrator != "none"

  def tag(self) -> str:
    """Short form for logs: ``P`` producer, ``C0`` consumer of position 0, ``p0`` reuses position 0's
    probabilities, ``l/add`` reuses the previous layer's logits, ``+Wc`` compensation."""
    t = "P" if self.is_producer else f"C{self.kv_from}"
    if self.score_reuse == "probs":
      t += f"p{self.score_from}"
    elif self.score_reuse == "logits":
      t += f"l/{self.integrator}"
    return t + ("+Wc" if self.compensation else "")


@dataclasses.dataclass(frozen=True)
class RunPlan:
  """``length`` consecutive layers of one superblock with the same role, from position ``start``."""

  start: int
  length: int
  role: LayerRole


@dataclasses.dataclass(frozen=True)
class SuperblockPlan:
  """Contiguous layers ``start .. start+len(layers)-1`` closed under K/V and score references."""

  start: int
  layers: tuple[LayerPlan, ...]
  runs: tuple[RunPlan, ...]


@dataclasses.dataclass(frozen=True)
class StackPlan:
  """``count`` consecutive superblocks of one structure (equal runs), stacked and scanned together."""

  start: int
  count: int
  superblock_size: int
  runs: tuple[RunPlan, ...]


@dataclasses.dataclass(frozen=True)
class Schedule:
  """A compiled, validated schedule.

  Attributes:
    kind: the preset expression, e.g. ``"mlkv+uniattn"``.
    layers: one plan per layer.
    superblocks / stacks: the execution grouping (see module docstring).
    tied_heads: head-wise sharing: number N of heads whose W_q, W_k, W_v are tied to an earlier layer's head.
    lisa_rank / lisa_hidden: LISA's per-head low rank r and aligner hidden width (resolved; 0 without LISA).
  """

  kind: str
  layers: tuple[LayerPlan, ...]
  superblocks: tuple[SuperblockPlan, ...]
  stacks: tuple[StackPlan, ...]
  tied_heads: int = 0
  lisa_rank: int = 0
  lisa_hidden: int = 0

  @property
  def producers(self) -> tuple[int, ...]:
    return tuple(p.index for p in self.layers if p.is_producer)

  def describe(self) -> str:
    """One line, e.g. ``cla: 2/4 layers produce K/V (G=[4]) | 2x[P C0]``; ``*n`` marks a scanned run of n layers."""
    segs = " + ".join(f"{s.count}x[{' '.join(r.role.tag() + (f'*{r.length}' if r.length > 1 else '') for r in s.runs)}]"
                      for s in self.stacks)
    heads = sorted({p.num_kv_heads for p in self.layers})
    reuse = sum(1 for p in self.layers if p.score_reuse)
    extra = (f", {reuse} reuse scores" if reuse else "") + (f", {self.tied_heads} tied heads" if self.tied_heads else "")
    return f"{self.kind}: {len(self.producers)}/{len(self.layers)} layers produce K/V (G={heads}){extra} | {segs}"


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


def _is_int(x) -> bool:
  """A layer index or head count: an int, not a bool (YAML reads ``true`` as one) nor a float."""
  return isinstance(x, int) and not isinstance(x, bool)


def _from_producers(producers: Sequence[int], num_layers: int, g: int, field: str) -> list[LayerPlan]:
  producers = list(producers)
  bad = next((p for p in producers if not _is_int(p)), None)
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


def kv_plans(model: ModelConfig, sched: ScheduleConfig, kind: str) -> list[LayerPlan]:
  """Expand a K/V-family preset into one :class:`LayerPlan` per layer.

  Raises:
    ScheduleError: the preset's knobs do not fit the model (naming the field, value and what is allowed).
  """
  L, H = model.num_layers, model.num_heads
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
        if not _is_int(g) or g < 1 or H % g:
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
  raise ScheduleError(f"schedule.kind={kind!r} is invalid: must be one of {', '.join(KV_PRESETS)}")


def _split_kind(kind: str) -> tuple[str, str, str]:
  """``"mlkv+uniattn"`` -> (K/V preset, score preset or "", head preset or "")."""
  parts = [p.strip() for p in kind.split("+") if p.strip()]
  families = {"K/V": KV_PRESETS, "score": SCORE_PRESETS, "head": HEAD_PRESETS}
  picked: dict[str, str] = {}
  for p in parts:
    fam = next((f for f, names in families.items() if p in names), None)
    if fam is None:
      raise ScheduleError(f"schedule.kind={kind!r} is invalid: {p!r} is not a preset; allowed: "
                          f"{', '.join(KV_PRESETS + SCORE_PRESETS + HEAD_PRESETS)}, joined by '+'")
    if fam in picked:
      raise ScheduleError(f"schedule.kind={kind!r} is invalid: two {fam} presets ({picked[fam]!r}, {p!r}); "
                          "combine at most one of each family")
    picked[fam] = p
  if not parts:
    raise ScheduleError("schedule.kind='' is invalid: name a preset, e.g. dense")
  return picked.get("K/V", "dense"), picked.get("score", ""), picked.get("head", "")


def _span(value: int, default: int, field: str, lo: int, hi: int) -> int:
  v = default if value == -1 else value
  if not lo <= v <= hi:
    raise ScheduleError(f"{field}={value!r} is invalid: must be in {lo}..{hi} (or -1 for the default {default})")
  return v


def score_plans(model: ModelConfig, sched: ScheduleConfig, preset: str, plans: list[LayerPlan]) -> list[LayerPlan]:
  """Apply a score-sharing preset (SA, UniAttn, LISA family) on top of K/V plans.

  Raises:
    ScheduleError: bad span/range/layer list, or a reusing layer that is not a K/V producer (it needs its own V).
  """
  L = model.num_layers
  plans = list(plans)
  if preset == "sa":
    c = sched.sa
    start = _span(c.start, L // 2, "schedule.sa.start", 0, L - 1)
    end = _span(c.end, L - 2, "schedule.sa.end", start, L - 1)
    if c.semantics == "reference_code":
      if start == 0:
        raise ScheduleError("schedule.sa.start=0 is invalid with semantics=reference_code: the span reuses the "
                            "layer before it, and layer 0 has none")
      reuse = {i: start - 1 for i in range(start, end + 1)}
    else:
      reuse = {i: start for i in range(start + 1, end + 1)}
    updates = {i: dict(score_source=src, score_reuse="probs") for i, src in reuse.items()}
  elif preset == "uniattn":
    c = sched.uniattn
    start = _span(c.start, L // 2, "schedule.uniattn.start", 0, L - 1)
    end = _span(c.end, L, "schedule.uniattn.end", start + 1, L)
    if c.block_size < 1:
      raise ScheduleError(f"schedule.uniattn.block_size={c.block_size!r} is invalid: must be >= 1")
    if c.block_size > end - start:  # it would silently become one superblock of the whole, shorter range
      raise ScheduleError(f"schedule.uniattn.block_size={c.block_size!r} is invalid: the unified range is layers "
                          f"{start}..{end - 1} ({end - start} of model.num_layers={L}; schedule.uniattn.start/end), "
                          f"so a superblock holds at most {end - start} layers")
    updates = {}
    for bottom in range(start, end, c.block_size):
      for i in range(bottom + 1, min(bottom + c.block_size, end)):
        updates[i] = dict(score_source=bottom, score_reuse="probs", compensation=True)
  else:  # lisa family
    updates = {n: dict(score_source=n - 1, score_reuse="logits", integrator=integrator, keep_qk=sched.lisa.keep_qk)
               for layers, integrator in lisa_groups(model, sched, preset) for n in layers}
  for i, upd in updates.items():
    p = plans[i]
    if not p.is_producer:
      raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid at layer {i}: it reuses attention scores and "
                          f"so needs its own V, but the K/V preset makes it read layer {p.kv_source}'s K/V; "
                          "reuse scores only on K/V-producing layers")
    plans[i] = dataclasses.replace(p, **upd)
  return plans


def default_lisa_layers(num_layers: int) -> list[int]:
  """LISA's default shared layers, 0-based ``3 .. L-3`` (1-based 4 to L-2): the span of LISA(27) and DS(27) on 32
  layers (4-30) in Table 4, where the paper never shares layers 1-3 or the last layer."""
  return list(range(3, num_layers - 2))


def lisa_groups(model: ModelConfig, sched: ScheduleConfig, preset: str) -> list[tuple[list[int], str]]:
  """The LISA-family layers as ``(layers, integrator)`` groups: ``schedule.lisa.groups`` (one integrator per group,
  e.g. LISA_SL(7+10) = linear on 5, 6, 17-21 and DS on 22-31, 1-based), else ``schedule.lisa.layers`` (or the
  default) with ``schedule.lisa.integrator`` (``add`` for lisa_plus, ``none`` for ds).

  Raises:
    ScheduleError: groups with a preset that fixes the integrator, groups and layers both given, a layer outside
      1..L-1 or in two groups, an empty default, a rank < 1 or an aligner narrower than 2H.
  """
  L, c = model.num_layers, sched.lisa
  if c.groups:
    if preset != "lisa":
      raise ScheduleError(f"schedule.lisa.groups is invalid with schedule.kind={sched.kind!r}: {preset} fixes the "
                          "integrator; use schedule.kind=lisa with one integrator per group")
    if c.layers:
      raise ScheduleError(f"schedule.lisa.layers={list(c.layers)!r} is invalid together with schedule.lisa.groups: "
                          "give the layers inside the groups")
    groups = [(list(g.layers), g.integrator) for g in c.groups]
    fields = [f"schedule.lisa.groups[{i}].layers" for i in range(len(groups))]
    for i, (layers, integrator) in enumerate(groups):
      if integrator not in INTEGRATORS:
        raise ScheduleError(f"schedule.lisa.groups[{i}].integrator={integrator!r} is invalid: must be one of "
                            f"{', '.join(INTEGRATORS)}")
      if not layers:
        raise ScheduleError(f"schedule.lisa.groups[{i}].layers=[] is invalid: list the group's layers")
  else:
    integrator = {"lisa_plus": "add", "ds": "none"}.get(preset, c.integrator)
    layers = list(c.layers) if c.layers else default_lisa_layers(L)
    if not layers:
      raise ScheduleError(f"schedule.lisa.layers=[] is invalid for model.num_layers={L}: the default, layers 3..L-3 "
                          "(1-based 4 to L-2, LISA(27)'s span in the paper's Table 4), is empty; list the layers")
    groups = [(layers, integrator)]
    fields = ["schedule.lisa.layers"]
  seen: set = set()
  for (layers, _), field in zip(groups, fields):
    for n in layers:
      if not _is_int(n) or not 1 <= n <= L - 1:
        raise ScheduleError(f"{field}={layers!r} is invalid: layer {n!r} must be in 1..{L - 1} (it reuses layer "
                            "n-1)")
      if n in seen:
        raise ScheduleError(f"{field}={layers!r} is invalid: layer {n} is "
                            + ("in two groups" if c.groups else "listed twice"))
      seen.add(n)
  integrators = {integrator for _, integrator in groups}
  if integrators - {"none"} and c.rank < 1:
    raise ScheduleError(f"schedule.lisa.rank={c.rank!r} is invalid: must be >= 1")
  if "ffn" in integrators and c.hidden and c.hidden < 2 * model.num_heads:
    raise ScheduleError(f"schedule.lisa.hidden={c.hidden!r} is invalid: the ffn aligner needs >= 2*num_heads="
                        f"{2 * model.num_heads} units to start as A_(n-1) + A_delta (0: 8*num_heads)")
  return groups


def tied_head_count(model: ModelConfig, ratio: float) -> int:
  """Heads N tied by head-wise sharing at ratio alpha: ``round(alpha * 4*L*H / 3)`` (removed W_q,W_k,W_v of N heads
  over all MHA parameters q,k,v,o; reproduces Table 3's 6.74B -> 6.09B for Llama2-7B at 30%)."""
  return round(ratio * 4 * model.num_layers * model.num_heads / 3)


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
      score_reuse=p.score_reuse, score_from=p.score_source - start if p.score_reuse == "probs" else None,
      feeds="" if p.score_reuse else feeds.get(i, ""), integrator=p.integrator,
      lisa_rank=settings.lisa_rank if low_rank else 0,
      lisa_hidden=settings.lisa_hidden if p.integrator == "ffn" else 0,
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
  alone = [i in referenced or (i + 1 < len(roles) and roles[i + 1].score_reuse == "logits"
                               and role.score_reuse != "logits") for i, role in enumerate(roles)]
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


# The presets that read each knob of ScheduleConfig: a knob set away from its default under presets that all ignore it
# is an error (a typo or a misunderstanding would otherwise train something else than asked, silently).
_KNOB_READERS = {
  "kv_heads": ("dense", "gqa", "cla", "mlkv", "explicit"), "kv_heads_per_layer": ("gqa",),
  "factor": ("cla",), "producers": ("cla",), "kv_layers": ("mlkv",), "placement": ("mlkv",),
  "sources": ("explicit",), "sa": ("sa",), "uniattn": ("uniattn",), "lisa": ("lisa", "lisa_plus", "ds"),
  "headwise": ("headwise",),
}


def _check_ignored_knobs(sched: ScheduleConfig, presets: tuple[str, ...]) -> None:
  defaults = ScheduleConfig()
  for knob, readers in _KNOB_READERS.items():
    value, default = getattr(sched, knob), getattr(defaults, knob)
    if value == default or any(p in readers for p in presets):
      continue
    if dataclasses.is_dataclass(value):  # name the sub-field that was set
      sub = next(f.name for f in dataclasses.fields(value) if getattr(value, f.name) != getattr(default, f.name))
      knob, value = f"{knob}.{sub}", getattr(value, sub)
    raise ScheduleError(f"schedule.{knob}={value!r} is invalid with schedule.kind={sched.kind!r}, which ignores it: "
                        f"it is read by {', '.join(readers)}; remove it or choose one of those presets")


def compile_schedule(model: ModelConfig, sched: ScheduleConfig) -> Schedule:
  """Validate a schedule config against the model and compile it.

  Raises:
    ScheduleError: see :func:`kv_plans` and :func:`score_plans`; head-wise sharing on GQA models, with K/V consumers,
      together with score sharing (undefined in the paper) or with Q/K/V biases (the tied projections have none); a
      ratio outside [0, 0.75).
  """
  kv_preset, score_preset, head_preset = _split_kind(sched.kind)
  _check_ignored_knobs(sched, (kv_preset, score_preset, head_preset))
  plans = kv_plans(model, sched, kv_preset)
  for p in plans:
    src = plans[p.kv_source]
    if not src.is_producer or src.num_kv_heads != p.num_kv_heads:
      raise ScheduleError(f"layer {p.index}: K/V source {p.kv_source} is not a producer with "
                          f"{p.num_kv_heads} K/V heads")
  if score_preset:
    plans = score_plans(model, sched, score_preset, plans)
    for p in plans:
      if p.has_query_key and not plans[p.kv_source].has_query_key:
        raise ScheduleError(f"schedule.kind={sched.kind!r} is invalid at layer {p.index}: it computes its own scores "
                            f"with the K of layer {p.kv_source}, which reuses scores and so projects no K")
  tied = 0
  if head_preset:
    ratio = sched.headwise.ratio
    if not 0.0 <= ratio < 0.75:
      raise ScheduleError(f"schedule.headwise.ratio={ratio!r} is invalid: must be in [0, 0.75) (all q,k,v of the "
                          "layers after the first removed is 0.75 * (L-1)/L)")
    if any(not p.is_producer or p.num_kv_heads != model.num_heads for p in plans) or score_preset:
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
  lisa = score_preset in ("lisa", "lisa_plus", "ds")
  rank = sched.lisa.rank if lisa else 0
  hidden = (sched.lisa.hidden or 8 * model.num_heads) if lisa else 0
  blocks, stacks = group(plans, RoleSettings(lisa_rank=rank, lisa_hidden=hidden, lisa_rope=sched.lisa.rope,
                                               wc_normed=sched.uniattn.wc_input == "normed", tied_qkv=tied > 0))
  return Schedule(sched.kind, tuple(plans), blocks, stacks, tied, lisa_rank=rank, lisa_hidden=hidden)
