"""Similarity analysis: metric properties on hand-made attention/weights, schedule suggestion, the CLI on a run."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from conftest import tiny_config
from jaxshare.analysis import similarity as sim
from jaxshare.analysis.__main__ import main
from jaxshare.config import load_config
from jaxshare.schedule import compile_schedule
from jaxshare.train.loop import train

LN2 = math.log(2)


def random_probs(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  """Causal attention probabilities ``[..., T, T]`` from random logits."""
  return sim.causal_softmax(rng.normal(scale=2.0, size=shape))


def test_causal_softmax_rows_are_causal_distributions():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 5, 5)).astype(np.float32)
  p = sim.causal_softmax(logits)
  assert p.dtype == np.float32
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-6)
  assert np.all(p[..., np.triu_indices(5, 1)[0], np.triu_indices(5, 1)[1]] == 0)
  row = logits[1, 2, 3, :4]
  np.testing.assert_allclose(p[1, 2, 3, :4], np.exp(row) / np.exp(row).sum(), rtol=1e-5)
  with pytest.raises(ValueError, match=r"logits has shape \(3, 4\)"):
    sim.causal_softmax(np.zeros((3, 4)))


def test_causal_softmax_respects_a_sliding_window():
  logits = np.random.default_rng(1).normal(size=(2, 7, 7))
  p = sim.causal_softmax(logits, window=3)
  t, s = np.arange(7)[:, None], np.arange(7)[None, :]
  inside = (s <= t) & (t - s < 3)
  assert np.all(p[:, ~inside] == 0)
  np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-12)
  e = np.where(inside, np.exp(logits), 0.0)
  np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), rtol=1e-12)


def test_js_divergence_is_zero_symmetric_and_bounded_by_ln2():
  rng = np.random.default_rng(1)
  p, q = rng.dirichlet(np.ones(6), size=50), rng.dirichlet(np.ones(6), size=50)
  np.testing.assert_allclose(sim.js_divergence(p, p), 0.0, atol=1e-15)
  np.testing.assert_allclose(sim.js_divergence(p, q), sim.js_divergence(q, p), rtol=1e-12)
  assert np.all(sim.js_divergence(p, q) > 0) and np.all(sim.js_divergence(p, q) <= LN2)
  # Disjoint supports reach the bound; zeros (masked keys) are handled as 0 log 0 = 0.
  assert sim.js_divergence([0.5, 0.5, 0, 0], [0, 0, 0.3, 0.7]) == pytest.approx(LN2, rel=1e-12)


def test_layer_copy_gives_zero_divergence_and_unit_cosine():
  rng = np.random.default_rng(2)
  probs = random_probs(rng, (4, 3, 2, 6, 6))  # [L, B, H, T, T]
  probs[2] = probs[1]
  js = sim.js_divergence_matrix(probs)
  cos = sim.cosine_matrix(probs)
  adjacent = sim.adjacent_cosine(probs)
  assert js.shape == cos.shape == (4, 4) and adjacent.shape == (3,)
  np.testing.assert_allclose(js, js.T)
  np.testing.assert_allclose(np.diag(js), 0.0)
  np.testing.assert_allclose(np.diag(cos), 1.0)
  assert js[1, 2] == pytest.approx(0.0, abs=1e-12) and cos[1, 2] == pytest.approx(1.0)
  assert adjacent[1] == pytest.approx(1.0)  # Sim(2) = cos(s_2, s_1)
  off = ~np.eye(4, dtype=bool)
  off[1, 2] = off[2, 1] = False
  assert np.all(js[off] > 1e-3) and np.all(js <= LN2) and np.all(cos[off] < 1 - 1e-3)
  assert np.all(adjacent[[0, 2]] < 1 - 1e-3) and np.all(adjacent > 0)


def test_head_matching_best_finds_a_permuted_head_copy():
  rng = np.random.default_rng(3)
  probs = random_probs(rng, (3, 2, 4, 6, 6))
  perm = np.array([2, 0, 3, 1])
  probs[1] = probs[0][:, perm]  # layer 1's head h is layer 0's head perm[h]
  out = sim.head_matching(probs, seed=0)
  assert set(out) == {"direct", "random", "best"} and all(v.shape == (2,) for v in out.values())
  assert out["best"][0] == pytest.approx(0.0, abs=1e-12)
  assert out["direct"][0] > 0.05
  assert np.all(out["best"] <= out["direct"]) and np.all(out["best"] <= out["random"])
  m = sim.head_js_matrix(probs[1], probs[0])
  np.testing.assert_array_equal(m.argmin(axis=1), perm)
  np.testing.assert_array_equal(sim.head_matching(probs, seed=0)["random"], out["random"])  # seeded
  with pytest.raises(ValueError, match="at least 2"):
    sim.head_matching(probs[:1])


def test_weight_similarity_matches_a_copied_head():
  rng = np.random.default_rng(4)
  num_layers, dim, heads, head_dim = 3, 8, 4, 2
  wq, wk = rng.normal(size=(2, num_layers, dim, heads, head_dim))
  # Layer 2 head 1 copies layer 0 head 3, scaled: cosine ignores the scale.
  wq[2, :, 1], wk[2, :, 1] = 3 * wq[0, :, 3], 3 * wk[0, :, 3]
  s = sim.weight_head_similarity(wq, wk)
  assert s.shape == (12, 12)
  np.testing.assert_allclose(np.diag(s), 1.0)
  np.testing.assert_allclose(s, s.T, atol=1e-12)
  assert s[2 * heads + 1, 3] == pytest.approx(1.0)
  match, score = sim.best_earlier_match(s, num_layers, heads)
  assert match.shape == score.shape == (2, heads)
  assert match[1, 1] == 3 and score[1, 1] == pytest.approx(1.0)
  assert np.all(match[0] < heads) and np.all(match[1] < 2 * heads)  # strictly earlier layers only
  others = np.ones_like(score, bool)
  others[1, 1] = False
  assert np.all(score[others] < 0.9)  # independent random heads are far from parallel
  with pytest.raises(ValueError, match="wq has shape"):
    sim.weight_head_similarity(wq, wk[:, :, :2])
  wq[1, :, 0], wk[1, :, 0] = 0, 0
  with pytest.raises(ValueError, match="layer 1 head 0 are all zero"):
    sim.weight_head_similarity(wq, wk)


def compiled_sources(num_layers: int, overrides: list[str]) -> dict[int, int]:
  """``{reusing layer: score source}`` of the schedule the overrides build."""
  cfg = load_config(None, [f"model.num_layers={num_layers}"] + overrides)
  return {p.index: p.score_source for p in compile_schedule(cfg.model, cfg.schedule).layers if p.score_reuse}


def test_suggest_schedule_groups_and_equivalent_overrides():
  # Sim(j) for j = 1..7: layer 1 is unlike 0, layers 1-3 and 4-6 are similar; blocks of at most 3.
  adjacent = [0.5, 0.95, 0.95, 0.3, 0.92, 0.97, 0.99]
  s = sim.suggest_schedule(np.array(adjacent), threshold=0.9, max_block=3)
  assert s.groups == [(1, [2, 3]), (4, [5, 6])]
  assert s.uniattn == ["schedule.kind=uniattn", "schedule.uniattn.block_size=3", "schedule.uniattn.start=1",
                       "schedule.uniattn.end=7"]
  assert compiled_sources(8, s.uniattn) == {2: 1, 3: 1, 5: 4, 6: 4}
  # Equally long groups: the SA span is the deepest, reusing the layer before it.
  assert s.sa == ["schedule.kind=sa", "schedule.sa.start=5", "schedule.sa.end=6", "schedule.sa.semantics=reference_code"]
  assert compiled_sources(8, s.sa) == {5: 4, 6: 4}


def test_suggest_schedule_irregular_groups_and_no_groups():
  s = sim.suggest_schedule([0.95, 0.1, 0.2, 0.95, 0.95], threshold=0.9, max_block=4)
  assert s.groups == [(0, [1]), (3, [4, 5])]
  assert s.uniattn is None  # sizes 2 and 3: not UniAttn's equal superblocks
  assert compiled_sources(6, s.sa) == {4: 3, 5: 3}  # the longest group
  # A shorter last block is expressible: uniattn.end cuts it.
  s = sim.suggest_schedule([0.95] * 5, threshold=0.9, max_block=4)
  assert s.groups == [(0, [1, 2, 3]), (4, [5])]
  assert compiled_sources(6, s.uniattn) == {1: 0, 2: 0, 3: 0, 5: 4}
  assert sim.suggest_schedule([0.5, 0.6], threshold=0.9, max_block=4) == sim.ScheduleSuggestion([], None, None)
  with pytest.raises(ValueError, match="max_block=1 is invalid"):
    sim.suggest_schedule([0.95], threshold=0.9, max_block=1)
  with pytest.raises(ValueError, match="threshold=nan is invalid"):
    sim.suggest_schedule([0.95], threshold=float("nan"), max_block=2)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
  run_dir = tmp_path_factory.mktemp("analysis_run")
  train(tiny_config("train.steps=4", "train.log_every=4", f"train.run_dir={run_dir}"))
  return run_dir


def read_csv(path) -> list[list[str]]:
  with open(path, newline="") as f:
    return list(csv.reader(f))


def test_cli_writes_every_table_and_figure(tiny_run, corpus, tmp_path, capsys):
  out = tmp_path / "out"
  rc = main([str(tiny_run), "--text", str(corpus), "--out", str(out), "--samples", "4", "--seq-len", "16",
             "--suggest", "--threshold", "0.5", "--max-block", "2"])
  stdout = capsys.readouterr().out
  assert rc == 0
  names = ["js_divergence", "cosine", "head_matching", "weight_similarity"]
  for name in names:
    assert (out / f"{name}.csv").stat().st_size > 0
    assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert (out / "adjacent_cosine.csv").is_file()
  js = np.array([row[1:] for row in read_csv(out / "js_divergence.csv")[1:]], float)
  assert js.shape == (4, 4) and np.allclose(js, js.T) and np.all((js >= 0) & (js <= LN2))
  assert read_csv(out / "head_matching.csv")[0] == ["layer", "direct", "random", "best"]
  assert len(read_csv(out / "adjacent_cosine.csv")) == 1 + 3
  assert len(read_csv(out / "weight_similarity.csv")) == 1 + 4 * 4
  assert "4 windows of 16 tokens" in stdout and "suggested schedule" in stdout and "schedule.kind=sa" in stdout


def test_cli_rejects_missing_or_short_text(tiny_run, tmp_path, capsys):
  missing = tmp_path / "nope.txt"
  assert main([str(tiny_run), "--text", str(missing), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "--text" in err and str(missing) in err and "does not exist" in err
  short = tmp_path / "short.txt"
  short.write_text("too short")
  assert main([str(tiny_run), "--text", str(short), "--out", str(tmp_path / "o")]) == 2
  err = capsys.readouterr().err
  assert "9 tokens, shorter than one window of --seq-len 32" in err
  assert not (tmp_path / "o").exists()


def test_out_pointing_at_a_file_is_refused(tmp_path, capsys):
  from jaxshare.analysis.__main__ import parse_args

  (tmp_path / "file").write_text("x")
  with pytest.raises(SystemExit) as e:
    parse_args(["run", "--text", "t.txt", "--out", str(tmp_path / "file")])
  assert e.value.code == 2 and "is a file: it must be a directory" in capsys.readouterr().err
