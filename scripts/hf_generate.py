#!/usr/bin/env python
"""Generate from an exported model with transformers alone (never imports JAX or jaxshare), and measure its cache.

Loads ``HF_DIR`` offline with ``trust_remote_code=True`` (a jaxshare remote-code export, or any transformers class),
greedily continues the prompts as one left-padded batch and prints the continuations and the cache's allocated
bytes per token (summed over its tensors after the prompts, divided by batch x prompt length).

Usage:
  python scripts/hf_generate.py hf/cla2 --prompt "ROMEO:" --prompt "JULIET: O" --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import sys


def cache_name() -> str:
  """The name of a transformers model's cache argument and output field: ``cache`` from transformers 5.23,
  ``past_key_values`` before."""
  from transformers.modeling_outputs import CausalLMOutputWithPast

  return "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def output_cache(output):
  """The cache a transformers model output carries (None without ``use_cache``)."""
  return getattr(output, cache_name())


def cache_bytes(cache) -> int:
  """Bytes of the tensors a transformers cache holds (keys and values of every layer)."""
  import torch

  return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
             if isinstance(t, torch.Tensor))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("hf_dir", help="an exported Hugging Face directory")
  ap.add_argument("--prompt", action="append", default=None, help="a prompt (repeat for a batch; default ROMEO:)")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  args = ap.parse_args(argv)
  if args.max_new_tokens < 1:
    ap.error(f"--max-new-tokens={args.max_new_tokens} must be >= 1")

  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  prompts = args.prompt or ["ROMEO:"]
  tok = AutoTokenizer.from_pretrained(args.hf_dir, trust_remote_code=True, local_files_only=True)
  model = AutoModelForCausalLM.from_pretrained(args.hf_dir, trust_remote_code=True, local_files_only=True).eval()
  batch = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
  with torch.no_grad():
    prefill = model(**batch, use_cache=True)
    out = model.generate(**batch, max_new_tokens=args.max_new_tokens, do_sample=False,
                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
  rows, width = batch["input_ids"].shape
  cache = output_cache(prefill)
  print(f"{type(model).__name__} from {args.hf_dir}; cache {type(cache).__name__}: "
        f"{cache_bytes(cache) / (rows * width):,.0f} bytes per token ({next(model.parameters()).dtype})")
  for prompt, ids in zip(prompts, out[:, width:]):
    print(f"--- {prompt!r}\n{prompt}{tok.decode(ids, skip_special_tokens=True)}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
