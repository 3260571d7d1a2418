"""Run logging: console lines, a tqdm progress bar, ``metrics.jsonl`` and TensorBoard events; MFU."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
import os
from typing import Any

import jax
import jax.numpy as jnp
from etils import epath
from tqdm.auto import tqdm

from jaxshare.files import is_remote, with_retries

# Dense bf16 peak TFLOP/s per device, by substring of jax's device_kind (MaxText's and vendors' figures).
_PEAK_TFLOPS = (("v6 lite", 918.0), ("v6e", 918.0), ("v5 lite", 197.0), ("v5e", 197.0), ("v5p", 459.0),
                ("v5", 459.0), ("v4", 275.0), ("h200", 989.0), ("h100", 989.0), ("a100", 312.0), ("b200", 2250.0),
                ("l4", 121.0))


def _summary_writer(logdir: str):
  """tensorboardX's ``SummaryWriter`` for ``logdir``, imported without PyTorch: tensorboardX imports torch whenever
  it is installed (the ``hf`` extra installs it) only to accept torch tensors, which a JAX run never logs, and that
  import cost ~2 s of every run's start-up. Imported here, not at module level: it pulls protobuf."""
  import sys

  blocked = "torch" not in sys.modules
  if blocked:
    sys.modules["torch"] = None  # makes `import torch` raise ImportError, which tensorboardX handles
  try:
    from tensorboardX import SummaryWriter
  finally:
    if blocked:
      del sys.modules["torch"]
  return SummaryWriter(logdir)


@dataclasses.dataclass(frozen=True)
class Peak:
  """What MFU divides by.

  Attributes:
    flops_per_sec: peak FLOP/s of everything one train step runs on (all devices together).
    label: where the figure comes from, printed once in the run header.
    tag: a word or two printed beside every MFU figure ("" for a vendor peak, "host roofline", "configured peak").
  """

  flops_per_sec: float
  label: str
  tag: str


def vendor_peak_tflops(device_kind: str) -> float | None:
  """Dense bf16 peak TFLOP/s of one device of a known accelerator, by jax's ``device_kind`` (None: unknown)."""
  kind = device_kind.lower()
  return next((tflops for key, tflops in _PEAK_TFLOPS if key in kind), None)


@functools.cache
def host_matmul_flops(dtype: str = "float32", n: int = 1536, repeats: int = 5) -> float:
  """FLOP/s of the best of ``repeats`` jitted ``n x n`` matmuls in ``dtype`` on the first device: the host's
  practical matmul roofline (measured once per process; ~0.5 s on 2 cores)."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.dtype(dtype))
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  best = float("inf")
  for _ in range(repeats):
    t0 = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - t0)
  return 2 * n ** 3 / best


def resolve_peak(configured_tflops: float, num_devices: int, dtype: str) -> Peak | None:
  """The peak MFU is reported against: ``train.peak_tflops`` per device when set; else the vendor's dense bf16
  peak of a known accelerator (TPU v4-v6, H100/H200, A100, L4); else, on CPU, the host's matmul roofline in the
  compute dtype, measured (all CPU devices share the host's cores, so it is not multiplied by their count). None
  (MFU not shown) for an unknown accelerator."""
  if configured_tflops > 0:
    return Peak(configured_tflops * 1e12 * num_devices,
                f"train.peak_tflops={configured_tflops:g} TFLOP/s x {num_devices} device(s)", "configured peak")
  device = jax.devices()[0]
  tflops = vendor_peak_tflops(device.device_kind)
  if tflops is not None:
    return Peak(tflops * 1e12 * num_devices, f"{device.device_kind} dense bf16 peak {tflops:g} TFLOP/s x "
                f"{num_devices} device(s)", "")
  if device.platform == "cpu":
    flops = host_matmul_flops(dtype)
    return Peak(flops, f"host matmul roofline {flops / 1e12:.3f} TFLOP/s ({dtype} {1536}^3 matmul, measured)",
                "host roofline")
  return None


def _records_up_to(text: str, step: int) -> list[str]:
  """The lines of a ``metrics.jsonl`` with ``step <= step``; a torn last line (a write cut off by a kill) is dropped."""
  kept = []
  for line in text.splitlines():
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    if isinstance(record, dict) and record.get("step", step + 1) <= step:
      kept.append(line)
  return kept


class MetricsLogger:
  """Writes one JSON object per logged step to ``metrics.jsonl`` plus TensorBoard scalars; prints log lines.

  Only process 0 of a multi-host run writes or prints anything (the others hold the same replicated metrics). On
  resume, records past the restored step (written after the last checkpoint of an interrupted run) are dropped so
  the file holds one consistent curve.
  """

  def __init__(self, run_dir: str | os.PathLike, total_steps: int, start_step: int, progress_bar: bool,
               patience_s: float = 0.0):
    self.run_dir = epath.Path(run_dir)
    self.patience_s = patience_s  # a bucket's outage: how long writes are retried (files.with_retries)
    self.path = self.run_dir / "metrics.jsonl"
    # Objects on a bucket cannot be appended to: there the file is rewritten whole at each record.
    self._lines: list[str] | None = [] if is_remote(self.path) else None
    self._primary = jax.process_index() == 0
    self._file = self._tb = self._bar = None
    if not self._primary:
      return
    kept = _records_up_to(self.path.read_text(), start_step) if self.path.exists() else []
    self.path.write_text("".join(ln + "\n" for ln in kept))
    if self._lines is None:
      self._file = self.path.open("a")
    else:
      self._lines = kept
    self._tb = _summary_writer(str(self.run_dir / "tensorboard"))
    self._bar = tqdm(total=total_steps, initial=start_step, disable=not progress_bar, dynamic_ncols=True,
                     unit="step", leave=False)

  def write(self, record: dict[str, Any]) -> None:
    if not self._primary:
      return
    if self._lines is None:
      self._file.write(json.dumps(record) + "\n")
      self._file.flush()
    else:
      self._lines.append(json.dumps(record))
      text = "".join(ln + "\n" for ln in self._lines)
      with_retries(self.path, lambda: self.path.write_text(text), "metrics.jsonl", self.patience_s)
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
        self._tb.add_scalar(k, v, record["step"])
    with_retries(self.run_dir, self._tb.flush, "TensorBoard events", self.patience_s)

  def print(self, line: str) -> None:
    if not self._primary:
      return
    if not self._bar.disable:
      self._bar.write(line)
    else:
      print(line, flush=True)

  def advance(self, n: int, loss: float | None = None) -> None:
    if self._bar is not None:
      self._bar.update(n)
      if loss is not None:
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

  def close(self) -> None:
    if not self._primary:
      return
    self._bar.close()
    if self._file is not None:
      self._file.close()
    self._tb.close()
