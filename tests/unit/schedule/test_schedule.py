import pytest

from jaxshare.config import (HeadPreset, KVPreset, LisaConfig, LisaGroupConfig, ModelConfig, ScheduleConfig,
                             ScorePreset, UniAttnConfig)
from jaxshare.schedule import ScheduleError, compile_schedule, mlkv_owners, parse_kind


def sched(**kw):
  return ScheduleConfig(**kw)


M = ModelConfig(num_layers=6, num_heads=4, d_model=32)


def sources(s):
  return [p.kv_source for p in s.layers]


@pytest.mark.parametrize("kind, dense, presets", [
  ("dense", True, {KVPreset.DENSE}), ("cla", False, {KVPreset.CLA}),
  ("cla+uniattn", False, {KVPreset.CLA, ScorePreset.UNIATTN}),
  ("uniattn", False, {KVPreset.DENSE, ScorePreset.UNIATTN}),
  ("dense+headwise", False, {KVPreset.DENSE, HeadPreset.HEADWISE}),
  ("mlkv+lisa_plus", False, {KVPreset.MLKV, ScorePreset.LISA_PLUS})])
def test_a_kind_has_exactly_its_presets(kind, dense, presets):
  parsed = parse_kind(kind)
  assert parsed.dense == dense
  every = [*KVPreset, *ScorePreset, *HeadPreset]
  assert {p for p in every if parsed.has(p)} == presets, "a composed kind has each part and no other preset"


def test_presets_expand_to_per_layer_sources():
  assert sources(compile_schedule(M, sched(kind="dense"))) == [0, 1, 2, 3, 4, 5]
  assert sources(compile_schedule(M, sched(kind="cla", factor=2))) == [0, 0, 2, 2, 4, 4]
  assert sources(compile_schedule(M, sched(kind="cla", factor=4))) == [0, 0, 0, 0, 4, 4]
  assert sources(compile_schedule(M, sched(kind="cla", producers=[0, 1, 5]))) == [0, 1, 1, 1, 1, 5]
  assert sources(compile_schedule(M, sched(kind="mlkv", kv_layers=3))) == [0, 0, 2, 2, 4, 4]
  assert sources(compile_schedule(M, sched(kind="explicit", sources="0_0_2_2_2_5"))) == [0, 0, 2, 2, 2, 5]
  assert {p.num_kv_heads for p in compile_schedule(M, sched(kind="mqa")).layers} == {1}
  gqa = compile_schedule(M, sched(kind="gqa", kv_heads_per_layer=[4, 2, 2, 1, 1, 4]))
  assert [p.num_kv_heads for p in gqa.layers] == [4, 2, 2, 1, 1, 4]


def test_mlkv_owner_placements_follow_paper_and_reference_code():
  # methods-mlkv-sa-headwise.md 1.2 and 1.6
  assert mlkv_owners(12, 6, "reference_code") == [0, 2, 4, 6, 8, 10]
  assert mlkv_owners(12, 4, "reference_code") == [0, 3, 6, 9]
  assert mlkv_owners(12, 2, "reference_code") == [0, 6]
  assert mlkv_owners(12, 1, "reference_code") == [0]
  assert mlkv_owners(12, 5, "paper") == [0, 3, 5, 8, 10]
  assert mlkv_owners(12, 5, "reference_code") == [0, 2, 4, 7, 9]
  for m in (1, 2, 3, 4, 6, 12):  # agree whenever m divides L
    assert mlkv_owners(12, m, "paper") == mlkv_owners(12, m, "reference_code")


def test_mlkv_reference_code_placement_is_the_authors_expression():
  """pythia-mlkv computes ``int((i+1)*(L/m))``: the float quotient first. ``int((i+1)*L/m)`` differs for 101 of the
  (L <= 128, m <= L) pairs, e.g. (30, 22), whose 12th owner is int(11 * (30/22)) = int(14.999...) = 14, not 15."""
  for num_layers in range(1, 129):
    for m in range(1, num_layers + 1):
      authors = [0] + [int((i + 1) * (num_layers / m)) for i in range(m - 1)]
      assert mlkv_owners(num_layers, m, "reference_code") == authors, (num_layers, m)
  assert mlkv_owners(30, 22, "reference_code")[11] == 14


