"""A schedule search from its command line to its results: the space under the budget, stage 1, successive
halving, the finals and the report (:mod:`jaxshare.search.__main__` describes it)."""

from __future__ import annotations

import argparse
from pathlib import Path

from jaxshare import smoke
from jaxshare.analysis.pareto import pareto
from jaxshare.store import runs
from jaxshare.search import report
from jaxshare.search.budget import Budget, parse_limit
from jaxshare.search.calibration import Calibration, calibration_batches
from jaxshare.search.kvsharer import kvsharer_applies, kvsharer_options
from jaxshare.search.space import candidate_config, candidates
from jaxshare.search.stages import Settings, finals, rung_dir, stage1, stage2
from jaxshare.search.study import failures, open_storage
from jaxshare.sweep.devices import device_groups
from jaxshare.sweep.provenance import provenance, write_result
from jaxshare.sweep.runner import say


REPO = Path(__file__).resolve().parents[2]
MEASURE = ("eval.py val_loss: next-token cross-entropy in nats per token, over the validation batches after the first "
           "--calibration-batches (the finals); stage 1 and the rungs over those first batches")


def budget_of(args: argparse.Namespace) -> Budget:
  """The budget the flags give (:func:`~jaxshare.search.budget.parse_limit`)."""
  return Budget(None if not args.kv_budget else parse_limit(args.kv_budget, "kv", "--kv-budget"),
                None if not args.flops_budget else parse_limit(args.flops_budget, "flops", "--flops-budget"),
                args.params == "equal")


def search(args: argparse.Namespace) -> int:
  """Run (or resume) the search of ``args``; 0 once its report is written.

  Raises:
    SearchError: bad flags, or a budget no candidate meets. ConfigError / CheckpointError / DataError: the source
      run or its data.
  """
  out = Path(args.out).absolute()
  source = str(runs.locate(args.source)[0])
  budget = budget_of(args)
  families = [f.strip() for f in args.families.split(",") if f.strip()]
  src = runs.load_run(source)
  batches = calibration_batches(src, args.calibration_batches, reported=args.trials > 0)
  extra = kvsharer_options(src, batches, args.kvsharer_threshold, say) if "kv" in families and kvsharer_applies(
    src.schedule) else []
  cands, src_cost = candidates(src.cfg, source, budget, families, extra)
  cands = smoke.first(cands, 2)  # a smoke check: two candidates (a halving), one seed
  args.seeds = len(smoke.first(range(args.seeds), 1))
  say(f"search: {src.schedule.describe()} at {source} | budget: {budget.describe(src_cost)} | {len(cands)} "
      f"candidates ({sum(c.preset for c in cands)} presets, {sum(c.name.startswith('kvsharer') for c in cands)} "
      "KVSharer proposals)")
  out.mkdir(parents=True, exist_ok=True)
  storage = open_storage(args.storage or f"sqlite:///{out / 'study.db'}")
  settings = Settings(out, source, args.steps, args.trials, args.seeds, args.lr, args.calibration_batches,
                      tuple(args.set))

  scored = stage1(settings, src, cands, Calibration(src, batches), storage)
  ranked = sorted(scored, key=lambda n: scored[n].value)
  presets = {c.name for c in cands if c.preset}
  rungs, rung_steps, final = [], [], {}
  winner = best_preset = None
  if args.trials:
    groups = device_groups(args.parallel, args.devices, args.platform)
    rungs = stage2(settings, ranked, presets, storage, groups)
    rung_steps = [args.steps * 2 ** r for r in range(len(rungs))]
    winner = min(rungs[-1], key=rungs[-1].get)
    best_preset = _best_preset(rungs, presets)
    names = [winner] + ([best_preset] if best_preset not in (None, winner) else [])
    last = len(rungs) - 1  # the last rung trained its candidates at seed 0 for the finals' steps
    final = finals(settings, names, rung_steps[-1], storage, groups,
                   {n: rung_dir(settings, last, n) for n in names if n in rungs[-1]})

  by_name = {c.name: c for c in cands}
  rows = report.candidate_rows({c.name: (c.schedule, c.families, c.preset, c.cost) for c in cands}, src_cost,
                               scored, rungs, rung_steps, final)
  report.write_csv(out / "results.csv", rows)
  rung_keys = [f"rung{r}_loss_{s}_steps" for r, s in enumerate(rung_steps)]
  title = f"Schedule search: {budget.describe(src_cost)}"
  failed = {f"{stage}/{point}": error for stage in ["stage1", *(f"rung{r}" for r in range(len(rungs))), "finals"]
            for point, error in failures(storage, stage).items()}
  (out / "frontier.md").write_text(report.frontier_markdown(title, rows, rung_keys, final, winner, best_preset,
                                                            failed))
  if args.results:  # the published table's row, with what made it
    results = Path(args.results).absolute()
    write_result(results, {**report.summary(budget.describe(src_cost), rows, rung_keys, final, winner, best_preset),
                           "provenance": provenance([["python", "-m", "jaxshare.search", *args.argv]], MEASURE,
                                                    REPO)})
  plots = report.plot(rows, rung_keys[0] if rung_keys else "stage1_loss", out, title)
  front = {r["name"] for key in ["stage1_loss", *rung_keys] for cost in ("kv_bytes_per_token_bf16", "flops_per_token")
           for r in pareto(rows, cost, key)}  # (rows without that loss are left out)
  (out / "frontier").mkdir(exist_ok=True)
  for name in sorted(front):
    run_dir = out / "uptrained" / name
    cfg = candidate_config(src.cfg, source, [*by_name[name].overrides, f"train.run_dir={run_dir}"],
                           src.plan.param_count().total)
    report.write_config(out / "frontier" / f"{name}.yaml", cfg, by_name[name].wc_fit)
  say(f"results: {out / 'results.csv'}, frontier.md, " + ", ".join(p.name for p in plots)
      + f", frontier/ ({len(front)} configs)"
      + (f" | winner {winner}: {report.mean_std(final[winner])}" if winner else "")
      + (f" | best preset {best_preset}: {report.mean_std(final[best_preset])}"
         if best_preset and best_preset in final else "")
      + (f" | {len(failed)} trial(s) failed: see frontier.md" if failed else ""))
  return 0


def _best_preset(rungs: list[dict[str, float]], presets: set[str]) -> str | None:
  """The preset that reached the deepest rung, the best of those there."""
  for scores in reversed(rungs):
    there = {n: v for n, v in scores.items() if n in presets}
    if there:
      return min(there, key=there.get)
  return None

