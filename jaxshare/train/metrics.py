"""Run logging: console lines, a tqdm progress bar, ``metrics.jsonl`` and TensorBoard events; MFU."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import jax
from tqdm.auto import tqdm

# Dense bf16 peak TFLOP/s per device, by substring of jax's device_kind (MaxText's and vendors' figures).
_PEAK_TFLOPS = (("v6 lite", 918.0), ("v6e", 918.0), ("v5 lite", 197.0), ("v5e", 197.0), ("v5p", 459.0),
                ("v5", 459.0), ("v4", 275.0), ("h200", 989.0), ("h100", 989.0), ("a100", 312.0), ("l4", 121.0))
CPU_NOMINAL_TFLOPS = 0.1  # 2 AVX-512 cores sustain ~0.06-0.085 TFLOP/s in fp32 matmuls (measured)


def peak_tflops_per_device(configured: float = 0.0) -> float:
  """Peak TFLOP/s of one device: the configured value, else a lookup by device kind (CPU: nominal 0.1)."""
  if configured > 0:
    return configured
  kind = jax.devices()[0].device_kind.lower()
  for key, tflops in _PEAK_TFLOPS:
    if key in kind:
      return tflops
  return CPU_NOMINAL_TFLOPS


class MetricsLogger:
  """Writes one JSON object per logged step to ``metrics.jsonl`` plus TensorBoard scalars; prints log lines.

  On resume, records past the restored step (written after the last checkpoint of an interrupted run) are dropped
  so the file holds one consistent curve.
  """

  def __init__(self, run_dir: str | Path, total_steps: int, start_step: int, progress_bar: bool):
    self.run_dir = Path(run_dir)
    self.path = self.run_dir / "metrics.jsonl"
    if self.path.exists():
      kept = [ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= start_step]
      self.path.write_text("".join(ln + "\n" for ln in kept))
    self._file = self.path.open("a")
    from tensorboardX import SummaryWriter  # import here: pulls protobuf, only needed for a real run

    self._tb = SummaryWriter(str(self.run_dir / "tensorboard"))
    self._bar = tqdm(total=total_steps, initial=start_step, disable=not progress_bar, dynamic_ncols=True,
                     unit="step", leave=False) if jax.process_index() == 0 else None

  def write(self, record: dict[str, Any]) -> None:
    if jax.process_index() != 0:
      return
    self._file.write(json.dumps(record) + "\n")
    self._file.flush()
    for k, v in record.items():
      if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
        self._tb.add_scalar(k, v, record["step"])
    self._tb.flush()

  def print(self, line: str) -> None:
    if jax.process_index() != 0:
      return
    if self._bar is not None and not self._bar.disable:
      self._bar.write(line)
    else:
      print(line, flush=True)

  def advance(self, n: int, loss: float | None = None) -> None:
    if self._bar is not None:
      self._bar.update(n)
      if loss is not None:
        self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
    self._file.close()
    self._tb.close()
