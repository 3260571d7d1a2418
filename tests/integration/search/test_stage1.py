"""Stage 1 of the search: scores equal an independent recomputation; KVSharer's caches are the decode cache's, and
its acceptance test keeps a replacement only above its threshold."""

import jax
from flax import nnx
import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.convert.uptrain import convert
from jaxshare.evaluation.val_loss import make_eval_step
from jaxshare.store.runs import load_run
from jaxshare.search.budget import SearchError
from jaxshare.search.calibration import Calibration, calibration_batches
from jaxshare.model.cache import init_cache
from jaxshare.search.kvsharer import cache_distances, kvsharer_options, kvsharer_sources, layer_kv_caches


@pytest.fixture(scope="module")
def source(tmp_path_factory):
  from jaxshare.train.loop import train

  run_dir = tmp_path_factory.mktemp("dense")
  train(tiny_config(f"train.run_dir={run_dir}"))
  return run_dir, load_run(run_dir)


def _log_softmax(x: np.ndarray) -> np.ndarray:
  x = x.astype(np.float64)
  z = x - x.max(-1, keepdims=True)
  return z - np.log(np.exp(z).sum(-1, keepdims=True))


def test_the_selection_split_leaves_validation_batches_to_report_on(source):
  _, src = source
  total = len(calibration_batches(src, 10**6))  # stage 1 only: the whole split may select
  assert len(calibration_batches(src, total - 1, reported=True)) == total - 1
  with pytest.raises(SearchError, match=f"--calibration-batches {total} is invalid: .* has {total} batches of "
                                        f".* N must be 1 to {total - 1}"):
    calibration_batches(src, total, reported=True)


def test_stage1_scores_equal_an_independent_recomputation(source):
  run_dir, src = source
  batches = calibration_batches(src, 2)
  conv = convert(src, run_dir, ["schedule.kind=cla", "schedule.factor=2"], calibration_batches=0)
  score = Calibration(src, batches).score(conv.graphdef, conv.params)
  # the loss as validation computes it (evaluation's eval step), the KL in float64 NumPy from both models' logits
  eval_step = make_eval_step(conv.graphdef)
  sums = [tuple(map(float, eval_step(conv.params, b))) for b in batches]
  assert score.loss == pytest.approx(sum(s for s, _ in sums) / sum(c for _, c in sums), rel=1e-5)
  kl, count = 0.0, 0.0
  for b in batches:
    p = _log_softmax(np.asarray(src.model()(b.inputs, b.positions, b.segment_ids)))
    q = _log_softmax(np.asarray(jax.device_get(conv.graphdef.apply(conv.params)(b.inputs, b.positions,
                                                                                b.segment_ids)[0])))
    mask = np.asarray(b.loss_mask, np.float64)
    kl += float(((np.exp(p) * (p - q)).sum(-1) * mask).sum())
    count += float(mask.sum())
  assert score.kl == pytest.approx(kl / count, rel=1e-4, abs=1e-7)
  assert score.kl > 0  # CLA's consumers read another layer's K/V: the model changed
  same = convert(src, run_dir, ["schedule.kind=dense"], calibration_batches=0)
  assert Calibration(src, batches).score(same.graphdef, same.params).kl == pytest.approx(0.0, abs=1e-6)


def test_layer_kv_caches_are_the_decode_cache_averaged_over_sequences(source):
  """KVSharer averages the KV cache: K after RoPE, as a prefill writes it (an independent path: the decode step)."""
  _, src = source
  T = calibration_batches(src, 1)[0].inputs.shape[1]
  # positions from 0 in every row, as a prefill of an empty cache counts them (the corpus is one document)
  batches = [b.replace(positions=np.broadcast_to(np.arange(T, dtype=np.int32), b.positions.shape))
             for b in calibration_batches(src, 2)]
  k, v = layer_kv_caches(src, batches)
  L, H, d = 4, 4, 8
  assert k.shape == v.shape == (L, T, H, d)
  want = {"k": np.zeros((L, T, H, d)), "v": np.zeros((L, T, H, d))}
  rows = 0
  for b in batches:
    _, cache = src.model().decode(b.inputs, init_cache(src.plan, b.inputs.shape[0], T))
    for stack, runs in zip(src.schedule.stacks, cache.buffers):
      for run_plan, buffers in zip(stack.runs, runs):
        for name, buf in buffers.items():  # [count, length, B, G, S, d]
          for c in range(stack.count):
            for j in range(run_plan.length):
              layer = stack.start + c * stack.superblock_size + run_plan.start + j
              want[name][layer] += np.asarray(buf[c, j], np.float64).sum(0).transpose(1, 0, 2)
    rows += b.inputs.shape[0]
  np.testing.assert_allclose(k, want["k"] / rows, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(v, want["v"] / rows, rtol=1e-4, atol=1e-5)


def test_kvsharer_keeps_a_replacement_only_above_the_threshold(source):
  """The acceptance test on the real model: each trial's similarity is the mean per-sequence cosine of the final
  hidden states of the source and of the trial converted by KVSharer's rule (the consumer reads the earlier layer's
  K/V unchanged); nothing passes a threshold of 1, everything one of -1."""
  run_dir, src = source
  batches = calibration_batches(src, 1)
  heard = []
  assert kvsharer_options(src, batches, threshold=1.0, say=heard.append) == []
  assert heard and all("not kept" in line for line in heard)
  heard.clear()
  options = kvsharer_options(src, batches, threshold=-1.0, say=heard.append)
  steps = kvsharer_sources(cache_distances(*layer_kv_caches(src, batches)), lambda s: True, 3)
  assert [o.name for o in options] == ["kvsharer1", "kvsharer2", "kvsharer3"]  # a quarter, half, three quarters
  assert [o.knobs for o in options] == [("schedule.sources=" + "_".join(map(str, s)),) for s in steps]
  # the first trial's similarity, recomputed: the own-K/V conversion's final hidden states against the source's
  first = steps[0]
  conv = convert(src, run_dir, ["schedule.kind=explicit", f"schedule.sources={'_'.join(map(str, first))}",
                                "train.init_kv_pool=producer"], calibration_batches=0)
  b = batches[0]
  a = np.asarray(src.model().final_hidden(b.inputs, b.positions, b.segment_ids), np.float64).reshape(len(b.inputs), -1)
  c = np.asarray(nnx.merge(conv.graphdef, conv.params).final_hidden(b.inputs, b.positions, b.segment_ids),
                 np.float64).reshape(len(b.inputs), -1)
  cosine = np.mean((a * c).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(c, axis=1))
  assert f"sources {'_'.join(map(str, first))}: final hidden cosine similarity {cosine:.4f} (kept" in heard[0]
  layers = [layer for layer in range(4) if first[layer] != layer]
  attn = jax.device_get(conv.params)
  from jaxshare.model.params import layer_params
  # KVSharer's conversion: the producer's K/V projections are its own (nothing pooled)
  np.testing.assert_array_equal(
    layer_params(attn, conv.plan.schedule, first[layers[0]])["attn"]["k_proj"]["kernel"],
    layer_params(jax.device_get(src.params), src.schedule, first[layers[0]])["attn"]["k_proj"]["kernel"])
