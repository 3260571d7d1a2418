#!/usr/bin/env python
"""The uptraining experiment, end to end through the CLIs: a miniature of the MLKV paper's Table 2.

  1. train a dense 8-layer Pythia-style (GPT-NeoX) model on Tiny Shakespeare   train.py --config uptrain_neox.yaml
  2. export it to a Hugging Face directory                                     python -m jaxshare.convert export
  3. load it with transformers (PyTorch) and generate greedily; the text must equal jaxshare's own greedy sample
  4. import the HF directory back into a jaxshare run                          python -m jaxshare.convert import
  5. convert the imported model into each schedule (SCHEDULES)                 python -m jaxshare.convert uptrain
     GQA, MQA, the MLKV ladder (4, 2 and 1 K/V heads over 8 layers), CLA2, each with and without
     schedule.match_params (MLKV Sec. 4's control: equal parameter counts); UniAttn with least-squares W_c, uptrained
     with the standard and the paper's two-stage recipe (stage 1, then the steps every row gets); LISA from its DS
     start, the weight fit and the fit calibrated on data (train.init_lisa=ds, fit, calibrated); and the papers'
     recipes beside them, each one change against the row it names (RECIPES): CLA2 from mean-pooled K/V, MLKV-4
     matched by duplicated units, W_c fitted to the averages (UniAttn Theorem 3.1), UniAttn's two stages, and LISA's
     recipe (Sec. 5.1, App. B) one change at a time from its DS start: only the new parameters trained, then
     distillation from the dense source, then the paper's lr
  6. uptrain each for the same token budget at every seed, and train the KV schedules from scratch for the same
     tokens at every seed                                                      train.py
  7. tabulate validation loss (mean ± sample std over seeds) against KV bytes per token: results.md, results.json,
     pareto.png in --out

Seeds vary the uptraining (train.seed and data.shuffle_seed); the dense source and each conversion are shared by
every seed. Re-running skips finished steps: conversions and runs are reused, evaluations read back from each run's
eval.json. Runs go seed by seed, so an interrupted experiment has whole seeds to tabulate. Usage:
  python scripts/uptrain_experiment.py [--out runs/uptrain] [--dense-steps 600] [--steps 150] [--seeds 0 1 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

from jaxshare import smoke  # noqa: E402  (after the path fix above)
from jaxshare.sweep.results import mean_std  # noqa: E402

EXPERIMENT = "configs/experiments/uptrain_neox.yaml"
MATCHED = ["schedule.match_params=true"]
STAGE1_MAX_STEPS = 50  # the two-stage rows' stage 1 at most; their stage 2 gets --steps (train.stage2_steps)
# name -> (conversion overrides of the dense model's config, extra uptraining overrides, also trained from scratch).
# The dense model has 8 layers x 4 heads; the MLKV ladder has 4, 2 and 1 K/V heads in all, fewer than its layers.
_KV = {
  "gqa2": ["schedule.kind=gqa", "schedule.kv_heads=2"],
  "mqa": ["schedule.kind=mqa"],
  "mlkv4": ["schedule.kind=mlkv", "schedule.kv_layers=4", "schedule.kv_heads=1"],
  "mlkv2": ["schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=1"],
  "mlkv1": ["schedule.kind=mlkv", "schedule.kv_layers=1", "schedule.kv_heads=1"],
  "cla2": ["schedule.kind=cla", "schedule.factor=2"],
}
_UNIATTN = ["schedule.kind=uniattn", "schedule.uniattn.block_size=2"]  # top half: layers 5 and 7 reuse 4 and 6
_LISA = ["schedule.kind=lisa", "schedule.lisa.rank=8"]  # layers 3-5 (the paper's rule), ffn aligner
# name -> (conversion overrides of the dense model's config, extra uptraining overrides, also trained from scratch)
_ROWS: dict[str, tuple[list[str], list[str], bool]] = {
  "dense": (["schedule.kind=dense"], [], True),  # the control: the dense model trained on for the same tokens
  **{name: (o, [], True) for name, o in _KV.items()},
  **{f"{name}_m": ([*o, *MATCHED], [], False) for name, o in _KV.items()},
  "uniattn": (_UNIATTN, [], True),
  "lisa_ds": ([*_LISA, "train.init_lisa=ds"], [], False),
  "lisa_fit": ([*_LISA, "train.init_lisa=fit"], [], False),
  "lisa_cal": ([*_LISA, "train.init_lisa=calibrated"], [], False),
}
# The papers' recipes and conversion rules, each one change against its twin (the row it names, listed above it):
# name -> (twin, conversion overrides added, uptraining overrides added, convert flags instead of --wc-fit's).
RECIPES: dict[str, tuple[str, list[str], list[str], list[str]]] = {
  "cla2_pool": ("cla2", ["train.init_kv_pool=mean"], [], []),  # producers from the mean of their layers (MLKV's)
  "mlkv4_m_dup": ("mlkv4_m", ["train.init_mlp_widen=duplicate"], [], []),  # pythia-mlkv's widening
  "uniattn_wcmean": ("uniattn", [], [], ["--wc-fit", "mean"]),  # W_c fitted to the averages (Theorem 3.1)
  # UniAttn Alg. 1: stage 1 (W_c alone, early stopping) before the same fine-tuning budget the standard recipe gets
  "uniattn_2stage": ("uniattn", [], ["train.recipe=uniattn_two_stage", f"train.stage1_max_steps={STAGE1_MAX_STEPS}"],
                     []),
  # LISA Sec. 5.1 and App. B from the DS start, one change at a time: only the new parameters trained; distilled from
  # the dense model (beta 0.25; the teacher is the dense source the conversion recorded); the paper's lr 3e-4
  "lisa_frozen": ("lisa_ds", [], ["train.trainable=sharing"], []),
  "lisa_frozen_kd": ("lisa_frozen", [], ["train.kd_beta=0.25"], []),
  "lisa_paper": ("lisa_frozen_kd", [], ["train.lr=3e-4"], []),
}


def _descends(name: str, twin: str) -> bool:
  """Whether ``name`` is ``twin`` or a recipe row changed (through its twins) from ``twin``."""
  while name != twin and name in RECIPES:
    name = RECIPES[name][0]
  return name == twin


def _with_recipes() -> tuple[dict[str, tuple[list[str], list[str], bool]], dict[str, str]]:
  """Every row in table order, each recipe row after its twin and the rows changed from it before, and the
  conversion each row uptrains where it is another row's (a recipe row that changes only the uptraining)."""
  rows, conversion = dict(_ROWS), {}
  for name, (twin, convert, uptrain, flags) in RECIPES.items():
    conv, up, _ = rows[twin]
    if not convert and not flags:
      conversion[name] = conversion.get(twin, twin)
    order = list(rows)
    at = max(i for i, row in enumerate(order) if _descends(row, twin)) + 1
    rows[name] = ([*conv, *convert], [*up, *uptrain], False)
    rows = {n: rows[n] for n in [*order[:at], name, *order[at:]]}
  return rows, conversion


