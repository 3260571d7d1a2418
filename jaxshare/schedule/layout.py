"""The compiled schedule's types: one :class:`LayerPlan` per layer, the execution grouping into superblocks
(:class:`SuperblockPlan`), runs of equal :class:`LayerRole`s (:class:`RunPlan`) and stacks (:class:`StackPlan`), and
the whole :class:`Schedule`. All frozen and hashable: they are static arguments of compiled functions."""

from __future__ import annotations

import dataclasses

from jaxshare.config import ConfigError, Integrator, ScoreReuse


class ScheduleError(ConfigError):
  """An invalid sharing schedule; the message names the field (and layer) at fault."""


def is_int(x) -> bool:
  """A layer index or head count: an int, not a bool (YAML reads ``true`` as one) nor a float."""
  return isinstance(x, int) and not isinstance(x, bool)


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
  score_reuse: ScoreReuse = ScoreReuse.NONE
  compensation: bool = False
  integrator: Integrator = Integrator.NOT_LISA
  keep_qk: bool = False

  def __post_init__(self):
    if self.score_source < 0:
      object.__setattr__(self, "score_source", self.index)
    object.__setattr__(self, "score_reuse", ScoreReuse(self.score_reuse))
    object.__setattr__(self, "integrator", Integrator(self.integrator))

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
    return self.score_reuse == ScoreReuse.LOGITS and self.integrator != Integrator.NONE


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
  score_reuse: ScoreReuse = ScoreReuse.NONE
  score_from: int | None = None
  feeds: ScoreReuse = ScoreReuse.NONE
  integrator: Integrator = Integrator.NOT_LISA
  lisa_rank: int = 0
  lisa_hidden: int = 0
  lisa_rope: bool = False
  keep_qk: bool = False
  compensation: bool = False
  wc_normed: bool = False
  tied_qkv: bool = False

  def __post_init__(self):
    for name, kind in (("score_reuse", ScoreReuse), ("feeds", ScoreReuse), ("integrator", Integrator)):
      object.__setattr__(self, name, kind(getattr(self, name)))

  @property
  def is_producer(self) -> bool:
    return self.kv_from is None

  @property
  def has_low_rank(self) -> bool:
    return self.score_reuse == ScoreReuse.LOGITS and self.integrator != Integrator.NONE

  def tag(self) -> str:
    """Short form for logs: ``P`` producer, ``C0`` consumer of position 0, ``p0`` reuses position 0's
    probabilities, ``l/add`` reuses the previous layer's logits, ``+Wc`` compensation."""
    t = "P" if self.is_producer else f"C{self.kv_from}"
    if self.score_reuse == ScoreReuse.PROBS:
      t += f"p{self.score_from}"
    elif self.score_reuse == ScoreReuse.LOGITS:
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
    extra = ((f", {reuse} reuse scores" if reuse else "")
             + (f", {self.tied_heads} tied heads" if self.tied_heads else ""))
    return f"{self.kind}: {len(self.producers)}/{len(self.layers)} layers produce K/V (G={heads}){extra} | {segs}"
