#!/usr/bin/env python
"""Peak memory of converting an HF checkpoint, relative to the checkpoint's size.

Builds a random Llama checkpoint with transformers (fp32 or bf16 safetensors, nothing downloaded), then runs
``python -m jaxshare.convert import`` and ``export`` on it in child processes and prints each one's peak resident
memory (ru_maxrss) as a multiple of the weights' bytes, next to a bare ``python -c 'import jax'`` baseline.

Usage: python scripts/bench_convert.py [--layers 8 --d-model 1024] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def peak_rss(cmd: list[str]) -> tuple[float, float, float]:
  """``(peak RSS, peak anonymous RSS, seconds)`` of a child process, bytes. Anonymous memory is what cannot be
  evicted; RSS also counts file-backed pages (the memory-mapped checkpoint, disk-backed parameters), which the kernel
  drops under pressure. Sampled every 10 ms from /proc (anonymous) and ru_maxrss (total)."""
  start = time.perf_counter()
  proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL)
  anon = 0
  while True:
    pid, status, usage = os.wait4(proc.pid, os.WNOHANG)  # reaps with the child's own rusage once it exits
    if pid:
      break
    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
      if line.startswith("RssAnon:"):
        anon = max(anon, int(line.split()[1]) * 1024)
    time.sleep(0.01)
  if status:
    raise SystemExit(f"{cmd} failed with status {status}")
  rss = usage.ru_maxrss * 1024
  return rss, anon, time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--d-model", type=int, default=1024)
  parser.add_argument("--vocab", type=int, default=32000)
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  parser.add_argument("--max-shard-gb", type=float, default=0.25, help="export shard size (GB)")
  args = parser.parse_args(argv)
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM

  with tempfile.TemporaryDirectory() as tmp:
    tmp = Path(tmp)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
                         num_hidden_layers=args.layers, num_attention_heads=args.d_model // 64,
                         num_key_value_heads=args.d_model // 64, max_position_embeddings=512)
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
    model.save_pretrained(tmp / "hf")
    weights = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    n_params = sum(p.numel() for p in model.parameters())
    del model
    base, base_anon, _ = peak_rss([sys.executable, "-c", "import jax, jax.numpy as jnp; jnp.zeros(1).block_until_ready()"])
    imp, imp_anon, t_imp = peak_rss([sys.executable, "-m", "jaxshare.convert", "import", str(tmp / "hf"), str(tmp / "run")])
    exp, exp_anon, t_exp = peak_rss([sys.executable, "-m", "jaxshare.convert", "export", str(tmp / "run"),
                                     str(tmp / "out"), "--max-shard-gb", str(args.max_shard_gb)])
  gib = 2 ** 30
  print(f"checkpoint: {n_params / 1e6:.1f}M parameters, {weights / gib:.3f} GiB of {args.dtype} safetensors")
  print(f"baseline (import jax):   peak RSS {base / gib:.3f} GiB, anonymous {base_anon / gib:.3f} GiB")
  for name, rss, anon, t in (("import", imp, imp_anon, t_imp), ("export", exp, exp_anon, t_exp)):
    print(f"{name:<24} peak RSS {rss / gib:.3f} GiB = baseline + {(rss - base) / weights:.2f} x weights; "
          f"anonymous {anon / gib:.3f} GiB = baseline + {(anon - base_anon) / weights:.2f} x weights ({t:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
