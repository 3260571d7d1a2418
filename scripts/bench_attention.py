#!/usr/bin/env python
"""Attention kernels side by side: the Pallas kernels, ``jax.nn.dot_product_attention`` (cuDNN on GPU) and the XLA
reference, for full attention, a CLA consumer (another layer's K/V) and probability reuse (another layer's Q, K and
log-sum-exp applied to this layer's V).

On a GPU or TPU: first the kernels' values and gradients on that backend against the XLA reference (GQA/MQA, packed
documents, a sliding window, lengths off the tile; ``--no-check`` skips it, and the exit status is 1 when a case is
out of tolerance), then forward and forward+backward milliseconds and TFLOP/s per implementation at each T and head
width, and the ratios the kernels issue targets (Pallas / cuDNN forward+backward at T = 4096, d = 128; probability
reuse against full attention). On a CPU there is nothing to time (interpret mode measures the interpreter): the
script runs the correctness check in interpret mode instead and says so.

Usage: python scripts/bench_attention.py [--lengths 1024 4096 16384] [--widths 64 128] [--batch 4 --heads 16
       --kv-heads 4] [--dtype bfloat16] [--repeats 10] [--impls pallas cudnn cudnn_packed cudnn_unpacked]
       [--no-check | --check-only]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxshare.kernels import cudnn, flash, reference, tuning, xla
from jaxshare.kernels.dispatch import get_attention, knowing


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
  if backend == "triton":
    # attention.impl=cudnn as the train step runs it for these rows (one document each: no packed layout), and with
    # cuDNN's packed layout (rows of up to MAX_DOCUMENTS documents); probability reuse as attention over the source's
    # Q and K (no LSE handed on)
    ops = get_attention("cudnn")
    for name, bound in (("cudnn", 1), ("cudnn_packed", cudnn.MAX_DOCUMENTS)):
      impls[name] = {"attention": knowing(bound, ops.attention),
                     "reuse": knowing(bound, lambda q, k, lse, v, qs, ks, **kw: ops.attention_from_lse(
                       q, k, None, v, qs, ks, **kw))}

    def unpacked(q, k, v, qs, ks, **_):  # jax's public cuDNN attention: what the library does without documents
      return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    impls["cudnn_unpacked"] = {"attention": unpacked, "reuse": None}
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
               (("xla_reference", "full"), ("pallas", "full")), (("cudnn_unpacked", "full"), ("cudnn", "full")),
               (("cudnn", "full"), ("cudnn_packed", "full")), (("cudnn", "full"), ("cudnn", "cla_consumer")),
               (("cudnn", "full"), ("cudnn", "prob_reuse")), (("cudnn", "full"), ("pallas", "prob_reuse"))]
      for (i1, r1), (i2, r2) in pairs:
        a, b = by.get((t, d, i1, r1)), by.get((t, d, i2, r2))
        if a and b:
          print(f"  T={t} d={d}: {i2}/{r2} vs {i1}/{r1}: {a[5] / b[5]:.2f}x speed")


def correctness_sweep(backend: str) -> bool:
  """The Pallas kernels on ``backend`` against the XLA reference, values and gradients (fp32 and bf16), at the
  backend's own tile sizes: GQA and MQA, packed documents, a sliding window and lengths that are not a multiple of
  the tile. Prints one line per case and returns whether every relative error is within tolerance (fp32 1e-3,
  bf16 3e-2, of the largest reference magnitude)."""
  print(f"Correctness of the Pallas kernels ({backend}) against the XLA reference (values and gradients of q, k, v, "
        f"v2; error / max |reference|):")
  ok = True
  for t, h, g, d, docs, window in ((64, 4, 4, 32, 1, 0), (100, 8, 2, 64, 2, 0), (256, 8, 1, 128, 3, 0),
                                   (300, 8, 2, 64, 1, 96)):
    for dtype in (jnp.float32, jnp.bfloat16):
      q, k, v, v2, _, _ = _inputs(2, t, h, g, d, dtype)
      seg = jnp.broadcast_to((jnp.arange(t) * docs // t + 1).astype(jnp.int32), (2, t))
      kw = {"window": window}
      lse = reference.attention(q, k, v, seg, seg, return_lse=True, **kw)[1]
      # a random cotangent: a plain sum's gradient leaves errors in directions it does not weigh unseen
      w = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
      cases = {
        "full": (lambda f: lambda q, k, v, v2: jnp.sum(f(q, k, v, seg, seg, **kw).astype(jnp.float32) * w),
                 flash.attention, reference.attention),
        "prob_reuse": (lambda f: lambda q, k, v, v2: jnp.sum(f(q, k, lse, v2, seg, seg, scale=d ** -0.5, **kw)
                                                             .astype(jnp.float32) * w),
                       flash.attention_from_lse, reference.attention_from_lse),
      }
      for role, (loss, kernel, ref) in cases.items():
        mine = loss(functools.partial(kernel, backend=backend))
        want_fn = loss(ref)
        got = (jax.jit(mine)(q, k, v, v2), *jax.jit(jax.grad(mine, argnums=(0, 1, 2, 3)))(q, k, v, v2))
        want = (jax.jit(want_fn)(q, k, v, v2), *jax.jit(jax.grad(want_fn, argnums=(0, 1, 2, 3)))(q, k, v, v2))
        err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) /
                        max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-30)) for a, b in zip(got, want))
        tol = 1e-3 if dtype == jnp.float32 else 3e-2
        ok &= err <= tol
        print(f"  T={t:4d} H={h} G={g} d={d:4d} docs={docs} window={window:3d} {jnp.dtype(dtype).name:9s} "
              f"{role:11s} error {err:.1e} {'ok' if err <= tol else f'ABOVE {tol:.0e}'}", flush=True)
  if backend == "triton":
    ok &= cudnn_sweep()
  return ok


def cudnn_sweep() -> bool:
  """``attention.impl=cudnn`` on this GPU against the XLA reference, values and gradients (bf16, the dtype cuDNN
  takes): full attention (packed documents through cuDNN's packed layout, GQA, a sliding window, lengths off the
  tile) and probability reuse as attention over the source's Q and K. A case cuDNN refuses prints its error."""
  print("Correctness of attention.impl=cudnn against the XLA reference (bf16; values and gradients of q, k, v, v2; "
        "error / max |reference|):")
  ops, ok = get_attention("cudnn"), True
  for t, h, g, d, docs, window in ((1024, 16, 4, 128, 5, 0), (256, 8, 2, 64, cudnn.MAX_DOCUMENTS + 4, 0),
                                   (64, 4, 4, 32, 1, 0), (100, 8, 2, 64, 2, 0), (256, 8, 1, 128, 3, 0),
                                   (300, 8, 2, 64, 1, 96)):
    q, k, v, v2, _, _ = _inputs(2, t, h, g, d, jnp.bfloat16)
    seg = jnp.broadcast_to((jnp.arange(t) * docs // t + 1).astype(jnp.int32), (2, t))
    # one document per row: cuDNN without the packed layout, as the train step runs it; else the per-call choice
    bound = 1 if docs == 1 else None
    fits = bool(reference.documents_fit(seg, cudnn.MAX_DOCUMENTS))
    path = ("cudnn M=1" if bound == 1 else "cudnn") if fits else "fallback"
    w = jax.random.normal(jax.random.PRNGKey(1), q.shape, jnp.float32)
    scale = d ** -0.5
    # a bf16 LISA_plus chain: Q/K features wider than V (d + 44, as 11 layers of rank 4 add), the scale folded in
    extra = jax.random.normal(jax.random.PRNGKey(2), (2, t, h + g, 44), jnp.bfloat16)
    widen = lambda q, k: (jnp.concatenate([(q * d ** -0.5).astype(q.dtype), extra[:, :, :h]], axis=-1),  # noqa: E731
                          jnp.concatenate([k, extra[:, :, h:]], axis=-1))
    cases = {
      "full": (knowing(bound, lambda q, k, v, v2: ops.attention(q, k, v, seg, seg, window=window)),
               lambda q, k, v, v2: reference.attention(q, k, v, seg, seg, window=window)),
      "wide_qk": (knowing(bound, lambda q, k, v, v2: ops.attention(*widen(q, k), v, seg, seg, scale=1.0,
                                                                   window=window)),
                  lambda q, k, v, v2: reference.attention(*widen(q, k), v, seg, seg, scale=1.0, window=window)),
      "prob_reuse": (knowing(bound, lambda q, k, v, v2: ops.attention_from_lse(q, k, None, v2, seg, seg, scale=scale,
                                                                              window=window)),
                     lambda q, k, v, v2: reference.attention(q, k, v2, seg, seg, scale=scale, window=window)),
    }
    for role, (mine, want) in cases.items():
      loss_mine, loss_want = (lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w))(mine), \
          (lambda f: lambda *a: jnp.sum(f(*a).astype(jnp.float32) * w))(want)
      try:
        got = (jax.jit(mine)(q, k, v, v2), *jax.jit(jax.grad(loss_mine, argnums=(0, 1, 2, 3)))(q, k, v, v2))
      except Exception as e:  # a shape cuDNN refuses at run time: the message is the finding
        ok = False
        print(f"  T={t:4d} H={h} G={g} d={d:4d} docs={docs:2d} window={window:3d} {role:11s} {path:9s} FAILED "
              f"{type(e).__name__}: {str(e)[:300]}", flush=True)
        continue
      ref = (jax.jit(want)(q, k, v, v2), *jax.jit(jax.grad(loss_want, argnums=(0, 1, 2, 3)))(q, k, v, v2))
      err = max(float(np.max(np.abs(np.asarray(a, np.float32) - np.asarray(b, np.float32))) /
                      max(float(np.max(np.abs(np.asarray(b, np.float32)))), 1e-30)) for a, b in zip(got, ref))
      ok &= err <= 3e-2
      print(f"  T={t:4d} H={h} G={g} d={d:4d} docs={docs:2d} window={window:3d} {role:11s} {path:9s} error {err:.1e} "
            f"{'ok' if err <= 3e-2 else 'ABOVE 3e-02'}", flush=True)
  return ok


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
  ap.add_argument("--widths", type=int, nargs="+", default=[64, 128])
  ap.add_argument("--batch", type=int, default=4)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=16)
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--impls", nargs="+", choices=["pallas", "xla_reference", "cudnn", "cudnn_packed", "cudnn_unpacked"],
                  help="only these implementations (default: all; the XLA reference at T = 16k needs ~64 GB)")
  ap.add_argument("--no-check", action="store_true", help="skip the correctness check that runs before the timings")
  ap.add_argument("--check-only", action="store_true", help="run the correctness check alone, without timings")
  args = ap.parse_args(argv)
  backend = tuning.default_backend()
  if backend == "interpret" or args.check_only:
    if backend == "interpret":
      print("No GPU or TPU: timings need an accelerator; interpret mode checks correctness only.")
    return 0 if correctness_sweep(backend) else 1
  print(f"{jax.devices()[0].device_kind}: Pallas backend {backend}")
  ok = args.no_check or correctness_sweep(backend)
  bench(args, backend)
  return 0 if ok else 1


if __name__ == "__main__":
  raise SystemExit(main())
