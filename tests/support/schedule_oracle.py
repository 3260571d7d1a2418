"""The validation oracle of the property tests: every field's and schedule knob's documented rule, written
independently of the code under test (from the fields' help text and the schedule modules' docstrings), and the
hypothesis strategies that draw model fields and schedules as users write them (dotted ``key=value`` overrides).

:func:`oracle` judges a drawn spec: the violations it must be rejected for (each naming its field), or the per-layer
K/V sources, K/V head counts, score reuse and tied-head count it must compile to.
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction
from typing import Any

from hypothesis import strategies as st

from conftest import TINY
from jaxshare.config import Config, load_config

NAN, INF = float("nan"), float("inf")


# The documented preset families (ScheduleConfig.kind's help) and the knobs each preset reads (each knob's help).
KV_KINDS = ("dense", "gqa", "mqa", "cla", "mlkv", "explicit")


SCORE_KINDS = ("sa", "uniattn", "lisa", "lisa_plus", "ds")


HEAD_KINDS = ("headwise",)


FAMILY = {**{k: "kv" for k in KV_KINDS}, **{k: "score" for k in SCORE_KINDS}, **{k: "head" for k in HEAD_KINDS}}


READERS = {"kv_heads": {"dense", "gqa", "cla", "mlkv", "explicit"}, "kv_heads_per_layer": {"gqa"},
           "factor": {"cla"}, "producers": {"cla"}, "kv_layers": {"mlkv"}, "placement": {"mlkv"},
           "sources": {"explicit"}, "sa": {"sa"}, "uniattn": {"uniattn"}, "lisa": {"lisa", "lisa_plus", "ds"},
           "headwise": {"headwise"}}


INTEGRATORS = ("ffn", "linear", "add", "none")


def config_leaves(obj: Any, prefix: str = ""):
  """``(dotted name, dataclasses.Field, value)`` of every leaf field of a config dataclass."""
  for f in dataclasses.fields(obj):
    value = getattr(obj, f.name)
    if dataclasses.is_dataclass(value):
      yield from config_leaves(value, f"{prefix}{f.name}.")
    else:
      yield f"{prefix}{f.name}", f, value


def flat_config(obj: Any) -> dict[str, Any]:
  """Dotted name -> value of every leaf field of a config dataclass."""
  return {name: value for name, _, value in config_leaves(obj)}


def config_groups(obj: Any, prefix: str = "") -> list[str]:
  """Dotted names of the config groups (``model``, ``schedule.sa``, ...)."""
  out = []
  for f in dataclasses.fields(obj):
    if dataclasses.is_dataclass(getattr(obj, f.name)):
      out += [f"{prefix}{f.name}"] + config_groups(getattr(obj, f.name), f"{prefix}{f.name}.")
  return out


BASE = flat_config(load_config(None, TINY))  # TINY over the defaults: a valid starting point


DEFAULTS = flat_config(Config())


FIELDS = set(DEFAULTS)


GROUPS = config_groups(Config())


FLOAT_FIELDS = sorted(k for k, v in DEFAULTS.items() if type(v) is float)


INT_LIST_FIELDS = ("schedule.kv_heads_per_layer", "schedule.producers", "schedule.lisa.layers",
                   "distributed.local_device_ids")


DOTTED = re.compile(r"\b(?:%s)(?:\.[A-Za-z_]\w*)+" % "|".join(f.name for f in dataclasses.fields(Config)))


def named_fields(message: str) -> set[str]:
  """The config fields (and groups) a message names by dotted name."""
  return {m for m in DOTTED.findall(message) if m in FIELDS or m in GROUPS}


def is_int(x: Any) -> bool:
  return isinstance(x, int) and not isinstance(x, bool)


def finite(x: Any) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def render(value: Any, spelling: int = 0) -> str:
  """A value as command-line YAML text; ``spelling`` picks one of the ways people write non-finite floats."""
  if isinstance(value, bool):
    return "true" if value else "false"
  if isinstance(value, float):
    if math.isnan(value):
      return ("nan", ".nan", "NaN")[spelling % 3]
    if math.isinf(value):
      return ("-" if value < 0 else "") + ("inf", ".inf", "Infinity")[spelling % 3]
    return repr(value)
  if isinstance(value, list):
    return "[" + ", ".join(render(v, spelling) for v in value) + "]"
  if isinstance(value, dict):
    return "{" + ", ".join(f"{k}: {render(v, spelling)}" for k, v in value.items()) + "}"
  return str(value)


def overrides(spec: dict[str, Any], spelling: int = 0) -> list[str]:
  out = list(TINY)
  for key, value in spec.items():
    # a top-level string (schedule.kind, schedule.sources) is kept as typed; inside lists YAML quotes it
    text = value if isinstance(value, str) else render(value, spelling)
    out.append(f"{key}={text}")
  return out


def same(a: Any, b: Any) -> bool:
  """Equality with nan == nan and without True == 1 or 1.0 == 1 (the YAML round trip must keep the type)."""
  if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
    return True
  if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
  if dataclasses.is_dataclass(a) and isinstance(b, dict):
    return all(same(getattr(a, k), v) for k, v in b.items())
  return type(a) is type(b) and a == b


@dataclasses.dataclass
class Verdict:
  """Violations (each a set of dotted fields an error may blame) and, for a valid config, the expected plan."""

  violations: list[frozenset[str]] = dataclasses.field(default_factory=list)
  sources: list[int] | None = None
  heads: list[int] | None = None
  reuse: dict[int, tuple[str, int, str]] | None = None  # layer -> (probs|logits, score source, integrator)
  tied: int = 0

  def bad(self, ok: bool, *blame: str) -> bool:
    if not ok:
      self.violations.append(frozenset(blame))
    return not ok


def config_rules(v: dict[str, Any], out: Verdict) -> None:
  """What :class:`~jaxshare.config.ModelConfig`/``TrainConfig`` fields document, for the fields drawn here."""
  for name, choices in (("model.flavor", ("llama", "neox")), ("model.rope_scaling", ("none", "linear", "llama3")),
                        ("model.dtype", ("float32", "bfloat16")), ("model.param_dtype", ("float32", "bfloat16")),
                        ("schedule.placement", ("paper", "reference_code")),
                        ("schedule.sa.semantics", ("paper", "reference_code")),
                        ("schedule.uniattn.wc_input", ("residual", "normed")),
                        ("schedule.lisa.integrator", INTEGRATORS),
                        ("schedule.headwise.match", ("qk", "q", "k", "v", "qkv", "separately")),
                        ("attention.score_sharing", ("recompute", "materialize"))):
    out.bad(v[name] in choices, name)
  for name in FLOAT_FIELDS:  # a float setting is a number: nan or inf is never meant
    out.bad(finite(v[name]), name)
  for name in ("num_layers", "d_model", "num_heads", "mlp_dim"):
    out.bad(v[f"model.{name}"] > 0, f"model.{name}")
  D, H, hd = v["model.d_model"], v["model.num_heads"], v["model.head_dim"]
  out.bad(hd >= 0, "model.head_dim")
  if D > 0 and H > 0 and hd >= 0:
    dims = ("model.num_heads", "model.d_model", "model.head_dim")
    if not out.bad(hd > 0 or D % H == 0, *dims):
      pct = v["model.rotary_pct"]
      if not out.bad(0 < pct <= 1, "model.rotary_pct"):
        rot = int((hd or D // H) * pct)  # RoPE rotates dims in pairs
        out.bad(rot > 0 and rot % 2 == 0, "model.rotary_pct", *dims)
  for name in ("norm_eps", "init_std", "rope_theta", "rope_scaling_factor"):
    out.bad(v[f"model.{name}"] > 0, f"model.{name}")
  if v["model.rope_scaling"] == "llama3":
    out.bad(v["model.rope_high_freq_factor"] > v["model.rope_low_freq_factor"] > 0, "model.rope_high_freq_factor",
            "model.rope_low_freq_factor")
  out.bad(v["model.sliding_window"] >= 0, "model.sliding_window")
  out.bad(v["train.lr"] > 0, "train.lr")
  out.bad(0 <= v["train.b1"] < 1, "train.b1")
  out.bad(0 <= v["train.b2"] < 1, "train.b2")
  out.bad(v["train.eps"] > 0, "train.eps")
  out.bad(v["train.weight_decay"] >= 0, "train.weight_decay")
  out.bad(v["train.clip_norm"] >= 0, "train.clip_norm")
  out.bad(v["train.peak_tflops"] >= 0, "train.peak_tflops")
  out.bad(v["schedule.lisa.rank"] >= 0, "schedule.lisa.rank")
  out.bad(v["schedule.lisa.hidden"] >= 0, "schedule.lisa.hidden")


def mlkv_owners(L: int, m: int, placement: str) -> list[int]:
  """MLKV's KV-owning layers as the placement help text documents them."""
  if placement == "paper":  # layer n uses KV set floor(n / (L/m)); a set's owner is its lowest layer
    sets = [math.floor(Fraction(n) / Fraction(L, m)) for n in range(L)]
    return [n for n in range(L) if n == 0 or sets[n] != sets[n - 1]]
  return [0] + [int((i + 1) * (L / m)) for i in range(m - 1)]  # pythia-mlkv's expression


