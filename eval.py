#!/usr/bin/env python
"""Evaluate a jaxshare run directory or checkpoint on its validation split.

Examples:
  python eval.py runs/shakespeare_cla2
  python eval.py runs/shakespeare_cla2/checkpoints/400 --json
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("path", help="run directory (latest checkpoint) or <run_dir>/checkpoints/<step>")
  parser.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
  parser.add_argument("--max-batches", type=int, default=0, help="validation batches (0: the whole split)")
  parser.add_argument("--prompt", default="ROMEO:\n", help="prompt of the greedy sample")
  parser.add_argument("--sample-tokens", type=int, default=200, help="tokens to generate (0: no sample)")
  args = parser.parse_args(argv)

  from jaxshare.config import ConfigError
  from jaxshare.data import DataError
  from jaxshare.evaluation.evaluate import evaluate_run, format_report
  from jaxshare.train.checkpoint import CheckpointError

  try:
    report = evaluate_run(args.path, max_batches=args.max_batches, prompt=args.prompt,
                          sample_tokens=args.sample_tokens)
  except (ConfigError, DataError, CheckpointError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(json.dumps(report) if args.json else format_report(report))
  return 0


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()  # before JAX allocates anything: see jaxshare/allocator.py
  sys.exit(main())
