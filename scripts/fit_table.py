#!/usr/bin/env python
"""The long-context fit table: for each GPU or TPU topology, sequence length and schedule, the largest global batch
whose train step compiles within the device's memory (``train.py --compile-only --max-batch``, compiled on this host
for the target), and the decode KV cache one sequence of that length needs. The memory argument for sharing, as
numbers a user planning a run can check.

  python scripts/fit_table.py                                   # h100:1 and h100:8; T = 8k, 32k, 128k; 5 schedules
  python scripts/fit_table.py --topology v5e:2x2 --lengths 8192 --schedules dense cla2

Needs the compile-only runtimes of ``make install-aot``. Prints one markdown row per compile search as it finishes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

from jaxshare.aot.topology import use_host_compiler  # noqa: E402

use_host_compiler()  # before JAX is imported

from jaxshare import accounting, smoke  # noqa: E402
from jaxshare.aot.fit import max_batch  # noqa: E402
from jaxshare.aot.report import gib  # noqa: E402
from jaxshare.config import load_config  # noqa: E402
from jaxshare.config.catalogue import schedule_matrix  # noqa: E402
from jaxshare.exit_codes import report_input_errors  # noqa: E402
from jaxshare.plan import plan_of  # noqa: E402

# The ~1.2B Llama's 32 heads of 64 under each schedule (the variants docs/gpu.md and bench_mfu.py measure).
SCHEDULES = schedule_matrix("script_fit_table")
CONFIG = REPO / "configs" / "experiments" / "llama_1b_h100.yaml"


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--topology", nargs="+", default=["h100:1", "h100:8"])
  ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072])
  ap.add_argument("--schedules", nargs="+", choices=sorted(SCHEDULES), default=list(SCHEDULES))
  ap.add_argument("--config", type=Path, default=CONFIG, help=f"experiment config (default {CONFIG.name})")
  ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. attention.impl=cudnn")
  args = ap.parse_args(argv)
  print("| topology | T | schedule | largest global batch | HBM per chip | decode KV cache per sequence | compiles |")
  print("|---|---|---|---|---|---|---|", flush=True)

  def table() -> int:
    for target in args.topology:
      for length in args.lengths:
        for name in smoke.first(args.schedules):
          # from one sequence per device up: the search doubles while it fits
          cfg = load_config(args.config, [*SCHEDULES[name], f"data.seq_len={length}", "train.batch_size=1",
                                          *args.overrides])
          schedule = plan_of(cfg).schedule
          cache = accounting.kv_cache_bytes(cfg.model, schedule, 1, length)
          best, probes = max_batch(cfg, target)
          found = f"{best.batch}" if best else "none (one sequence per device does not fit)"
          hbm = gib((best or probes[-1]).hbm)
          print(f"| {target} | {length:,} | {name} | {found} | {hbm} | {gib(cache)} | {len(probes)} |", flush=True)
    return 0

  return report_input_errors(table)


if __name__ == "__main__":
  sys.exit(main())
