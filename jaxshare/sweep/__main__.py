"""Run a sweep of config variants (and seeds) through train.py and eval.py, and tabulate and plot the results.

Usage:
  python scripts/sweep.py configs/sweeps/mlkv_ladder.yaml                # train + evaluate every run, table, plots
  python scripts/sweep.py SWEEP --only gqa_8 mqa_4 --parallel 2         # two runs at a time, each on its own devices
  python scripts/sweep.py SWEEP --check                                  # validate every run's config, train nothing
  python scripts/sweep.py SWEEP --dry-run                                # print the commands, run nothing
  python scripts/sweep.py SWEEP --launch slurm --launcher-args "--nodes 1 --gpus-per-node 8"
  python scripts/sweep.py SWEEP --collect                                # evaluate launched runs that have finished
  python scripts/sweep.py SWEEP --results results/NAME                   # also commit-ready result files per run

Sweep file (YAML):
  experiment: configs/experiments/sharing_base.yaml   # train.py --config
  run_root: runs/mlkv_ladder                           # runs: <run_root>/<variant>/seed<S> (<variant> without seeds)
  base: [train.steps=400]                              # optional: overrides of every run (first)
  seeds: [0, 1]                                        # optional: one run per seed, train.seed=S (init only; the
                                                       #   data order, data.shuffle_seed, is the same for all)
  variants: {gqa_8: [schedule.kind=gqa, schedule.kv_heads=2], ...}   # named override lists
  grid: {schedule.kv_heads: [1, 2], schedule.factor: [1, 2]}         # crossed; names like kv_heads=1,factor=2
  series: {within layers: [mha_16, gqa_8]}             # optional: plot colours (default: a grid's first key)

Runs are the named variants followed by the grid's points, each for every seed. A run whose latest checkpoint is at
train.steps and whose evaluation is cached in <run_dir>/eval.json is skipped; an interrupted run resumes (train.py
resumes from its run directory). Each run's train.py/eval.py output goes to <run_dir>/sweep.log. A failing run is
recorded with status `failed` and the sweep goes on; one stopped by Ctrl-C or preemption (train.py exit 130, its
checkpoint saved) as `interrupted`. The exit code is 1 if any run failed, 130 on Ctrl-C, 2 for a bad sweep file
or flag. Results merge by (variant, seed) into <run_root>/results.csv (rows of other variants are kept), and
results.md (mean ± sample std over seeds), loss_vs_kv.png and loss_vs_params.png are rewritten from it. With
--results DIR each run finished in this invocation is also written to DIR/rows/ with the commands that made it, the
commit, versions and date (jaxshare.sweep.publish), the files scripts/render_results.py renders published tables from.
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from jaxshare import exit_codes
from jaxshare.config import REPO_ROOT, ConfigError
from jaxshare.exit_codes import interrupt_on_ctrl_c, report_input_errors
from jaxshare.schedule import ScheduleError
from jaxshare.sweep.devices import DeviceGroup, device_groups
from jaxshare.sweep.launch import LAUNCHERS, check_launcher_args, launch, launcher_command
from jaxshare.sweep.publish import Published
from jaxshare.sweep.results import Results, markdown_table, plot, result_row, summarize
from jaxshare.sweep.runner import appending, cached_eval, command, execute, latest_step, say, train_all
from jaxshare.sweep.spec import Sweep, SweepError, Trial, check_config, load_sweep, rel


def _parser(prog: str | None) -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("sweep", help="sweep YAML (see above)")
  parser.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these variants (all seeds)")
  parser.add_argument("--check", action="store_true",
                      help="validate every run's config and schedule (no JAX), print KV bytes and params, exit")
  parser.add_argument("--dry-run", action="store_true", help="print the commands of the pending runs, run nothing")
  parser.add_argument("--parallel", type=int, default=1, metavar="N",
                      help="local runs at once, each on its own group of --devices")
  parser.add_argument("--devices", default=None, metavar="IDS",
                      help="comma-separated device ids to split into --parallel groups: GPU indices, TPU chips or "
                      "CPU cores (default: all GPUs/chips; on CPU all cores when --parallel > 1)")
  parser.add_argument("--platform", default="auto", choices=("auto", "cpu", "gpu", "tpu"),
                      help="how to confine a run to its devices (auto: nvidia-smi, /dev/accel*, else cpu)")
  parser.add_argument("--launch", choices=tuple(LAUNCHERS), default=None,
                      help="submit each pending run through scripts/launch_{slurm,tpu_pod}.sh instead of training here")
  parser.add_argument("--launcher-args", default="", metavar="ARGS",
                      help="extra launcher flags, one string, e.g. \"--nodes 1 --gpus-per-node 8\" or "
                      "\"--bucket gs://B/runs --tpu NAME --zone Z\"")
  parser.add_argument("--collect", action="store_true",
                      help="train nothing: evaluate runs that finished (e.g. launched ones) and tabulate")
  parser.add_argument("--results", default=None, metavar="DIR",
                      help="also write each run that finishes here to DIR/rows/<variant>[-seed<S>].json with its "
                      "provenance, and the sweep's variants to DIR/sweep.json (e.g. results/sharing, committed)")
  return parser


def _check(sweep: Sweep, runs: list[Trial]) -> int:
  bad = 0
  for run in {r.variant: r for r in runs}.values():  # a seed changes no shape
    try:
      _, plan = check_config(sweep, run)
    except ValueError as e:  # ConfigError and ScheduleError
      print(f"INVALID {run.variant}: {e}")
      bad += 1
      continue
    kv, params = plan.kv_cache_bytes_per_token(2), plan.param_count().total
    print(f"ok {run.variant}: {kv:,} KV bytes/token (bf16), {params:,} params | {plan.schedule.describe()}")
  print(f"{len(runs)} runs of {len({r.variant for r in runs})} variants; {bad} invalid")
  return 2 if bad else 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
  """The sweep command line; ``prog`` names it in usage lines (default: the script's file name)."""
  args = _parser(prog).parse_args(argv)
  interrupt_on_ctrl_c()  # the runs it starts stop on Ctrl-C, so must it (exit 130) rather than start the next
  return report_input_errors(lambda: _sweep(args))


def _sweep(args) -> int:
  """Check, dry-run, launch, collect or train-and-evaluate the sweep of ``args``.

  Raises:
    SweepError: a bad sweep file or launcher arguments (before any run starts).
  """
  sweep = load_sweep(args.sweep)
  runs = sweep.runs(args.only)
  if args.check:
    return _check(sweep, runs)
  launcher_args = shlex.split(args.launcher_args)
  check_launcher_args(launcher_args)
  groups = [] if args.launch or args.collect else device_groups(args.parallel, args.devices, args.platform)
  if args.launch and not args.dry_run and not (REPO_ROOT / LAUNCHERS[args.launch]).is_file():
    raise SweepError(f"--launch {args.launch}: {LAUNCHERS[args.launch]} is not there")

  results = Results(sweep)
  published = Published(Path(args.results).resolve(), sweep) if args.results and not args.dry_run else None
  done: list[dict] = []  # rows of this invocation
  pending: list[tuple[Trial, int | None, str]] = []  # run, target steps, config error
  for run in runs:
    try:
      cfg, _ = check_config(sweep, run)
      steps, error = cfg.train.steps, ""
    except (ConfigError, ScheduleError) as e:
      steps, error = None, str(e)
    report = cached_eval(run.run_dir, steps) if steps else None
    if report is not None:
      print(f"{run.label}: skipped (finished at step {steps}, evaluation cached in eval.json)", flush=True)
      done.append(result_row(run, "ok", report))
    else:
      pending.append((run, steps, error))

  if args.dry_run:
    for i, (run, _, error) in enumerate(pending):
      if error:
        print(f"# {run.label}: invalid config: {error}")
      elif args.launch:
        print(shlex.join(launcher_command(args.launch, sweep, run, launcher_args)))
      elif args.collect:
        print(command(DeviceGroup(), run.eval_command()))
      else:  # the group each run would get if runs took equally long
        group = groups[i % len(groups)]
        print(command(group, run.train_command(sweep.experiment)) + " && " + command(group, run.eval_command()))
    return 0

  failures = 0
  for run, _, error in pending:
    if error:  # recorded without starting a process: train.py would refuse the same config
      run.run_dir.mkdir(parents=True, exist_ok=True)
      with appending(run.run_dir / "sweep.log") as f:
        f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} invalid config: {error}\n")
      print(f"{run.label}: FAILED, invalid config: {error}", flush=True)
      done.append(result_row(run, "failed", error=f"invalid config: {error}"[:300]))
      failures += 1
  todo = [(run, steps) for run, steps, error in pending if not error]

  if args.launch:
    failures += launch(args.launch, args.sweep, sweep, [run for run, _ in todo], launcher_args)
    if done:
      results.add(done)
    return 1 if failures else 0

  if args.collect:
    group = DeviceGroup()
    for run, steps in todo:
      reached = latest_step(run.run_dir)
      if reached == steps:
        print(f"{run.label}: evaluating (step {steps})", flush=True)
        row = execute(sweep.experiment, run, steps, group, evaluate_only=True)
      else:
        print(f"{run.label}: not finished (step {reached} of {steps})", flush=True)
        row = result_row(run, "incomplete", {"step": reached if reached is not None else ""})
      if published:
        published.add(run, row)
      failures += row["status"] != "ok"
      done.append(row)
  else:
    try:
      failures += train_all(sweep, todo, groups, results, done, published)
    except KeyboardInterrupt:
      say("interrupted: finished runs are in results.csv; run the same command again to resume the others",
          file=sys.stderr)
      return exit_codes.INTERRUPTED

  merged = results.add(done)
  summary = summarize(merged, list(sweep.variants))
  paths = plot(summary, sweep, sweep.run_root)
  print(markdown_table(summary), end="")
  print(f"results: {rel(sweep.run_root / 'results.csv')}, results.md" + "".join(f", {p.name}" for p in paths))
  if failures:
    print(f"{failures} run(s) failed or unfinished; see each run's sweep.log", file=sys.stderr)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main(prog="python -m jaxshare.sweep"))