def kv_rules(v: dict[str, Any], kv: str, out: Verdict) -> None:
  L, H = v["model.num_layers"], v["model.num_heads"]
  kv_heads = v["schedule.kv_heads"]
  g = kv_heads or H
  g_ok = is_int(g) and g >= 1 and H % g == 0
  producers: list[int] = list(range(L))
  if kv == "dense":
    out.bad(kv_heads in (0, H), "schedule.kv_heads")
    heads = [H] * L
  elif kv == "mqa":
    heads = [1] * L
  elif kv == "gqa" and v["schedule.kv_heads_per_layer"]:
    per = v["schedule.kv_heads_per_layer"]
    out.bad(len(per) == L and all(is_int(x) and x >= 1 and H % x == 0 for x in per), "schedule.kv_heads_per_layer")
    heads = per
  else:
    heads = [g] * L
    if out.bad(g_ok, "schedule.kv_heads") or kv == "gqa":
      pass
    elif kv == "cla" and v["schedule.producers"]:
      p = v["schedule.producers"]
      ok = (all(is_int(x) for x in p) and p[0] == 0 and all(b > a for a, b in zip(p, p[1:])) and p[-1] < L)
      out.bad(ok, "schedule.producers")
      producers = p
    elif kv == "cla":
      f = v["schedule.factor"]
      if not out.bad(1 <= f <= L, "schedule.factor"):
        producers = list(range(0, L, f))
    elif kv == "mlkv":
      m = v["schedule.kv_layers"]
      if not out.bad(1 <= m <= L, "schedule.kv_layers"):
        producers = mlkv_owners(L, m, v["schedule.placement"])
    elif kv == "explicit":
      parts = v["schedule.sources"].replace(",", "_").split("_")
      ok = bool(v["schedule.sources"]) and all(re.fullmatch(r"-?\d+", p) for p in parts)
      src = [int(p) for p in parts] if ok else []
      ok = ok and len(src) == L and all(0 <= s <= i and src[s] == s for i, s in enumerate(src))
      if not out.bad(ok, "schedule.sources"):
        producers = sorted(set(src))
        out.sources = src
  if out.violations:
    return
  if out.sources is None:
    out.sources = [max(p for p in producers if p <= i) for i in range(L)]
  out.heads = heads


