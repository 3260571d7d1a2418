#!/usr/bin/env python
"""The uptraining experiment, end to end through the CLIs: a miniature of the MLKV paper's Tables 2-3.

  1. train a dense Pythia-style (GPT-NeoX) model on Tiny Shakespeare     train.py --config uptrain_neox.yaml
  2. export it to a Hugging Face directory                               python -m jaxshare.convert export
  3. load it with transformers (PyTorch) and generate greedily; the text must equal jaxshare's own greedy sample
  4. import the HF directory back into a jaxshare run                    python -m jaxshare.convert import
  5. convert the imported model into each schedule                       python -m jaxshare.convert uptrain
     (GQA, MQA, MLKV at m = 2 and 1, CLA2, UniAttn with least-squares W_c)
  6. uptrain each for the same token budget, and train each from scratch for the same tokens   train.py
  7. tabulate validation loss against KV bytes per token: results.md, results.json, pareto.png in --out

Re-running skips finished steps (each run resumes or is reused). Usage:
  python scripts/uptrain_experiment.py [--out runs/uptrain] [--dense-steps 600] [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from anywhere: jaxshare is importable without an install
  sys.path.insert(0, str(REPO))

EXPERIMENT = "configs/experiments/uptrain_neox.yaml"
# name -> overrides of the dense model's config; the tiny NeoX has 4 layers x 4 heads
SCHEDULES = {
  "dense": ["schedule.kind=dense"],  # the control: the dense model trained on for the same tokens
  "gqa2": ["schedule.kind=gqa", "schedule.kv_heads=2"],
  "mqa": ["schedule.kind=mqa"],
  "mlkv2": ["schedule.kind=mlkv", "schedule.kv_layers=2", "schedule.kv_heads=1"],
  "mlkv1": ["schedule.kind=mlkv", "schedule.kv_layers=1", "schedule.kv_heads=1"],
  "cla2": ["schedule.kind=cla", "schedule.factor=2"],
  "uniattn": ["schedule.kind=uniattn", "schedule.uniattn.block_size=2"],
}
PROMPT = "ROMEO:\n"


def run(*cmd: str) -> str:
  """Run a command from the repository root, echoing it; returns its stdout."""
  print("$ " + " ".join(cmd), flush=True)
  return subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, text=True).stdout


def evaluate(run_dir: Path, sample_tokens: int = 0) -> dict:
  return json.loads(run(sys.executable, "eval.py", str(run_dir), "--json", "--sample-tokens", str(sample_tokens),
                        "--prompt", PROMPT))


def run_variant(experiment: str, run_dir: Path, overrides: list[str], sample_tokens: int = 0) -> dict:
  """Train (or resume; a finished run returns at once) one run, then evaluate it: eval.py's JSON report."""
  run(sys.executable, "train.py", "--config", experiment, "--no-eval", *overrides, f"train.run_dir={run_dir}")
  return evaluate(run_dir, sample_tokens)


