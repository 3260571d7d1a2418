#!/usr/bin/env python
"""Attention kernels side by side: the Pallas kernels, ``jax.nn.dot_product_attention`` (cuDNN on GPU) and the XLA
reference, for full attention, a CLA consumer (another layer's K/V) and probability reuse (another layer's Q, K and
log-sum-exp applied to this layer's V).

On a GPU or TPU: forward and forward+backward milliseconds and TFLOP/s per implementation at each T and head width,
and the ratios the kernels issue targets (Pallas / cuDNN forward+backward at T = 4096, d = 128; probability reuse
against full attention). On a CPU there is nothing to time (interpret mode measures the interpreter): the script
runs the interpret-mode correctness sweep against the reference instead and says so.

Usage: python scripts/bench_attention.py [--lengths 1024 4096 16384] [--widths 64 128] [--batch 4 --heads 16
       --kv-heads 4] [--dtype bfloat16] [--repeats 10] [--impls pallas cudnn]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxshare.kernels import flash, reference, xla
from jaxshare.kernels.dispatch import get_attention


def _inputs(b, t, h, g, d, dtype, seed=0, backend="interpret"):
  keys = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(keys[0], (b, t, h, d), dtype)
  k, v, v2 = (jax.random.normal(key, (b, t, g, d), dtype) for key in keys[1:])
  seg = jnp.ones((b, t), jnp.int32)
  # the probability source's log-sum-exp, from the kernel on an accelerator (XLA's [B, H, T, T] is 64 GB at T = 16k)
  source = xla.attention if backend == "interpret" else functools.partial(flash.attention, backend=backend)
  lse = source(q, k, v, seg, seg, return_lse=True)[1]
  return q, k, v, v2, seg, lse


def roles(impl: dict) -> dict:
  """Each role's loss ``(q, k, v, v2, seg, lse) -> scalar`` under one implementation's two functions."""
  attention, reuse = impl["attention"], impl["reuse"]
  return {
    "full": lambda q, k, v, v2, seg, lse: jnp.sum(attention(q, k, v, seg, seg).astype(jnp.float32)),
    # a CLA consumer: its own queries, the producer's K/V (gradients flow to both)
    "cla_consumer": lambda q, k, v, v2, seg, lse: jnp.sum(attention(q * 0.5, k, v, seg, seg).astype(jnp.float32)),
    "prob_reuse": lambda q, k, v, v2, seg, lse: jnp.sum(reuse(q, k, lse, v2, seg, seg,
                                                              scale=q.shape[-1] ** -0.5).astype(jnp.float32)),
  }


def implementations(backend: str) -> dict:
  impls = {
    "pallas": {"attention": functools.partial(flash.attention, backend=backend),
               "reuse": functools.partial(flash.attention_from_lse, backend=backend)},
    "xla_reference": {"attention": xla.attention, "reuse": get_attention("xla").attention_from_lse},
  }
  if backend == "triton":  # cuDNN flash attention; probability reuse has no cuDNN form
    def cudnn(q, k, v, qs, ks, **_):
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    impls["cudnn"] = {"attention": cudnn, "reuse": None}
  return impls


def time_call(fn, args, repeats) -> float:
  """Seconds per call of ``fn(*args)``, the mean of ``repeats`` back-to-back calls after one warm-up call."""
  out = fn(*args)
  jax.block_until_ready(out)
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / repeats


def flops(b, t, h, d, backward: bool) -> float:
  """Causal attention FLOPs: two matmuls of 2·T²·d per head, halved by the mask; backward 2.5x the forward."""
  fwd = 2 * 2 * b * h * t * t * d / 2
  return fwd * (3.5 if backward else 1.0)


def bench(args, backend: str) -> None:
  rows = []
  for t in args.lengths:
    for d in args.widths:
      inputs = _inputs(args.batch, t, args.heads, args.kv_heads, d, jnp.dtype(args.dtype), backend=backend)
      for impl_name, impl in implementations(backend).items():
        if args.impls and impl_name not in args.impls:
          continue
        for role, loss in roles(impl).items():
          if role == "prob_reuse" and impl["reuse"] is None:
            continue
          fwd = jax.jit(loss)
          bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
          try:
            tf, tb = time_call(fwd, inputs, args.repeats), time_call(bwd, inputs, args.repeats)
          except Exception as e:  # an implementation that cannot run this shape (memory, cuDNN limits)
            print(f"T={t} d={d} {impl_name} {role}: {type(e).__name__}: {str(e)[:120]}")
            continue
          f = flops(args.batch, t, args.heads, d, False)
          rows.append((t, d, impl_name, role, tf * 1e3, tb * 1e3, f / tf / 1e12, flops(
            args.batch, t, args.heads, d, True) / tb / 1e12))
          print(f"T={t:6d} d={d:4d} {impl_name:14s} {role:13s} fwd {tf * 1e3:8.3f} ms {rows[-1][6]:6.1f} TFLOP/s   "
                f"fwd+bwd {tb * 1e3:8.3f} ms {rows[-1][7]:6.1f} TFLOP/s", flush=True)
  by = {(r[0], r[1], r[2], r[3]): r for r in rows}
  print("\nratios (fwd+bwd time of the second over the first):")
  for t in args.lengths:
    for d in args.widths:
      pairs = [(("cudnn", "full"), ("pallas", "full")), (("pallas", "prob_reuse"), ("pallas", "full")),
               (("xla_reference", "full"), ("pallas", "full"))]
      for (i1, r1), (i2, r2) in pairs:
        a, b = by.get((t, d, i1, r1)), by.get((t, d, i2, r2))
        if a and b:
          print(f"  T={t} d={d}: {i2}/{r2} vs {i1}/{r1}: {a[5] / b[5]:.2f}x speed")


def correctness_sweep() -> None:
  """Interpret-mode kernels against the reference (fp32 and bf16), the numbers a CPU can give."""
  print("No GPU or TPU: timings need an accelerator. Interpret-mode correctness sweep against the XLA reference:")
  for t, h, g, d in ((64, 4, 4, 32), (100, 8, 2, 64), (256, 8, 1, 128)):
    for dtype in (jnp.float32, jnp.bfloat16):
      q, k, v, v2, seg, lse = _inputs(1, t, h, g, d, dtype)
      pallas = roles(implementations("interpret")["pallas"])
      ref = roles({"attention": reference.attention, "reuse": reference.attention_from_lse})
      for role in pallas:
        got = jax.grad(pallas[role], argnums=(0, 1, 2, 3))(q, k, v, v2, seg, lse)
        want = jax.grad(ref[role], argnums=(0, 1, 2, 3))(q, k, v, v2, seg, lse)
        err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) /
                        max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-30)) for a, b in zip(got, want))
        print(f"  T={t:4d} H={h} G={g} d={d:4d} {jnp.dtype(dtype).name:9s} {role:13s} "
              f"max gradient error / max |gradient| = {err:.1e}")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  ap.add_argument("--widths", type=int, nargs="+", default=[64, 128])
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=16)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--impls", nargs="+", choices=["pallas", "xla_reference", "cudnn"],
                  help="only these implementations (default: all; the XLA reference at T = 16k needs ~64 GB)")
  args = ap.parse_args(argv)
  backend = flash.default_backend()
  if backend == "interpret":
    correctness_sweep()
  else:
    print(f"{jax.devices()[0].device_kind}: Pallas backend {backend}")
    bench(args, backend)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