def test_superblocks_and_stacks():
  s = compile_schedule(ModelConfig(num_layers=12, num_heads=4, d_model=32),
                       sched(kind="mlkv", kv_layers=5, placement="reference_code"))
  assert [len(b.layers) for b in s.superblocks] == [2, 2, 3, 2, 3]
  assert [(g.start, g.count, g.superblock_size) for g in s.stacks] == [(0, 2, 2), (4, 1, 3), (7, 1, 2), (9, 1, 3)]
  cla = compile_schedule(M, sched(kind="cla", factor=2))
  assert len(cla.stacks) == 1 and cla.stacks[0].count == 3
  # A producer between a consumer and its source ends up inside the same superblock.
  s = compile_schedule(M, sched(kind="explicit", sources="0_1_0_3_4_4"))
  assert [len(b.layers) for b in s.superblocks] == [3, 1, 2]
  assert [(r.start, r.length, r.role.kv_from) for r in s.superblocks[0].runs] == [(0, 1, None), (1, 1, None), (2, 1, 0)]


@pytest.mark.parametrize("kw, needle", [
  (dict(kind="explicit", sources="0_2_2_2_4_4"), "layer 1: source 2 is not an earlier-or-same layer"),
  (dict(kind="explicit", sources="0_0_1_1_4_4"), "source layer 1 does not produce"),
  (dict(kind="explicit", sources="0_0_2"), "has 3 entries"),
  (dict(kind="explicit", sources="0_a"), "expected integers"),
  (dict(kind="cla", producers=[1, 3]), "layer 0 must produce"),
  (dict(kind="cla", producers=[0, 3, 2]), "strictly increasing"),
  (dict(kind="cla", producers=[0, 9]), "layer 9 does not exist"),
  (dict(kind="cla", factor=0), "schedule.factor=0"),
  (dict(kind="mlkv", kv_layers=0), "schedule.kv_layers=0"),
  (dict(kind="mlkv", kv_layers=7), "schedule.kv_layers=7"),
  (dict(kind="gqa", kv_heads=3), "schedule.kv_heads=3"),
  (dict(kind="gqa", kv_heads_per_layer=[4, 4]), "needs 6 entries"),
  (dict(kind="gqa", kv_heads_per_layer=[4, 4, 3, 4, 4, 4]), "kv_heads_per_layer[2]=3"),
  (dict(kind="dense", kv_heads=2), "use schedule.kind=gqa"),
  (dict(kind="cla+uniattn", producers=[0, 1, 2, 3, 4], uniattn=UniAttnConfig(block_size=2)),
   "which reuses scores and so projects no K"),
  (dict(kind="cla+sa"), "needs its own V"),
  (dict(kind="sa+lisa"), "two score presets"),
  (dict(kind="mqa+headwise"), "head-wise sharing is defined for MHA"),
  (dict(kind="flash"), "'flash' is not a preset"),
])
def test_invalid_schedules_raise_clear_errors(kw, needle):
  with pytest.raises(ScheduleError) as e:
    compile_schedule(M, sched(**kw))
  assert needle in str(e.value)


def runs(s):
  """Per segment: count and the superblock's runs as (role tag, length)."""
  return [(seg.count, [(r.role.tag(), r.length) for r in seg.runs]) for seg in s.stacks]


def test_identical_layers_inside_a_superblock_form_one_run():
  deep = ModelConfig(num_layers=48, num_heads=4, d_model=32)
  # MLKV m=3: three superblocks of a producer and 15 consumers of its K/V
  assert runs(compile_schedule(deep, sched(kind="mlkv", kv_layers=3))) == [(3, [("P", 1), ("C0", 15)])]
  # CLA factor 4: the three consumers of each producer
  assert runs(compile_schedule(deep, sched(kind="cla", factor=4))) == [(12, [("P", 1), ("C0", 3)])]
  # UniAttn b=4 on the top half: the bottom layer and three probability reusers with W_c
  assert runs(compile_schedule(deep, sched(kind="uniattn"))) == [(24, [("P", 1)]), (6, [("P", 1), ("Pp0+Wc", 3)])]
  # SA (reference code): layers 24..46 reuse layer 23
  assert runs(compile_schedule(deep, sched(kind="sa"))) == [(23, [("P", 1)]), (1, [("P", 1), ("Pp0", 23)]),
                                                            (1, [("P", 1)])]
  # LISA_plus with the default layers 3..45: one chain of 43 layers after its source, layer 2
  assert runs(compile_schedule(deep, sched(kind="lisa_plus"))) == [(2, [("P", 1)]), (1, [("P", 1), ("Pl/add", 43)]),
                                                                   (2, [("P", 1)])]