def transformers_greedy(hf_dir: Path, tokens: int) -> str:
  """Greedy continuation of PROMPT by the exported model in PyTorch (byte-level vocabulary: ids are bytes)."""
  import torch
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(hf_dir, local_files_only=True).eval()
  ids = torch.tensor([list(PROMPT.encode())])
  with torch.no_grad():
    out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=0)
  return bytes(out[0, ids.shape[1]:].tolist()).decode("utf-8", errors="replace")


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", default="runs/uptrain", help="directory of every run and the results")
  parser.add_argument("--dense-steps", type=int, default=600, help="training steps of the dense model")
  parser.add_argument("--steps", type=int, default=150, help="steps of every uptraining and from-scratch run")
  parser.add_argument("--uptrain-lr", type=float, default=1e-3, help="peak learning rate of uptraining")
  parser.add_argument("--wc-fit", default="tokens", choices=("mean", "tokens"), help="UniAttn W_c fit")
  parser.add_argument("--only", nargs="*", default=None, help="run only these schedules")
  args = parser.parse_args(argv)
  out = (REPO / args.out).resolve()
  dense = out / "dense"
  dense_eval = run_variant(EXPERIMENT, dense, [f"train.steps={args.dense_steps}",
                                               f"train.warmup_steps={args.dense_steps // 12}"], sample_tokens=100)

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

  budget = [f"train.steps={args.steps}", f"train.warmup_steps={max(1, args.steps // 10)}",
            f"train.eval_every={args.steps}", f"train.checkpoint_every={args.steps}"]
  rows = [{"name": "start", "series": "dense start", "val_loss": imported_eval["val_loss"],
           "kv_bytes_per_token_bf16": imported_eval["kv_bytes_per_token_bf16"], "schedule": imported_eval["schedule"],
           "num_params": imported_eval["num_params"], "converted": imported_eval["val_loss"],
           "uptrained": None, "scratch": None}]
  for name, overrides in SCHEDULES.items():
    if args.only and name not in args.only:
      continue
    converted = out / f"converted_{name}"
    if not converted.exists():
      print(run(sys.executable, "-m", "jaxshare.convert", "uptrain", str(imported), str(converted), *overrides,
                "--wc-fit", args.wc_fit), end="")
    config = str(converted / "config.yaml")
    at_conversion = evaluate(converted)
    uptrained = run_variant(config, out / f"uptrained_{name}", [*budget, f"train.init_from={converted}",
                                                                f"train.lr={args.uptrain_lr}"])
    scratch = run_variant(config, out / f"scratch_{name}", [*budget, "train.init_from="])
    rows.append({"name": name, "series": "uptrained", "val_loss": uptrained["val_loss"],
                 "kv_bytes_per_token_bf16": uptrained["kv_bytes_per_token_bf16"], "schedule": uptrained["schedule"],
                 "num_params": uptrained["num_params"], "converted": at_conversion["val_loss"],
                 "uptrained": uptrained["val_loss"], "scratch": scratch["val_loss"]})
    rows.append({**rows[-1], "series": "from scratch", "val_loss": scratch["val_loss"]})
    print(f"{name}: converted {at_conversion['val_loss']:.4f}, uptrained {uptrained['val_loss']:.4f}, "
          f"from scratch {scratch['val_loss']:.4f}", flush=True)

  table = [f"Dense start: {args.dense_steps} steps; uptraining and from-scratch runs: {args.steps} steps of the same "
           f"32x128 tokens each (uptraining lr {args.uptrain_lr}, from scratch the dense recipe's). Validation loss "
           "in nats per token (= per byte: byte tokenizer) on the whole validation split.", "",
           "| schedule | KV bytes/token (bf16) | params | converted (step 0) | uptrained | from scratch | "
           "uptrained - dense uptrained |", "|---|---|---|---|---|---|---|"]
  for r in (r for r in rows if r["series"] != "from scratch"):
    up = "—" if r["uptrained"] is None else f"{r['uptrained']:.4f}"
    sc = "—" if r["scratch"] is None else f"{r['scratch']:.4f}"
    control = next((c["uptrained"] for c in rows if c["name"] == "dense" and c["series"] == "uptrained"), None)
    delta = "—" if r["uptrained"] is None or control is None else f"{r['uptrained'] - control:+.4f}"
    table.append(f"| {r['name']} ({r['schedule']}) | {r['kv_bytes_per_token_bf16']:,} | {r['num_params']:,} | "
                 f"{r['converted']:.4f} | {up} | {sc} | {delta} |")
  out.mkdir(parents=True, exist_ok=True)
  table += ["", "start: the dense model after export to HF and import back (bit-exact); dense: that model trained on "
            "with the uptraining recipe, the control every schedule is compared with."]
  (out / "results.md").write_text("\n".join(table) + "\n")
  (out / "results.json").write_text(json.dumps(rows, indent=1))
  from jaxshare.analysis.plots import loss_vs_kv

  loss_vs_kv(rows, out / "pareto.png", kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label="validation loss (nats/byte)")
  print("\n".join(table))
  return 0


if __name__ == "__main__":
  sys.exit(main())
