#!/usr/bin/env python
"""Block sizes and Triton launch parameters of the flash kernels, measured on the GPU at hand.

For each (block_q, block_k, num_warps, num_stages) the forward, dQ and dK/dV kernels all run with that launch
(``jaxshare.kernels.tuning.TRITON_LAUNCH``); the script times full causal attention forward and forward+backward
(the backward is their difference) at each T and head width, against cuDNN, and prints the best configuration per
phase. A configuration that does not compile (shared memory, registers) is printed with its error and skipped.
Without a GPU it sweeps the tile sizes in Pallas interpret mode against XLA attention: a check that it runs, not a
measurement.

  python scripts/tune_attention.py --lengths 4096 --widths 64 128
"""

from __future__ import annotations

import argparse
import functools
import itertools

import jax
import jax.numpy as jnp

from bench_attention import time_call  # scripts/ is on the path of a script run from it
from jaxshare.kernels import flash, tuning, xla


def _losses(attention):
  fwd = jax.jit(lambda q, k, v, seg: jnp.sum(attention(q, k, v, seg, seg).astype(jnp.float32)))
  return fwd, jax.jit(jax.grad(lambda q, k, v, seg: jnp.sum(attention(q, k, v, seg, seg).astype(jnp.float32)),
                               argnums=(0, 1, 2)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", type=int, nargs="+", default=[4096])
  ap.add_argument("--widths", type=int, nargs="+", default=[64, 128])
  ap.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128])
  ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
  ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--repeats", type=int, default=5)
  args = ap.parse_args(argv)
  backend = tuning.default_backend()
  print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}, Pallas backend {backend}", flush=True)
  names = ("jaxshare_flash_forward", "jaxshare_flash_dq", "jaxshare_flash_dkv")
  if backend == "triton":
    baseline_name, baseline = "cudnn", lambda q, k, v, qs, ks: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn")
  else:  # no cuDNN here: XLA attention, so that the sweep still runs
    baseline_name, baseline = "xla", xla.attention
  for t, d in itertools.product(args.lengths, args.widths):
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    qkv = [jax.random.normal(key, (args.batch, t, args.heads, d), jnp.bfloat16) for key in keys]
    seg = jnp.ones((args.batch, t), jnp.int32)
    ref = _losses(baseline)
    ref_f, ref_b = time_call(ref[0], (*qkv, seg), args.repeats), time_call(ref[1], (*qkv, seg), args.repeats)
    print(f"T={t} d={d} {baseline_name}: fwd {1e3 * ref_f:.3f} ms, bwd {1e3 * (ref_b - ref_f):.3f} ms", flush=True)
    rows = []
    for bq, bk, warps, stages in itertools.product(args.blocks, args.blocks, args.warps, args.stages):
      for name in names:
        tuning.TRITON_LAUNCH[name] = (warps, stages)
      fwd, grad = _losses(functools.partial(flash.attention, backend=backend, block_q=bq, block_k=bk))
      try:
        tf, tb = time_call(fwd, (*qkv, seg), args.repeats), time_call(grad, (*qkv, seg), args.repeats)
      except Exception as e:  # a launch that does not fit the chip: report and go on
        print(f"  bq={bq:3d} bk={bk:3d} warps={warps} stages={stages}: {type(e).__name__}: {str(e)[:150]}",
              flush=True)
        continue
      rows.append((tf, tb - tf, bq, bk, warps, stages))
      print(f"  bq={bq:3d} bk={bk:3d} warps={warps} stages={stages}: fwd {1e3 * tf:8.3f} ms "
            f"({ref_f / tf:.2f}x {baseline_name})  bwd {1e3 * (tb - tf):8.3f} ms "
            f"({(ref_b - ref_f) / (tb - tf):.2f}x {baseline_name})", flush=True)
    if rows:
      best_f, best_b = min(rows), min(rows, key=lambda r: r[1])
      print(f"T={t} d={d} best forward: bq={best_f[2]} bk={best_f[3]} warps={best_f[4]} stages={best_f[5]} "
            f"{ref_f / best_f[0]:.2f}x {baseline_name}; best backward: bq={best_b[2]} bk={best_b[3]} warps={best_b[4]} "
            f"stages={best_b[5]} {(ref_b - ref_f) / best_b[1]:.2f}x {baseline_name}", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
