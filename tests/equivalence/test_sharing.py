"""Score sharing (SA, UniAttn, LISA family): NumPy parity, recompute == materialised, degenerate equivalences."""

import contextlib
import io
import re

import jax
import jax.numpy as jnp
from jax import ad_checkpoint
import numpy as np
import pytest
from flax import nnx

from support import reference_numpy
from conftest import tiny_config
from jaxshare import accounting
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.init.shared import copy_shared_weights
from jaxshare.plan import plan_of
from jaxshare.model import build_model
from support.models import forward, loss_and_grads, randomized, tokens

SCORE_SCHEDULES = schedule_matrix("score_sharing")
RECOMPUTABLE = ["sa_reference_code", "sa_paper", "uniattn", "lisa_plus", "lisa_plus_rope", "ds", "gqa_lisa_plus",
                "cla_uniattn", "gqa_per_layer_lisa_plus", "gqa_per_layer_ds", "lisa_plus_keep_qk", "lisa_ffn",
                "lisa_linear", "lisa_groups"]


@pytest.mark.parametrize("name", sorted(SCORE_SCHEDULES))
def test_matches_numpy_reference(name):
  cfg = tiny_config(*SCORE_SCHEDULES[name])
  schedule, graphdef, params = randomized(cfg)
  assert any(p.score_reuse for p in schedule.layers)
  x = tokens()
  ours = np.asarray(forward(graphdef, params, x))
  ref = reference_numpy.forward(cfg.model, schedule, jax.device_get(params), x, lisa_rope=cfg.schedule.lisa.rope,
                                wc_normed=cfg.schedule.uniattn.wc_input == "normed")
  np.testing.assert_allclose(ours, ref, atol=3e-4, rtol=3e-4)


@pytest.mark.parametrize("name", sorted(SCORE_SCHEDULES))
def test_scanned_equals_unrolled_and_accounting_matches(name):
  cfg = tiny_config(*SCORE_SCHEDULES[name])
  schedule, graphdef, params = randomized(cfg)
  _, graphdef_u, _ = randomized(tiny_config(*SCORE_SCHEDULES[name], "model.scan_layers=false"))
  x = tokens()
  np.testing.assert_allclose(np.asarray(forward(graphdef, params, x)), np.asarray(forward(graphdef_u, params, x)),
                             atol=1e-5, rtol=1e-5)
  live = sum(leaf.size for leaf in jax.tree.leaves(params))
  assert live == accounting.param_count(cfg.model, schedule).total


@pytest.mark.parametrize("name", RECOMPUTABLE)
def test_recompute_equals_materialized_values_and_grads(name):
  cfg = tiny_config(*SCORE_SCHEDULES[name])
  _, graphdef, params = randomized(cfg)
  _, graphdef_m, _ = randomized(tiny_config(*SCORE_SCHEDULES[name], "attention.score_sharing=materialize"))
  x = tokens()
  la, ga = loss_and_grads(graphdef, params, x)
  lb, gb = loss_and_grads(graphdef_m, params, x)
  np.testing.assert_allclose(float(la), float(lb), rtol=1e-5)
  for u, v in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
    np.testing.assert_allclose(np.asarray(u), np.asarray(v), atol=1e-6, rtol=2e-4)


def _score_sized_residuals(cfg) -> int:
  _, graphdef, params = randomized(cfg)
  x = tokens(2, 64)
  buf = io.StringIO()
  with contextlib.redirect_stdout(buf):  # jax's public API prints the residuals
    ad_checkpoint.print_saved_residuals(lambda p: jnp.mean(nnx.merge(graphdef, p)(x)), params)
  return sum(1 for line in buf.getvalue().splitlines() if re.match(r"\S+\[2,4,64,64\]", line))


