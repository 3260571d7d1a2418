"""The score family of presets: each marks layers that reuse an earlier layer's attention scores, on top of the K/V
plans: post-softmax probabilities (SA, UniAttn) or the previous layer's pre-softmax logits (LISA family)."""

from __future__ import annotations

from jaxshare.config import INTEGRATORS, Integrator, ModelConfig, ScheduleConfig, ScorePreset, ScoreReuse
from jaxshare.schedule.layout import ScheduleError, is_int


def _span(value: int, default: int, field: str, lo: int, hi: int) -> int:
  v = default if value == -1 else value
  if not lo <= v <= hi:
    raise ScheduleError(f"{field}={value!r} is invalid: must be in {lo}..{hi} (or -1 for the default {default})")
  return v


def sa(model: ModelConfig, sched: ScheduleConfig) -> dict[int, dict]:
  """Shared Attention (Beyond KV Caching, Alg. 1): the layers of ``schedule.sa``'s span reuse one layer's
  probabilities (the span's first under ``paper`` semantics, the layer before it under ``reference_code``)."""
  L, c = model.num_layers, sched.sa
  start = _span(c.start, L // 2, "schedule.sa.start", 0, L - 1)
  end = _span(c.end, L - 2, "schedule.sa.end", start, L - 1)
  if c.semantics == "reference_code":
    if start == 0:
      raise ScheduleError("schedule.sa.start=0 is invalid with semantics=reference_code: the span reuses the "
                          "layer before it, and layer 0 has none")
    reuse = {i: start - 1 for i in range(start, end + 1)}
  else:
    reuse = {i: start for i in range(start + 1, end + 1)}
  return {i: dict(score_source=src, score_reuse=ScoreReuse.PROBS) for i, src in reuse.items()}


def uniattn(model: ModelConfig, sched: ScheduleConfig) -> dict[int, dict]:
  """UniAttn (Softmax Unification, Eq. 3-5): in superblocks of ``block_size`` layers over the unified range, the
  layers above the bottom one reuse its probabilities and add the linear compensation ``x W_c``."""
  L, c = model.num_layers, sched.uniattn
  start = _span(c.start, L // 2, "schedule.uniattn.start", 0, L - 1)
  end = _span(c.end, L, "schedule.uniattn.end", start + 1, L)
  if c.block_size < 1:
    raise ScheduleError(f"schedule.uniattn.block_size={c.block_size!r} is invalid: must be >= 1")
  if c.block_size > end - start:  # it would silently become one superblock of the whole, shorter range
    raise ScheduleError(f"schedule.uniattn.block_size={c.block_size!r} is invalid: the unified range is layers "
                        f"{start}..{end - 1} ({end - start} of model.num_layers={L}; schedule.uniattn.start/end), "
                        f"so a superblock holds at most {end - start} layers")
  return {i: dict(score_source=bottom, score_reuse=ScoreReuse.PROBS, compensation=True)
          for bottom in range(start, end, c.block_size) for i in range(bottom + 1, min(bottom + c.block_size, end))}


def lisa_family(model: ModelConfig, sched: ScheduleConfig, preset: ScorePreset) -> dict[int, dict]:
  """LISA (Cross-layer Attention Sharing, Eq. 3-4), LISA_plus and DS: each layer of :func:`lisa_groups` reuses the
  previous layer's logits through its group's integrator."""
  return {n: dict(score_source=n - 1, score_reuse=ScoreReuse.LOGITS, integrator=integrator,
                  keep_qk=sched.lisa.keep_qk)
          for layers, integrator in lisa_groups(model, sched, preset) for n in layers}


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
    if preset != ScorePreset.LISA:
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
    integrator = {ScorePreset.LISA_PLUS: Integrator.ADD, ScorePreset.DS: Integrator.NONE}.get(preset, c.integrator)
    layers = list(c.layers) if c.layers else default_lisa_layers(L)
    if not layers:
      raise ScheduleError(f"schedule.lisa.layers=[] is invalid for model.num_layers={L}: the default, layers 3..L-3 "
                          "(1-based 4 to L-2, LISA(27)'s span in the paper's Table 4), is empty; list the layers")
    groups = [(layers, integrator)]
    fields = ["schedule.lisa.layers"]
  seen: set = set()
  for (layers, _), field in zip(groups, fields):
    for n in layers:
      if not is_int(n) or not 1 <= n <= L - 1:
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


