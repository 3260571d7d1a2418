"""Uptraining conversions: K/V heads and layers pooled exactly as GQA / MLKV / pythia-mlkv / CLA do it (checked
against direct NumPy arithmetic), a trivial conversion keeps the logits, and the report names every tensor's rule."""

import jax
import numpy as np
import pytest
from flax import nnx

from jaxshare.init.kv import combine_layers, pool_heads

from jaxshare.init.report import init_report
from jaxshare.model import params as P
from jaxshare.init.rules import InitRules
from jaxshare.train.state import init_state, setup_training

from conftest import tiny_config
from support.runs import as_run


def test_pool_heads_is_the_mean_of_consecutive_groups():
  x = np.random.default_rng(0).normal(size=(5, 8, 3)).astype(np.float32)
  got = np.asarray(pool_heads(x, 2))
  np.testing.assert_allclose(got[:, 0], x[:, 0:4].mean(1), rtol=1e-6)
  np.testing.assert_allclose(got[:, 1], x[:, 4:8].mean(1), rtol=1e-6)
  with pytest.raises(ValueError, match="cannot mean-pool 8 K/V heads into 3 groups"):
    pool_heads(x, 3)


def test_running_pairwise_mean_weights_the_last_layer_half():
  a, b, c = (np.full(2, v, np.float32) for v in (1.0, 2.0, 4.0))
  np.testing.assert_allclose(np.asarray(combine_layers([a, b, c], "running")), a / 4 + b / 4 + c / 2)
  np.testing.assert_allclose(np.asarray(combine_layers([a, b, c], "mean")), (a + b + c) / 3)
  np.testing.assert_array_equal(np.asarray(combine_layers([a, b, c], "producer")), a)


def _dense_source():
  cfg = tiny_config()
  setup = setup_training(cfg)
  return setup, init_state(setup, seed=3).params


@pytest.mark.parametrize("overrides,groups", [
  (("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2"), {0: [0, 1], 2: [2, 3]}),
  (("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2", "train.init_kv_pool=running"),
   {0: [0, 1], 2: [2, 3]}),
  (("schedule.kind=mlkv", "schedule.kv_layers=1", "schedule.kv_heads=1"), {0: [0, 1, 2, 3]}),
  (("schedule.kind=cla", "schedule.factor=2"), {0: [0, 1], 2: [2, 3]}),
  (("schedule.kind=gqa", "schedule.kv_heads=2"), {0: [0], 1: [1], 2: [2], 3: [3]}),
])
def test_producers_kv_are_pooled_from_their_readers(overrides, groups):
  src_setup, src = _dense_source()
  cfg = tiny_config(*overrides)
  setup = setup_training(cfg)
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  pool = InitRules.of(cfg.train, cfg.schedule.kind).kv_pool
  for producer, readers in groups.items():
    for m in ("k_proj", "v_proj"):
      got = np.asarray(P.layer_params(dst, setup.schedule, producer)["attn"][m]["kernel"])
      g = got.shape[1]
      per_layer = []
      for r in readers:  # [D, H, d] -> [D, G, H/G, d] mean: NumPy, independently of pool_heads
        w = np.asarray(P.layer_params(src, src_setup.schedule, r)["attn"][m]["kernel"])
        per_layer.append(w.reshape(w.shape[0], g, -1, w.shape[-1]).mean(2))
      if pool == "producer":
        want = per_layer[0]
      elif pool == "running":
        want = per_layer[0]
        for w in per_layer[1:]:
          want = (want + w) / 2
      else:
        want = np.mean(per_layer, axis=0)
      np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7, err_msg=f"layer {producer} {m}")


def test_trivial_conversion_keeps_the_logits(corpus):
  src_setup, src = _dense_source()
  dst = init_state(src_setup, from_params=(src, src_setup.schedule)).params
  tokens = np.frombuffer(corpus.read_bytes()[:32], np.uint8).astype(np.int32)[None]
  np.testing.assert_array_equal(np.asarray(nnx.merge(src_setup.graphdef, dst)(tokens)),
                                np.asarray(nnx.merge(src_setup.graphdef, src)(tokens)))


