#!/usr/bin/env python
"""Run a sweep of schedule variants at one budget and tabulate validation loss, KV bytes and parameters.

Usage: python scripts/sweep.py configs/sweeps/sharing_table.yaml [--only NAME ...]

Each variant trains in its own run directory (re-running resumes or skips finished runs), is evaluated on the whole
validation split, and the results go to <run_root>/results.csv, results.md and a loss-vs-KV-bytes Pareto plot.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parent.parent


def run_variant(experiment: str, run_dir: Path, overrides: list[str], sample_tokens: int = 0) -> dict:
  """Train (or resume) one variant in a subprocess, then evaluate it; returns eval.py's JSON report (with a greedy
  sample of ``sample_tokens`` tokens)."""
  cmd = [sys.executable, str(REPO / "train.py"), "--config", experiment, "--no-eval", *overrides,
         f"train.run_dir={run_dir}"]
  subprocess.run(cmd, check=True, cwd=REPO)
  out = subprocess.run([sys.executable, str(REPO / "eval.py"), str(run_dir), "--json", "--sample-tokens",
                        str(sample_tokens)],
                       check=True, cwd=REPO, capture_output=True, text=True).stdout
  return json.loads(out)


def pareto_plot(rows: list[dict], path: Path) -> None:
  from jaxshare.analysis.plots import loss_vs_kv

  loss_vs_kv(rows, path, kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label="validation loss (nats/byte)")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep", help="sweep YAML: experiment, run_root, variants {name: [overrides]}")
  parser.add_argument("--only", nargs="*", default=None, help="run only these variants")
  args = parser.parse_args(argv)
  spec = OmegaConf.to_container(OmegaConf.load(args.sweep))
  root = REPO / spec["run_root"]
  rows = []
  for name, overrides in spec["variants"].items():
    if args.only and name not in args.only:
      continue
    report = run_variant(spec["experiment"], root / name, [str(o) for o in overrides])
    rows.append({"name": name, "val_loss": report["val_loss"], "bits_per_byte": report["bits_per_byte"],
                 "kv_bytes_per_token_bf16": report["kv_bytes_per_token_bf16"], "num_params": report["num_params"],
                 "schedule": report["schedule"]})
    print(f"{name}: val_loss {report['val_loss']:.4f}", flush=True)
  root.mkdir(parents=True, exist_ok=True)
  with (root / "results.csv").open("w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
  lines = ["| variant | val loss (nats/byte) | KV bytes/token (bf16) | params |", "|---|---|---|---|"]
  lines += [f"| {r['name']} | {r['val_loss']:.4f} | {r['kv_bytes_per_token_bf16']:,} | {r['num_params']:,} |"
            for r in rows]
  (root / "results.md").write_text("\n".join(lines) + "\n")
  pareto_plot(rows, root / "pareto.png")
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
