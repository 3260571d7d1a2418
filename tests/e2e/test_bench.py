"""The throughput benchmark races the same architecture in every framework: parameter counts agree per shape."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_train  # noqa: E402

torch_peers = pytest.importorskip("torch_peers")


@pytest.mark.parametrize("name", sorted(bench_train.SHAPES))
def test_contestants_have_equal_parameter_counts(name):
  from jaxshare.config import load_config
  from jaxshare.train.state import setup_training

  shape = bench_train.SHAPES[name]
  cfg = load_config(bench_train.ROOT / "configs" / "base.yaml", bench_train.jax_overrides(shape, "dense"))
  ours = setup_training(cfg).num_params
  for peer in shape["peers"]:
    assert torch_peers.num_params(torch_peers.build(peer, shape)) == ours, peer
  if shape["flavor"] == "llama":
    import jax_minimal
    assert jax_minimal.MinimalTrainer(shape, bench_train.synthetic_batches(shape, 1)).num_params == ours


def test_peer_trains():
  shape = dict(bench_train.SHAPES["default"], layers=1, batch=2, seq_len=16)
  trainer = torch_peers.PeerTrainer("nanogpt", shape, bench_train.synthetic_batches(shape, 1))
  first = trainer.step()
  assert abs(first - 5.545) < 0.1  # ln(256): a fresh model predicts uniformly
  assert min(trainer.step() for _ in range(20)) < first - 0.5  # it learns the repeated batch


def test_race_rotates_the_order_every_round():
  """Each contestant takes every slot of the round equally often, so slot effects (a peer whose threads are still
  spinning, a warm cache) are not read as differences between contestants."""
  order = []

  class Fake:
    def __init__(self, label):
      self.label = label

    def run(self, steps):
      order.append(self.label)
      return float(steps)

  times = bench_train.race([Fake(c) for c in "abc"], rounds=6, steps=2)
  assert times == {c: [2.0] * 6 for c in "abc"}
  slots = [order[i:i + 3] for i in range(0, 18, 3)]
  for c in "abc":
    assert sorted(s.index(c) for s in slots) == [0, 0, 1, 1, 2, 2]


def test_nanogpt_itself_is_raced_only_from_a_checkout(monkeypatch, tmp_path):
  """``--nanogpt`` imports nanoGPT's model.py from a checkout; a directory without one is refused by name."""
  monkeypatch.setenv("NANOGPT_DIR", str(tmp_path))
  with pytest.raises(ValueError, match=r"NANOGPT_DIR='.*' is invalid: must be a nanoGPT checkout \(holding model.py\)"):
    torch_peers.build("nanogpt_upstream", bench_train.SHAPES["default"])


def test_gpt2_layer_contestant_is_nanogpts_model_in_size_and_learns():
  """The calibration contestant has nanoGPT's parameter count at the default shape (GPTConfig(block_size=128,
  vocab_size=256, n_layer=4, n_head=4, n_embd=128, bias=False): 836,736 with the tied head counted once, as nanoGPT's
  model.py builds it) and trains."""
  shape = bench_train.SHAPES["default"]
  d, layers = shape["d"], shape["layers"]
  nanogpt = shape["vocab"] * d + shape["seq_len"] * d + layers * (2 * d + 12 * d * d) + d
  assert nanogpt == 836_736
  assert torch_peers.num_params(torch_peers.build("nanogpt_gpt2", shape)) == nanogpt
  small = dict(shape, layers=1, batch=2, seq_len=16)
  trainer = torch_peers.PeerTrainer("nanogpt_gpt2", small, bench_train.synthetic_batches(small, 1))
  first = trainer.step()
  assert abs(first - 5.545) < 0.1
  assert min(trainer.step() for _ in range(20)) < first - 0.5


def test_jaxshare_flops_follow_a_width_matched_plan():
  """MFU's FLOPs come from the run's plan: under ``schedule.match_params`` the MLPs are widened, and a count from the
  schedule alone (the model's configured width) would be too low."""
  from jaxshare.config import load_config
  from jaxshare.plan import plan_of

  shape = dict(bench_train.SHAPES["default"], layers=4, batch=2, seq_len=16)
  overrides = ["schedule.match_params=true"]
  trainer = bench_train.JaxTrainer(shape, "mlkv", overrides)
  plan = plan_of(load_config(bench_train.ROOT / "configs" / "base.yaml",
                             bench_train.jax_overrides(shape, "mlkv") + overrides))
  assert plan.mlp_dim > shape["mlp"], "the matched width is wider than the configured one"
  assert trainer.flops_per_token == plan.train_flops_per_token(shape["seq_len"])