def test_report_names_every_rule_and_the_new_tensors():
  src_setup, src = _dense_source()
  cfg = tiny_config("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2")
  setup = setup_training(cfg)
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  lines = init_report(src, src_setup.schedule, dst, setup.schedule, "running")
  assert lines[1:] == ["layer 0 k_proj/v_proj: running pairwise mean over layers [0, 1], 4 -> 2 heads (mean of groups)",
                       "layer 2 k_proj/v_proj: running pairwise mean over layers [2, 3], 4 -> 2 heads (mean of groups)"]
  assert lines[0] == f"{_per_layer_leaves(dst, setup.schedule) - 4} tensors copied (same layer, name and shape)"

  cfg = tiny_config("schedule.kind=gqa+uniattn", "schedule.kv_heads=2", "schedule.uniattn.block_size=2")
  setup = setup_training(cfg)
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  lines = init_report(src, src_setup.schedule, dst, setup.schedule, "mean")
  assert "layer 3 k_proj/v_proj: from layer 3, 4 -> 2 heads (mean of groups)" in lines
  assert lines[-1] == "NEW (fresh initialisation): layer 3 compensation/kernel"
  kv_leaves = sum(len(jax.tree.leaves({m: v for m, v in P.layer_params(dst, setup.schedule, i)["attn"].items()
                                       if m in ("k_proj", "v_proj")})) for i in range(4))
  assert lines[0] == (f"{_per_layer_leaves(dst, setup.schedule) - kv_leaves - 1} tensors copied "
                      "(same layer, name and shape)")


def _per_layer_leaves(params, schedule):
  """Leaves counted per layer (a stacked run's leaf is one tensor per layer), plus the global ones."""
  per_layer = sum(len(jax.tree.leaves(P.layer_params(params, schedule, i))) for i in range(len(schedule.layers)))
  return per_layer + len(jax.tree.leaves({k: v for k, v in params.items() if k != "stacks"}))


def test_cli_uptrain_writes_the_converted_run_and_reports_it(tmp_path, capsys):
  from jaxshare.convert.__main__ import main
  from jaxshare.store.runs import load_run, write_run

  src_setup, src = _dense_source()
  write_run(tmp_path / "dense", as_run(src_setup.cfg, src))
  overrides = ["schedule.kind=mlkv", "schedule.kv_layers=1", "schedule.kv_heads=1", "train.init_kv_pool=running"]
  assert main(["uptrain", str(tmp_path / "dense"), str(tmp_path / "mlkv"), *overrides]) == 0
  out = capsys.readouterr().out
  assert "layer 0 k_proj/v_proj: running pairwise mean over layers [0, 1, 2, 3], 4 -> 1 heads" in out
  run = load_run(tmp_path / "mlkv")
  cfg, params, step = run.cfg, run.params, run.step
  assert step == 0 and cfg.schedule.kind == "mlkv" and cfg.train.init_from == str(tmp_path / "dense")
  # what train.py would start from with train.init_from=dense
  want = init_state(setup_training(cfg), from_params=(src, src_setup.schedule)).params
  jax.tree.map(np.testing.assert_array_equal, params, want)
  assert main(["uptrain", str(tmp_path / "dense"), str(tmp_path / "bad"), "schedule.kind=nope"]) == 2
  assert "schedule.kind='nope' is invalid" in capsys.readouterr().err


@pytest.mark.parametrize("rule", ["zero", "duplicate"])
def test_mlkv_parameter_matching_widens_every_mlp_from_the_source(rule):
  src_setup, src = _dense_source()
  cfg = tiny_config("schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=2",
                    "schedule.match_params=true", f"train.init_mlp_widen={rule}")
  setup = setup_training(cfg)
  fresh = init_state(setup, seed=11).params
  dst = init_state(setup, seed=11, from_params=(src, src_setup.schedule)).params
  for layer in range(4):
    s, d, f0 = (P.layer_params(t, sch, layer)["mlp"] for t, sch in
                ((src, src_setup.schedule), (dst, setup.schedule), (fresh, setup.schedule)))
    f, f_new = s["up"]["kernel"].shape[1], d["up"]["kernel"].shape[1]
    assert f_new > f
    extra = np.arange(f_new - f) % f
    for name in ("gate", "up"):
      np.testing.assert_array_equal(np.asarray(d[name]["kernel"][:, :f]), np.asarray(s[name]["kernel"]))
      want = np.asarray(s[name]["kernel"])[:, extra] if rule == "duplicate" else np.asarray(f0[name]["kernel"])[:, f:]
      np.testing.assert_array_equal(np.asarray(d[name]["kernel"][:, f:]), want)
    np.testing.assert_array_equal(np.asarray(d["down"]["kernel"][:f]), np.asarray(s["down"]["kernel"]))
    want = np.asarray(s["down"]["kernel"])[extra] if rule == "duplicate" else np.zeros((f_new - f, 32), np.float32)
    np.testing.assert_array_equal(np.asarray(d["down"]["kernel"][f:]), want)
  lines = init_report(src, src_setup.schedule, dst, setup.schedule, "mean", rule)
  assert any(line.startswith("layer 3 mlp: widened 64 -> ") for line in lines)
  assert not any(line.startswith("NEW") for line in lines)


