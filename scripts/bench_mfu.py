#!/usr/bin/env python
"""Train-step throughput and MFU of a ~1B model and its sharing variants on the accelerator at hand.

For each schedule: the experiment's config (default: the ~1.2B Llama of ``configs/experiments/llama_1b_pod.yaml``)
on every local device, one jitted train step (AdamW, mixed precision, the run's own sharding), compiled and warmed
up, then ``--steps`` steps back to back on synthetic device-resident batches. Prints compile seconds, ms per step,
tokens/s and MFU against the device's dense bf16 peak (``jaxshare.train.metrics``), with the model FLOPs of
``jaxshare.accounting.train_flops_per_token`` (attention included, causal halved). Schedules that save attention
FLOPs (probability reuse) are charged only what they compute, so their MFU compares hardware use, not speed; the
tokens/s column compares speed.

  python scripts/bench_mfu.py                                      # dense, cla2, mlkv, uniattn; pallas
  python scripts/bench_mfu.py --schedules dense --impls pallas xla --batch 8 --seq-len 2048

On a CPU the numbers mean nothing at this size; use ``--config configs/experiments/shakespeare_dense.yaml`` there to
check that the script runs.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax

from bench_train import one_document_rows, synthetic_batches  # scripts/ is on the path of a script run from it
from jaxshare.config import load_config
from jaxshare.config.catalogue import schedule_matrix
from jaxshare.parallel import shard_batch
from jaxshare.train.loop import jit_train_step
from jaxshare.train.metrics import resolve_peak
from jaxshare.train.state import init_state, setup_training
from jaxshare.train.step import Objective

ROOT = Path(__file__).resolve().parents[1]

SCHEDULES = schedule_matrix("script_bench_mfu")


def measure(config: Path, overrides: list[str], steps: int) -> dict:
  """Compile seconds, seconds per step and model FLOPs per token of one config's train step."""
  cfg = load_config(config, overrides)
  setup = setup_training(cfg)
  state = init_state(setup)
  b, t = cfg.train.batch_size, cfg.data.seq_len
  batches = [shard_batch(setup.batch_sharding, one_document_rows(x, y))
             for x, y in synthetic_batches({"vocab": cfg.model.vocab_size, "batch": b, "seq_len": t}, n=2)]
  with jax.set_mesh(setup.mesh):
    start = time.perf_counter()
    step = jit_train_step(setup, Objective(), None).lower(state, batches[0], None).compile()
    compile_s = time.perf_counter() - start
    for i in range(2):
      state, metrics = step(state, batches[i % 2], None)
    jax.block_until_ready(metrics)
    start = time.perf_counter()
    for i in range(steps):
      state, metrics = step(state, batches[i % 2], None)
    jax.block_until_ready(metrics)
    per_step = (time.perf_counter() - start) / steps
  mem = step.memory_analysis()
  return {"compile_s": compile_s, "step_s": per_step, "tokens": b * t, "loss": float(metrics["loss"]),
          "flops_per_token": setup.plan.train_flops_per_token(t),
          "params": setup.num_params, "dtype": cfg.model.dtype,
          "temp_gib": None if mem is None else mem.temp_size_in_bytes / 2 ** 30}


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--config", type=Path, default=ROOT / "configs/experiments/llama_1b_pod.yaml")
  ap.add_argument("--schedules", nargs="+", default=["dense", "cla2", "mlkv", "uniattn"], choices=list(SCHEDULES))
  ap.add_argument("--impls", nargs="+", default=["pallas"], help="attention.impl values to compare")
  ap.add_argument("--batch", type=int, default=8, help="sequences per step (global)")
  ap.add_argument("--seq-len", type=int, default=2048)
  ap.add_argument("--steps", type=int, default=10)
  ap.add_argument("overrides", nargs="*", help="further config overrides")
  args = ap.parse_args(argv)
  device = jax.devices()[0]
  print(f"{len(jax.devices())} x {device.device_kind} ({device.platform}), jax {jax.__version__}", flush=True)
  # schedule by schedule, every implementation of one schedule together: a time limit cuts whole schedules
  for name in args.schedules:
    for impl in args.impls:
      overrides = SCHEDULES[name] + [f"attention.impl={impl}", f"train.batch_size={args.batch}",
                                     f"data.seq_len={args.seq_len}", "mesh.fsdp=-1", "train.grad_accum_steps=1"]
      try:
        r = measure(args.config, overrides + args.overrides, args.steps)
      except Exception as e:  # one schedule's failure (memory, a kernel limit) must not hide the others' figures
        print(f"{name:10s} {impl:8s} FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      tps = r["tokens"] / r["step_s"]
      peak = resolve_peak(0.0, len(jax.devices()), r["dtype"])
      mfu = "" if peak is None else f" MFU {100 * r['flops_per_token'] * tps / peak.flops_per_sec:5.1f}%"
      temp = "" if r["temp_gib"] is None else f" temp {r['temp_gib']:.1f} GiB"
      print(f"{name:10s} {impl:8s} {r['params'] / 1e9:.2f}B params  compile {r['compile_s']:6.1f} s  "
            f"{1e3 * r['step_s']:8.1f} ms/step  {tps:10,.0f} tok/s{mfu}{temp}  loss {r['loss']:.3f}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
