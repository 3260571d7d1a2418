"""Prepare a corpus for training: tokenize it once, in parallel, into token shards and a manifest.

  python -m jaxshare.data prepare --out data/shakespeare ../shared/data/tinyshakespeare.txt --val-fraction 0.1
  python -m jaxshare.data prepare --out gs://bucket/web --tokenizer path/to/tokenizer --workers 16 \\
      --val-docs 10000 'corpus/*.jsonl.zst' --text-field text
"""

from __future__ import annotations

import argparse
import json
import sys

from jaxshare.cli_args import parse_anywhere


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  from jaxshare.data.prepare import DEFAULT_VAL_FRACTION

  parser = argparse.ArgumentParser(prog="python -m jaxshare.data", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  prep = sub.add_parser("prepare", help="tokenize inputs into token shards and a manifest (resumes if interrupted)")
  prep.add_argument("inputs", nargs="+", help="files, directories, globs of UTF-8 text, JSONL (.gz/.zst), parquet, a "
                    "saved datasets directory or tfds:NAME/SPLIT; local or any etils.epath path (gs://...)")
  prep.add_argument("--out", required=True, help="output directory (local or gs://...)")
  prep.add_argument("--tokenizer", default="byte", help="byte, or a local Hugging Face tokenizer directory")
  prep.add_argument("--workers", type=int, default=1, help="tokenizer processes for a Hugging Face tokenizer (the "
                    "output does not depend on it; byte-level tokenization is a copy and stays in one process)")
  prep.add_argument("--val-docs", type=int, default=0, help="hold out the last N documents for validation (on a "
                    "large corpus: a held-out set of a fixed size)")
  prep.add_argument("--val-fraction", type=float, default=None,
                    help="hold out the last documents making up this share of the tokens for validation (default: "
                    f"{DEFAULT_VAL_FRACTION}, the share train.py holds out of a text file, unless --val-docs is given; "
                    "0: no validation split, and training runs without validation)")
  prep.add_argument("--document-separator", default="", help="split text files into documents at this string")
  prep.add_argument("--text-field", default="text", help="text field of JSONL records, parquet/datasets columns, TFDS")
  prep.add_argument("--tfds-data-dir", default="", help="where tfds: inputs are prepared (default: TFDS's)")
  prep.add_argument("--shard-tokens", type=int, default=None, help="tokens per shard (default 2^27)")
  prep.add_argument("--skip-bad-docs", action="store_true",
                    help="skip unreadable, non-UTF-8 or malformed documents and files (counted) instead of stopping")
  prep.add_argument("--no-progress", action="store_true", help="no progress bar")
  return parse_anywhere(parser, argv, {"prepare": prep})


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)
  from jaxshare.data.prepare import DEFAULT_SHARD_TOKENS, PrepareOptions, prepare
  from jaxshare.data.shards import manifest_summary
  from jaxshare.exit_codes import report_input_errors

  options = PrepareOptions(tokenizer=args.tokenizer, separator=args.document_separator, text_field=args.text_field,
                           tfds_data_dir=args.tfds_data_dir, val_docs=args.val_docs, val_fraction=args.val_fraction,
                           shard_tokens=args.shard_tokens or DEFAULT_SHARD_TOKENS, skip_bad_docs=args.skip_bad_docs)

  def run() -> int:
    summary = manifest_summary(prepare(args.inputs, args.out, options, workers=args.workers,
                                       progress=not args.no_progress))
    print(f"prepared {args.out}: {json.dumps(summary)}")
    if not summary["validation_tokens"]:
      print("warning: no validation split (--val-fraction 0): train.py trains on it with validation off; hold some "
            "out with --val-docs N or --val-fraction F into a new --out", file=sys.stderr)
    return 0

  return report_input_errors(run)


if __name__ == "__main__":
  sys.exit(main())