@pytest.mark.parametrize("flavor", ["llama", "neox"])
def test_zero_widening_keeps_the_function(corpus, flavor):
  """A dense model into the same model with wider MLPs: the zero rule leaves the logits unchanged."""
  cfg = tiny_config(f"model.flavor={flavor}")
  src_setup = setup_training(cfg)
  src = init_state(src_setup, seed=3).params
  setup = setup_training(tiny_config(f"model.flavor={flavor}", "model.mlp_dim=96"))
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  tokens = np.frombuffer(corpus.read_bytes()[:32], np.uint8).astype(np.int32)[None]
  np.testing.assert_allclose(np.asarray(nnx.merge(setup.graphdef, dst)(tokens)),
                             np.asarray(nnx.merge(src_setup.graphdef, src)(tokens)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["lisa_plus", "lisa"])
def test_converted_lisa_starts_as_ds(corpus, kind):
  """k_lr = 0 makes A_delta vanish: the converted LISA model computes what DS (pure logits reuse) computes."""
  src_setup, src = _dense_source()
  layers = "schedule.lisa.layers=[1,2,3]"
  ds_setup = setup_training(tiny_config("schedule.kind=ds", layers))
  ds = init_state(ds_setup, from_params=(src, src_setup.schedule)).params
  setup = setup_training(tiny_config(f"schedule.kind={kind}", layers))
  dst = init_state(setup, from_params=(src, src_setup.schedule)).params
  tokens = np.frombuffer(corpus.read_bytes()[:32], np.uint8).astype(np.int32)[None]
  np.testing.assert_allclose(np.asarray(nnx.merge(setup.graphdef, dst)(tokens)),
                             np.asarray(nnx.merge(ds_setup.graphdef, ds)(tokens)), rtol=1e-5, atol=1e-5)
  lines = init_report(src, src_setup.schedule, dst, setup.schedule, "mean")
  assert any(line.startswith("layers [1, 2, 3] attn/k_lr: zero") for line in lines)
  fresh = init_state(setup).params  # from scratch nothing is zeroed
  k_lr = np.asarray(P.layer_params(fresh, setup.schedule, 1)["attn"]["k_lr"]["kernel"])
  assert np.abs(k_lr).max() > 0
  again = init_state(setup, from_params=(fresh, setup.schedule)).params  # a LISA source's k_lr is kept
  np.testing.assert_array_equal(np.asarray(P.layer_params(again, setup.schedule, 1)["attn"]["k_lr"]["kernel"]), k_lr)


def test_cli_uptrain_into_uniattn_fits_wc_on_calibration_batches(tmp_path, capsys):
  from jaxshare.convert.__main__ import main
  from jaxshare.store.runs import load_run, write_run

  src_setup, src = _dense_source()
  write_run(tmp_path / "dense", as_run(src_setup.cfg, src))
  overrides = ["schedule.kind=uniattn", "schedule.uniattn.start=2", "schedule.uniattn.block_size=2"]
  assert main(["uptrain", str(tmp_path / "dense"), str(tmp_path / "uni"), *overrides,
               "--calibration-batches", "2"]) == 0
  out = capsys.readouterr().out
  assert "W_c by least squares on calibration batches (UniAttn Thm 3.1 / Alg. 1, bottom-up, fit=tokens)" in out
  assert "layer 3 compensation: error" in out and "NEW" not in out
  setup = load_run(tmp_path / "uni")
  params = setup.params
  w = np.asarray(P.layer_params(params, setup.schedule, 3)["compensation"]["kernel"])
  assert np.abs(w).max() > 0
  with pytest.raises(SystemExit):
    main(["uptrain", str(tmp_path / "dense"), str(tmp_path / "bad"), *overrides, "--calibration-batches", "-1"])
  assert "--calibration-batches=-1 is invalid: must be >= 0" in capsys.readouterr().err
  assert main(["uptrain", str(tmp_path / "dense"), str(tmp_path / "uni0"), *overrides,
               "--calibration-batches", "0"]) == 0
  setup = load_run(tmp_path / "uni0")
  params = setup.params
  assert not np.asarray(P.layer_params(params, setup.schedule, 3)["compensation"]["kernel"]).any()
