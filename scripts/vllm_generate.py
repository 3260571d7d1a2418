"""Serve K/V-sharing exports with vLLM (on a GPU, with ``pip install 'jaxshare[vllm]'``): greedy continuations next
to transformers' for the same directories, and the KV cache vLLM allocates for each.

    python scripts/vllm_generate.py hf/dense hf/cla2 hf/mlkv --prompt "ROMEO:" --max-new-tokens 32

For every directory (exported by ``python -m jaxshare.convert export``): vLLM's greedy tokens, whether they equal
transformers' remote code's (``trust_remote_code=True``, same dtype), and the number of KV cache blocks vLLM's
allocator made from the same ``--gpu-memory-utilization``, with the tokens they hold: a consumer layer has no blocks,
so at equal memory CLA2 holds about twice dense's tokens and MLKV ``L/m * H/g`` times. Each model runs in its own
process (vLLM keeps its GPU memory until the process ends).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys


def parse_args(argv):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("dirs", nargs="+", help="export directories (remote code of K/V schedules)")
  p.add_argument("--prompt", action="append", help="prompt text (repeatable; default 'ROMEO:')")
  p.add_argument("--max-new-tokens", type=int, default=32)
  p.add_argument("--dtype", default="bfloat16",
                 help="vLLM's and transformers' dtype (default bfloat16: vLLM's CUDA backend for float32 at head "
                      "width < 32, FlexAttention, refuses K/V sharing)")
  p.add_argument("--gpu-memory-utilization", type=float, default=0.5)
  return p.parse_args(argv)


def _vllm_run(directory: str, prompts: list[str], args, queue) -> None:
  from vllm import LLM, SamplingParams

  llm = LLM(model=directory, trust_remote_code=True, dtype=args.dtype, enforce_eager=True,
            gpu_memory_utilization=args.gpu_memory_utilization, tensor_parallel_size=1)
  # ignore_eos: the export's config has no eos_token_id, so transformers never stops early either
  outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_new_tokens, ignore_eos=True))
  cache = llm.llm_engine.vllm_config.cache_config
  queue.put({"tokens": [list(o.outputs[0].token_ids) for o in outs], "blocks": cache.num_gpu_blocks,
             "block_size": cache.block_size})


def _transformers_tokens(directory: str, prompts: list[str], args) -> list[list[int]]:
  import torch
  from transformers import AutoModelForCausalLM, AutoTokenizer

  tok = AutoTokenizer.from_pretrained(directory)
  model = AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True,
                                               dtype=getattr(torch, args.dtype)).eval()
  out = []
  for prompt in prompts:  # one at a time: no padding to differ from vLLM's unpadded requests
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
      gen = model.generate(ids, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                           do_sample=False)
    out.append(gen[0, ids.shape[1]:].tolist())
  return out


def main(argv=None) -> int:
  args = parse_args(argv)
  prompts = args.prompt or ["ROMEO:"]
  ctx = multiprocessing.get_context("spawn")
  print("directory | greedy == transformers | KV cache blocks x block size = tokens")
  ok = True
  for directory in args.dirs:
    queue = ctx.Queue()
    proc = ctx.Process(target=_vllm_run, args=(directory, prompts, args, queue))
    proc.start()
    result = queue.get()
    proc.join()
    same = result["tokens"] == _transformers_tokens(directory, prompts, args)
    ok &= same
    print(f"{directory} | {same} | {result['blocks']} x {result['block_size']} = "
          f"{result['blocks'] * result['block_size']:,}")
    print(json.dumps({"dir": directory, **result}))
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
