"""How much of the training loop's wall time is not the train step: data, host-device transfer, logging, metrics,
checkpointing (validation excluded, as in the loop's own tokens/s).

Two measurements of the default experiment (real data from ../shared/data, its logging and checkpoint cadence):
- the host work budget: each piece of the loop's host work timed on its own (next batch + transfer, one metrics
  record, one checkpoint save) and amortised per step, as a share of the step. On 2 cores XLA uses both, so host
  work costs about its own duration even when it overlaps the asynchronous step: this is the overhead's upper bound,
  and it is stable (the pieces are timed hundreds of times);
- end to end: ``train()`` for ``--steps`` steps against the same jitted step back to back on device-resident batches,
  alternated ``--rounds`` times. The machine's run-to-run noise (15-20%) swamps a few-percent overhead here; it is
  printed as a cross-check.

  python scripts/bench_loop.py
  python scripts/bench_loop.py --config configs/experiments/shakespeare_cla2.yaml --steps 400
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax

from jaxshare.config import load_config
from jaxshare.data import Datasets
from jaxshare.train.loop import jit_train_step, train
from jaxshare.train.state import init_state, setup_training
from jaxshare.parallel import shard_batch
from jaxshare.train.step import Objective

ROOT = Path(__file__).resolve().parents[1]


def loop_seconds_per_step(cfg, steps: int, run_dir: Path) -> float:
  """Seconds per step of ``train()`` after its first logging interval (compilation), validation excluded."""
  train(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, run_dir=str(run_dir), steps=steps)))
  records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
  later = records[1:]
  n = later[-1]["step"] - records[0]["step"]
  return sum(r["step_time"] * (r["step"] - p["step"]) for p, r in zip(records, later)) / n


def pure_seconds_per_step(cfg, steps: int) -> float:
  """The same jitted step, back to back, on batches already on the device."""
  setup = setup_training(cfg)
  state = init_state(setup)
  step_fn = jit_train_step(setup, Objective(), None)
  it = Datasets(cfg.data, cfg.train.batch_size).train_iter()
  batches = [shard_batch(setup.batch_sharding, next(it)) for _ in range(4)]
  with jax.set_mesh(setup.mesh):
    state, metrics = step_fn(state, batches[0], None)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(steps):
      state, metrics = step_fn(state, batches[i % 4], None)
    jax.block_until_ready(metrics)
  return (time.perf_counter() - start) / steps


def host_work_ms(cfg, run_dir: Path) -> dict[str, float]:
  """Milliseconds per step of each piece of the loop's host work, amortised over its cadence."""
  from jaxshare.store.checkpoint import Checkpointer
  from jaxshare.train.metrics import MetricsLogger

  setup = setup_training(cfg)
  state = init_state(setup)
  it = Datasets(cfg.data, cfg.train.batch_size).train_iter()
  n = 200
  for _ in range(n):  # the first transfers are slow (allocator and dispatch warm-up); time the steady state
    jax.block_until_ready(shard_batch(setup.batch_sharding, next(it)))
  start = time.perf_counter()
  for _ in range(n):
    jax.block_until_ready(shard_batch(setup.batch_sharding, next(it)))
  data = (time.perf_counter() - start) / n
  log = MetricsLogger(run_dir, 10, 0, False)
  record = {"step": 1, "loss": 1.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_sec": 1.0, "step_time": 1.0,
            "trainable_params": 1, "mfu": 0.1}
  start = time.perf_counter()
  for i in range(n):
    log.write(dict(record, step=i))
  logging = (time.perf_counter() - start) / n
  log.close()
  ckpt = Checkpointer(run_dir / "checkpoints", 2)
  saves = []
  for step in (1, 2, 3):
    start = time.perf_counter()
    ckpt.save(step, state.as_dict(), it, {"step": step})
    ckpt.wait()
    saves.append(time.perf_counter() - start)
  ckpt.close()
  t = cfg.train
  return {"data + transfer": 1e3 * data, "logging": 1e3 * logging / t.log_every,
          "checkpoint": 1e3 * statistics.median(saves) / t.checkpoint_every}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", default=str(ROOT / "configs/experiments/shakespeare_cla2.yaml"))
  parser.add_argument("--steps", type=int, default=300, help="loop steps per round (the loop logs every "
                      "train.log_every and checkpoints every train.checkpoint_every, as configured)")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("overrides", nargs="*", help="config overrides")
  args = parser.parse_intermixed_args()
  cfg = load_config(args.config, [*args.overrides, "train.progress_bar=false", "train.eval_every=0"])
  if args.steps < 2 * cfg.train.log_every:  # the first interval (compilation) is left out: a second must follow
    parser.error(f"--steps {args.steps}: the loop is timed after its first logging interval, so it needs at least "
                 f"two (>= {2 * cfg.train.log_every} steps at train.log_every={cfg.train.log_every})")
  pure = pure_seconds_per_step(cfg, 50)
  with tempfile.TemporaryDirectory() as tmp:
    pieces = host_work_ms(cfg, Path(tmp))
  total = sum(pieces.values())
  print("host work per step: " + ", ".join(f"{k} {v:.2f} ms" for k, v in pieces.items())
        + f"; total {total:.2f} ms = {100 * total / (1e3 * pure):.2f}% of the {1e3 * pure:.0f} ms step", flush=True)
  overheads = []
  for r in range(args.rounds):
    cfg = load_config(args.config, [*args.overrides, "train.progress_bar=false", "train.eval_every=0"])
    pure = pure_seconds_per_step(cfg, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
      loop = loop_seconds_per_step(cfg, args.steps, Path(tmp))
    overheads.append(1 - pure / loop)
    print(f"round {r}: loop {loop * 1e3:.1f} ms/step, pure step {pure * 1e3:.1f} ms/step, "
          f"overhead {100 * overheads[-1]:.1f}% of wall time", flush=True)
  if not overheads:
    return
  print(f"median overhead {100 * statistics.median(overheads):.1f}% (logging every "
        f"{cfg.train.log_every}, checkpoint every {cfg.train.checkpoint_every} steps)")


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()  # before JAX allocates anything: see jaxshare/allocator.py
  main()
