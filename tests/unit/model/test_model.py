"""Model correctness: NumPy float64 parity, degenerate equivalences, scan == unrolled, packing."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from support import reference_numpy
from conftest import tiny_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.init.headwise import compute_ties
from jaxshare.model.params import layer_params
from jaxshare.plan import plan_of
from jaxshare.model import build_model
from support.models import forward, loss_and_grads, randomized, tokens


SCHEDULES = schedule_matrix("structures")
FLAVORS = {"llama": [], "neox": ["model.flavor=neox", "model.rotary_pct=0.5"],
           "llama_tied": ["model.tie_embeddings=true"]}


@pytest.mark.parametrize("flavor, sched", [("llama", s) for s in sorted(SCHEDULES)] + [
  (f, s) for f in ("neox", "llama_tied") for s in ("cla2", "mlkv_uneven")])
def test_matches_numpy_reference(flavor, sched):
  cfg = tiny_config(*SCHEDULES[sched], *FLAVORS[flavor])
  schedule, graphdef, params = randomized(cfg)
  x = tokens()
  ours = np.asarray(forward(graphdef, params, x))
  ref = reference_numpy.forward(cfg.model, schedule, jax.device_get(params), x)
  np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("sched", ["cla2", "mlkv_uneven", "explicit_nested"])
def test_scanned_equals_unrolled(sched):
  cfg = tiny_config(*SCHEDULES[sched])
  schedule, graphdef, params = randomized(cfg)
  cfg_unrolled = tiny_config(*SCHEDULES[sched], "model.scan_layers=false")
  _, graphdef_u, _ = randomized(cfg_unrolled)
  x = tokens()
  a, b = forward(graphdef, params, x), forward(graphdef_u, params, x)
  np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)
  (_, ga), (_, gb) = loss_and_grads(graphdef, params, x), loss_and_grads(graphdef_u, params, x)
  for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("variant", [["schedule.kind=cla", "schedule.factor=1"],
                                     ["schedule.kind=mlkv", "schedule.kv_layers=4", "schedule.kv_heads=4"],
                                     ["schedule.kind=explicit", "schedule.sources=0_1_2_3"]])
def test_degenerate_sharing_equals_dense(variant):
  dense_cfg = tiny_config()
  _, dense_gd, dense_params = randomized(dense_cfg)
  cfg = tiny_config(*variant)
  schedule, graphdef, params = randomized(cfg, seed=5)
  assert schedule.producers == (0, 1, 2, 3)
  assert jax.tree.structure(params) == jax.tree.structure(dense_params)
  x = tokens()
  np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, dense_params)(x)),
                                np.asarray(nnx.merge(dense_gd, dense_params)(x)))


def test_consumers_have_no_kv_parameters():
  cfg = tiny_config("schedule.kind=cla", "schedule.factor=2")
  schedule, _, params = randomized(cfg)
  assert {"k_proj", "v_proj", "q_proj", "o_proj"} <= set(layer_params(params, schedule, 0)["attn"])
  assert set(layer_params(params, schedule, 1)["attn"]) == {"q_proj", "o_proj"}


def test_packed_documents_do_not_attend_to_each_other():
  cfg = tiny_config("schedule.kind=cla")
  _, graphdef, params = randomized(cfg)
  model = nnx.merge(graphdef, params)
  a, b = tokens(1, 7, seed=1), tokens(1, 9, seed=2)
  packed = jnp.concatenate([a, b], axis=1)
  seg = jnp.array([[1] * 7 + [2] * 9], jnp.int32)
  pos = jnp.array([list(range(7)) + list(range(9))], jnp.int32)
  out = model(packed, pos, seg)
  np.testing.assert_allclose(np.asarray(out[:, 7:]), np.asarray(model(b)), atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out[:, :7]), np.asarray(model(a)), atol=1e-5, rtol=1e-5)


def test_remat_and_bf16():
  cfg = tiny_config("schedule.kind=cla")
  schedule, graphdef, params = randomized(cfg)
  _, graphdef_r, _ = randomized(tiny_config("schedule.kind=cla", "model.remat=full"))
  _, graphdef_bf, _ = randomized(tiny_config("schedule.kind=cla", "model.dtype=bfloat16"))
  x = tokens()
  (_, ga), (_, gr) = loss_and_grads(graphdef, params, x), loss_and_grads(graphdef_r, params, x)
  for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gr)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-6, rtol=1e-5)
  full = forward(graphdef, params, x)
  half = forward(graphdef_bf, params, x)
  assert half.dtype == jnp.float32  # logits are returned in float32
  np.testing.assert_allclose(np.asarray(half), np.asarray(full), atol=0.1, rtol=0.05)


# Presets whose knobs do not depend on depth; 12 and 48 layers give the same stacks and runs, only longer.
DEPTH_PRESETS = schedule_matrix("depth_presets")


def _program_size(jaxpr) -> int:
  """Equations of a jaxpr, each sub-jaxpr (scan body, checkpoint, ...) counted once."""
  n = 0
  for eqn in jaxpr.eqns:
    n += 1
    for value in eqn.params.values():
      for sub in value if isinstance(value, (list, tuple)) else [value]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          n += _program_size(sub.jaxpr)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          n += _program_size(sub)
  return n


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("name", sorted(DEPTH_PRESETS))
def test_traced_layer_bodies_do_not_grow_with_depth(name, remat, monkeypatch):
  """Compile time follows the traced program: at 12 and 48 layers the train step's gradient traces the same number
  of layer bodies and has the same size, because identical superblocks are scanned, and under a remat policy the
  identical layers inside them too (K/V consumers, probability reusers, LISA chains). Without remat superblocks of
  several layers unroll (scanned, their residuals cost more memory than dense's: jaxshare.model.block.unrolled), so
  only schedules of one-layer superblocks keep the program's size."""
  from jaxshare.model.block import DecoderLayer

  stacks = plan_of(tiny_config("model.num_layers=12", *DEPTH_PRESETS[name])).schedule.stacks
  sizes_of = {s.superblock_size for s in stacks}
  if remat == "none" and sizes_of != {1}:
    pytest.skip(f"{name}'s superblocks of {sorted(sizes_of)} layers unroll without remat")
  traced = []
  call = DecoderLayer.__call__
  monkeypatch.setattr(DecoderLayer, "__call__", lambda self, *a, **kw: (traced.append(1), call(self, *a, **kw))[1])
  sizes = {}
  for depth in (12, 48):
    cfg = tiny_config(f"model.num_layers={depth}", f"model.remat={remat}", *DEPTH_PRESETS[name])
    ties = compute_ties(plan_of(cfg), 0)
    graphdef, params = nnx.split(nnx.eval_shape(lambda: build_model(plan_of(cfg), 0, ties)), nnx.Param)
    x = jax.ShapeDtypeStruct((2, 16), jnp.int32)
    traced.clear()
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, t: jnp.mean(nnx.merge(graphdef, p)(t) ** 2)))(params, x)
    sizes[depth] = (len(traced), _program_size(jaxpr.jaxpr))
  assert sizes[12] == sizes[48], sizes
