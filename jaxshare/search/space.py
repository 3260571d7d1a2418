"""The space a schedule search draws from: every family's options on a given model (K/V sources and heads,
probability-reuse superblocks and spans, LISA layer sets, head-wise ratios) and their compositions, each a
``schedule.*`` override list of the source's config that the existing CLIs train, convert, export and serve.

The papers' own settings (CLA's factor 2, MLKV's owners, UniAttn's "top half, blocks of 4", SA's span, LISA's
layers, DirectShare's 30%) are marked ``preset``: a search compares its result with them at the same budget.

A candidate is an architecture (its compiled plan: every layer's K/V source, heads and score reuse, tied heads, LISA's
rank, the MLP width) under a conversion rule. Options that compile to one plan are one architecture, named after
a preset where one compiles to it (``cla4`` on 8 layers is MLKV's 2 owners, ``mlkv2``); where layers read another
layer's K/V, how the producer's K/V start from the source (``train.init_kv_pool``: the producer's own, the readers'
mean, their running pairwise mean) is a labelled dimension, so one architecture appears once per rule that builds
different K/V, named by both (``mlkv2-own``, ``mlkv2-mean``); so is how UniAttn's W_c are fitted (every token or
their averages, both the paper's: ``uniattn_b4_s4-wctokens``, ``-wcmean``). A candidate is a preset when its
architecture is a preset's and its rule the one that preset converts with (CLA's own K/V, MLKV's mean, either
W_c fit).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Sequence

from jaxshare.config import Config, ConfigError, apply_overrides
from jaxshare.config.choices import KVPool, WcFit
from jaxshare.config.source import with_match_reference
from jaxshare.init.rules import InitRules
from jaxshare.plan import ModelPlan
from jaxshare.search.budget import Budget, Footprint, SearchError, footprint

FAMILIES = ("kv", "scores", "lisa", "headwise")
# The K/V conversion rules by label (``train.init_kv_pool``), in the order a candidate's rules are listed.
KV_RULES = {"own": KVPool.PRODUCER, "mean": KVPool.MEAN, "running": KVPool.RUNNING}
# UniAttn's W_c fits (``convert uptrain --wc-fit``), both the paper's: every calibration token (App. F, Eq. 22-23) and
# their averages (Alg. 1 with v = 1, Theorem 3.1), in the order a candidate's fits are listed.
WC_FITS = (WcFit.TOKENS, WcFit.MEAN)


@dataclasses.dataclass(frozen=True)
class Option:
  """One family's setting: a name (directory-safe), the ``schedule.*`` overrides that set it (``kind`` apart, which a
  composition joins with ``+``), and whether it is a paper's own setting."""

  name: str
  family: str
  kind: str
  knobs: tuple[str, ...] = ()
  preset: bool = False


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A schedule of the search.

  Attributes:
    name: directory-safe, the architecture's and its conversion rules', e.g. ``mlkv4+uniattn_b4_s4-mean-wctokens``.
    overrides: ``schedule.*`` overrides of the source's config (``schedule.kind`` first), then the K/V rule's
      ``train.init_kv_pool`` where it has one.
    families: the families it composes, e.g. ``("kv", "scores")``.
    preset: every part is a paper's own setting, converted by the paper's rule.
    cost: its KV bytes, FLOPs and parameters (:func:`~jaxshare.search.budget.footprint`).
    rule: the K/V conversion rule's label (:data:`KV_RULES`), ``""`` where no layer reads another's K/V.
    wc_fit: how UniAttn's W_c are fitted at conversion (:data:`WC_FITS`, ``convert uptrain --wc-fit``), ``""``
      where no layer has a W_c.
  """

  name: str
  overrides: tuple[str, ...]
  families: tuple[str, ...]
  preset: bool
  cost: Footprint
  rule: str = ""
  wc_fit: str = ""

  @property
  def schedule(self) -> str:
    """The overrides as one line (what results.csv records)."""
    return " ".join(self.overrides)


def _divisors_below(n: int) -> list[int]:
  return [g for g in range(1, n) if n % g == 0]


def kv_options(num_layers: int, num_heads: int) -> list[Option]:
  """K/V sharing: GQA/MQA within layers, CLA factors (alone and with fewer heads), MLKV's owner counts."""
  opts = [Option(f"gqa{g}", "kv", "gqa", (f"schedule.kv_heads={g}",), preset=g == 1 or g == num_heads // 2)
          for g in _divisors_below(num_heads)]
  for f in range(2, num_layers // 2 + 1):
    opts.append(Option(f"cla{f}", "kv", "cla", (f"schedule.factor={f}",), preset=f == 2))
    opts += [Option(f"cla{f}_g{g}", "kv", "cla", (f"schedule.factor={f}", f"schedule.kv_heads={g}"))
             for g in _divisors_below(num_heads) if f == 2]
  for m in sorted({num_layers // 2, num_layers // 4, 2, 1} - {0}):
    if m < num_layers:
      opts.append(Option(f"mlkv{m}", "kv", "mlkv", (f"schedule.kv_layers={m}",), preset=True))
      opts += [Option(f"mlkv{m}_g{g}", "kv", "mlkv", (f"schedule.kv_layers={m}", f"schedule.kv_heads={g}"))
               for g in _divisors_below(num_heads) if g == num_heads // 2]
  return opts


def explicit_option(sources: Sequence[int], name: str) -> Option:
  """A K/V option of per-layer sources (LCKV style: layer i reads layer ``sources[i] <= i``), e.g. KVSharer's."""
  return Option(name, "kv", "explicit", ("schedule.sources=" + "_".join(map(str, sources)),))


def score_options(num_layers: int) -> list[Option]:
  """Probability reuse: UniAttn superblocks (block sizes, over the top half or from layer 1) and SA spans."""
  opts = []
  for b, start in itertools.product((2, 3, 4), (num_layers // 2, 1)):
    if num_layers - start >= b:
      opts.append(Option(f"uniattn_b{b}_s{start}", "scores", "uniattn",
                         (f"schedule.uniattn.block_size={b}", f"schedule.uniattn.start={start}"),
                         preset=b == 4 and start == num_layers // 2))
  for start in sorted({num_layers // 2, num_layers // 4} - {0}):
    if num_layers - 2 > start:
      opts.append(Option(f"sa_{start}_{num_layers - 2}", "scores", "sa",
                         (f"schedule.sa.start={start}", f"schedule.sa.end={num_layers - 2}"),
                         preset=start == num_layers // 2))
  return opts


def lisa_options(num_layers: int) -> list[Option]:
  """Logit reuse: LISA (ffn aligner) and LISA_plus (add) over the paper's span (layers 3 to L-3) and the top half."""
  spans = {"": None, f"_top{num_layers // 2}": list(range(num_layers // 2, num_layers - 1))}
  opts = []
  for kind, (suffix, layers) in itertools.product(("lisa", "lisa_plus"), spans.items()):
    knobs = () if layers is None else ("schedule.lisa.layers=[" + ",".join(map(str, layers)) + "]",)
    opts.append(Option(kind + suffix, "lisa", kind, knobs, preset=layers is None))
  return opts


def headwise_options() -> list[Option]:
  """Head-wise weight tying (DirectShare) at sharing ratios 10-30% (the paper's headline is 30%)."""
  return [Option(f"headwise{int(r * 100)}", "headwise", "headwise", (f"schedule.headwise.ratio={r}",),
                 preset=r == 0.3) for r in (0.1, 0.2, 0.3)]


def combine(parts: Sequence[Option]) -> tuple[str, tuple[str, ...]]:
  """``(name, overrides)`` of one option per family composed (``schedule.kind`` joined with ``+``)."""
  return ("+".join(p.name for p in parts),
          ("schedule.kind=" + "+".join(p.kind for p in parts), *itertools.chain.from_iterable(p.knobs for p in parts)))


def compositions(families: Sequence[str], options: dict[str, list[Option]]) -> list[tuple[Option, ...]]:
  """Each family's options alone; then every K/V option composed with each other family's preset (and with every
  option of the other families at CLA's factor 2): the papers compose K/V sharing with the rest, one at a time."""
  out = [(o,) for f in families for o in options[f]]
  if "kv" in families:
    for f in families:
      if f == "kv":
        continue
      out += [(k, o) for k in options["kv"] for o in options[f] if o.preset or k.name == "cla2"]
  return out


def architecture(plan: ModelPlan) -> tuple:
  """What makes two candidates one architecture: the compiled plan's layers (K/V sources and heads, score reuse,
  compensation, LISA integrators), tied heads, LISA's rank and aligner width and the MLP width; not the preset
  names it was written with."""
  s = plan.schedule
  return s.layers, s.tied_heads, s.lisa_rank, s.lisa_hidden, plan.mlp_dim


def kv_rules(plan: ModelPlan) -> tuple[str, ...]:
  """The labels of the K/V conversion rules (:data:`KV_RULES`) that start ``plan``'s producers differently: none
  where no layer reads another layer's K/V; ``own`` and ``mean`` where each producer serves at most two layers (their
  running pairwise mean is their mean); all three otherwise."""
  served: dict[int, int] = {}
  for layer in plan.schedule.layers:
    served[layer.kv_source] = served.get(layer.kv_source, 0) + 1
  most = max(served.values())
  return () if most == 1 else ("own", "mean") if most == 2 else tuple(KV_RULES)


def wc_fits(plan: ModelPlan) -> tuple[str, ...]:
  """The W_c fits (:data:`WC_FITS`) that start ``plan`` differently: both where a layer has UniAttn's compensation,
  none otherwise."""
  return tuple(WC_FITS) if any(p.compensation for p in plan.schedule.layers) else ()


def candidate_config(src_cfg: Config, src_run: str, overrides: Sequence[str], src_params: int) -> Config:
  """The config of a candidate uptrained from ``src_run`` (whose config is ``src_cfg``, whose model has
  ``src_params`` parameters): the source's with the candidate's ``overrides`` (``schedule.*``, then any other),
  matched to the source when it matches parameters.

  Raises:
    ConfigError / ScheduleError: the overrides make an invalid config or schedule.
  """
  cfg = apply_overrides(src_cfg, ["schedule.kind=dense", "schedule.match_reference_params=0",
                                  f"train.init_from={src_run}", *overrides])
  return with_match_reference(cfg, src_params)


def candidates(src_cfg: Config, src_run: str, budget: Budget, families: Sequence[str] = FAMILIES,
               extra_kv: Iterable[Option] = ()) -> tuple[list[Candidate], Footprint]:
  """Every valid candidate within ``budget``, ordered presets first, then by KV bytes.

  Args:
    src_cfg: the source run's config (its model, data and tokenizer are every candidate's).
    src_run: the source run directory (``train.init_from`` of every candidate).
    extra_kv: K/V options beyond the enumerated ones (e.g. KVSharer's proposals).

  Returns:
    ``(the candidates within budget, the source's footprint)``.

  Raises:
    SearchError: an unknown family, or a budget no valid candidate meets (naming the smallest achievable figures).
  """
  unknown = [f for f in families if f not in FAMILIES]
  if unknown or not families:
    raise SearchError(f"--families {','.join(families)!r} is invalid: choose among {', '.join(FAMILIES)}")
  m = src_cfg.model
  options = {"kv": kv_options(m.num_layers, m.num_heads) + list(extra_kv), "scores": score_options(m.num_layers),
             "lisa": lisa_options(m.num_layers), "headwise": headwise_options()}
  source = footprint(src_cfg)[1]
  matched = ("schedule.match_params=true",) if budget.equal_params else ()
  archs: dict[tuple, list[tuple[str, tuple[str, ...], tuple[Option, ...], ModelPlan, Footprint, str]]] = {}
  for parts in compositions(families, options):
    name, overrides = combine(parts)
    try:
      overrides += matched
      cfg = candidate_config(src_cfg, src_run, overrides, source.params)
      plan, cost = footprint(cfg)
    except (ConfigError, ValueError):  # a composition the schedule language refuses, or a width below one neuron
      continue
    paper_rule = InitRules.of(cfg.train, cfg.schedule.kind).kv_pool
    archs.setdefault(architecture(plan), []).append((name, overrides, parts, plan, cost, paper_rule))
  valid = []
  for options_of_arch in archs.values():
    plan = options_of_arch[0][3]
    for label, fit in itertools.product(kv_rules(plan) or ("",), wc_fits(plan) or ("",)):
      # the option it is named after: a preset converting by this rule, else a preset, else the first enumerated
      preset = [o for o in options_of_arch if all(p.preset for p in o[2]) and (not label or o[5] == KV_RULES[label])]
      name, overrides, parts, _, cost, _ = (preset or [o for o in options_of_arch if all(p.preset for p in o[2])]
                                            or options_of_arch)[0]
      rule = (f"train.init_kv_pool={KV_RULES[label].value}",) if label else ()
      suffix = "".join(f"-{part}" for part in (label, fit and f"wc{fit}") if part)
      valid.append(Candidate(name + suffix, overrides + rule, tuple(p.family for p in parts), bool(preset), cost,
                             label, fit))
  if not valid:
    raise SearchError(f"--families {','.join(families)} has no valid schedule on this model "
                      f"({m.num_layers} layers of {m.num_heads} heads): add a family")
  within = [c for c in valid if budget.fits(c.cost, source)]
  if not within:
    kv, flops = min(c.cost.kv_bytes for c in valid), min(c.cost.flops for c in valid)
    raise SearchError(f"no candidate of the families {','.join(families)} fits the budget "
                      f"({budget.describe(source)}): the smallest achievable is {kv:,} KV B/token "
                      f"({kv / source.kv_bytes:.3f} of the source's) and {flops / 1e6:,.3f} MFLOP/token "
                      f"({flops / source.flops:.3f} of the source's)")
  within.sort(key=lambda c: (not c.preset, c.cost.kv_bytes, c.cost.flops, c.name))
  return within, source
