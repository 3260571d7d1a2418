"""Convert between Hugging Face checkpoints and jaxshare run directories.

  python -m jaxshare.convert import HF_DIR RUN_DIR [overrides...]
      a local HF directory (config.json, safetensors, tokenizer) -> a jaxshare run directory; then e.g.
      python train.py train.init_from=RUN_DIR ...   or   python eval.py RUN_DIR
  python -m jaxshare.convert export RUN_DIR HF_DIR
      a run's latest checkpoint -> an HF directory: LlamaForCausalLM / GPTNeoXForCausalLM for dense and GQA
      models (transformers loads it offline), jaxshare's own layout for any other schedule (re-imports exactly)
  python -m jaxshare.convert uptrain SRC_RUN OUT_RUN schedule.kind=mlkv schedule.kv_layers=2 [overrides...]
  python -m jaxshare.convert uptrain SRC_RUN OUT_RUN --config runs/search/frontier/cla2.yaml [overrides...]
      a trained run converted into another schedule (the source's config, with the --config file's schedule, plus
      the overrides): K/V pooled per
      train.init_kv_pool, MLPs widened per train.init_mlp_widen, UniAttn's W_c fitted by least squares on
      calibration batches, shared tensors copied, the rest freshly initialised; prints which rule built each tensor.
      Then train it: python train.py <same overrides> train.init_from=OUT_RUN train.run_dir=NEW_DIR
  python -m jaxshare.convert ties RUN_DIR
      a head-wise run written before jaxshare stored its ties with the run: choose them once more, as they were
      chosen when it started (on its train.init_from source, or on the dense model of its seed), and store them

Weights are read through safetensors only; nothing is unpickled and nothing is downloaded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line; flags may come before, between or after the overrides."""
  from jaxshare.cli_args import parse_anywhere
  from jaxshare.config import WcFit

  parser = argparse.ArgumentParser(prog="python -m jaxshare.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True)
  imp = sub.add_parser("import", help="HF directory -> jaxshare run directory")
  imp.add_argument("hf_dir", help="HF model directory (config.json, model.safetensors[.index.json]), local or gs://")
  imp.add_argument("run_dir", help="new jaxshare run directory to write")
  imp.add_argument("overrides", nargs="*", help="jaxshare config overrides for the run (train.*, data.*)")
  exp = sub.add_parser("export", help="jaxshare run directory -> HF directory")
  exp.add_argument("run_dir", help="run directory (latest checkpoint) or checkpoint step directory")
  exp.add_argument("hf_dir", help="new output directory, local or gs:// (written locally, then uploaded)")
  exp.add_argument("--max-shard-gb", type=float, default=5.0, metavar="GB",
                   help="split the weights into safetensors shards of at most this size, with an index "
                   "(default: %(default)s, as save_pretrained)")
  up = sub.add_parser("uptrain", help="jaxshare run -> the same model converted into another schedule")
  up.add_argument("src_run", help="source run directory (e.g. a dense model, imported or trained)")
  up.add_argument("out_run", help="new run directory to write")
  up.add_argument("overrides", nargs="*", help="overrides of the source's config, e.g. schedule.kind=gqa "
                  "schedule.kv_heads=2 train.init_kv_pool=running")
  up.add_argument("--config", metavar="YAML", help="take the target's schedule from this config file (e.g. a "
                  "schedule search's frontier/<name>.yaml); the overrides apply after it")
  up.add_argument("--calibration-batches", type=int, default=8, metavar="N",
                  help="UniAttn: fit each W_c by least squares on the first N training batches (Thm 3.1 / Alg. 1, "
                  "bottom-up); 0 keeps W_c at zero (default: %(default)s)")
  up.add_argument("--lisa-steps", type=int, default=200, metavar="N",
                  help="train.init_lisa=calibrated: Adam steps fitting LISA's low-rank factors to the source's logits "
                  "on the calibration batches (default: %(default)s)")
  up.add_argument("--wc-fit", choices=tuple(WcFit), default="tokens",
                  help="UniAttn W_c fit: tokens (least squares over every calibration token) or mean (the paper's "
                  "v=1: sample means per position; when seq_len is not much larger than d_model it fits the mean "
                  "error exactly with a W_c that fails on single tokens) (default: %(default)s)")
  ties = sub.add_parser("ties", help="store an old head-wise run's ties in its run directory (once)")
  ties.add_argument("run_dir", help="head-wise run directory without head_ties.json")
  args = parse_anywhere(parser, argv, {"import": imp, "export": exp, "uptrain": up, "ties": ties})
  if args.command == "uptrain" and args.calibration_batches < 0:
    up.error(f"--calibration-batches={args.calibration_batches} is invalid: must be >= 0")
  if args.command == "uptrain" and args.lisa_steps < 0:
    up.error(f"--lisa-steps={args.lisa_steps} is invalid: must be >= 0")
  if args.command == "uptrain" and not args.overrides and not args.config:
    up.error("the target schedule is missing: give overrides (e.g. schedule.kind=cla) or --config YAML")
  if args.command == "export" and args.max_shard_gb <= 0:
    exp.error(f"--max-shard-gb={args.max_shard_gb} is invalid: must be > 0")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)

  from jaxshare.exit_codes import report_input_errors

  return report_input_errors(lambda: _run(args), also=(FileExistsError,))


