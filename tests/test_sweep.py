"""The sweep runner end to end on a tiny budget: trains, evaluates, tabulates, plots."""

import csv
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import sweep  # noqa: E402


def test_sweep_tabulates_each_variant(tmp_path):
  spec = tmp_path / "sweep.yaml"
  tiny = ["model.num_layers=2", "model.d_model=32", "model.mlp_dim=64", "data.seq_len=32", "train.batch_size=8",
          "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "train.eval_batches=1",
          "train.log_every=1", "train.progress_bar=false"]
  spec.write_text(f"experiment: configs/experiments/sharing_base.yaml\nrun_root: {tmp_path / 'runs'}\nvariants:\n"
                  f"  dense: {tiny}\n  cla2: {tiny + ['schedule.kind=cla']}\n")
  assert sweep.main([str(spec)]) == 0
  rows = list(csv.DictReader((tmp_path / "runs" / "results.csv").open()))
  assert [r["name"] for r in rows] == ["dense", "cla2"]
  assert int(rows[1]["kv_bytes_per_token_bf16"]) * 2 == int(rows[0]["kv_bytes_per_token_bf16"])
  assert (tmp_path / "runs" / "pareto.png").stat().st_size > 0
  assert "| cla2 |" in (tmp_path / "runs" / "results.md").read_text()
