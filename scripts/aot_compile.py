#!/usr/bin/env python
"""Compile the Pallas attention kernels and the model's train step for real TPU topologies and GPU clusters on a CPU
host with no accelerator.

``jax.experimental.topologies`` describes the devices: libtpu for TPU (``make .libtpu/.installed`` puts it in
``.libtpu/``, outside the venv; ``pip install 'jaxshare[tpu]'`` on a TPU VM), jax's CUDA plugin for GPU (``make
.jaxcuda/.installed``; targets in ``jaxshare/aot/gpu_targets/``). Each kernel's forward+backward (the decode kernel's
forward) and the train step (``attention.impl=pallas``, sharded on a data x fsdp x tensor mesh) compile to Mosaic
custom calls on TPU and Triton calls on GPU (sm_90 for H100/H200, sm_80 for A100, sm_100 for B200), and
``memory_analysis()`` is recorded. A kernel asking for more on-chip memory than the device has fails here.

Usage: python scripts/aot_compile.py [--topology v5e:2x2 --topology h100:8 ...] [--train-on h100:8] [--schedule dense ...]
       [--no-kernels] [--json OUT] [overrides ...]   (overrides apply to the train-step config, e.g. model.num_layers=8
       or attention.impl=splash; each row names its kernels by family: splash, pallas, pallas decode)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from jaxshare.aot.topology import topology_mesh, use_host_compiler

use_host_compiler()  # before JAX is imported: the host compiles, libtpu only describes the topologies

from jaxshare import smoke  # noqa: E402
from jaxshare.aot.compile import compile_kernels, compile_train_step  # noqa: E402
from jaxshare.config import MeshConfig, load_config  # noqa: E402
from jaxshare.config.catalogue import schedule_matrix  # noqa: E402
from jaxshare.exit_codes import report_input_errors  # noqa: E402

TOPOLOGIES = ("v5e:2x2", "v5p:2x2x1", "v6e:2x2", "h100:8", "a100:8")
SMOKE_TOPOLOGIES = ("v5e:2x2", "h100:8")  # JAXSHARE_SMOKE: one TPU, one GPU
# Train-step schedules: flash attention (dense), K/V consumers (CLA2, MLKV), probability reuse (UniAttn), both at once
# (CLA + UniAttn), concatenated-feature attention (LISA_plus).
SCHEDULES = schedule_matrix("script_aot_compile")
SMALL_MODEL = ["model.num_layers=4", "model.d_model=128", "model.num_heads=4", "model.mlp_dim=256",
               "data.seq_len=256", "train.batch_size=8", "attention.impl=pallas", "mesh.data=2", "mesh.tensor=2",
               "mesh.fsdp=-1"]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--topology", action="append",
                  help=f"TPU topology or GPU cluster (repeatable; default {', '.join(TOPOLOGIES)})")
  ap.add_argument("--train-on", action="append", metavar="TOPOLOGY",
                  help="topologies to compile the train steps for (repeatable; default every --topology)")
  ap.add_argument("--schedule", action="append", choices=sorted(SCHEDULES),
                  help="train-step schedules to compile (repeatable; default all)")
  ap.add_argument("--no-kernels", action="store_true", help="compile the train steps only, not each kernel alone")
  ap.add_argument("--json", help="also write the results to this JSON file")
  ap.add_argument("overrides", nargs="*", help="config overrides for the train step (key=value)")
  args = ap.parse_intermixed_args(argv)
  results: dict = {}
  topologies = args.topology or (SMOKE_TOPOLOGIES if smoke.enabled() else TOPOLOGIES)
  schedules = args.schedule or smoke.first(list(SCHEDULES))  # JAXSHARE_SMOKE: a quick check of the script

  def compile_all() -> int:
    for topology in topologies:
      start = time.perf_counter()
      mesh = topology_mesh(topology, MeshConfig(data=2, fsdp=1, tensor=-1))
      rows = [] if args.no_kernels else compile_kernels(mesh)
      for name in schedules if topology in (args.train_on or [topology]) else ():
        cfg = load_config(None, SMALL_MODEL + SCHEDULES[name] + list(args.overrides))
        rows.append(compile_train_step(cfg, topology_mesh(topology, cfg.mesh)))
      results[topology] = [dataclasses.asdict(r) for r in rows]
      device = mesh.devices.flat[0]
      calls = "Mosaic" if device.platform == "tpu" else "Triton"
      print(f"{topology} ({device.device_kind}, mesh {dict(mesh.shape)}): {time.perf_counter() - start:.1f} s")
      for r in rows:
        mem = r.memory or {}
        print(f"  {r.name:34s} {r.custom_calls:3d} {calls} calls  args {mem.get('argument_size_in_bytes', 0):>10,} B  "
              f"temp {mem.get('temp_size_in_bytes', 0):>10,} B  "
              f"code {mem.get('generated_code_size_in_bytes', 0):>9,} B  attention: {r.kernel_summary()}")
    return 0

  code = report_input_errors(compile_all)
  if code:
    return code
  if args.json:
    with open(args.json, "w") as f:
      json.dump(results, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
