"""The search space and its budget: every candidate a valid schedule within budget (a property over models and
budgets), budgets parsed with units, an impossible budget refused with the smallest achievable figures."""

import pytest
from hypothesis import given, settings, strategies as st

from conftest import tiny_config
from jaxshare import accounting
from jaxshare.config import apply_overrides
from jaxshare.config.source import with_match_reference
from jaxshare.plan import plan_of
from jaxshare.search.budget import Budget, Limit, SearchError, parse_limit
from jaxshare.search.space import FAMILIES, KV_RULES, architecture, candidates


def _cfg(layers: int, heads: int):
  return tiny_config(f"model.num_layers={layers}", f"model.num_heads={heads}", "model.d_model=32")


@settings(max_examples=12, deadline=None)
@given(layers=st.sampled_from([2, 4, 6, 8]), heads=st.sampled_from([2, 4]),
       kv=st.sampled_from([None, 0.25, 0.5, 0.75, 1.0]), flops=st.sampled_from([None, 0.9, 1.0]),
       equal=st.booleans(), families=st.sets(st.sampled_from(FAMILIES), min_size=1))
def test_every_candidate_is_a_valid_schedule_within_budget(layers, heads, kv, flops, equal, families):
  src = _cfg(layers, heads)
  budget = Budget(None if kv is None else Limit(kv, True), None if flops is None else Limit(flops, True), equal)
  try:
    cands, source = candidates(src, "runs/src", budget, sorted(families))
  except SearchError as e:
    assert "smallest achievable" in str(e) or "has no valid schedule on this model" in str(e)
    return
  names = [c.name for c in cands]
  assert len(set(names)) == len(names)
  seen = set()
  src_plan = plan_of(src)
  assert source.kv_bytes == accounting.kv_cache_bytes_per_token(src.model, src_plan.schedule)
  for c in cands:
    cfg = with_match_reference(apply_overrides(src, ["schedule.kind=dense", "schedule.match_reference_params=0",
                                                     *c.overrides, "train.init_from=runs/src"]), source.params)
    plan = plan_of(cfg)  # compiles: a schedule the CLIs train, convert and serve
    # one candidate per architecture and conversion rule (K/V pooling, W_c fit)
    assert (architecture(plan), c.rule, c.wc_fit) not in seen, c.name
    seen.add((architecture(plan), c.rule, c.wc_fit))
    assert cfg.train.init_kv_pool == (KV_RULES[c.rule] if c.rule else "auto")
    assert c.rule == "" or any(p.kv_source != p.index for p in plan.schedule.layers)
    assert (c.wc_fit != "") == any(p.compensation for p in plan.schedule.layers)
    assert c.name.endswith(f"-wc{c.wc_fit}" if c.wc_fit else ("-" + c.rule if c.rule else ""))
    kv_bytes = accounting.kv_cache_bytes_per_token(cfg.model, plan.schedule)
    assert kv_bytes == c.cost.kv_bytes
    assert kv is None or kv_bytes <= kv * source.kv_bytes
    assert flops is None or c.cost.flops <= flops * source.flops * (1 + 1e-9)
    if equal:  # matched to the source's parameters (within half an MLP neuron per layer)
      assert abs(plan.param_count().total - source.params) <= layers * accounting.params_per_mlp_neuron(cfg.model)
    assert set(c.families) <= families


def test_the_papers_presets_are_among_the_candidates_at_their_budget():
  cands, _ = candidates(_cfg(8, 4), "runs/src", Budget(Limit(0.5, True)))
  presets = {c.name for c in cands if c.preset}
  assert {"cla2-own", "mlkv4-mean", "gqa2"} <= presets
  assert all(c.preset for c in cands[:len(presets)])  # presets first


