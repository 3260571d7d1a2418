"""Inference efficiency of a model under its schedule, measured: KV bytes per token (accounting and live cache), the
largest batch whose cache fits a memory budget (MLKV Fig. 3), decode tokens/s, prefill latency (UniAttn's time to
first token) and the compiled decode step's peak memory."""

from __future__ import annotations

import math
import time
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxshare.evaluation.generate import decode_steps, prefill
from jaxshare.store.runs import load_run
from jaxshare.evaluation.sampling import Sampling
from jaxshare.model.cache import init_cache
from jaxshare.plan import ModelPlan

GIB = 1 << 30


def max_batch(plan: ModelPlan, budget_bytes: int, context: int, dtype=None) -> int:
  """The largest batch whose cache of ``context`` tokens fits ``budget_bytes`` (0 if one sequence does not)."""
  per_token = plan.kv_cache_bytes_per_token(jnp.dtype(dtype or plan.model.dtype).itemsize)
  return budget_bytes // (per_token * context)


def _filled(plan, batch, context, steps, dtype):
  """A cache of ``context`` slots whose first ``context - steps`` count as written (their contents do not change
  the work), so that ``steps`` decode steps fill it."""
  if steps >= context:
    raise ValueError(f"decode steps={steps} must be fewer than the context={context}")
  cache = init_cache(plan, batch, context, dtype)
  return cache.replace(index=jnp.asarray(context - steps, jnp.int32))


def decode_speed(model: nnx.Module, plan: ModelPlan, *, batch: int, context: int,
                 steps: int = 32, dtype=None, repeats: int = 2) -> dict[str, float]:
  """Greedy decode of the last ``steps`` tokens of a ``context``-slot cache per row (one compiled, scanned call).

  Returns:
    ``tokens_per_s`` (batch × steps / best wall time of ``repeats`` calls, compile excluded), ``step_ms``,
    ``peak_bytes`` (the compiled call's arguments + outputs + temporaries, XLA's memory analysis; donated buffers
    counted once), ``cache_bytes`` (the live cache's buffers).
  """
  graphdef, params = nnx.split(model)
  logits = jnp.zeros((batch, plan.model.vocab_size), jnp.float32)
  done = jnp.zeros(batch, bool)
  cache_bytes = []

  def make_args(cache=None):  # a fresh cache per call: the call donates it
    if cache is None:
      cache = _filled(plan, batch, context, steps, dtype)
      cache_bytes.append(cache.nbytes)
    return params, cache, logits, done, jax.random.key(0), jnp.asarray([-1], jnp.int32), jnp.asarray(0)

  # Compiled from shapes: a cache allocated only to lower the call would double the memory at the largest batch.
  abstract = jax.eval_shape(lambda: _filled(plan, batch, context, steps, dtype))
  compiled = decode_steps.lower(graphdef, *make_args(abstract), sampling=Sampling(), chunk=steps, pad_id=0).compile()
  mem = compiled.memory_analysis()
  peak = (mem.argument_size_in_bytes + mem.output_size_in_bytes - mem.alias_size_in_bytes
          + mem.temp_size_in_bytes) if mem is not None else float("nan")
  best = _best_seconds(compiled, make_args, repeats)
  return {"tokens_per_s": batch * steps / best, "step_ms": 1e3 * best / steps, "peak_bytes": peak,
          "cache_bytes": cache_bytes[-1]}


def prefill_latency(model: nnx.Module, plan: ModelPlan, *, context: int, dtype=None,
                    repeats: int = 2) -> float:
  """Seconds to prefill one prompt of ``context`` tokens into an empty cache (time to first token's logits)."""
  graphdef, params = nnx.split(model)
  tokens = jnp.zeros((1, context), jnp.int32)
  return _best_seconds(lambda *a: prefill(graphdef, *a, False), lambda: (params, tokens, init_cache(
    plan, 1, context, dtype)), repeats)