def span(value: int, default: int, lo: int, hi: int) -> int | None:
  """A range end as documented: -1 is the default; None when outside lo..hi."""
  value = default if value == -1 else value
  return value if lo <= value <= hi else None


def lisa_rules(v: dict[str, Any], preset: str, out: Verdict) -> dict[int, tuple[str, int, str]]:
  L, H = v["model.num_layers"], v["model.num_heads"]
  groups, layers = v["schedule.lisa.groups"], v["schedule.lisa.layers"]
  if groups:
    field = "schedule.lisa.groups"
    if out.bad(preset == "lisa", field, "schedule.kind") or out.bad(not layers, field, "schedule.lisa.layers"):
      return {}
    pairs = [(g["layers"], g.get("integrator", "ffn")) for g in groups]
    if any(out.bad(i in INTEGRATORS and bool(ls), field) for ls, i in pairs):
      return {}
  else:
    field = "schedule.lisa.layers"
    pairs = [(layers or list(range(3, L - 2)), {"lisa_plus": "add", "ds": "none"}.get(preset,
                                                                                    v["schedule.lisa.integrator"]))]
    if out.bad(bool(pairs[0][0]), field):
      return {}
  flat = [n for ls, _ in pairs for n in ls]
  if out.bad(all(is_int(n) and 1 <= n <= L - 1 for n in flat) and len(set(flat)) == len(flat), field):
    return {}
  integrators = {i for _, i in pairs}
  out.bad(v["schedule.lisa.rank"] >= 1 or integrators == {"none"}, "schedule.lisa.rank")
  hidden = v["schedule.lisa.hidden"]
  out.bad("ffn" not in integrators or hidden == 0 or hidden >= 2 * H, "schedule.lisa.hidden")
  return {n: ("logits", n - 1, i) for ls, i in pairs for n in ls}