def test_recompute_keeps_no_score_tensor_per_consumer():
  """The recompute path saves no [B,H,T,T] residual for probability-reusing layers: with the reference attention
  only the producer's own; with the xla attention (O(T) residuals) none at all, in dense models too."""
  sa = ["schedule.kind=sa", "schedule.sa.start=1", "schedule.sa.end=3"]  # layers 1-3 reuse layer 0's probabilities
  counts = {}
  for impl in ("reference", "xla"):
    for mode, sched in (("recompute", sa), ("materialize", sa), ("dense", [])):
      counts[impl, mode] = _score_sized_residuals(tiny_config(
        "data.seq_len=64", *sched, "model.scan_layers=false", f"attention.impl={impl}",
        f"attention.score_sharing={'materialize' if mode == 'materialize' else 'recompute'}"))
  assert counts["reference", "dense"] > 0
  assert counts["reference", "recompute"] * 4 == counts["reference", "dense"]  # only the one producer's
  # materialised consumers apply the producer's own probabilities tensor: no copy per consumer either
  assert counts["reference", "materialize"] == counts["reference", "recompute"]
  assert counts["xla", "dense"] == counts["xla", "recompute"] == 0
  assert counts["xla", "materialize"] == counts["reference", "materialize"]  # materialising is what it says


@pytest.mark.parametrize("integrator", ["ffn", "linear"])
def test_full_lisa_recompute_never_holds_the_sequence_square(integrator):
  """Full LISA's aligners mix heads per score cell; with recompute the chain hands on features and each layer
  attends query chunk by query chunk: no array of the program (forward or backward) is [.., T, S] for the whole
  sequence (T = S = 160, chunks of 128 rows; the source layer attends in Pallas kernel tiles); the materialised path
  does hold them."""
  t = 160
  found = {}
  for mode in ("recompute", "materialize"):
    cfg = tiny_config(f"data.seq_len={t}", "schedule.kind=lisa", "schedule.lisa.layers=[1,2,3]",
                      f"schedule.lisa.integrator={integrator}", "schedule.lisa.hidden=12",
                      f"attention.score_sharing={mode}", "attention.impl=pallas_interpret")
    _, graphdef, params = randomized(cfg)
    x = tokens(2, t)
    jaxpr = str(jax.make_jaxpr(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x))))(params))
    found[mode] = re.search(rf"\[(\d+,)*{t},{t}\]", jaxpr) is not None
  assert found == {"recompute": False, "materialize": True}


def test_lisa_plus_with_zero_delta_equals_ds_equals_sa():
  x = tokens()
  sa_cfg = tiny_config("schedule.kind=sa", "schedule.sa.start=2", "schedule.sa.end=2")  # layer 2 reuses layer 1
  ds_cfg = tiny_config("schedule.kind=ds", "schedule.lisa.layers=[2]")
  lp_cfg = tiny_config("schedule.kind=lisa_plus", "schedule.lisa.layers=[2]")
  sa_s, sa_gd, sa_p = randomized(sa_cfg)
  ds_s, ds_gd, ds_p = randomized(ds_cfg, seed=3)
  lp_s, lp_gd, lp_p = randomized(lp_cfg, seed=4)
  ds_p, lp_p = copy_shared_weights(sa_p, sa_s, ds_p, ds_s), copy_shared_weights(sa_p, sa_s, lp_p, lp_s)
  lp_p = jax.tree_util.tree_map_with_path(
    lambda k, v: jnp.zeros_like(v) if "q_lr" in jax.tree_util.keystr(k) else v, lp_p)
  a = np.asarray(forward(sa_gd, sa_p, x))
  np.testing.assert_allclose(np.asarray(forward(ds_gd, ds_p, x)), a, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(forward(lp_gd, lp_p, x)), a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", [
  ["schedule.kind=sa", "schedule.sa.semantics=paper", "schedule.sa.start=2", "schedule.sa.end=2"],
  ["schedule.kind=uniattn", "schedule.uniattn.block_size=1", "schedule.uniattn.start=0"],
  ["schedule.kind=headwise", "schedule.headwise.ratio=0.0"],
])
def test_degenerate_score_and_head_sharing_equals_dense(variant):
  _, dense_gd, dense_p = randomized(tiny_config())
  cfg = tiny_config(*variant)
  schedule, graphdef, params = randomized(cfg, seed=9)
  assert not any(p.score_reuse for p in schedule.layers) and schedule.tied_heads == 0
  assert jax.tree.structure(params) == jax.tree.structure(dense_p)
  x = tokens()
  np.testing.assert_array_equal(np.asarray(nnx.merge(graphdef, dense_p)(x)),
                                np.asarray(nnx.merge(dense_gd, dense_p)(x)))


