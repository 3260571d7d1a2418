"""Search the sharing schedule that loses least under a budget of KV bytes or FLOPs per token, starting from a
trained (or imported) dense run.

  python -m jaxshare.search SOURCE_RUN --kv-budget 0.5 --out runs/search_kv50
  python -m jaxshare.search SOURCE_RUN --kv-budget 1KiB --flops-budget 0.9 --params equal --families kv,scores
  python -m jaxshare.search SOURCE_RUN --kv-budget 0.25 --trials 12 --steps 50 --seeds 3 --parallel 2 --out DIR

Stage 1 (no training): every schedule of the space within the budget (each family's options, their compositions,
the papers' presets, and KVSharer's proposals, found by its acceptance test at --kvsharer-threshold) is converted from the source as `convert uptrain`
converts it and scored on the selection split (the first --calibration-batches validation batches): the loss right
after conversion and the KL divergence of its next-token distribution from the source's. Stage 2: the best (the
best preset among them) are uptrained for --steps steps, the better half again with twice the steps, and so on while
--trials runs last, each scored on the selection split too. The finals run the winner and the best preset at --seeds
seeds and are reported on the validation batches after the selection split's only.

Each stage is an Optuna study kept in --storage (default: sqlite in --out): run the same command again to resume a
killed search (finished trials are not run again), or run it in several processes, or on several hosts with a
PostgreSQL URL, to split the trials. Output in --out: results.csv (every candidate), frontier.md and frontier.png
(Pareto frontiers of loss against KV bytes and FLOPs, presets beside them, finals, stage 1's rank correlation with
stage 2), frontier/<name>.yaml (each frontier schedule: `train.py --config` and `convert uptrain --config` take it),
converted/<name> (each conversion), rung<r>/<name> and finals/<name>/seed<k> (the uptraining runs).

Exit codes: 0 done; 2 bad flags or input; 130 stopped by Ctrl-C (the runs in flight save a checkpoint; run the same
command again to resume).
"""

from __future__ import annotations

import argparse
import sys


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m jaxshare.search", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("source", help="source run directory: trained, or imported with `convert import`")
  p.add_argument("--out", required=True, help="search directory (created; a search's second run resumes it)")
  p.add_argument("--kv-budget", metavar="B", help="KV-cache bytes per token: a fraction of the source's (0.5) or "
                 "bytes (2048B, 1.5KiB)")
  p.add_argument("--flops-budget", metavar="F", help="forward FLOPs per token: a fraction of the source's (0.9) or "
                 "a figure (3.2MFLOP)")
  p.add_argument("--params", choices=("free", "equal"), default="free",
                 help="equal: every candidate's MLPs resized to the source's total parameters (schedule.match_params)")
  p.add_argument("--families", default="kv,scores,lisa,headwise",
                 help="families the space draws from, comma-separated (default: %(default)s)")
  p.add_argument("--trials", type=int, default=8, help="stage 2's uptraining runs over all rungs; 0: stage 1 only "
                 "(default: %(default)s)")
  p.add_argument("--steps", type=int, default=50, help="uptraining steps of the first rung (default: %(default)s)")
  p.add_argument("--seeds", type=int, default=3, help="seeds of the finals (default: %(default)s)")
  p.add_argument("--lr", type=float, default=1e-3, help="uptraining peak learning rate (default: %(default)s)")
  p.add_argument("--calibration-batches", type=int, default=4, metavar="N",
                 help="the selection split: the first N validation batches, which stage 1 and the rungs score "
                 "on (the finals report on the batches after them); and the training batches a conversion fits on "
                 "(default: %(default)s)")
  p.add_argument("--kvsharer-threshold", type=float, default=0.5, metavar="S",
                 help="KVSharer's acceptance test: a replacement is kept while the final hidden states' mean cosine "
                 "similarity to the source's on the selection split stays above S, in [-1, 1] (default: %(default)s, "
                 "the authors' released search's)")
  p.add_argument("--results", metavar="FILE", help="also write the search's summary (the README's table row: "
                 "scripts/render_results.py) with its provenance to FILE, e.g. results/search/kv50.json")
  p.add_argument("--storage", help="Optuna storage URL (default: sqlite:///OUT/study.db)")
  p.add_argument("--parallel", type=int, default=1, metavar="N", help="uptraining runs at once (each on its own "
                 "group of --devices)")
  p.add_argument("--devices", metavar="IDS", help="device ids to split into --parallel groups (as the sweep's)")
  p.add_argument("--platform", choices=("auto", "cpu", "gpu", "tpu"), default="auto", help=argparse.SUPPRESS)
  p.add_argument("--set", nargs="*", default=[], metavar="OVERRIDE",
                 help="overrides of every uptraining run, e.g. train.batch_size=8")
  return p


def main(argv: list[str] | None = None) -> int:
  parser = _parser()
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)  # what the results' provenance records
  for flag, value, least in (("--trials", args.trials, 0), ("--steps", args.steps, 1), ("--seeds", args.seeds, 1),
                             ("--calibration-batches", args.calibration_batches, 1), ("--parallel", args.parallel, 1)):
    if value < least:
      parser.error(f"{flag}={value} is invalid: must be >= {least}")
  if not -1.0 <= args.kvsharer_threshold <= 1.0:
    parser.error(f"--kvsharer-threshold={args.kvsharer_threshold} is invalid: a cosine similarity, in [-1, 1]")
  if not args.kv_budget and not args.flops_budget:
    parser.error("give a budget: --kv-budget and/or --flops-budget")

  from jaxshare import exit_codes
  from jaxshare.search.run import search

  exit_codes.interrupt_on_ctrl_c()  # the runs it starts stop on Ctrl-C, so must it (exit 130) rather than start the next
  try:
    return exit_codes.report_input_errors(lambda: search(args))
  except KeyboardInterrupt:
    print("interrupted: the finished trials are kept in the study; run the same command again to resume (an "
          "interrupted run continues from its last checkpoint)", file=sys.stderr, flush=True)
    return exit_codes.INTERRUPTED


if __name__ == "__main__":
  sys.exit(main())