SCHEDULES, CONVERSION = _with_recipes()
CONVERSION_FLAGS = {name: flags for name, (_, _, _, flags) in RECIPES.items() if flags}
TWO_STAGE = {"uniattn_2stage"}
PROMPT = "ROMEO:\n"


def run(*cmd: str) -> str:
  """Run a command from the repository root, echoing it; returns its stdout. XLA's persistent compilation cache
  (JAX_COMPILATION_CACHE_DIR, set in main) lets later seeds skip the compilations of the first."""
  print("$ " + " ".join(cmd), flush=True)
  return subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True).stdout


def cached_report(run_dir: Path, step: int | None = None) -> dict | None:
  """The eval.py report kept in run_dir/eval.json by :func:`evaluate`, if it is of ``step`` (when given: a run
  trained under another --steps is evaluated again); None otherwise."""
  cached = run_dir / "eval.json"
  report = json.loads(cached.read_text()) if cached.exists() else None
  return report if report is not None and (step is None or report["step"] == step) else None


def evaluate(run_dir: Path, sample_tokens: int = 0, step: int | None = None) -> dict:
  """eval.py's JSON report of a run's latest checkpoint, kept in run_dir/eval.json for re-runs."""
  report = None if sample_tokens else cached_report(run_dir, step)
  if report is None:
    report = json.loads(run(sys.executable, "eval.py", str(run_dir), "--json", "--sample-tokens",
                            str(sample_tokens), "--prompt", PROMPT))
    (run_dir / "eval.json").write_text(json.dumps(report))
  return report


