#!/usr/bin/env python
"""Decode efficiency of sharing schedules of one base model, side by side in one run.

For each schedule (random weights; the speed does not depend on them) or run directory: KV bytes per token (the
accounting and the live cache), the largest batch whose cache fits ``--budget-gib`` at ``--max-batch-context``
tokens (MLKV Fig. 3) and decode tokens/s at that batch, decode tokens/s at a fixed batch for each of
``--contexts``, prefill latency and the decode step's peak memory. With ``--hf`` the dense model is also exported
with the converter and transformers' PyTorch ``generate`` is timed against jaxshare's on the same prompts and
weights (their logits are compared too). With ``--torch`` every schedule is exported (remote code where no
transformers class holds it) and run by PyTorch outside jaxshare: cache bytes per token measured from the cache's
allocated tensors beside the accounting's, decode tokens/s and the process's peak memory at ``--torch-batch`` x
``--torch-context`` tokens. Writes ``decode.md``, ``decode.json`` and, for runs, ``pareto.png`` (validation loss
against KV bytes per token).

Usage:
  python scripts/bench_decode.py                                   # dense, cla2, mlkv, uniattn, lisa_plus; 8 layers
  python scripts/bench_decode.py --runs runs/a runs/b --out bench/decode_runs
  python scripts/bench_decode.py --schedules dense cla2 --contexts 256 1024 --hf --out /tmp/bench
  python scripts/bench_decode.py --torch --out bench/decode_torch            # the exported PyTorch models
  python scripts/bench_decode.py --torch --out bench/decode_torch --results results/decode_torch  # docs/results.md's
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from jaxshare.config.catalogue import schedule_matrix  # noqa: E402

BASE_CONFIG = REPO / "configs" / "experiments" / "sharing_base.yaml"
BASE = ["model.num_layers=8"]
SCHEDULES = schedule_matrix("script_bench_decode")
TORCH_THREADS = 2  # the exported models' PyTorch threads (--torch)


def _config(overrides: list[str]):
  from jaxshare.config import load_config

  return load_config(str(BASE_CONFIG), BASE + overrides)


def _model(cfg, seed: int = 0):
  from jaxshare.plan import plan_of
  from jaxshare.model import build_model
  from jaxshare.init.headwise import compute_ties

  schedule = plan_of(cfg).schedule
  return build_model(plan_of(cfg), seed, compute_ties(plan_of(cfg), seed)), schedule


def hf_comparison(cfg, model, schedule, *, batch: int, prompt_len: int, new_tokens: int) -> dict:
  """jaxshare's cached greedy generation against transformers' ``generate`` of the exported weights."""
  import jax.numpy as jnp
  import numpy as np
  import torch
  import transformers
  from flax import nnx

  from jaxshare.config import to_yaml
  from jaxshare.convert.hf_export import export_params
  from jaxshare.evaluation.generate import Generator
  from jaxshare.plan import plan_of

  torch.set_num_threads(TORCH_THREADS)
  prompts = np.random.default_rng(0).integers(1, cfg.model.vocab_size, (batch, prompt_len))
  with tempfile.TemporaryDirectory() as out:
    export_params(plan_of(cfg), nnx.to_pure_dict(nnx.state(model, nnx.Param)), out, config_yaml=to_yaml(cfg),
                  seq_len=cfg.data.seq_len)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  ids = torch.from_numpy(prompts).long()
  kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                do_sample=False, pad_token_id=0)
  with torch.no_grad():
    logit_diff = float(np.abs(hf(ids).logits.numpy() - np.asarray(model(jnp.asarray(prompts)))).max())
    hf.generate(ids, **kwargs)  # warm-up
    t0 = time.perf_counter()
    want = hf.generate(ids, **kwargs)[:, prompt_len:].tolist()
    hf_s = time.perf_counter() - t0
  generator = Generator(model, plan_of(cfg))
  generator.generate(prompts.tolist(), new_tokens, chunk=new_tokens)  # compile
  t0 = time.perf_counter()
  got = generator.generate(prompts.tolist(), new_tokens, chunk=new_tokens)
  jax_s = time.perf_counter() - t0
  # Greedy continuations of random weights diverge at near-ties of the logits; count the agreeing prefix.
  agree = [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), len(g)) for g, w in zip(got, want)]
  return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "max_logit_diff": logit_diff,
          "agreeing_prefix_mean": sum(agree) / len(agree),
          "jaxshare_tokens_per_s": batch * new_tokens / jax_s, "transformers_tokens_per_s": batch * new_tokens / hf_s,
          "ratio": hf_s / jax_s}


def export_schedule(name: str, out: str) -> tuple[str, int]:
  """Export schedule ``name`` (random weights) to ``out``; returns the class written and the accounting's fp32 KV
  bytes per token."""
  from flax import nnx

  from jaxshare.config import to_yaml
  from jaxshare.convert.hf_export import export_params
  from jaxshare.plan import plan_of

  cfg = _config(SCHEDULES[name])
  model, _ = _model(cfg)  # SCHEDULES tie no heads
  arch = export_params(plan_of(cfg), nnx.to_pure_dict(nnx.state(model, nnx.Param)), out, config_yaml=to_yaml(cfg),
                       seq_len=cfg.data.seq_len)
  return arch, plan_of(cfg).kv_cache_bytes_per_token(4)


def torch_measurement(directory: str, *, batch: int, context: int, new_tokens: int) -> dict:
  """An exported model decoded by PyTorch alone (a process that never imports JAX): the cache's allocated bytes per
  token after a ``context``-token prefill of ``batch`` rows, greedy decode tokens/s over ``new_tokens`` steps, and
  the peak RSS added by loading, prefill and decode (above the process after its imports)."""
  import resource

  import numpy as np
  import torch
  import transformers

  from scripts.hf_generate import cache_bytes

  torch.set_num_threads(TORCH_THREADS)
  base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  hf = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, trust_remote_code=True,
                                                         local_files_only=True).eval()
  ids = torch.from_numpy(np.random.default_rng(0).integers(1, hf.config.vocab_size, (batch, context)))
  with torch.no_grad():
    out = hf(ids, use_cache=True, logits_to_keep=1)
    cache = out.cache
    measured = cache_bytes(cache) / (batch * context)
    token = out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
      token = hf(token, cache=cache, use_cache=True).logits[:, -1:].argmax(-1)
    seconds = time.perf_counter() - t0
  return {"batch": batch, "context": context, "cache_bytes_per_token": measured,
          "decode_tokens_per_s": batch * new_tokens / seconds,
          "peak_rss_gib": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 2 ** 20}


def torch_table(rows: list[dict]) -> str:
  """Markdown table of :func:`torch_measurement` rows, ratios against the first (the dense model)."""
  base = rows[0]
  lines = ["| schedule | class | cache B/token (measured) | accounting | ratio to dense (measured / accounting) | "
           "decode tok/s | peak RSS added, GiB |", "|---|---|---|---|---|---|---|"]
  for r in rows:
    measured = r["cache_bytes_per_token"] / base["cache_bytes_per_token"]
    accounted = r["accounting_bytes_per_token"] / base["accounting_bytes_per_token"]
    lines.append(f"| {r['name']} | {r['architecture']} | {r['cache_bytes_per_token']:,.0f} | "
                 f"{r['accounting_bytes_per_token']:,} | {measured:.3f} / {accounted:.3f} | "
                 f"{r['decode_tokens_per_s']:,.0f} | {r['peak_rss_gib']:.2f} |")
  return "\n".join(lines)


def _pareto_plot(rows: list[dict], path: Path) -> None:
  from jaxshare.analysis.plots import loss_vs_kv

  points = [{**r, "name": Path(r["name"]).name} for r in rows if "val_loss" in r]
  loss_vs_kv(points, path, kv_key="kv_bytes_per_token",
             kv_label=f"KV cache, bytes per token ({points[0]['cache_dtype']})", loss_label="validation loss")


def _measure_schedule(name: str, common: dict) -> dict:
  from jaxshare.evaluation.efficiency import measure
  from jaxshare.plan import plan_of

  cfg = _config(SCHEDULES[name])
  model, _ = _model(cfg)
  return measure(model, plan_of(cfg), name=name, **common)


def _measure_run(run: str, common: dict) -> dict:
  from jaxshare.evaluation.efficiency import measure
  from jaxshare.store.runs import load_run

  loaded = load_run(run)
  metrics = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line]
  losses = [m["val_loss"] for m in metrics if "val_loss" in m]
  row = measure(loaded.model(), loaded.plan, name=run, **common)
  return {**row, **({"val_loss": losses[-1]} if losses else {})}


def _hf_dense(batch: int) -> dict:
  cfg = _config(SCHEDULES["dense"])
  model, schedule = _model(cfg)
  return hf_comparison(cfg, model, schedule, batch=batch, prompt_len=64, new_tokens=64)


def _isolated(fn, *args, **kwargs):
  """``fn(*args)`` in a fresh process: every model is measured alone, with nothing of the previous one alive (the
  largest batch fills the budget, and XLA's CPU allocator keeps memory it has freed)."""
  import multiprocessing
  from concurrent.futures import ProcessPoolExecutor

  with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
    return pool.submit(fn, *args, **kwargs).result()


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
  ap.add_argument("--runs", nargs="+", default=[], help="run directories instead of schedules (quality known)")
  ap.add_argument("--budget-gib", type=float, default=4.0)
  ap.add_argument("--max-batch-context", type=int, default=8192)
  ap.add_argument("--contexts", type=int, nargs="+", default=[256, 2048])
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--steps", type=int, default=8, help="decode steps per timed call")
  ap.add_argument("--prefill", type=int, default=1024, help="prompt length of the prefill latency")
  ap.add_argument("--no-max-batch-timing", action="store_true", help="skip timing decode at the largest batch")
  ap.add_argument("--hf", action="store_true", help="also time transformers' generate on the exported dense model")
  ap.add_argument("--torch", action="store_true",
                  help="run the exported PyTorch models (remote code) instead of jaxshare's decode")
  ap.add_argument("--torch-batch", type=int, default=16)
  ap.add_argument("--torch-context", type=int, default=1024)
  ap.add_argument("--torch-new-tokens", type=int, default=32)
  ap.add_argument("--out", default="bench/decode")
  ap.add_argument("--results", type=Path, metavar="DIR", help="also write the table with this command's provenance "
                  "to DIR/table.json (published by scripts/render_results.py)")
  args = ap.parse_args(argv)
  from jaxshare.sweep.provenance import script_command

  args.command = script_command("scripts/bench_decode.py", argv)
  from jaxshare import smoke

  args.schedules = smoke.first(args.schedules)  # JAXSHARE_SMOKE: a quick check of the script, on small caches
  args.budget_gib, args.max_batch_context, args.contexts = smoke.cache_sizes(args.budget_gib, args.max_batch_context,
                                                                             args.contexts)
  args.prefill = min(args.prefill, args.contexts[-1]) if smoke.enabled() else args.prefill
  if args.torch:
    return _torch_main(args)

  from jaxshare.evaluation.efficiency import format_table

  common = dict(budget_gib=args.budget_gib, max_batch_context=args.max_batch_context, contexts=tuple(args.contexts),
                batch=args.batch, steps=args.steps, prefill_context=args.prefill,
                time_max_batch=not args.no_max_batch_timing)
  jobs = [(_measure_run, run) for run in args.runs] or [(_measure_schedule, name) for name in args.schedules]
  rows = []
  for fn, target in jobs:
    rows.append(_isolated(fn, target, common))
    print(format_table(rows[-1:]), flush=True)
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  table = format_table(rows)
  report = {"rows": rows}
  if args.hf:
    report["hf"] = h = _isolated(_hf_dense, args.batch)
    table += (f"\n\nDense model, B={h['batch']}, prompt {h['prompt_len']}, {h['new_tokens']} new tokens (greedy): "
              f"jaxshare {h['jaxshare_tokens_per_s']:,.0f} tok/s, transformers {h['transformers_tokens_per_s']:,.0f} "
              f"tok/s, ratio {h['ratio']:.2f}x; prompt logits differ by at most {h['max_logit_diff']:.1e}, greedy tokens agree "
              f"for {h['agreeing_prefix_mean']:.1f} of {h['new_tokens']} on average")
  print("\n" + table)
  (out / "decode.md").write_text(table + "\n")
  (out / "decode.json").write_text(json.dumps(report, indent=1, default=float))
  if any("val_loss" in r for r in rows):
    _pareto_plot(rows, out / "pareto.png")
  print(f"wrote {out}/decode.md, decode.json" + (", pareto.png" if any("val_loss" in r for r in rows) else ""))
  if args.results:
    import os

    _publish(args, table, f"jaxshare's cached decode, one fresh process per model, on {os.cpu_count()} CPU threads, "
             "one run")
  return 0


def _publish(args, table: str, measure: str) -> None:
  from jaxshare.sweep.provenance import publish_table

  publish_table(args.results.resolve(), table.splitlines(), [args.command], measure, REPO)


def _torch_main(args) -> int:
  names = ["dense", *(n for n in args.schedules if n != "dense")]
  rows = []
  for name in names:
    with tempfile.TemporaryDirectory() as directory:
      arch, accounted = _isolated(export_schedule, name, directory)
      row = _isolated(torch_measurement, directory, batch=args.torch_batch, context=args.torch_context,
                      new_tokens=args.torch_new_tokens)
    rows.append({"name": name, "architecture": arch, "accounting_bytes_per_token": accounted, **row})
    print(torch_table(rows).splitlines()[-1], flush=True)
  table = torch_table(rows)
  equal = all(abs(r["cache_bytes_per_token"] - r["accounting_bytes_per_token"]) < 1e-9 for r in rows)
  table += f"\n\nMeasured cache bytes equal the accounting's for every schedule: {equal}"
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  print("\n" + table)
  (out / "decode_torch.md").write_text(table + "\n")
  (out / "decode_torch.json").write_text(json.dumps({"rows": rows}, indent=1, default=float))
  if args.results:
    from importlib.metadata import version

    _publish(args, table, f"the exported models run by PyTorch {version('torch')} with transformers "
             f"{version('transformers')} alone, fp32, {TORCH_THREADS} PyTorch threads, each in a fresh process, one run")
  return 0 if equal else 1


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()
  sys.exit(main())