def test_layers_read_by_position_stay_alone():
  # layer 3 reads layer 1's K/V: layers 1 and 2 have equal roles but 1 must hand its K/V on
  s = compile_schedule(M, sched(kind="explicit", sources="0_1_1_1_4_5"))
  assert [(r.start, r.length, r.role.kv_from) for r in s.superblocks[1].runs] == [(0, 1, None), (1, 2, 0)]
  s = compile_schedule(M, sched(kind="explicit", sources="0_1_2_1_4_5"))
  assert [(r.start, r.length, r.role.kv_from) for r in s.superblocks[1].runs] == [(0, 1, None), (1, 1, None),
                                                                                   (2, 1, 0)]


def test_lisa_default_layers_follow_the_paper():
  # LISA Table 4: LISA(27) on 32 layers is 4-30 (1-based); layers 1-3 and 32 are never shared
  s = compile_schedule(ModelConfig(num_layers=32, num_heads=4, d_model=32), sched(kind="lisa"))
  assert [p.index + 1 for p in s.layers if p.score_reuse] == list(range(4, 31))
  with pytest.raises(ScheduleError, match=r"schedule.lisa.layers=\[\] is invalid for model.num_layers=5"):
    compile_schedule(ModelConfig(num_layers=5, num_heads=4, d_model=32), sched(kind="lisa_plus"))


def test_lisa_groups_give_one_integrator_per_group():
  # LISA_SL(7+10) (1-based 5, 6, 17-21 linear and 22-31 direct sharing) on 32 layers
  groups = [LisaGroupConfig(layers=[4, 5, 16, 17, 18, 19, 20], integrator="linear"),
            LisaGroupConfig(layers=list(range(21, 31)), integrator="none")]
  s = compile_schedule(ModelConfig(num_layers=32, num_heads=4, d_model=32),
                       sched(kind="lisa", lisa=LisaConfig(groups=groups)))
  assert {p.index: p.integrator for p in s.layers if p.score_reuse} == {
    **{n: "linear" for n in (4, 5, *range(16, 21))}, **{n: "none" for n in range(21, 31)}}
  assert runs(s)[-2][1] == [("P", 1), ("Pl/linear", 5), ("Pl/none", 10)]  # one chain, two runs


@pytest.mark.parametrize("kw, needle", [
  (dict(kind="lisa_plus", lisa=LisaConfig(groups=[LisaGroupConfig(layers=[2])])), "lisa_plus fixes the integrator"),
  (dict(kind="lisa", lisa=LisaConfig(layers=[2], groups=[LisaGroupConfig(layers=[3])])), "together with"),
  (dict(kind="lisa", lisa=LisaConfig(groups=[LisaGroupConfig(layers=[2, 3]), LisaGroupConfig(layers=[3])])),
   "layer 3 is in two groups"),
  (dict(kind="lisa", lisa=LisaConfig(groups=[LisaGroupConfig(layers=[2], integrator="sum")])),
   "groups[0].integrator='sum'"),
  (dict(kind="lisa", lisa=LisaConfig(layers=[2], hidden=7)), "schedule.lisa.hidden=7"),
  (dict(kind="lisa", lisa=LisaConfig(layers=[0])), "layer 0 must be in 1..5"),
])
def test_invalid_lisa_settings_raise_clear_errors(kw, needle):
  with pytest.raises(ScheduleError) as e:
    compile_schedule(M, sched(**kw))
  assert needle in str(e.value)


def test_a_uniattn_superblock_larger_than_its_range_is_refused():
  """issue 43: block_size=8 on 4 layers silently became one 2-layer superblock."""
  four = ModelConfig(num_layers=4, num_heads=4, d_model=32)
  with pytest.raises(ScheduleError, match=r"schedule.uniattn.block_size=8 is invalid: the unified range is layers "
                                          r"2..3 \(2 of model.num_layers=4; .*at most 2 layers"):
    compile_schedule(four, sched(kind="uniattn", uniattn=UniAttnConfig(block_size=8)))
  fits = compile_schedule(four, sched(kind="uniattn", uniattn=UniAttnConfig(block_size=2)))
  assert [p.score_source for p in fits.layers] == [0, 1, 2, 2] and fits.layers[3].score_reuse == "probs"