def test_an_architecture_is_listed_once_per_conversion_rule_under_a_presets_name():
  """On 8 layers, CLA's factor 4 compiles to MLKV's 2 owners (K/V sources [0,0,0,0,4,4,4,4]) and CLA's factor 2 to
  MLKV's 4: each is one architecture, named after the preset, once per K/V rule; a preset only under its paper's
  rule. A producer serving two layers has no running-mean rule (the running mean of two is their mean)."""
  cands = {c.name: c for c in candidates(_cfg(8, 4), "runs/src", Budget(Limit(0.5, True)), ["kv"])[0]}
  assert not [n for n in cands if n.startswith("cla4")]
  assert {n: cands[n].preset for n in cands if n.startswith("mlkv2-")} == {
    "mlkv2-own": False, "mlkv2-mean": True, "mlkv2-running": False}
  assert cands["mlkv2-own"].cost == cands["mlkv2-mean"].cost
  assert "train.init_kv_pool=producer" in cands["mlkv2-own"].overrides
  same = {n: cands[n].preset for n in cands if n.split("-")[0] in ("cla2", "mlkv4")}
  assert same == {"cla2-own": True, "mlkv4-mean": True}
  assert cands["gqa2"].rule == "" and not [n for n in cands if n.startswith("gqa2-")]


def test_uniattn_is_listed_once_per_w_c_fit_both_the_papers():
  """UniAttn's W_c is fitted by least squares on every calibration token (App. F, Eq. 22-23) or on their averages (Alg.
  1 with v = 1, Theorem 3.1): one architecture under two conversion rules, each the paper's, so both are presets."""
  cands = {c.name: c for c in candidates(_cfg(8, 4), "runs/src", Budget(Limit(1.0, True)), ["scores"])[0]}
  fits = {n: (cands[n].wc_fit, cands[n].preset) for n in cands if n.startswith("uniattn_b4_s4")}
  assert fits == {"uniattn_b4_s4-wctokens": ("tokens", True), "uniattn_b4_s4-wcmean": ("mean", True)}
  assert cands["uniattn_b4_s4-wctokens"].cost == cands["uniattn_b4_s4-wcmean"].cost
  assert cands["uniattn_b2_s4-wcmean"].preset is False  # not the paper's block size
  assert all(cands[n].wc_fit == "" for n in cands if n.startswith("sa_"))  # no W_c to fit


def test_an_impossible_budget_is_refused_with_the_smallest_achievable_value():
  with pytest.raises(SearchError, match=r"smallest achievable is 64 KV B/token \(0\.125 of the source's\)"):
    candidates(_cfg(4, 4), "runs/src", Budget(Limit(8, False)), ["kv"])
  with pytest.raises(SearchError, match="--families 'kv,heads' is invalid"):
    candidates(_cfg(4, 4), "runs/src", Budget(Limit(0.5, True)), ["kv", "heads"])
  with pytest.raises(SearchError, match=r"--families scores has no valid schedule on this model \(2 layers"):
    candidates(_cfg(2, 2), "runs/src", Budget(), ["scores"])


@pytest.mark.parametrize("text,kind,expected", [("0.5", "kv", Limit(0.5, True)), ("2048B", "kv", Limit(2048, False)),
                                                ("1.5KiB", "kv", Limit(1536, False)),
                                                ("3.2MFLOP", "flops", Limit(3.2e6, False)),
                                                ("1", "flops", Limit(1.0, True))])
def test_budgets_parse_as_fractions_or_figures_with_units(text, kind, expected):
  assert parse_limit(text, kind, "--flag") == expected


@pytest.mark.parametrize("text,needle", [("1.5", "must be in \\(0, 1\\]"), ("0", "is invalid"), ("2GB", "unit 'GB'"),
                                         ("abc", "is invalid")])
def test_bad_budgets_name_the_flag_and_what_is_allowed(text, needle):
  with pytest.raises(SearchError, match=f"--kv-budget '{text}'.*{needle}|{needle}.*B, KiB, MiB"):
    parse_limit(text, "kv", "--kv-budget")


def test_a_frontier_config_names_the_w_c_fit_no_field_holds(tmp_path):
  from jaxshare.config import load_config
  from jaxshare.search.report import write_config

  cfg = tiny_config("schedule.kind=uniattn", "schedule.uniattn.block_size=2")
  write_config(tmp_path / "c.yaml", cfg, "mean")
  assert (tmp_path / "c.yaml").read_text().splitlines()[0] == "# converted with: convert uptrain --wc-fit mean"
  assert load_config(tmp_path / "c.yaml") == cfg
