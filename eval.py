#!/usr/bin/env python
"""Evaluate a jaxshare run (or an imported HF checkpoint's run directory): report, generate, perplexity, efficiency.

Examples:
  python eval.py runs/shakespeare_cla2                       # report: val loss, perplexity, bits/byte, KV bytes, sample
  python eval.py report runs/shakespeare_cla2/checkpoints/400 --json
  python eval.py generate runs/shakespeare_cla2 --prompt "ROMEO:" --max-new-tokens 200 --temperature 0.8 --top-p 0.95
  python eval.py generate runs/shakespeare_cla2 --prompt "ROMEO:" --no-cache   # full forward per token (reference)
  python eval.py ppl runs/shakespeare_cla2 --text ../shared/data/tinyshakespeare.txt
  python eval.py efficiency runs/shakespeare_cla2 --context 512 --batch 4
"""

from __future__ import annotations

import argparse
import json
import sys

COMMANDS = ("report", "generate", "ppl", "efficiency")


def parse_args(argv: list[str]) -> argparse.Namespace:
  """The command line (``eval.py RUN`` is ``eval.py report RUN``); flags may come anywhere after the command."""
  from jaxshare.cli_args import parse_anywhere

  if argv and argv[0] not in COMMANDS and not argv[0].startswith("-"):
    argv = ["report", *argv]
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  run_help = "run directory (latest checkpoint) or <run_dir>/checkpoints/<step>"

  report = sub.add_parser("report", help="validation loss, perplexity, bits/byte, size, KV bytes and a greedy sample")
  report.add_argument("path", help=run_help)
  report.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
  report.add_argument("--max-batches", type=int, default=0, help="validation batches (0: the whole split)")
  report.add_argument("--skip-batches", type=int, default=0, metavar="N",
                      help="skip the first N validation batches (a search's selection batches)")
  report.add_argument("--prompt", default="ROMEO:\n", help="prompt of the greedy sample")
  report.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate (0: no sample)")

  gen = sub.add_parser("generate", help="continue a prompt, streaming tokens as they are produced")
  gen.add_argument("path", help=run_help)
  gen.add_argument("--prompt", required=True, help="the text to continue")
  gen.add_argument("--max-new-tokens", type=int, default=200, help="tokens to generate")
  gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
  gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0: all)")
  gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
  gen.add_argument("--seed", type=int, default=0, help="sampling seed")
  gen.add_argument("--stop", action="append", default=[], help="stop at this token id (repeatable; default: EOS)")
  gen.add_argument("--nf", action="store_true", help="LISA's NF strategy: prefill with the kept original attention")
  gen.add_argument("--no-cache", action="store_true",
                   help="decode by a full forward pass per token instead of the KV cache (the reference)")

  ppl = sub.add_parser("ppl", help="loss, perplexity and bits per byte of a text file or a local tfds dataset")
  ppl.add_argument("path", help=run_help)
  src = ppl.add_mutually_exclusive_group(required=True)
  src.add_argument("--text", help="a UTF-8 text file")
  src.add_argument("--tfds", help="a tfds dataset name, read from --tfds-data-dir (never downloaded)")
  ppl.add_argument("--tfds-split", default="test", help="tfds split")
  ppl.add_argument("--tfds-data-dir", default="", help="tfds data directory")
  ppl.add_argument("--text-field", default="text", help="tfds feature holding the text")
  ppl.add_argument("--max-batches", type=int, default=0, help="batches to score (0: all)")
  ppl.add_argument("--json", action="store_true", help="print one JSON object")

  eff = sub.add_parser("efficiency", help="KV bytes, the largest batch in a memory budget, decode and prefill speed")
  eff.add_argument("path", help=run_help)
  eff.add_argument("--budget-gib", type=float, default=4.0, help="KV-cache memory budget for the largest batch")
  eff.add_argument("--context", type=int, default=512, help="context length of the timed decode (tokens)")
  eff.add_argument("--max-batch-context", type=int, default=8192, help="context length of the largest-batch figure")
  eff.add_argument("--batch", type=int, default=4, help="batch of the timed decode")
  eff.add_argument("--steps", type=int, default=32, help="timed decode steps")
  eff.add_argument("--json", action="store_true", help="print one JSON object")
  return parse_anywhere(parser, argv, {"report": report, "generate": gen, "ppl": ppl, "efficiency": eff})


def main(argv: list[str] | None = None) -> int:
  args = parse_args(list(sys.argv[1:] if argv is None else argv))

  from jaxshare.exit_codes import report_input_errors

  command = {"report": _report, "generate": _generate, "ppl": _ppl, "efficiency": _efficiency}[args.command]
  return report_input_errors(lambda: command(args), also=(ValueError,))


def _report(args) -> int:
  from jaxshare.evaluation.evaluate import evaluate_run, format_report

  report = evaluate_run(args.path, max_batches=args.max_batches, skip_batches=args.skip_batches, prompt=args.prompt,
                        sample_tokens=args.sample_tokens)
  print(json.dumps(report) if args.json else format_report(report))
  return 0


def _generate(args) -> int:
  from jaxshare.evaluation.generate import Generator
  from jaxshare.evaluation.sampling import Sampling
  from jaxshare.evaluation.text_stream import TextStream
  from jaxshare.store.runs import load_run

  sampling = Sampling(args.temperature, args.top_k, args.top_p)
  run = load_run(args.path)
  tokenizer = run.tokenizer()
  prompt = tokenizer.encode(args.prompt)
  stop = [int(s) for s in args.stop] or [tokenizer.eos_id]
  generator = Generator(run.model(), run.plan)
  text = TextStream(tokenizer)
  print(args.prompt, end="", flush=True)

  def stream(tokens, live):
    print(text.push(t for t, keep in zip(tokens[0], live[0]) if keep), end="", flush=True)

  generator.generate([prompt], args.max_new_tokens, sampling, seed=args.seed, stop_tokens=stop, nf=args.nf,
                     use_cache=not args.no_cache, chunk=1 if args.no_cache else 8, on_tokens=stream)
  print(text.finish())
  return 0


def _ppl(args) -> int:
  from jaxshare.evaluation.evaluate import perplexity

  r = perplexity(args.path, text=args.text, tfds_name=args.tfds, tfds_split=args.tfds_split,
                 tfds_data_dir=args.tfds_data_dir, text_field=args.text_field, max_batches=args.max_batches)
  print(json.dumps(r) if args.json else
        f"loss {r['loss']:.4f} nats/token | perplexity {r['perplexity']:.3f} | bits/byte {r['bits_per_byte']:.4f} "
        f"| {r['tokens']:,} tokens")
  return 0


def _efficiency(args) -> int:
  from jaxshare import smoke
  from jaxshare.evaluation.efficiency import format_table, measure_run

  budget, big_context, (context,) = smoke.cache_sizes(args.budget_gib, args.max_batch_context, [args.context])
  r = measure_run(args.path, budget_gib=budget, max_batch_context=big_context, contexts=(context,),
                  prefill_context=context, batch=args.batch, steps=args.steps)
  print(json.dumps(r) if args.json else format_table([r]))
  return 0


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()  # before JAX allocates anything: see jaxshare/allocator.py
  sys.exit(main())