def stage1_steps(run_dir: Path) -> int:
  """Where UniAttn's stage 1 ended in a finished two-stage run: the ``stage_start`` its checkpoints record."""
  from jaxshare.store.checkpoint import Checkpointer

  ckpt = Checkpointer(run_dir / "checkpoints", 1)
  try:
    return ckpt.read_meta(ckpt.latest_step())["stage_start"]
  finally:
    ckpt.close()


def run_variant(experiment: str, run_dir: Path, overrides: list[str], steps: int, sample_tokens: int = 0,
                two_stage: bool = False) -> dict:
  """Train (or resume; a finished run returns at once) one run of ``steps`` steps, then evaluate it: eval.py's
  JSON report. ``two_stage``: UniAttn's stage 1 (at most STAGE1_MAX_STEPS) and then ``steps`` steps of stage 2;
  the report gains ``stage1_steps``."""
  final = None if two_stage else steps  # a two-stage run ends where stage 1 did, plus steps
  if sample_tokens or cached_report(run_dir, final) is None:
    budget = ([f"train.steps={steps + STAGE1_MAX_STEPS}", f"train.stage2_steps={steps}"] if two_stage else
              [f"train.steps={steps}"])
    run(sys.executable, "train.py", "--config", experiment, "--no-eval", *overrides, *budget,
        f"train.run_dir={run_dir}")
  report = evaluate(run_dir, sample_tokens, final)
  if two_stage:
    report["stage1_steps"] = stage1_steps(run_dir)
    if report["step"] != report["stage1_steps"] + steps:
      raise SystemExit(f"{run_dir}: evaluated at step {report['step']}, not at stage 1's end + {steps} (an evaluation "
                       "of another --steps): delete its eval.json and re-run")
  return report