def _run(args) -> int:
  """The subcommand ``args.command``."""
  from jaxshare.convert.hf_checkpoint import HFCheckpoint
  from jaxshare.convert.hf_export import export_run
  from jaxshare.convert.byte_tokenizer import is_byte_tokenizer
  from jaxshare.convert.hf_import import load_hf_model
  from jaxshare.convert.migrate import store_ties
  from jaxshare.convert.staging import local_hf_input, local_hf_output
  from jaxshare.files import is_remote, writable_dir
  from jaxshare.convert.uptrain import uptrain_run
  from jaxshare.store.runs import write_run

  if args.command == "import":
    out = writable_dir(args.run_dir, "run_dir")
    if not is_remote(out):
      out.parent.mkdir(parents=True, exist_ok=True)
    # disk-backed parameters: beside the run on its disk, or in the system's temporary directory for a bucket
    scratch_parent = None if is_remote(out) else out.parent
    with local_hf_input(args.hf_dir) as hf_dir, tempfile.TemporaryDirectory(prefix=".import-",
                                                                             dir=scratch_parent) as scratch:
      ckpt = HFCheckpoint(hf_dir)
      model = load_hf_model(ckpt, args.overrides, progress=True, scratch_dir=scratch)
      # a jaxshare export of a byte-tokenizer run carries that tokenizer for transformers; the run keeps "byte"
      byte_run = is_byte_tokenizer(ckpt.directory)
      run = write_run(out, model, tokenizer_files=[] if byte_run else ckpt.tokenizer_files(),
                      meta={"imported_from": str(args.hf_dir), "architecture": ckpt.architecture})
      what = f"{model.num_params:,} parameters, {model.schedule.describe()}"
      del model
    print(f"imported {ckpt.architecture} ({what}) into {run}")
  elif args.command == "uptrain":
    from jaxshare.config import load_config

    schedule = load_config(args.config, []).schedule if args.config else None
    for line in uptrain_run(args.src_run, args.out_run, args.overrides, calibration_batches=args.calibration_batches,
                            wc_fit=args.wc_fit, lisa_steps=args.lisa_steps, schedule=schedule):
      print(line)
  elif args.command == "ties":
    print(store_ties(args.run_dir))
  else:
    with local_hf_output(args.hf_dir) as out_dir:
      arch, why_remote = export_run(args.run_dir, out_dir, progress=True, max_shard_bytes=int(args.max_shard_gb * 1e9))
    print(f"exported {args.run_dir} as {arch} into {args.hf_dir}"
          + (f" (remote code, as no transformers class holds it: {why_remote}; load it with "
             "AutoModelForCausalLM.from_pretrained(..., trust_remote_code=True))" if why_remote else ""))
  return 0


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()
  sys.exit(main())
