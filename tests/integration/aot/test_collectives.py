"""The collective traffic of a compiled step (jaxshare.aot.collectives): ring volumes per kind, loop trip counts, the
costliest branch, async tuples, and the K/V share; on 4 host devices CLA2 moves half of dense's K/V bytes and MLKV
(2 producers of 2 heads against 4 layers of 4) a quarter."""

import jax
import pytest

from conftest import tiny_config
from jaxshare import parallel
from jaxshare.aot.collectives import traffic
from jaxshare.aot.compile import compile_traced, trace_train_step
from jaxshare.config.catalogue import schedule_matrix

HLO = """HloModule jit_step, entry_computation_layout={()->()}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %p = (s32[], bf16[8,64]) parameter(0)
  %ag = ((bf16[16,64]), bf16[128,64]) all-gather-start(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, metadata={op_name="jit(step)/while/body/kv_gather/sharding_constraint"}
  %agd = bf16[128,64] all-gather-done(%ag)
  %rs = ((bf16[1,128,64]), bf16[1,16,64]) reduce-scatter-start(%y), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={1}, to_apply=%add
  %rsd = bf16[1,16,64] reduce-scatter-done(%rs)
  ROOT %t = (s32[], bf16[8,64]) tuple(%i, %z)
}

%cheap (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  ROOT %ar = f32[4] all-reduce(%a), replica_groups=[2,4]<=[8], to_apply=%add
}

%dear (a: f32[4]) -> f32[4] {
  %a = f32[4] parameter(0)
  %ar1 = f32[1024] all-reduce(%a), replica_groups=[2,4]<=[8], to_apply=%add
  ROOT %cp = f32[4] collective-permute(%a), source_target_pairs={{0,1},{1,0}}
}

ENTRY %main (x: bf16[8,64]) -> f32[4] {
  %x = bf16[8,64] parameter(0)
  %w = (s32[], bf16[8,64]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %c = f32[4] conditional(%i, %a, %a), branch_computations={%cheap, %dear}
  ROOT %g = f32[4] all-gather(%a), replica_groups=mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, dimensions={0}
}
"""


def test_volumes_loops_branches_and_the_kv_share():
  t = traffic(HLO)
  gather = 128 * 64 * 2 * 7 / 8  # the result each device receives, less its own eighth
  scatter = 16 * 64 * 2 * 7  # the result's (n - 1) multiples: its operand is 8 results, 7/8 of them moved
  costliest = 2 * 1024 * 4 * 3 / 4 + 4 * 4  # the dear branch: a ring all-reduce over 4 devices and a permute
  assert t.by_kind == pytest.approx({"all-gather": 3 * gather + 4 * 4 * 3 / 4, "reduce-scatter": 3 * scatter,
                                     "all-reduce": costliest - 16, "collective-permute": 16})
  # the unnamed reduce-scatter's operand has the gathered keys' shape (up to unit dimensions): their gradients' sum
  assert t.kv == pytest.approx(3 * (gather + scatter))
  assert t.count == 3 * 2 + 2 + 1


TPU_PERMUTE = """HloModule jit_step, entry_computation_layout={()->()}

ENTRY %main (x: bf16[1,4096,32,64]) -> bf16[1,4096,32,64] {
  %x = bf16[1,4096,32,64]{1,3,2,0:T(8,128)(2,1)} parameter(0)
  %cps = (bf16[1,4096,32,64]{1,3,2,0:T(8,128)(2,1)}, bf16[1,4096,32,64]{1,3,2,0:T(8,128)(2,1)}, u32[]{:S(2)}, u32[]{:S(2)}) collective-permute-start(%x), channel_id=1, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}, metadata={op_name="jit(step)/kv_gather/shard_map/ppermute"}
  ROOT %cpd = bf16[1,4096,32,64]{1,3,2,0:T(8,128)(2,1)} collective-permute-done(%cps)
}
"""