def transformers_greedy(hf_dir: Path, tokens: int) -> str:
  """Greedy continuation of PROMPT by the exported model in PyTorch (byte-level vocabulary: ids are bytes)."""
  import torch
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
  ids = torch.tensor([list(PROMPT.encode())])
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
  return bytes(out[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")


def dense_round_trip(out: Path, dense_steps: int) -> dict:
  """Steps 1-4: the dense source trained, exported, checked against transformers and imported back; the imported
  run's evaluation."""
  dense = out / "dense"
  dense_eval = run_variant(EXPERIMENT, dense, [f"train.warmup_steps={dense_steps // 12}"], dense_steps,
                           sample_tokens=100)
  hf_dir = out / "hf_dense"
  if not hf_dir.exists():
    print(run(sys.executable, "-m", "jaxshare.convert", "export", str(dense), str(hf_dir)), end="")
  torch_text = transformers_greedy(hf_dir, 100)
  print(f"transformers greedy sample:\n{PROMPT}{torch_text}\n", flush=True)
  if torch_text != dense_eval["sample"]:
    raise SystemExit(f"transformers and jaxshare disagree on the greedy sample:\n{torch_text!r}\n"
                     f"{dense_eval['sample']!r}")
  imported = out / "imported"
  if not imported.exists():
    print(run(sys.executable, "-m", "jaxshare.convert", "import", str(hf_dir), str(imported),
              "data.path=tinyshakespeare.txt", "data.seq_len=128", "train.batch_size=32"), end="")
  imported_eval = evaluate(imported)
  print(f"dense val loss {dense_eval['val_loss']:.5f}, after export + import {imported_eval['val_loss']:.5f}",
        flush=True)
  return imported_eval


def table(rows: list[dict], args: argparse.Namespace) -> list[str]:
  """results.md: one line per schedule, losses as mean ± sample std over the seeds that finished."""
  control = next(r for r in rows if r["name"] == "dense")["uptrained"]
  lines = [f"Dense source: {args.dense_steps} steps. Uptraining and from-scratch runs: {args.steps} steps of the same "
           f"32x128 tokens each (uptraining lr {args.uptrain_lr}, from scratch the dense recipe's), at seeds "
           f"{', '.join(map(str, args.seeds))}: mean ± sample std over the seeds (n in the last column). "
           "Validation loss in nats per token (= per byte: byte tokenizer) on the whole validation split. The "
           "difference from the dense control is the mean ± std of the per-seed differences (a seed fixes the data "
           "order).", "",
           "| schedule | KV bytes/token (bf16) | params | converted (step 0) | uptrained | uptrained - dense "
           "uptrained (paired by seed) | from scratch | n |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    up, name = r["uptrained"], r["name"]
    delta = "—" if not up or name in ("start", "dense") else mean_std([a - b for a, b in zip(up, control)])
    label = f"{name} ({r['schedule']})"
    if name in RECIPES:
      twin, convert, uptrain, flags = RECIPES[name]
      label += f", {twin} with {' '.join([*convert, *uptrain, *flags])}"
    converted = f"= {CONVERSION[name]}" if name in CONVERSION else f"{r['converted']:.4f}"
    lines.append(f"| {label} | {r['kv_bytes_per_token_bf16']:,} | {r['num_params']:,} | {converted} | "
                 f"{mean_std(up)} | {delta} | {mean_std(r['scratch'])} | {len(up)} |")
  stage1 = {r["name"]: r["stage1_steps"] for r in rows if r["stage1_steps"]}
  return lines + ["", *(f"{name}: stage 1 (W_c alone, early stopping, at most {STAGE1_MAX_STEPS} steps) ran "
                        f"{', '.join(map(str, steps))} steps at the seeds above, then stage 2 the {args.steps} steps "
                        "every other row gets (UniAttn Alg. 1, App. D)." for name, steps in stage1.items()),
                  "start: the dense model after export to HF and import back (bit-exact); dense: that model "
                  "trained on with the uptraining recipe, the control every schedule is compared with; _m: "
                  "schedule.match_params (the MLPs resized to the dense model's parameter count, new units with zero "
                  "output rows). A row naming another changes one thing against it (the overrides or flags it "
                  "names); '= row' in the converted column: it uptrains that row's conversion. lisa_frozen_kd and "
                  "lisa_paper distil from the dense source the conversion recorded (train.kd_teacher)."]


def plot(rows: list[dict], out: Path) -> None:
  from jaxshare.analysis.plots import loss_vs_kv

  points = []
  for r in rows:
    for series, key in (("uptrained", "uptrained"), ("from scratch", "scratch")):
      if r[key]:
        series = f"{series}, matched" if r["name"].endswith(("_m", "_m_dup")) else series
        points.append({"name": r["name"], "series": series, "val_loss": statistics.mean(r[key]),
                       "std": statistics.stdev(r[key]) if len(r[key]) > 1 else 0.0,
                       "kv_bytes_per_token_bf16": r["kv_bytes_per_token_bf16"]})
  loss_vs_kv(points, out / "pareto.png", kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label="validation loss (nats/byte)", err_key="std", title="mean ± std over seeds", log_x=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/uptrain", help="directory of every run and the results")
  parser.add_argument("--dense-steps", type=int, default=600, help="training steps of the dense model")
  parser.add_argument("--steps", type=int, default=150, help="steps of every uptraining and from-scratch run")
  parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every uptraining and "
                      "from-scratch run")
  parser.add_argument("--uptrain-lr", type=float, default=1e-3, help="peak learning rate of uptraining")
  parser.add_argument("--wc-fit", default="tokens", choices=("mean", "tokens"), help="UniAttn W_c fit")
  parser.add_argument("--only", nargs="*", default=None, choices=list(SCHEDULES), metavar="NAME",
                      help=f"run only these schedules ({', '.join(SCHEDULES)}); dense is always run, as the control")
  parser.add_argument("--no-scratch", action="store_true", help="skip the from-scratch runs (e.g. to add uptraining "
                      "rows to a table whose from-scratch cells exist)")
  args = parser.parse_args(argv)
  out = Path(args.out).resolve()  # relative to the working directory, as typed
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "xla_cache"))
  imported_eval = dense_round_trip(out, args.dense_steps)
  # JAXSHARE_SMOKE: dense alone (the control: converted, uptrained and trained from scratch) at the first seed
  names = smoke.first([n for n in SCHEDULES if n == "dense" or not args.only or n in args.only])
  args.seeds = smoke.first(args.seeds, 1)

  budget = [f"train.warmup_steps={max(1, args.steps // 10)}",
            f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}"]
  converted = {}
  for name in names:
    source = CONVERSION.get(name, name)
    path = out / f"converted_{source}"
    if not path.exists():
      print(run(sys.executable, "-m", "jaxshare.convert", "uptrain", str(out / "imported"), str(path),
                *SCHEDULES[source][0], *CONVERSION_FLAGS.get(source, ["--wc-fit", args.wc_fit])), end="")
    converted[name] = (path, evaluate(path))
  results = {name: {"uptrained": [], "scratch": [], "stage1_steps": []} for name in names}
  for seed in args.seeds:
    seeded = [*budget, f"train.seed={seed}", f"data.shuffle_seed={seed}"]
    for name in names:
      path, at_conversion = converted[name]
      config = str(path / "config.yaml")
      up = run_variant(config, out / f"uptrained_{name}" / f"seed{seed}",
                       [*seeded, f"train.init_from={path}", f"train.lr={args.uptrain_lr}", *SCHEDULES[name][1]],
                       args.steps, two_stage=name in TWO_STAGE)
      results[name]["uptrained"].append(up["val_loss"])
      line = f"seed {seed} {name}: converted {at_conversion['val_loss']:.4f}, uptrained {up['val_loss']:.4f}"
      if name in TWO_STAGE:
        results[name]["stage1_steps"].append(up["stage1_steps"])
        line += f" (stage 1: {up['stage1_steps']} steps)"
      if SCHEDULES[name][2] and not args.no_scratch:
        scratch = run_variant(config, out / f"scratch_{name}" / f"seed{seed}", [*seeded, "train.init_from="],
                              args.steps)
        results[name]["scratch"].append(scratch["val_loss"])
        line += f", from scratch {scratch['val_loss']:.4f}"
      print(line, flush=True)

  rows = [{"name": "start", "schedule": imported_eval["schedule"], "num_params": imported_eval["num_params"],
           "kv_bytes_per_token_bf16": imported_eval["kv_bytes_per_token_bf16"],
           "converted": imported_eval["val_loss"], "uptrained": [], "scratch": [], "stage1_steps": []}]
  for name in names:
    report = converted[name][1]
    rows.append({"name": name, "schedule": report["schedule"], "num_params": report["num_params"],
                 "kv_bytes_per_token_bf16": report["kv_bytes_per_token_bf16"], "converted": report["val_loss"],
                 **results[name]})
  lines = table(rows, args)
  (out / "results.md").write_text("\n".join(lines) + "\n")
  (out / "results.json").write_text(json.dumps(rows, indent=1))
  plot(rows, out)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