def _best_seconds(run, make_args, repeats: int) -> float:
  """Best wall time of ``repeats`` calls ``run(*make_args())`` after one warm-up call; arguments are made (and
  ready) before the clock starts."""
  best = math.inf
  for _ in range(repeats + 1):
    args = jax.block_until_ready(make_args())
    start = time.perf_counter()
    jax.block_until_ready(run(*args))
    best = min(best, time.perf_counter() - start)
  return best


def measure(model: nnx.Module, plan: ModelPlan, *, name: str, budget_gib: float = 4.0,
            max_batch_context: int = 8192, contexts: tuple[int, ...] = (512,), batch: int = 4, steps: int = 32,
            prefill_context: int = 512, time_max_batch: bool = True, dtype=None) -> dict[str, Any]:
  """Every efficiency figure of one model; see the module docstring.

  Args:
    budget_gib / max_batch_context: the cache budget and context of the largest-batch figure.
    contexts / batch: decode tokens/s at this fixed batch for each context.
    time_max_batch: also time decoding at the largest batch and ``max_batch_context`` (allocates the budget).
    dtype: the cache dtype (default: the compute dtype).
  """
  dtype = jnp.dtype(dtype or plan.model.dtype)
  per_token = plan.kv_cache_bytes_per_token(dtype.itemsize)
  probe = init_cache(plan, 1, 1, dtype)
  biggest = max_batch(plan, int(budget_gib * GIB), max_batch_context, dtype)
  row = {"name": name, "schedule": plan.schedule.describe(), "kv_bytes_per_token": per_token,
         "kv_bytes_per_token_measured": probe.nbytes, "cache_dtype": str(dtype), "budget_gib": budget_gib,
         "max_batch_context": max_batch_context, "max_batch": biggest,
         "prefill_context": prefill_context,
         "prefill_s": prefill_latency(model, plan, context=prefill_context, dtype=dtype), "decode": []}
  for context in contexts:
    row["decode"].append({"batch": batch, "context": context,
                          **decode_speed(model, plan, batch=batch, context=context, steps=steps, dtype=dtype)})
  if time_max_batch and biggest:
    big = decode_speed(model, plan, batch=biggest, context=max_batch_context, steps=steps, dtype=dtype,
                       repeats=1)
    row["max_batch_decode"] = {"batch": biggest, "context": max_batch_context, **big}
  return row


def measure_run(path: str, **kwargs) -> dict[str, Any]:
  """:func:`measure` for a run directory or checkpoint (its parameters, compute dtype and schedule)."""
  run = load_run(path)
  return measure(run.model(), run.plan, name=str(path), **kwargs)


def format_table(rows: list[dict[str, Any]]) -> str:
  """A Markdown table of :func:`measure` rows, ratios against the first row."""
  base = rows[0]
  contexts = [d["context"] for d in base["decode"]]
  head = ["model", "KV B/token", "KV vs first", f"max batch ({base['budget_gib']:g} GiB, {base['max_batch_context']})",
          "max batch vs first", "decode tok/s at max batch", f"prefill {base['prefill_context']} (s)",
          *[f"decode tok/s (B={base['decode'][0]['batch']}, ctx {c})" for c in contexts],
          f"decode peak MiB (B={base['decode'][0]['batch']}, ctx {contexts[0]})", "decode peak MiB at max batch"]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    big = r.get("max_batch_decode", {})
    cells = [r["name"], f"{r['kv_bytes_per_token']:,}", f"{r['kv_bytes_per_token'] / base['kv_bytes_per_token']:.3f}",
             f"{r['max_batch']:,}", f"{r['max_batch'] / max(base['max_batch'], 1):.3f}",
             f"{big.get('tokens_per_s', float('nan')):,.0f}", f"{r['prefill_s']:.3f}",
             *[f"{d['tokens_per_s']:,.0f}" for d in r["decode"]], f"{r['decode'][0]['peak_bytes'] / 2 ** 20:.1f}",
             f"{big.get('peak_bytes', float('nan')) / 2 ** 20:,.0f}"]
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)