TPU_LOOP = """HloModule jit_step, entry_computation_layout={()->()}

%cond (p: (s32[], bf16[8,64])) -> pred[] {
  %p = (s32[]{:T(128)}, bf16[8,64]) parameter(0)
  %c = s32[]{:T(128)} constant(5)
  %i = s32[]{:T(128)} get-tuple-element(%p), index=0
  ROOT %lt = pred[]{:T(512)} compare(%i, %c), direction=LT
}

%body (p: (s32[], bf16[8,64])) -> (s32[], bf16[8,64]) {
  %p = (s32[], bf16[8,64]) parameter(0)
  %cp = bf16[8,64] collective-permute(%x), source_target_pairs={{0,1},{1,0}}
  ROOT %t = (s32[], bf16[8,64]) tuple(%i, %cp)
}

ENTRY %main (x: bf16[8,64]) -> bf16[8,64] {
  %w = (s32[], bf16[8,64]) while(%init), condition=%cond, body=%body
  ROOT %r = bf16[8,64] get-tuple-element(%w), index=1
}
"""


def test_a_tpu_permute_start_counts_its_result_not_its_sync_flags():
  """TPU's async permute is ``(operand, result, u32[], u32[])``: the bytes moved are the result's."""
  t = traffic(TPU_PERMUTE)
  assert t.by_kind == {"collective-permute": 4096 * 32 * 64 * 2}
  assert t.kv == 4096 * 32 * 64 * 2


def test_a_loop_without_a_known_trip_count_runs_to_its_conditions_bound():
  """TPU programs carry no ``known_trip_count``: a scan's loop (counter from 0, ``counter < N``) runs N times."""
  assert traffic(TPU_LOOP).by_kind == {"collective-permute": 5 * 8 * 64 * 2}


COMBINED = """HloModule jit_step, entry_computation_layout={()->()}

ENTRY %main (x: f32[4,32,4,8]) -> (f32[], f32[32], f32[4,32,4,8]) {
  %x = f32[4,32,4,8] parameter(0)
  ROOT %ar = (f32[], f32[32]{0}, f32[4,32,4,8]{3,2,1,0}) all-reduce(%s, %n, %x), replica_groups={{0,1,2,3}}, to_apply=%add, metadata={op_name="jit(step)/transpose(jvp(kv_gather))/psum"}
}
"""


def test_a_combined_kv_reduction_counts_only_its_kv_arrays():
  """XLA's all-reduce combiner folds a scalar and a norm's scale gradient into a K/V gradient's reduction, under its
  metadata (CLA2's unrolled superblocks without remat: 390 bytes more than half of dense's K/V)."""
  t = traffic(COMBINED)
  ring = 2 * 3 / 4  # an all-reduce over 4 devices moves twice its result's (n - 1)/n
  assert t.by_kind == pytest.approx({"all-reduce": ring * (4 + 32 * 4 + 4 * 32 * 4 * 8 * 4)})
  assert t.kv == pytest.approx(ring * 4 * 32 * 4 * 8 * 4)


@pytest.mark.parametrize("remat", ["none", "full"])
def test_sharing_moves_a_share_of_dense_kv_bytes_under_context_parallelism(remat):
  families = schedule_matrix("families")
  kv = {}
  for name in ("dense", "cla", "mlkv"):
    cfg = tiny_config(*families[name], "mesh.context=4", "train.batch_size=4", f"model.remat={remat}")
    compiled = compile_traced(trace_train_step(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:4])), name)
    kv[name] = compiled.traffic.kv
  assert kv["dense"] > 0
  assert kv["cla"] == pytest.approx(kv["dense"] / 2)
  assert kv["mlkv"] == pytest.approx(kv["dense"] / 4)


def test_the_ring_moves_kv_by_permutes_that_every_reader_issues():
  """attention.context_strategy=ring: the K/V travel by collective permutes alone (no gather), and since every layer
  that reads K/V rotates them itself, CLA2 moves as many K/V bytes as dense and MLKV (heads 2 against 4) half."""
  families = schedule_matrix("families")
  moved = {}
  for name in ("dense", "cla", "mlkv"):
    cfg = tiny_config(*families[name], "mesh.context=4", "train.batch_size=4", "attention.context_strategy=ring")
    moved[name] = compile_traced(trace_train_step(cfg, parallel.make_mesh(cfg.mesh, jax.devices()[:4])), name).traffic
  for name, t in moved.items():
    assert t.kv > 0 and t.kv == pytest.approx(t.by_kind["collective-permute"]), name
  assert moved["cla"].kv == pytest.approx(moved["dense"].kv)
  assert moved["mlkv"].kv == pytest.approx(moved["dense"].kv / 2)
