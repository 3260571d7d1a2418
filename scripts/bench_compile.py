#!/usr/bin/env python
"""Compile time of the jitted train step against depth, for every sharing preset.

Usage: python scripts/bench_compile.py [--layers 12 24 48] [--only NAME ...] [--override KEY=VALUE ...]
                                      [--results DIR]

For each preset the default experiment's model (configs/experiments/shakespeare_cla2.yaml: byte-level Llama,
d_model 128, 4 heads, T=128) is built at each depth; the train step (forward, backward, AdamW) is lowered and
compiled ahead of time from abstract inputs, and the seconds are printed side by side with the ratio of the deepest
to the shallowest. Scanned superblocks and scanned runs of identical layers inside them keep every ratio near 1
under a remat policy (``--override model.remat=full``); without remat (the experiment's default) a stack of
superblocks of several layers is unrolled for memory (``jaxshare.model.block.unrolled``), so those presets' compile
time grows with depth. ``unrolled`` (``model.scan_layers=false``) shows what depth costs without scanning. Timings on a shared 2-core
machine vary by 10-20%: read the ratios, measured in one run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402

from jaxshare.config import REPO_ROOT, load_config  # noqa: E402
from jaxshare.data.batch import Batch  # noqa: E402
from jaxshare.train.state import abstract_state, setup_training  # noqa: E402
from jaxshare.sweep.provenance import publish_table, script_command  # noqa: E402
from jaxshare.train.step import make_train_step  # noqa: E402

EXPERIMENT = Path(__file__).resolve().parent.parent / "configs/experiments/shakespeare_cla2.yaml"

# Depth-independent knobs only, so that one override list describes the preset at every depth.
PRESETS: dict[str, list[str]] = {
  "dense": ["schedule.kind=dense"],
  "gqa": ["schedule.kind=gqa", "schedule.kv_heads=2"],
  "mqa": ["schedule.kind=mqa"],
  "cla2": ["schedule.kind=cla", "schedule.factor=2"],
  "cla4": ["schedule.kind=cla", "schedule.factor=4"],
  "mlkv_m3": ["schedule.kind=mlkv", "schedule.kv_layers=3", "schedule.kv_heads=2"],
  "mlkv_m3_paper": ["schedule.kind=mlkv", "schedule.kv_layers=3", "schedule.kv_heads=2", "schedule.placement=paper"],
  "sa": ["schedule.kind=sa"],
  "sa_paper": ["schedule.kind=sa", "schedule.sa.semantics=paper"],
  "uniattn": ["schedule.kind=uniattn"],
  "lisa": ["schedule.kind=lisa"],
  "lisa_sl": ["schedule.kind=lisa", "schedule.lisa.integrator=linear"],
  "lisa_plus": ["schedule.kind=lisa_plus"],
  "ds": ["schedule.kind=ds"],
  "headwise": ["schedule.kind=headwise", "schedule.headwise.ratio=0.3"],
  "gqa+uniattn": ["schedule.kind=gqa+uniattn", "schedule.kv_heads=2"],
  "gqa+lisa_plus": ["schedule.kind=gqa+lisa_plus", "schedule.kv_heads=2"],
  "mqa+sa": ["schedule.kind=mqa+sa"],
  "unrolled": ["schedule.kind=dense", "model.scan_layers=false"],
}


def compile_seconds(overrides: list[str], num_layers: int) -> tuple[float, float]:
  """(lower seconds, compile seconds) of the train step of the default experiment at ``num_layers``."""
  cfg = load_config(EXPERIMENT, [*overrides, f"model.num_layers={num_layers}", "train.batch_size=8"])
  setup = setup_training(cfg)
  step = make_train_step(setup.graphdef, setup.tx, setup.lr_schedule, cfg.train.grad_accum_steps)
  jitted = jax.jit(step, in_shardings=(setup.state_shardings, setup.batch_sharding),
                   out_shardings=(setup.state_shardings, None), donate_argnums=0)
  batch = Batch.spec(cfg.train.batch_size, cfg.data.seq_len, setup.batch_sharding)
  t0 = time.perf_counter()
  with jax.set_mesh(setup.mesh):
    lowered = jitted.lower(abstract_state(setup), batch)
  t1 = time.perf_counter()
  lowered.compile()
  t2 = time.perf_counter()
  return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, nargs="+", default=[12, 24, 48], help="depths to compile")
  parser.add_argument("--only", nargs="*", default=None, help="presets to run (default: all)")
  parser.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                      help="config override for every preset, e.g. model.remat=full (repeatable)")
  parser.add_argument("--results", type=Path, metavar="DIR", help="also write the table with this command's "
                      "provenance to DIR/table.json (published by scripts/render_results.py)")
  args = parser.parse_args(argv)
  names = [n for n in PRESETS if not args.only or n in args.only]
  depths = sorted(args.layers)
  compile_seconds([*args.override, *PRESETS["dense"]], depths[0])  # warm-up: first-use costs stay out of the table
  header = ["preset"] + [f"L={n} (s)" for n in depths] + [f"ratio {depths[-1]}/{depths[0]}"]
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  print("\n".join(lines))
  for name in names:
    secs = [sum(compile_seconds([*args.override, *PRESETS[name]], n)) for n in depths]
    cells = [name] + [f"{s:.2f}" for s in secs] + [f"{secs[-1] / secs[0]:.2f}x"]
    lines.append("| " + " | ".join(cells) + " |")
    print(lines[-1], flush=True)
  if args.results:
    command = script_command("scripts/bench_compile.py", argv)
    publish_table(args.results.resolve(), lines, [command], f"seconds to lower and compile the train step on "
                  f"{os.cpu_count()} CPU threads, one run", REPO_ROOT)
  return 0


if __name__ == "__main__":
  sys.exit(main())
