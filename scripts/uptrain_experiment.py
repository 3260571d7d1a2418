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
  7. record every result as it finishes in the committed result files (--results, default results/uptrain: Results)
     and tabulate validation loss (mean ± sample std over seeds) against KV bytes per token from them: results.md
     and pareto.png in --out; docs/results.md and the README show the same table (scripts/render_results.py)

Seeds vary the uptraining (train.seed and data.shuffle_seed); the dense source and each conversion are shared by
every seed. Re-running skips finished steps: a run recorded in --results is not run again (on any machine: the dense
source is trained again and checked against its record), and conversions and runs in --out are reused. Runs go seed
by seed, so an interrupted experiment has whole seeds to tabulate. Usage:
  python scripts/uptrain_experiment.py [--out runs/uptrain] [--results results/uptrain] [--dense-steps 600]
                                       [--steps 150] [--seeds 0 1 2]
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
from jaxshare.sweep.provenance import provenance, read_result, short_version, write_result  # noqa: E402
from jaxshare.sweep.results import mean_std  # noqa: E402

EXPERIMENT = "configs/experiments/uptrain_neox.yaml"
RESULTS = REPO / "results" / "uptrain"  # the committed result files the tables are rendered from
MEASURE = ("eval.py --json val_loss: next-token cross-entropy in nats per token (byte tokenizer: per byte), mean over "
           "every scored token of the whole validation split")
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
CONVERSION_REPORT = "conversion.txt"  # what convert uptrain printed, in the converted run's directory

# the conversion starts of _ROWS each against the one it refines (the weight fit against plain reuse, the calibrated
# fit against the fit it starts from); the recipe rows are against their twins and the matched rows their unmatched
LISA_STARTS = {"lisa_fit": "lisa_ds", "lisa_cal": "lisa_fit"}


def against(name: str) -> str | None:
  """The row that ``name`` changes one thing against, None for a row that changes none (the KV schedules, LISA's
  DS start and UniAttn are against the dense control, in the table's own column)."""
  if name in RECIPES:
    return RECIPES[name][0]
  if name.endswith("_m") and name[:-2] in SCHEDULES:
    return name[:-2]
  return LISA_STARTS.get(name)


def change(name: str, twin: str) -> list[str]:
  """The overrides and convert flags of ``name`` that ``twin`` has not: the one thing the row changes."""
  theirs = {*SCHEDULES[twin][0], *SCHEDULES[twin][1]}
  return [o for o in (*SCHEDULES[name][0], *SCHEDULES[name][1]) if o not in theirs] + CONVERSION_FLAGS.get(name, [])


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


def eval_command(run_dir: Path, sample_tokens: int = 0) -> list[str]:
  """The eval.py command that evaluates a run's latest checkpoint (:data:`MEASURE`)."""
  return [sys.executable, "eval.py", str(run_dir), "--json", "--sample-tokens", str(sample_tokens), "--prompt", PROMPT]


def evaluate(run_dir: Path, sample_tokens: int = 0, step: int | None = None) -> dict:
  """eval.py's JSON report of a run's latest checkpoint, kept in run_dir/eval.json for re-runs."""
  report = None if sample_tokens else cached_report(run_dir, step)
  if report is None:
    report = json.loads(run(*eval_command(run_dir, sample_tokens)))
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
                two_stage: bool = False) -> tuple[dict, list[list[str]]]:
  """Train (or resume; a finished run returns at once) one run of ``steps`` steps, then evaluate it: eval.py's
  JSON report, and the commands that make it (train.py's, eval.py's). ``two_stage``: UniAttn's stage 1 (at most
  STAGE1_MAX_STEPS) and then ``steps`` steps of stage 2; the report gains ``stage1_steps``."""
  final = None if two_stage else steps  # a two-stage run ends where stage 1 did, plus steps
  budget = ([f"train.steps={steps + STAGE1_MAX_STEPS}", f"train.stage2_steps={steps}"] if two_stage else
            [f"train.steps={steps}"])
  command = [sys.executable, "train.py", "--config", experiment, "--no-eval", *overrides, *budget,
             f"train.run_dir={run_dir}"]
  if sample_tokens or cached_report(run_dir, final) is None:
    run(*command)
  report = evaluate(run_dir, sample_tokens, final)
  if two_stage:
    report["stage1_steps"] = stage1_steps(run_dir)
    if report["step"] != report["stage1_steps"] + steps:
      raise SystemExit(f"{run_dir}: evaluated at step {report['step']}, not at stage 1's end + {steps} (an evaluation "
                       "of another --steps): delete its eval.json and re-run")
  return report, [command, eval_command(run_dir, sample_tokens)]


