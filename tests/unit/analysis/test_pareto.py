"""The Pareto front of loss against a cost, as the search's frontier and the sweeps' plots draw it: a point is on it
only if no other point is at most as costly and lower in loss. The plots once scanned by cost alone, so of two runs
with the same KV bytes the first listed stayed on the front although the second beat it (MLKV ladder: GQA-8 beside
MLKV-8 at 512 B/token)."""

from jaxshare.analysis import plots
from jaxshare.analysis.pareto import pareto

# The MLKV ladder's means at four seeds (results/mlkv_ladder): gqa_8 and mlkv_8 tie on KV bytes.
LADDER = [{"name": "mha_16", "kv": 1024, "val_loss": 2.0296}, {"name": "gqa_8", "kv": 512, "val_loss": 2.0318},
          {"name": "mlkv_8", "kv": 512, "val_loss": 2.0249}, {"name": "mqa_4", "kv": 256, "val_loss": 2.0338},
          {"name": "mlkv_4", "kv": 256, "val_loss": 2.0546}, {"name": "mlkv_2", "kv": 128, "val_loss": 2.0610},
          {"name": "mlkv_1", "kv": 64, "val_loss": 2.0433}]


def test_a_point_beaten_at_the_same_cost_is_off_the_front():
  assert [r["name"] for r in pareto(LADDER, "kv", "val_loss")] == ["mlkv_1", "mqa_4", "mlkv_8"]


def test_rows_without_a_loss_are_left_out_and_the_front_rises_in_cost():
  rows = [{"c": 3, "l": 1.0}, {"c": 1, "l": None}, {"c": 2, "l": 2.0}, {"c": 1, "l": 3.0}]
  assert pareto(rows, "c", "l") == [{"c": 1, "l": 3.0}, {"c": 2, "l": 2.0}, {"c": 3, "l": 1.0}]


def test_the_plot_draws_the_same_front(tmp_path, monkeypatch):
  drawn = []
  monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig))
  plots.loss_vs_kv(LADDER, tmp_path / "kv.png", kv_key="kv", kv_label="KV bytes")
  (line,) = [ln for ln in drawn[0].axes[0].get_lines() if ln.get_label() == "Pareto front"]
  assert list(zip(line.get_xdata(), line.get_ydata())) == [(64, 2.0433), (256, 2.0338), (512, 2.0249)]