def test_capture_returns_each_layers_logits():
  cfg = tiny_config(*SCORE_SCHEDULES["sa_reference_code"])
  _, graphdef, params = randomized(cfg)
  x = tokens()
  model = nnx.merge(graphdef, params)
  out, attn = model.capture_logits(x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(model(x)))
  assert attn.shape == (4, 2, 4, 12, 12)
  np.testing.assert_array_equal(np.asarray(attn[2]), np.asarray(attn[1]))  # layers 2, 3 reuse layer 1's scores
  np.testing.assert_array_equal(np.asarray(attn[3]), np.asarray(attn[1]))
  assert not np.allclose(np.asarray(attn[0]), np.asarray(attn[1]))


@pytest.mark.parametrize("name", ["lisa_ffn", "lisa_linear", "lisa_plus", "lisa_groups"])
def test_captured_chain_logits_are_each_layers_own(name):
  """Distillation reads each LISA layer's logits: recomputed from a chain's features they equal the materialised
  chain's, layer by layer (a layer's slot, not the chain's last)."""
  x = tokens()
  captured = {}
  for mode in ("recompute", "materialize"):
    _, graphdef, params = randomized(tiny_config(*SCORE_SCHEDULES[name], f"attention.score_sharing={mode}"))
    captured[mode] = np.asarray(nnx.merge(graphdef, params).capture_logits(x)[1])
  np.testing.assert_allclose(captured["recompute"], captured["materialize"], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("integrator", ["ffn", "linear"])
def test_lisa_aligners_start_as_lisa_plus(integrator):
  """LISA's aligners are initialised to A_{n-1} + A_delta: with every other weight random, the fresh aligner gives
  LISA_plus's output (the ffn through relu(s) - relu(-s) pairs, the extra units' output weights zero)."""
  layers = ["schedule.lisa.layers=[1,2]", "schedule.lisa.hidden=12"]
  cfg = tiny_config("schedule.kind=lisa", f"schedule.lisa.integrator={integrator}", *layers)
  schedule, graphdef, params = randomized(cfg)
  fresh = nnx.to_pure_dict(nnx.state(build_model(plan_of(cfg), 5), nnx.Param))
  params = jax.tree_util.tree_map_with_path(  # the aligner as initialised, everything else randomised
    lambda k, v, f: f if "align" in jax.tree_util.keystr(k) else v, params, fresh)
  plus_cfg = tiny_config("schedule.kind=lisa_plus", *layers)
  plus_schedule, plus_graphdef, plus_params = randomized(plus_cfg, seed=7)
  plus_params = copy_shared_weights(params, schedule, plus_params, plus_schedule)
  x = tokens()
  out = np.asarray(forward(graphdef, params, x))
  np.testing.assert_allclose(out, np.asarray(forward(plus_graphdef, plus_params, x)), atol=1e-5, rtol=1e-5)
  _, _, other = randomized(cfg, seed=11)  # with another (here: random) aligner the outputs differ
  params = jax.tree_util.tree_map_with_path(lambda k, v, o: o if "align" in jax.tree_util.keystr(k) else v,
                                            params, other)
  assert not np.allclose(out, np.asarray(forward(graphdef, params, x)), atol=1e-3)