def transformers_greedy(hf_dir: Path, tokens: int) -> str:
  """Greedy continuation of PROMPT by the exported model in PyTorch (byte-level vocabulary: ids are bytes)."""
  import torch
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
  ids = torch.tensor([list(PROMPT.encode())])
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
  return bytes(out[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")


def dense_round_trip(out: Path, dense_steps: int, results: Results) -> dict:
  """Steps 1-4: the dense source trained, exported, checked against transformers and imported back (recorded in
  ``results``' source.json, or checked against it); the imported run's evaluation."""
  dense = out / "dense"
  dense_eval, commands = run_variant(EXPERIMENT, dense, [f"train.warmup_steps={dense_steps // 12}"], dense_steps,
                                     sample_tokens=100)
  hf_dir = out / "hf_dense"
  export = [sys.executable, "-m", "jaxshare.convert", "export", str(dense), str(hf_dir)]
  if not hf_dir.exists():
    print(run(*export), end="")
  torch_text = transformers_greedy(hf_dir, 100)
  print(f"transformers greedy sample:\n{PROMPT}{torch_text}\n", flush=True)
  if torch_text != dense_eval["sample"]:
    raise SystemExit(f"transformers and jaxshare disagree on the greedy sample:\n{torch_text!r}\n"
                     f"{dense_eval['sample']!r}")
  imported = out / "imported"
  to_jaxshare = [sys.executable, "-m", "jaxshare.convert", "import", str(hf_dir), str(imported),
                 "data.path=tinyshakespeare.txt", "data.seq_len=128", "train.batch_size=32"]
  if not imported.exists():
    print(run(*to_jaxshare), end="")
  imported_eval = evaluate(imported)
  print(f"dense val loss {dense_eval['val_loss']:.5f}, after export + import {imported_eval['val_loss']:.5f}",
        flush=True)
  results.source({"dense_val_loss": dense_eval["val_loss"], "val_loss": imported_eval["val_loss"],
                  "transformers_sample_equal": True, **_sizes(imported_eval)},
                 [*commands, export, to_jaxshare, eval_command(imported)])
  return imported_eval


def convert(out: Path, name: str, wc_fit: str) -> tuple[Path, list[str]]:
  """Row ``name``'s conversion of the imported source (made unless it exists; what the conversion printed, the rule
  of each tensor and the fits' errors, kept in its CONVERSION_REPORT) and the command that makes it."""
  path = out / f"converted_{name}"
  command = [sys.executable, "-m", "jaxshare.convert", "uptrain", str(out / "imported"), str(path),
             *SCHEDULES[name][0], *CONVERSION_FLAGS.get(name, ["--wc-fit", wc_fit])]
  if not path.exists():
    printed = run(*command)
    print(printed, end="")
    (path / CONVERSION_REPORT).write_text(printed)
  return path, command


def fit_lines(printed: str) -> list[str]:
  """The fits a conversion printed (UniAttn's W_c, LISA's calibration): each fit's heading and its indented lines,
  and every line that reports a fit's error, without the per-tensor rules."""
  lines, kept = printed.splitlines(), []
  for i, line in enumerate(lines):
    if line.startswith("  ") or (i + 1 < len(lines) and lines[i + 1].startswith("  ")) or " error " in line:
      kept.append(line)
  return kept


def _sizes(report: dict) -> dict:
  """What a row's cells other than the losses hold, from an eval.py report."""
  return {k: report[k] for k in ("schedule", "num_params", "kv_bytes_per_token_bf16")}


class Results:
  """The experiment's committed result files (``results/uptrain``): ``settings.json`` (what every row shares),
  ``source.json`` (the dense source before and after the HF round trip) and ``rows/<name>.json`` (a row's overrides,
  its conversion's evaluation and each seed's runs), each result with its :func:`provenance`. A run recorded there
  is not run again: an experiment interrupted, or continued on another machine, resumes from the committed files.

  Raises (SystemExit): results of other settings, a source that no longer evaluates as recorded, or a row recorded
  with other overrides (each naming what to delete to re-run).
  """

  def __init__(self, root: Path, settings: dict):
    self.root = root
    saved = read_result(root / "settings.json")
    if saved is not None and saved != settings:
      raise SystemExit(f"{root} holds results of {saved}, not of {settings}: choose another --results, or delete "
                       f"{root} to run every row again")
    write_result(root / "settings.json", settings)

  def source(self, values: dict, commands: list[list[str]]) -> None:
    saved = read_result(self.root / "source.json")
    if saved is not None:
      changed = {k: (saved.get(k), v) for k, v in values.items() if saved.get(k) != v}
      if changed:
        raise SystemExit(f"the dense source no longer evaluates as {self.root / 'source.json'} records it "
                         f"(recorded, now: {changed}): the code or data changed under the recorded rows; delete "
                         f"{self.root} to run every row again at this code")
      return
    write_result(self.root / "source.json", {**values, "provenance": provenance(commands, MEASURE, REPO)})

  def row(self, name: str) -> dict:
    """The row's file (a new row: its overrides), checked against the experiment's overrides for it."""
    conversion, uptraining, _ = SCHEDULES[name]
    recipe = {"conversion": conversion, "uptraining": uptraining, "convert_flags": CONVERSION_FLAGS.get(name, []),
              "conversion_of": CONVERSION.get(name, name)}
    saved = read_result(self._path(name)) or {"row": name, **recipe}
    stale = {k: (saved.get(k), v) for k, v in recipe.items() if saved.get(k) != v}
    if stale:
      raise SystemExit(f"{self._path(name)} was measured with other overrides (recorded, now: {stale}): delete it to "
                       "run that row again")
    return saved

  def record(self, name: str, row: dict, key: str, seed: int | None, values: dict,
             commands: list[list[str]]) -> None:
    """Add one result to ``row`` (under ``key``, and seed when given) and write the row's file."""
    entry = {**values, "provenance": provenance(commands, MEASURE, REPO)}
    if seed is None:
      row[key] = entry
    else:
      row.setdefault(key, {})[str(seed)] = entry
    self.save(name, row)

  def save(self, name: str, row: dict) -> None:
    write_result(self._path(name), row)

  def _path(self, name: str) -> Path:
    return self.root / "rows" / f"{name}.json"


def load_rows(root: Path) -> tuple[dict, list[dict]]:
  """The settings and the table's rows (``start`` first, then every recorded row in table order) of the result files
  in ``root``; a row's losses are ``{seed: val_loss}``."""
  settings, source = read_result(root / "settings.json"), read_result(root / "source.json")
  if settings is None or source is None:
    raise SystemExit(f"{root} has no settings.json and source.json: run scripts/uptrain_experiment.py --results {root}")
  rows = [{"name": "start", **_sizes(source), "conversion": None, "converted": source["val_loss"], "fits": [],
           "uptrained": {}, "scratch": {}, "stage1_steps": {}, "commits": {_version(source)}}]
  for name in SCHEDULES:
    saved = read_result(root / "rows" / f"{name}.json")
    if saved is None or "sizes" not in saved:
      continue
    converted = read_result(root / "rows" / f"{saved['conversion_of']}.json") or {}
    runs = {key: saved.get(key, {}) for key in ("uptrained", "scratch")}
    rows.append({"name": name, **saved["sizes"], "conversion": saved["conversion"],
                 "converted": converted.get("converted", {}).get("val_loss"),
                 "fits": saved.get("converted", {}).get("fits", []),  # its own conversion's
                 **{key: {int(s): r["val_loss"] for s, r in v.items()} for key, v in runs.items()},
                 "stage1_steps": {int(s): r["stage1_steps"] for s, r in runs["uptrained"].items()
                                  if "stage1_steps" in r},
                 "commits": {_version(r) for v in runs.values() for r in v.values()} |
                            ({_version(saved["converted"])} if "converted" in saved else set())})
  return settings, rows


def _version(result: dict) -> str:
  """The code version a result was measured at: its commit's short hash, ``+`` when the tree differed from it."""
  return short_version(result["provenance"])


def render(root: Path) -> list[str]:
  """The uptraining table of the result files in ``root`` (:func:`table`), with the code versions it was measured
  at: what docs/results.md shows (scripts/render_results.py)."""
  settings, rows = load_rows(root)
  return [*table(rows, settings), "", _caption(root, rows)]


def _caption(root: Path, rows: list[dict]) -> str:
  """Where the rendered lines come from: the result directory and the code versions its rows were measured at."""
  commits = sorted({c for r in rows for c in r["commits"]})
  where = root.relative_to(REPO) if root.is_relative_to(REPO) else root
  return (f"Rendered by scripts/render_results.py from {where}/, measured at commit{'s' if len(commits) > 1 else ''} "
          f"{', '.join(commits)} (+: with uncommitted changes; each cell's commands, commit, jax and flax versions "
          "and date are in its row's file).")


def render_paired(root: Path) -> list[str]:
  """The one-change comparisons of the result files in ``root`` (:func:`paired_table`) and the fits their
  conversions printed, with the code versions they were measured at: docs/results.md's second uptraining table
  (scripts/render_results.py, ``results/uptrain#paired``)."""
  _, rows = load_rows(root)
  fits = [line for r in rows if r["fits"] for line in (f"{r['name']}:", *r["fits"])]
  printed = ["", "The fits the conversions printed (`python -m jaxshare.convert uptrain`, kept in each row's file):",
             "", "```", *fits, "```"] if fits else []
  return [*paired_table(rows), *printed, "", _caption(root, rows)]


def table(rows: list[dict], settings: dict) -> list[str]:
  """The table: one line per schedule, losses as mean ± sample std over the seeds recorded."""
  control = next((r for r in rows if r["name"] == "dense"), {"uptrained": {}})["uptrained"]
  seeds = sorted({s for r in rows for s in r["uptrained"]})
  lines = [f"Dense source: {settings['dense_steps']} steps. Uptraining and from-scratch runs: {settings['steps']} "
           f"steps of the same 32x128 tokens each (uptraining lr {settings['uptrain_lr']}, from scratch the dense "
           f"recipe's), at seeds {', '.join(map(str, seeds))}: mean ± sample std over the seeds (n in the last "
           "column). Validation loss in nats per token (= per byte: byte tokenizer) on the whole validation split. "
           "The difference from the dense control is the mean ± std of the per-seed differences (a seed fixes the "
           "data order).", "",
           "| schedule | KV bytes/token (bf16) | params | converted (step 0) | uptrained | uptrained - dense "
           "uptrained (paired by seed) | from scratch | n |", "|---|---|---|---|---|---|---|---|"]
  for r in rows:
    up, name = r["uptrained"], r["name"]
    delta = "—" if name in ("start", "dense") else _paired(up, control)[0]
    # what the row converts with, as its file records it (the compiled schedule is in the file's sizes)
    label = "start (the dense source after export to HF and import)" if r["conversion"] is None else (
      f"{name} (`{' '.join(r['conversion'])}`)".replace("|", "\\|"))
    if name in RECIPES:
      twin, convert, uptrain, flags = RECIPES[name]
      label += f", {twin} with {' '.join([*convert, *uptrain, *flags])}"
    converted = (f"= {CONVERSION[name]}" if name in CONVERSION else "—" if r["converted"] is None else
                 f"{r['converted']:.4f}")
    lines.append(f"| {label} | {r['kv_bytes_per_token_bf16']:,} | {r['num_params']:,} | {converted} | "
                 f"{mean_std(list(up.values()))} | {delta} | {mean_std(list(r['scratch'].values()))} | {len(up)} |")
  stage1 = {r["name"]: r["stage1_steps"] for r in rows if r["stage1_steps"]}
  return lines + ["", *(f"{name}: stage 1 (W_c alone, early stopping, at most {STAGE1_MAX_STEPS} steps) ran "
                        f"{', '.join(str(steps[s]) for s in sorted(steps))} steps at seeds "
                        f"{', '.join(map(str, sorted(steps)))}, then stage 2 the {settings['steps']} steps every other "
                        "row gets (UniAttn Alg. 1, App. D)." for name, steps in stage1.items()),
                  "start: the dense model after export to HF and import back (bit-exact); dense: that model "
                  "trained on with the uptraining recipe, the control every schedule is compared with; _m: "
                  "schedule.match_params (the MLPs resized to the dense model's parameter count, new units with zero "
                  "output rows). A row naming another changes one thing against it (the overrides or flags it "
                  "names); '= row' in the converted column: it uptrains that row's conversion. lisa_frozen_kd and "
                  "lisa_paper distil from the dense source the conversion recorded (train.kd_teacher)."]


def _paired(a: dict, b: dict) -> tuple[str, int]:
  """``a - b`` seed by seed over the seeds both have ({seed: loss} each): the mean ± sample std of the differences,
  signed (``—`` for none), and how many there are."""
  diffs = [a[s] - b[s] for s in sorted(a) if s in b]
  cell = mean_std(diffs)
  return (cell if cell[0] in "—-" else "+" + cell), len(diffs)


def paired_table(rows: list[dict]) -> list[str]:
  """Each one-change comparison of the table (validation loss, nats per token), as the mean ± sample std of the
  per-seed differences (seeds both rows have): every row that changes one thing against another (:func:`against`)
  and, for every schedule also trained from scratch, its uptrained runs against its from-scratch runs (what
  uptraining gains)."""
  by_name = {r["name"]: r for r in rows}

  lines = ["| row | against | the one change | uptrained - against (paired by seed) | n |", "|---|---|---|---|---|"]
  for r in rows:
    twin = against(r["name"])
    if twin in by_name:
      cell, n = _paired(r["uptrained"], by_name[twin]["uptrained"])
      lines.append(f"| {r['name']} | {twin} | {' '.join(change(r['name'], twin))} | {cell} | {n} |")
  for r in rows:
    if r["scratch"] and r["uptrained"]:
      cell, n = _paired(r["uptrained"], r["scratch"])
      lines.append(f"| {r['name']} | {r['name']} from scratch | uptrained from its conversion | {cell} | {n} |")
  return lines


def plot(rows: list[dict], out: Path) -> None:
  from jaxshare.analysis.plots import loss_vs_kv

  points = []
  for r in rows:
    for series, key in (("uptrained", "uptrained"), ("from scratch", "scratch")):
      losses = list(r[key].values())
      if losses:
        series = f"{series}, matched" if r["name"].endswith(("_m", "_m_dup")) else series
        points.append({"name": r["name"], "series": series, "val_loss": statistics.mean(losses),
                       "std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                       "kv_bytes_per_token_bf16": r["kv_bytes_per_token_bf16"]})
  loss_vs_kv(points, out / "pareto.png", kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label="validation loss (nats/byte)", err_key="std", title="mean ± std over seeds", log_x=True)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/uptrain", help="directory of every run and the results")
  parser.add_argument("--results", default=str(RESULTS.relative_to(REPO)),
                      help="the committed result files (default: %(default)s; under JAXSHARE_SMOKE, OUT/results): a "
                      "run recorded there is not run again")
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
  root = out / "results" if smoke.enabled() else Path(args.results).resolve()
  os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / "xla_cache"))
  results = Results(root, {"experiment": EXPERIMENT, "dense_steps": args.dense_steps, "steps": args.steps,
                           "uptrain_lr": args.uptrain_lr, "wc_fit": args.wc_fit})
  dense_round_trip(out, args.dense_steps, results)
  # JAXSHARE_SMOKE: dense alone (the control: converted, uptrained and trained from scratch) at the first seed
  names = smoke.first([n for n in SCHEDULES if n == "dense" or not args.only or n in args.only])
  args.seeds = smoke.first(args.seeds, 1)

  budget = [f"train.warmup_steps={max(1, args.steps // 10)}",
            f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}"]
  rows = {}
  for name in names:  # each row's sizes from its conversion, and its own conversion's loss, recorded once
    rows[name] = row = results.row(name)
    source = CONVERSION.get(name, name)
    if "sizes" in row and (source != name or "converted" in row):
      continue
    path, command = convert(out, source, args.wc_fit)
    report = evaluate(path)
    row["sizes"] = _sizes(report)
    if source == name:
      printed = path / CONVERSION_REPORT  # (a conversion made before the report was kept has none)
      fits = {"fits": fit_lines(printed.read_text())} if printed.exists() else {}
      results.record(name, row, "converted", None, {"val_loss": report["val_loss"], **fits},
                     [command, eval_command(path)])
    else:
      results.save(name, row)
  for seed in args.seeds:
    seeded = [*budget, f"train.seed={seed}", f"data.shuffle_seed={seed}"]
    for name in names:
      row = rows[name]
      path = out / f"converted_{CONVERSION.get(name, name)}"
      if str(seed) not in row.get("uptrained", {}):
        convert(out, CONVERSION.get(name, name), args.wc_fit)  # recorded on another machine: converted again
        up, commands = run_variant(str(path / "config.yaml"), out / f"uptrained_{name}" / f"seed{seed}",
                                   [*seeded, f"train.init_from={path}", f"train.lr={args.uptrain_lr}",
                                    *SCHEDULES[name][1]], args.steps, two_stage=name in TWO_STAGE)
        kept = {"val_loss": up["val_loss"], "step": up["step"],
                **({"stage1_steps": up["stage1_steps"]} if name in TWO_STAGE else {})}
        results.record(name, row, "uptrained", seed, kept, commands)
      line = f"seed {seed} {name}: uptrained {row['uptrained'][str(seed)]['val_loss']:.4f}"
      if SCHEDULES[name][2] and not args.no_scratch:
        if str(seed) not in row.get("scratch", {}):
          convert(out, CONVERSION.get(name, name), args.wc_fit)  # its config is the run's
          scratch, commands = run_variant(str(path / "config.yaml"), out / f"scratch_{name}" / f"seed{seed}",
                                          [*seeded, "train.init_from="], args.steps)
          results.record(name, row, "scratch", seed, {"val_loss": scratch["val_loss"], "step": scratch["step"]},
                         commands)
        line += f", from scratch {row['scratch'][str(seed)]['val_loss']:.4f}"
      print(line, flush=True)

  lines = render(root)
  (out / "results.md").write_text("\n".join(lines) + "\n")
  plot(load_rows(root)[1], out)
  print("\n".join(lines))
  return 0


if __name__ == "__main__":
  sys.exit(main())
