"""Ahead-of-time proof without an accelerator: every Pallas kernel (forward+backward; the decode kernel forward)
compiles to Mosaic custom calls for real TPU topologies, the model's train step with ``attention.impl=pallas`` compiles for a sharded TPU mesh
(every attention call a Mosaic kernel inside shard_map), and every kernel lowers to Triton custom calls for CUDA.
Runs ``scripts/aot_compile.py`` in a child process: libtpu is initialised there, not in the test workers."""

import importlib.util
import json
import subprocess
import sys

import pytest

from conftest import OPTIMIZED_ENV, REPO

pytestmark = pytest.mark.skipif(
  not (REPO / ".libtpu" / "libtpu").is_dir() and importlib.util.find_spec("libtpu") is None,
  reason="libtpu is not installed (make .libtpu/.installed)")

# Attention calls per train step, forward and backward: 3 kernels per flash attention (forward, dQ, dK/dV) and per
# probability reuse. cla+uniattn (6 layers, producers 0,2-5, UniAttn superblock of 2 from
# layer 2): attention, a K/V consumer and a probability reuser in distinct bodies; lisa_plus: attention and the
# feature-chain attention.
MIN_TRAIN_CALLS = {"cla+uniattn": 9, "lisa_plus": 6}


def test_kernels_and_train_steps_compile_for_tpu_and_lower_for_cuda(tmp_path):
  out = tmp_path / "aot.json"
  topologies = ["v5e:2x2", "v5p:2x2x1", "v6e:2x2"]
  cmd = [sys.executable, "scripts/aot_compile.py", *(f"--topology={t}" for t in topologies),
         "--train-on=v5e:2x2", *(f"--schedule={s}" for s in MIN_TRAIN_CALLS), f"--json={out}"]
  proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, env=OPTIMIZED_ENV)
  assert proc.returncode == 0, proc.stderr[-3000:]
  results = json.loads(out.read_text())
  for topology in topologies:
    rows = {r["name"]: r for r in results["tpu"][topology]}
    for kernel, calls in (("flash_attention", 3), ("kv_consumer", 6), ("probability_reuse", 3),
                          ("lisa_plus_features", 3), ("decode", 1)):
      assert rows[kernel]["custom_calls"] == calls, (topology, rows[kernel])
      assert rows[kernel]["memory"]["argument_size_in_bytes"] > 0
  train = {r["name"]: r for r in results["tpu"]["v5e:2x2"] if r["name"].startswith("train_step")}
  for schedule, least in MIN_TRAIN_CALLS.items():
    assert train[f"train_step[{schedule}]"]["custom_calls"] >= least, train
  assert {r["name"]: r["custom_calls"] for r in results["cuda"]} == {
    "flash_attention": 3, "kv_consumer": 6, "probability_reuse": 3, "lisa_plus_features": 3, "decode": 1}


def test_unknown_topology_is_refused_by_name():
  proc = subprocess.run([sys.executable, "scripts/aot_compile.py", "--topology=v9z:1x1", "--no-cuda"], cwd=REPO,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert "--topology 'v9z:1x1': cannot describe this TPU topology" in proc.stderr
