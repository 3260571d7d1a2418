"""train.py trains Tiny Shakespeare with the sequence split over 4 host devices (mesh.context=4), the keys gathered and
round the ring, its first 20 losses those of one device."""

import subprocess
import sys

import numpy as np

from conftest import REPO, cpu_env
from support.faults import losses_by_step

RUN = ["--config", "configs/experiments/shakespeare_cla2.yaml", "train.steps=20", "train.warmup_steps=5",
       "train.log_every=1", "train.eval_every=0", "train.progress_bar=false", "train.peak_tflops=0.1"]


def _train(run_dir, devices: int, *overrides: str) -> dict[int, float]:
  proc = subprocess.run([sys.executable, "train.py", *RUN, f"train.run_dir={run_dir}", *overrides], cwd=REPO,
                        env=cpu_env(devices), capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
  return losses_by_step(run_dir)


def test_context_parallel_training_follows_the_single_device_curve(tmp_path):
  one = _train(tmp_path / "one", 1)
  assert one[20] < one[1] - 1.0  # it learned: the curves compared are not flat
  for strategy in ("all_gather", "ring"):
    split = _train(tmp_path / strategy, 4, "mesh.context=4", f"attention.context_strategy={strategy}")
    assert sorted(split) == sorted(one) == list(range(1, 21)), strategy
    np.testing.assert_allclose([split[s] for s in sorted(split)], [one[s] for s in sorted(one)], rtol=2e-5,
                               err_msg=strategy)
