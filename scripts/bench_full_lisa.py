#!/usr/bin/env python
"""Full LISA (ffn/linear aligners): memory and time of the chunked recompute path against materialised logits.

Side by side in one run, for each sequence length: the compiled train-gradient program's temporary memory
(``memory_analysis()``) and its step time, with ``attention.score_sharing=materialize`` (the chain carries
``[B, H, T, T]`` logits) and ``recompute`` (the chain carries features; logits recomputed in 128-row query chunks).

Usage: python scripts/bench_full_lisa.py [--lengths 512 1024] [--integrator ffn] [--repeats 3] [overrides ...]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare.config import load_config
from jaxshare.plan import plan_of
from jaxshare.model import build_model

BASE = ["model.num_layers=4", "model.d_model=64", "model.num_heads=4", "model.mlp_dim=128", "train.batch_size=2",
        "schedule.kind=lisa", "schedule.lisa.layers=[1,2,3]", "schedule.lisa.hidden=16", "attention.impl=xla"]


def measure(overrides: list[str], repeats: int) -> tuple[float, float]:
  """``(temporary bytes, seconds per gradient step)`` of the model's loss gradient."""
  cfg = load_config(None, overrides)
  model = build_model(plan_of(cfg), 0)
  graphdef, params = nnx.split(model, nnx.Param)
  x = jax.random.randint(jax.random.key(0), (cfg.train.batch_size, cfg.data.seq_len), 0, cfg.model.vocab_size)
  compiled = jax.jit(jax.grad(lambda p: jnp.mean(nnx.merge(graphdef, p)(x) ** 2))).trace(params).lower().compile()
  jax.block_until_ready(compiled(params))
  start = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(compiled(params))
  return compiled.memory_analysis().temp_size_in_bytes, (time.perf_counter() - start) / repeats


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", type=int, nargs="+", default=[512, 1024])
  ap.add_argument("--integrator", choices=["ffn", "linear"], default="ffn")
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("overrides", nargs="*")
  args = ap.parse_intermixed_args(argv)
  for t in args.lengths:
    common = BASE + [f"data.seq_len={t}", f"schedule.lisa.integrator={args.integrator}", *args.overrides]
    (mem_m, s_m), (mem_r, s_r) = (measure(common + [f"attention.score_sharing={mode}"], args.repeats)
                                  for mode in ("materialize", "recompute"))
    print(f"T={t:5d}  materialize {mem_m / 2 ** 20:8.1f} MiB {s_m * 1e3:8.0f} ms | recompute {mem_r / 2 ** 20:8.1f} "
          f"MiB {s_r * 1e3:8.0f} ms | memory {mem_m / mem_r:.1f}x less, time {s_r / s_m:.2f}x", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