def score_rules(v: dict[str, Any], preset: str, out: Verdict) -> dict[int, tuple[str, int, str]]:
  L = v["model.num_layers"]
  if preset == "sa":
    start = span(v["schedule.sa.start"], L // 2, 0, L - 1)
    if out.bad(start is not None, "schedule.sa.start"):
      return {}
    end = span(v["schedule.sa.end"], L - 2, start, L - 1)
    if out.bad(end is not None, "schedule.sa.end"):
      return {}
    if v["schedule.sa.semantics"] == "reference_code":  # every span layer reuses the layer before the span
      out.bad(start > 0, "schedule.sa.start")
      return {i: ("probs", start - 1, "") for i in range(start, end + 1)}
    return {i: ("probs", start, "") for i in range(start + 1, end + 1)}
  if preset == "uniattn":
    b = v["schedule.uniattn.block_size"]
    start = span(v["schedule.uniattn.start"], L // 2, 0, L - 1)
    if out.bad(start is not None, "schedule.uniattn.start"):
      return {}
    end = span(v["schedule.uniattn.end"], L, start + 1, L)
    if out.bad(end is not None, "schedule.uniattn.end") or out.bad(1 <= b <= end - start,  # a superblock within
                                                                   "schedule.uniattn.block_size"):  # the range
      return {}
    return {i: ("probs", bottom, "") for bottom in range(start, end, b) for i in range(bottom + 1,
                                                                                        min(bottom + b, end))}
  return lisa_rules(v, preset, out)


def oracle(spec: dict[str, Any]) -> Verdict:
  """The verdict of the documented rules on BASE updated with ``spec``."""
  v = {**BASE, **spec}
  out = Verdict()
  config_rules(v, out)
  if out.violations:  # the config is checked as a whole before its schedule
    return out
  kind = v["schedule.kind"]
  tokens = [t.strip() for t in kind.split("+") if t.strip()]
  families = [FAMILY.get(t) for t in tokens]
  if out.bad(tokens and None not in families and len(set(families)) == len(families), "schedule.kind"):
    return out
  picked = dict(zip(families, tokens))
  kv, score, head = picked.get("kv", "dense"), picked.get("score"), picked.get("head")
  presets = {kv, score, head}
  for knob, readers in READERS.items():  # a knob set under presets that all ignore it
    if not readers & presets:
      changed = [k for k in FIELDS if (k == f"schedule.{knob}" or k.startswith(f"schedule.{knob}."))
                 and not same(v[k], DEFAULTS[k])]
      out.bad(not changed, *changed)
  if out.violations:
    return out
  kv_rules(v, kv, out)
  if out.violations:
    return out
  out.reuse = score_rules(v, score, out) if score else {}
  if out.violations:
    return out
  # a layer that reuses scores has no K of its own: it must project its own V, and nobody may read its K
  L, H = v["model.num_layers"], v["model.num_heads"]
  if out.bad(all(out.sources[i] == i for i in out.reuse) and
             not any(out.sources[i] in out.reuse for i in range(L) if i not in out.reuse), "schedule.kind"):
    return out
  if head:
    ratio = v["schedule.headwise.ratio"]
    if out.bad(0 <= ratio < 0.75, "schedule.headwise.ratio"):
      return out
    # defined for MHA layers that compute their own scores (every layer dense) with bias-free projections
    if out.bad(out.sources == list(range(L)) and out.heads == [H] * L and not score, "schedule.kind"):
      return out
    if out.bad(v["model.flavor"] == "llama", "schedule.kind", "model.flavor"):
      return out
    if out.bad(not v["model.qkv_bias"], "model.qkv_bias", "schedule.kind"):
      return out
    out.tied = round(ratio * 4 * L * H / 3)
    out.bad(out.tied <= (L - 1) * H, "schedule.headwise.ratio")
  return out


def pick(typical: list, edge: list) -> tuple:
  """A field's (typical values, out-of-range or odd values) strategies."""
  return st.sampled_from(typical), st.sampled_from(edge)


MODEL_FIELDS = {  # dotted field -> (typical values, out-of-range / odd values)
  "model.num_layers": (st.integers(1, 6), st.sampled_from([0, -1, -6])),
  "model.d_model": (st.sampled_from([8, 12, 16, 24, 32, 48, 64]), st.sampled_from([0, -16, 1, 2, 7, 30])),
  "model.num_heads": (st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([0, -2, 5, 7, 16, 64])),
  "model.head_dim": (st.sampled_from([0, 0, 4, 8, 16]), st.sampled_from([-1, -8, 1, 2, 3, 5, 6])),
  "model.mlp_dim": (st.sampled_from([16, 32, 48, 64, 100]), st.sampled_from([0, -1, 1, 7])),
  "model.rotary_pct": pick([1.0, 0.5, 0.25], [0.0, -0.5, 1.5, NAN, INF, 0.1, 0.34, 0.75]),
  "model.norm_eps": pick([1e-5, 1e-6, 0.1], [0.0, -1e-5, NAN, INF, -INF, 1e300, 5e-324]),
  "model.init_std": pick([0.02, 0.1, 1.0], [0.0, -0.02, NAN, INF]),
  "model.rope_theta": pick([10000.0, 500000.0, 1.5], [0.0, -1.0, NAN, INF, 1e-300]),
  "model.rope_scaling": (st.sampled_from(["none", "linear", "llama3"]), st.sampled_from(["yarn", ""])),
  "model.rope_scaling_factor": pick([1.0, 8.0], [0.0, -2.0, NAN]),
  "model.rope_low_freq_factor": pick([1.0, 2.0], [0.0, -1.0, 4.0, NAN, INF]),
  "model.rope_high_freq_factor": pick([4.0, 8.0], [1.0, 0.5, NAN, -INF]),
  "model.sliding_window": (st.sampled_from([0, 4, 16, 1000]), st.sampled_from([-1, -32])),
  "model.flavor": (st.sampled_from(["llama", "neox"]), st.sampled_from(["gpt2", "", "LLAMA"])),
  "model.qkv_bias": (st.booleans(), None),
  "model.tie_embeddings": (st.booleans(), None),
  "model.dtype": (st.sampled_from(["float32", "bfloat16"]), st.sampled_from(["float16", "fp32"])),
  "schedule.kind": (st.sampled_from(["dense", "mqa"]), None),
}


OPTIMIZER_FIELDS = {
  "train.lr": pick([3e-3, 1e-4, 1.0], [0.0, -1e-3, NAN, INF, -INF, 1e30]),
  "train.b1": pick([0.9, 0.0, 0.5], [1.0, -0.1, 1.5, NAN, INF]),
  "train.b2": pick([0.95, 0.999, 0.0], [1.0, -0.5, NAN, -INF]),
  "train.eps": pick([1e-8, 1e-6], [0.0, -1e-8, NAN, INF]),
  "train.weight_decay": pick([0.1, 0.0, 1.0], [-0.1, NAN, INF]),
  "train.clip_norm": pick([1.0, 0.0, 0.5], [-1.0, NAN, INF]),
}


def draw_fields(draw, fields: dict[str, tuple], max_edges: int = 2) -> dict[str, Any]:
  """Every field at a typical value except up to ``max_edges`` at out-of-range or odd ones."""
  edges = draw(st.sets(st.sampled_from(sorted(k for k, (_, e) in fields.items() if e is not None)),
                       max_size=max_edges))
  return {k: draw(edge if k in edges else typical) for k, (typical, edge) in fields.items()}


@st.composite
def model_specs(draw) -> dict[str, Any]:
  """Model dimensions and model/optimizer floats, up to two of them out of range."""
  return draw_fields(draw, {**MODEL_FIELDS, **OPTIMIZER_FIELDS})


def divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def sorted_subsets(draw, values: list[int], min_size: int = 0) -> list[int]:
  return sorted(draw(st.sets(st.sampled_from(values), min_size=min_size))) if values else []


@st.composite
def knob_values(draw, knob: str, kv: str, score: str | None, L: int, H: int, edge: bool) -> dict[str, Any]:
  """The overrides of one schedule knob (group), typical or out of range / malformed (``edge``)."""
  layers = list(range(L))
  odd = [-1, 0, L, L + 2]
  if knob == "kv_heads":
    good = [0, H] if kv == "dense" else [0] + divisors(H)
    bad = [g for g in range(-1, 2 * H + 2) if g not in good]
    return {"schedule.kv_heads": draw(st.sampled_from(bad if edge else good))}
  if knob == "kv_heads_per_layer":
    per = draw(st.lists(st.sampled_from(divisors(H)), min_size=L, max_size=L))
    if edge:
      i = draw(st.integers(0, L - 1))
      per = draw(st.sampled_from([per[:-1], per + [H], per[:i] + [draw(st.sampled_from(
        [0, -1, H + 1, float(H), True, "x"] + [g for g in range(2, H) if H % g]))] + per[i + 1:]]))
    return {"schedule.kv_heads_per_layer": per}
  if knob == "factor":
    return {"schedule.factor": draw(st.sampled_from([0, -1, L + 1, 10]) if edge else st.integers(1, L))}
  if knob == "producers":
    p = [0] + draw(sorted_subsets(layers[1:]))
    if edge:
      p = draw(st.sampled_from([p[1:] or [1], p + [L], list(reversed(p)) if len(p) > 1 else [0, 0], p + p[-1:],
                                [-1] + p, p + [float(L - 1)], p + ["a"], p + [[L - 1]], [0, True]]))
    return {"schedule.producers": p}
  if knob == "kv_layers":
    return {"schedule.kv_layers": draw(st.sampled_from([0, -1, L + 1]) if edge else st.integers(1, L))}
  if knob == "placement":
    return {"schedule.placement": draw(st.sampled_from(["bogus"] if edge else ["paper", "reference_code"]))}
  if knob == "sources":
    if edge:
      numbers = st.lists(st.integers(-1, L), min_size=max(L - 1, 1), max_size=L + 1)
      src = draw(st.sampled_from(["", "0_a", "0__0", "-1"]) | numbers.map(lambda s: "_".join(map(str, s))))
    else:
      own = [True] + draw(st.lists(st.booleans(), min_size=L - 1, max_size=L - 1))
      src = []
      for i in range(L):
        src.append(i if own[i] else draw(st.sampled_from([j for j in range(i) if own[j]])))
      src = draw(st.sampled_from(["_", ","])).join(map(str, src))
    return {"schedule.sources": src}
  if knob == "sa":
    ends = odd if edge else [-1] + layers
    return {"schedule.sa.start": draw(st.sampled_from(ends)), "schedule.sa.end": draw(st.sampled_from(ends)),
            "schedule.sa.semantics": draw(st.sampled_from(["paper", "reference_code"]))}
  if knob == "uniattn":
    return {"schedule.uniattn.block_size": draw(st.sampled_from([0, -1]) if edge else st.integers(1, 5)),
            "schedule.uniattn.start": draw(st.sampled_from(odd if edge else [-1] + layers)),
            "schedule.uniattn.end": draw(st.sampled_from([-1] + layers[1:] + [L])),
            "schedule.uniattn.wc_input": draw(st.sampled_from(["residual", "normed"]))}
  if knob == "lisa":
    out = {"schedule.lisa.integrator": draw(st.sampled_from(INTEGRATORS)),
           "schedule.lisa.rank": draw(st.sampled_from([0, -1]) if edge else st.integers(1, 8)),
           "schedule.lisa.hidden": draw(st.sampled_from([-1, 1, 2 * H - 1] if edge else [0, 2 * H, 8 * H, 64])),
           "schedule.lisa.rope": draw(st.booleans()), "schedule.lisa.keep_qk": draw(st.booleans())}
    chosen = draw(sorted_subsets(layers[1:], min_size=1)) or [1]  # one layer: LISA has no layer to share
    if not ((score == "lisa" or edge) and draw(st.booleans())):  # layers (or the default) + integrator
      if edge:
        chosen = draw(st.sampled_from([chosen + [0], chosen + [L], [-1], chosen + chosen[:1], chosen + ["x"],
                                       chosen + [1.5], [True]]))
      out["schedule.lisa.layers"] = draw(st.sampled_from([chosen, []]))
    else:  # groups, one integrator each (lisa only: lisa_plus and ds fix the integrator; an edge case for them)
      cut = draw(st.integers(0, len(chosen)))
      groups = [{"layers": g, "integrator": draw(st.sampled_from(INTEGRATORS))}
                for g in (chosen[:cut], chosen[cut:]) if g]
      if edge:
        groups = draw(st.sampled_from([groups + [{"layers": chosen[:1]}], groups + [{"layers": []}],
                                       [{**groups[0], "integrator": "sum"}]]))
        if draw(st.booleans()):
          out["schedule.lisa.layers"] = chosen
      out["schedule.lisa.groups"] = groups
    return out
  if knob == "headwise":
    return {"schedule.headwise.ratio": draw(st.sampled_from([0.75, 1.0, -0.1, NAN, INF] if edge
                                                            else [0.0, 0.1, 0.3, 0.5, 0.7])),
            "schedule.headwise.match": draw(st.sampled_from(["qk", "q", "k", "v", "qkv", "separately"]))}
  raise AssertionError(knob)


STRAY = {  # a non-default value of each knob, set under presets that ignore it
  "kv_heads": {"schedule.kv_heads": 1}, "kv_heads_per_layer": {"schedule.kv_heads_per_layer": [1]},
  "factor": {"schedule.factor": 3}, "producers": {"schedule.producers": [0]}, "kv_layers": {"schedule.kv_layers": 1},
  "placement": {"schedule.placement": "paper"}, "sources": {"schedule.sources": "0"},
  "sa": {"schedule.sa.semantics": "paper"}, "uniattn": {"schedule.uniattn.block_size": 2},
  "lisa": {"schedule.lisa.rank": 2}, "headwise": {"schedule.headwise.ratio": 0.1},
}


MALFORMED_KINDS = ["", "flash", "sa+lisa", "dense+gqa", "headwise+headwise", "MLKV", "dense,sa", "+", "lisa_plus+ds"]


@st.composite
def schedule_specs(draw, layers: tuple[int, int] = (1, 6)) -> dict[str, Any]:
  """A valid model (``layers`` layers, d_model <= 64) with a preset expression and the knobs its presets read."""
  L, H = draw(st.integers(*layers)), draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
  hd = draw(st.sampled_from([2, 4, 8]))
  explicit_hd = draw(st.booleans())
  spec = {"model.num_layers": L, "model.num_heads": H, "model.d_model": draw(st.sampled_from([16, 32, 64]))
          if explicit_hd else H * hd, "model.head_dim": hd if explicit_hd else 0,
          "model.flavor": draw(st.sampled_from(["llama", "neox"])), "model.qkv_bias": draw(st.booleans()),
          "schedule.match_params": draw(st.booleans()),
          "attention.score_sharing": draw(st.sampled_from(["recompute", "materialize"]))}
  kv = draw(st.sampled_from(KV_KINDS + (None,)))
  score = draw(st.sampled_from(SCORE_KINDS + (None,) * 5))  # about half the expressions share no scores
  head = draw(st.sampled_from([None] * 4 + ["headwise"]))
  tokens = draw(st.permutations([t for t in (kv, score, head) if t])) or ["dense"]
  kv = kv or "dense"
  read = [k for k, readers in READERS.items() if readers & {kv, score, head}]
  edges = draw(st.sets(st.sampled_from(read + ["stray", "kind"]), max_size=2))
  joiner = draw(st.sampled_from(["+", " + "]))  # spaces around '+' are allowed
  spec["schedule.kind"] = draw(st.sampled_from(MALFORMED_KINDS)) if "kind" in edges else joiner.join(tokens)
  for knob in read:
    if knob == "kv_heads_per_layer" and knob not in edges and draw(st.booleans()):
      continue  # gqa with one kv_heads for all layers
    if knob == "producers" and knob not in edges and draw(st.booleans()):
      continue  # cla by factor
    spec.update(draw(knob_values(knob, kv, score, L, H, knob in edges)))
  ignored = [k for k in READERS if k not in read]
  if "stray" in edges and ignored:
    spec.update(STRAY[draw(st.sampled_from(ignored))])
  return spec
