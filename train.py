#!/usr/bin/env python
"""Train a jaxshare language model.

Examples:
  python train.py --config configs/experiments/shakespeare_cla2.yaml
  python train.py --config configs/experiments/shakespeare_cla2.yaml train.steps=500 schedule.kind=mlkv \\
      schedule.kv_layers=2 train.run_dir=runs/mlkv2

Re-running with the same train.run_dir resumes from its latest checkpoint. Ctrl-C or SIGTERM (preemption) saves a
checkpoint after the current step and exits; a second signal still waits for that write, a third aborts (the last
finished checkpoint is kept).

Exit codes: 0 finished (or stopped at train.steps); 130 interrupted by SIGINT/SIGTERM, checkpoint saved (or aborted
by a third signal); 2 bad input (config, schedule, data, checkpoint); 3 training diverged (train.nan_policy=stop).

Ahead-of-time fit check (no TPU, no training; jaxshare/aot/fit.py): compile the real train step for a TPU topology or
accelerator type on this host and report HBM per chip, FLOPs and whether it fits; exit code 0 fits, 3 does not (what
to change on stderr), 2 bad flags or config:
  python train.py --config configs/experiments/llama_1b_pod.yaml --compile-only --topology v5e-256 [--max-batch]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  """The command line; flags may come before, between or after the overrides."""
  from jaxshare.cli_args import parse_anywhere

  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--config", help="experiment YAML (its includes: are merged first)")
  parser.add_argument("--help-config", action="store_true", help="list every config field with its documentation")
  parser.add_argument("--no-eval", action="store_true", help="skip the evaluation summary after training")
  parser.add_argument("--compile-only", action="store_true",
                      help="compile the train step for --topology on this host and report whether it fits; no training")
  parser.add_argument("--topology", help="--compile-only: TPU topology (v5e:16x16, v5p:4x4x4) or accelerator type "
                      "(v5e-256, v5p-128, v6e-64, v4-128)")
  parser.add_argument("--num-slices", type=int, help="--compile-only: TPU slices (default: the config's mesh.dcn_* "
                      "sizes; from a one-slice config, data parallel across the slices)")
  parser.add_argument("--max-batch", action="store_true",
                      help="--compile-only: also find the largest global batch that fits, by compiling")
  parser.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=500 model.num_layers=6")
  args = parse_anywhere(parser, argv)
  if args.compile_only != bool(args.topology) or (args.max_batch or args.num_slices) and not args.compile_only:
    parser.error("--compile-only needs --topology; --topology, --num-slices and --max-batch need --compile-only")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)

  from jaxshare.config import describe_fields

  if args.help_config:
    print(describe_fields())
    return 0
  if args.compile_only:
    return _compile_only(args)
  from jaxshare import exit_codes
  from jaxshare.files import StorageUnavailable
  from jaxshare.train.interrupts import interrupt_outside_loop
  from jaxshare.train.loop import DivergenceError

  interrupt_outside_loop()  # SIGTERM outside the training loop, which handles it itself
  try:
    from jaxshare.train.config import load_train_config

    cfg = load_train_config(args.config, args.overrides)  # train.init_from: on that run's model and schedule
    from jaxshare.distributed import initialize, is_primary

    multi_process = initialize(cfg.distributed)  # before any other JAX call: the processes join here
    from jaxshare.train.loop import train

    summary = train(cfg)
  except (exit_codes.InputError, DivergenceError) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    code = exit_codes.DIVERGED if isinstance(e, DivergenceError) else exit_codes.BAD_INPUT
    if _joined_others():  # this process may have stopped alone: waiting for the others in JAX's shutdown barrier
      sys.stdout.flush()  # would hang; gone, it is noticed by the coordination service, which stops them
      os._exit(code)
    return code
  except StorageUnavailable as e:  # the bucket's outage outlasted train.storage_patience_s
    print(f"error: {e}. Nothing committed was lost: re-run the same command to resume from the last committed "
          "checkpoint", file=sys.stderr, flush=True)
    sys.stdout.flush()  # without teardown: the writers of the unreachable bucket would try to flush again
    os._exit(exit_codes.STORAGE_UNAVAILABLE)
  except KeyboardInterrupt as e:  # outside the loop (nothing of this run written yet, or all of it), or a third signal
    print(f"interrupted{f' ({e})' if str(e) else ''}: re-run the same command to resume from the last finished "
          "checkpoint", file=sys.stderr, flush=True)
    # Exit without the interpreter's teardown: the signal may have cut a native library's initialisation or an orbax
    # write thread short, and tearing those down crashed (SIGSEGV) or printed tracebacks. What a cut write leaves is
    # a temporary directory, which never counts.
    sys.stdout.flush()
    os._exit(exit_codes.INTERRUPTED)
  if not is_primary():  # process 0 of a multi-host run reports for all
    return exit_codes.INTERRUPTED if summary["interrupted"] else 0
  print("training summary: " + json.dumps(summary))
  if summary["interrupted"]:
    return exit_codes.INTERRUPTED
  if multi_process:  # the evaluation runs in one process: evaluating here would leave the others out of its collectives
    print(f"evaluate with: python eval.py {cfg.train.run_dir}")
  elif not args.no_eval and summary["finished"]:
    from jaxshare.evaluation.evaluate import evaluate_run, format_report

    print(format_report(evaluate_run(cfg.train.run_dir)))
  return 0


def _joined_others() -> bool:
  """Whether this process is one of several joined by jax.distributed."""
  jax = sys.modules.get("jax")
  return jax is not None and jax.distributed.is_initialized() and jax.process_count() > 1


def _compile_only(args) -> int:
  """The fit check: the host compiles (JAX_PLATFORMS=cpu, set before JAX is imported) and jax.distributed is never
  started: there is no TPU and no cluster."""
  from jaxshare.aot import topology
  from jaxshare.exit_codes import report_input_errors

  def fit_check() -> int:
    topology.use_host_compiler()
    from jaxshare.train.config import load_train_config  # imports JAX: after the compiler is chosen

    cfg = load_train_config(args.config, args.overrides, fit_check=True)
    from jaxshare.aot import fit

    return fit.main(cfg, args.topology, args.num_slices, args.max_batch)

  return report_input_errors(fit_check)


if __name__ == "__main__":
  from jaxshare.allocator import reexec_with_tuned_allocator

  reexec_with_tuned_allocator()  # before JAX allocates anything: see jaxshare/allocator.py
  code = main()
  for late in (signal.SIGINT, signal.SIGTERM):  # the run is over: a late signal must not turn its exit code into a kill
    signal.signal(late, signal.SIG_IGN)
  sys.exit(code)
