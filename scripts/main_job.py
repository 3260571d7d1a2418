#!/usr/bin/env python
"""The main job, measured for publication: train an experiment from scratch (what ``make train`` runs), evaluate it
on the whole validation split, and print the README's main-job table with how the training went.

Usage: python scripts/main_job.py [--config configs/experiments/shakespeare_cla2.yaml] [--results DIR]
                                  [OVERRIDE ...]

Both steps are the CLIs, run as child processes and echoed: ``train.py --config CONFIG --no-eval OVERRIDES`` and
``eval.py report RUN_DIR --json --sample-tokens 0``. The table gives the run's parameters, KV-cache bytes per token in
the model's dtype, steps x tokens per step, and eval.py's validation loss (nats per token) and bits per byte; the
lines under it give the validation loss logged during training (``train.eval_batches`` batches), the training wall
time (train.py's whole process: start-up and compiles included), the median tokens/s and MFU of the logged intervals
after the first (which holds the compile), and the child's peak resident memory. With ``--results DIR`` the table and
those lines are written to DIR/table.json with the commands' provenance (published by scripts/render_results.py).

Exit codes: 0 done; 1 a child failed (its command and exit code are printed); 2 a bad config, ``--results`` under
``JAXSHARE_SMOKE``, or a run directory that already exists (a resumed run's time is not the job's: delete it or
name another ``train.run_dir=``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxshare.config import load_config  # noqa: E402
from jaxshare.exit_codes import BAD_INPUT, report_input_errors  # noqa: E402
from jaxshare.smoke import ENV as SMOKE_ENV, enabled as smoke  # noqa: E402
from jaxshare.store.runs import CONFIG_FILE  # noqa: E402
from jaxshare.sweep.provenance import portable, publish_table, script_command  # noqa: E402

DEFAULT_CONFIG = "configs/experiments/shakespeare_cla2.yaml"
HEADER = ["| experiment | schedule | params | KV cache | steps × tokens | val loss (whole split) | bits/byte |",
          "|---|---|---|---|---|---|---|"]


def _child(command: list[str]) -> list[str]:
  """Run ``command`` from the repository root, echoing its standard output; returns its lines.

  Raises:
    SystemExit: the child failed (exit code 1, naming the child's command and code).
  """
  print("$ " + " ".join(portable(command, REPO)), flush=True)
  lines = []
  with subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, text=True) as child:
    for line in child.stdout:
      print(line, end="", flush=True)
      lines.append(line.rstrip("\n"))
  if child.returncode:
    raise SystemExit(f"error: {' '.join(portable(command, REPO))} exited with {child.returncode}")
  return lines


def training_lines(metrics: list[dict], eval_batches: int, wall_s: float, peak_rss_kib: int,
                   mfu_peak: str | None) -> list[str]:
  """The lines under the table: the validation curve, wall time, median throughput and MFU, peak memory.

  Args:
    metrics: the run's metrics.jsonl records, in order; the first holds the compile, so it is left out of the medians.
    eval_batches: validation batches of each pass during training (``train.eval_batches``; 0: the whole split).
    wall_s: train.py's wall time in seconds. peak_rss_kib: its peak resident set (KiB, as getrusage gives it on Linux).
    mfu_peak: what MFU divides by, as train.py's summary names it (None: no MFU was logged).
  """
  curve = [(r["step"], r["val_loss"]) for r in metrics if "val_loss" in r]
  steady = metrics[1:] or metrics
  minutes, seconds = divmod(round(wall_s), 60)
  line = (f"Validation during training ({f'{eval_batches} batches' if eval_batches else 'whole split'}) at steps "
          f"{'/'.join(str(s) for s, _ in curve)}: {' / '.join(f'{v:.3f}' for _, v in curve)}. train.py took "
          f"{f'{minutes} min ' if minutes else ''}{seconds} s (start-up and compiles included) at a median "
          f"{statistics.median(r['tokens_per_sec'] for r in steady):,.0f} tokens/s")
  if mfu_peak is not None and all("mfu" in r for r in steady):
    line += f", MFU {100 * statistics.median(r['mfu'] for r in steady):.1f}% of the {mfu_peak}"
  return [line + f"; peak resident memory {peak_rss_kib / 2**20:.2f} GiB."]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=DEFAULT_CONFIG, help="experiment YAML (default: make train's)")
  parser.add_argument("--results", type=Path, metavar="DIR", help="also write the table with both commands' "
                      "provenance to DIR/table.json (published by scripts/render_results.py)")
  parser.add_argument("overrides", nargs="*", help="dotted overrides for train.py, e.g. train.steps=100")
  args = parser.parse_args(argv)
  command = script_command("scripts/main_job.py", argv)
  return report_input_errors(lambda: _main_job(args, command))


def _main_job(args: argparse.Namespace, command: list[str]) -> int:
  if args.results and smoke():
    print(f"error: --results with {SMOKE_ENV} set: a smoke run's figures mean nothing and are not published",
          file=sys.stderr)
    return BAD_INPUT
  cfg = load_config(REPO / args.config, args.overrides)  # a bad config is refused here, before anything runs
  run_dir = Path(cfg.train.run_dir)
  run = run_dir if run_dir.is_absolute() else REPO / run_dir
  if run.exists():
    print(f"error: train.run_dir {run_dir} exists: the table times a whole run, not a resumed one; delete it or "
          "name another train.run_dir=", file=sys.stderr)
    return BAD_INPUT
  train = [sys.executable, "train.py", "--config", args.config, "--no-eval", *args.overrides]
  start = time.perf_counter()
  printed = _child(train)
  wall_s = time.perf_counter() - start
  peak_rss_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # the only child waited for so far
  summary = json.loads(next(ln for ln in printed if ln.startswith("training summary: ")).split(": ", 1)[1])
  evaluate = [sys.executable, "eval.py", "report", str(run_dir), "--json", "--sample-tokens", "0"]
  report = json.loads(_child(evaluate)[-1])
  metrics = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
  cfg = load_config(run / CONFIG_FILE)  # what trained (JAXSHARE_SMOKE narrows the model and batches in train.py)
  schedule = report["schedule"].split(" | ")[0]  # its kind and K/V sources, without the layer pattern's pipes
  row = (f"| `{Path(args.config).stem}` | {schedule} | {report['num_params']:,} | "
         f"{report['kv_bytes_per_token']:,} B/token ({cfg.model.dtype}) | "
         f"{report['step']} × {cfg.train.batch_size * cfg.data.seq_len:,} | {report['val_loss']:.4f} nats/token | "
         f"{report['bits_per_byte']:.4f} |")
  lines = [*HEADER, row, "", *training_lines(metrics, cfg.train.eval_batches, wall_s, peak_rss_kib, summary.get("mfu_peak"))]
  print("\n".join(lines))
  if args.results:
    publish_table(args.results.resolve(), lines, [command],
                  f"eval.py report: next-token cross-entropy over the whole validation split, on {os.cpu_count()} "
                  "CPU threads", REPO)
  return 0


if __name__ == "__main__":
  sys.exit(main())
