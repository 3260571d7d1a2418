#!/usr/bin/env python
"""The long-context fit table: for each scenario (a model, a GPU or TPU topology, a sequence length and the context
axis it is split over), schedule and rematerialisation policy, the largest global batch whose train step compiles
within the device's memory (``train.py --compile-only --max-batch``, compiled on this host for the target), its HBM
per chip, the bytes its collectives move per chip and step (attention K/V apart), the step-time bound of its FLOPs,
and the decode KV cache one sequence of that length needs.

  python scripts/fit_table.py                      # the three long-context scenarios, remat full and save_qkv_proj
  python scripts/fit_table.py --scenario 1b-h100-128k --remat full --schedules dense cla2
  python scripts/fit_table.py --topology h100:8 --lengths 8192 32768 --config configs/experiments/llama_1b_h100.yaml
  python scripts/fit_table.py --policies --results results/fit_policies   # every policy's memory and FLOPs: dense

Needs the compile-only runtimes of ``make install-aot``. Prints one markdown row per compile search as it finishes.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Callable, NamedTuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

from jaxshare.aot.topology import use_host_compiler  # noqa: E402

use_host_compiler()  # before JAX is imported

from jaxshare import accounting, smoke  # noqa: E402
from jaxshare.aot import fit_results  # noqa: E402
from jaxshare.aot.fit import max_batch  # noqa: E402
from jaxshare.aot import topology  # noqa: E402
from jaxshare.aot.report import Fit, batch_unit, check  # noqa: E402
from jaxshare.aot.units import gib, ms  # noqa: E402
from jaxshare.config import ConfigError, load_config  # noqa: E402
from jaxshare.config.catalogue import schedule_matrix  # noqa: E402
from jaxshare.config.choices import RematPolicy  # noqa: E402
from jaxshare.exit_codes import report_input_errors  # noqa: E402
from jaxshare.plan import plan_of  # noqa: E402
from jaxshare.sweep.provenance import provenance, script_command  # noqa: E402

EXPERIMENTS = REPO / "configs" / "experiments"


class Scenario(NamedTuple):
  """A model on a topology at a sequence length: its experiment config and overrides, and its schedule matrix."""

  model: str
  target: str
  config: Path
  overrides: tuple[str, ...]
  matrix: str


SCENARIOS = {
  # one 128k-token sequence on one H100 (the ~1.2B Llama of models/llama_1b.yaml)
  "1b-h100-128k": Scenario("~1.2B Llama", "h100:1", EXPERIMENTS / "llama_1b_long_context.yaml",
                           ("data.seq_len=131072", "mesh.context=1"), "script_fit_table"),
  # 512k tokens over a node of 8 (mesh.context=8)
  "1b-h100x8-512k": Scenario("~1.2B Llama", "h100:8", EXPERIMENTS / "llama_1b_long_context.yaml", (),
                             "script_fit_table"),
  # Llama-3-8B's shape at 128k over a node of 8 (mesh.context=8)
  "8b-h100x8-128k": Scenario("Llama-3-8B", "h100:8", EXPERIMENTS / "llama3_8b_long_context.yaml", (),
                             "script_fit_table_8b"),
}
POLICY_TABLE = (("h100:1", ()), ("v5p-8", ("mesh.fsdp=-1", "train.batch_size=4")))  # one sequence per chip


def _columns() -> None:
  print("| model | topology | T | context | schedule | model.remat | largest global batch | HBM per chip | K/V moved "
        "per chip per step | all collectives per chip per step | step-time bound | decode KV cache per sequence | "
        "compiles |")
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|", flush=True)


def _row(model: str, target: str, cfg, name: str, best: Fit | None, probes: list[Fit]) -> str:
  fit = best or probes[-1]
  found = f"{best.batch}" if best else "none (one sequence per device does not fit)"
  moved = fit.traffic
  kv = gib(int(moved.kv)) if moved and fit.chips > 1 else "-"
  total = gib(int(moved.total)) if moved and fit.chips > 1 else "-"
  bound = ms(fit.step_time_bound)
  cache = accounting.kv_cache_bytes(cfg.model, plan_of(cfg).schedule, 1, cfg.data.seq_len)
  ring = " (ring)" if cfg.mesh.context_size > 1 and cfg.attention.context_strategy == "ring" else ""
  return (f"| {model} | {target} | {cfg.data.seq_len:,} | {cfg.mesh.context}{ring} | {name} | {cfg.model.remat} | "
          f"{found} | "
          f"{gib(fit.hbm)} | {kv} | {total} | {bound} | {gib(cache)} | {len(probes)} |")


def fit_rows(cases, remats: list[str], schedules: list[str] | None, overrides: list[str], search: bool,
             publish: Callable[[dict], None] = lambda row: None) -> None:
  """One row per (case, schedule, policy): ``cases`` are ``(model, target, config, overrides, matrix)``; ``publish``
  gets each row's :func:`~jaxshare.aot.fit_results.fit_row` as it is printed.

  Raises:
    ConfigError: a name in ``schedules`` is no schedule of any case's matrix (a config override written after
      ``--schedules`` is read as one).
  """
  known = list(dict.fromkeys(name for case in cases for name in schedule_matrix(case[4])))
  unknown = [name for name in schedules or () if name not in known]
  if unknown:
    raise ConfigError(f"--schedules: {', '.join(map(repr, unknown))} is not a schedule of this table (it has "
                      f"{', '.join(known)}); config overrides go before --schedules or after another option")
  _columns()
  for model, target, config, own, matrix in cases:
    variants = schedule_matrix(matrix)
    for policy in smoke.first(remats):
      for name in smoke.first([s for s in variants if schedules is None or s in schedules]):
        cfg = load_config(config, [*variants[name], *own, f"model.remat={policy}", *overrides])
        if search:
          best, probes = max_batch(cfg, target)
        else:  # one sequence per batch shard
          mesh = topology.topology_mesh(topology.topology_name(target), cfg.mesh)
          cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch_unit(cfg, mesh)))
          fit = check(cfg, target)
          best, probes = (fit if fit.fits else None), [fit]
        print(_row(model, target, cfg, name, best, probes), flush=True)
        ring = cfg.mesh.context_size > 1 and cfg.attention.context_strategy == "ring"
        cache = accounting.kv_cache_bytes(cfg.model, plan_of(cfg).schedule, 1, cfg.data.seq_len)
        publish(fit_results.fit_row(model, target, name, cfg.model.remat, cfg.data.seq_len, cfg.mesh.context_size,
                                    ring, best, probes, cache))


def policy_rows(lengths: list[int], overrides: list[str], publish: Callable[[dict], None] = lambda row: None) -> None:
  """Every policy's HBM and executed FLOPs for the dense ~1.2B Llama, one sequence per chip; ``publish`` gets each
  row's :func:`~jaxshare.aot.fit_results.fit_row` as it is printed."""
  print("| topology | T | model.remat | HBM per chip | executed FLOPs per step | executed / model FLOPs | compile s |")
  print("|---|---|---|---|---|---|---|", flush=True)
  config = EXPERIMENTS / "llama_1b_h100.yaml"
  for target, own in smoke.first(POLICY_TABLE):
    for length in smoke.first(lengths):
      for policy in smoke.first([p.value for p in RematPolicy]):
        cfg = load_config(config, ["train.batch_size=1", f"data.seq_len={length}", "train.num_vocab_tiling=8",
                                   f"model.remat={policy}", *own, *overrides])
        fit = check(cfg, target)
        verdict = gib(fit.hbm) + ("" if fit.fits else " (does not fit)")
        print(f"| {target} | {length:,} | {policy} | {verdict} | {fit.executed_flops:.3e} | "
              f"{fit.executed_flops / fit.model_flops:.3f} | {fit.compile_s:.0f} |", flush=True)
        cache = accounting.kv_cache_bytes(cfg.model, plan_of(cfg).schedule, 1, cfg.data.seq_len)
        publish(fit_results.fit_row(config.stem, target, "dense", policy, length, 1, False,
                                    fit if fit.fits else None, [fit], cache))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--scenario", nargs="+", choices=sorted(SCENARIOS), help="long-context scenarios (default: all)")
  ap.add_argument("--remat", nargs="+", default=["full", "save_qkv_proj"], choices=[p.value for p in RematPolicy],
                  help="rematerialisation policies compared (default: full save_qkv_proj)")
  ap.add_argument("--schedules", nargs="+", help="schedules of the scenario's matrix (default: all of them)")
  ap.add_argument("--topology", nargs="+", help="instead of scenarios: these topologies ...")
  ap.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768, 131072],
                  help="... at these sequence lengths (with --topology; with --policies: default 8192 32768)")
  ap.add_argument("--config", type=Path, default=EXPERIMENTS / "llama_1b_h100.yaml",
                  help="... of this experiment config (with --topology; its file name labels the rows)")
  ap.add_argument("--no-search", dest="search", action="store_false",
                  help="compile one sequence per batch shard only, not the search for the largest batch that fits")
  ap.add_argument("--policies", action="store_true", help="the policy table: every model.remat's memory and FLOPs")
  ap.add_argument("--results", type=Path, metavar="DIR",
                  help="also write every row with the command's provenance to DIR/fit.json as it finishes (replacing "
                  "that file's row of the same case and schedule, keeping the others: several invocations fill one "
                  "table), the file scripts/render_results.py renders the published table from")
  ap.add_argument("overrides", nargs="*", help="config overrides (key=value), e.g. attention.impl=pallas")
  args = ap.parse_args(argv)

  command = script_command("scripts/fit_table.py", argv)

  def publish(row: dict) -> None:
    if args.results:
      fit_results.publish(args.results.resolve(), row, provenance([command], fit_results.MEASURE, REPO))

  def table() -> int:
    if args.policies:
      policy_rows(args.lengths if "--lengths" in (argv or sys.argv) else [8192, 32768], args.overrides, publish)
    elif args.topology:
      cases = [(args.config.stem, t, args.config, (f"data.seq_len={n}", "train.batch_size=1"), "script_fit_table")
               for t in args.topology for n in args.lengths]
      fit_rows(cases, args.remat, args.schedules, args.overrides, args.search, publish)
    else:
      cases = [tuple(SCENARIOS[s]) for s in smoke.first(args.scenario or list(SCENARIOS))]
      fit_rows(cases, args.remat, args.schedules, args.overrides, args.search, publish)
    return 0

  return report_input_errors(table)


if __name__ == "__main__":
  sys.exit(main())
