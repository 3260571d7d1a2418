"""Fault injection for the reliability tests: ``train.py`` run as a subprocess, watched, and killed or signalled
at a chosen step or while a checkpoint is being written."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from conftest import REPO, TINY
from jaxshare.store.checkpoint import TMP_MARKER

# A tiny run whose every step is logged: the step lines say how far it got, to the step. Checkpoints are frequent,
# so that kills land during writes as well as between them.
RUN = TINY + ["train.steps=60", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
              "train.checkpoint_every=4", "train.keep_checkpoints=2"]
_STEP_LINE = re.compile(r"^step\s+(\d+)/")


class Run:
  """One ``train.py`` process on ``run_dir``; its output is collected on a thread and its step lines parsed."""

  def __init__(self, run_dir: Path, *overrides: str, env: dict | None = None):
    self.run_dir = Path(run_dir)
    self.lines: list[str] = []
    self.last_step = 0
    self.proc = subprocess.Popen(
      [sys.executable, "-u", str(REPO / "train.py"), "--no-eval", *RUN, f"train.run_dir={run_dir}", *overrides],
      cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu", **(env or {})})
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self.lines.append(line)
      m = _STEP_LINE.match(line)
      if m:
        self.last_step = int(m.group(1))

  @property
  def output(self) -> str:
    return "".join(self.lines)

  def wait_until(self, condition, timeout: float = 180.0, poll: float = 0.001) -> bool:
    """Poll ``condition()`` until it holds (True) or the process ends or time runs out (False)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
      if condition():
        return True
      if self.proc.poll() is not None:
        return False
      time.sleep(poll)
    return False

  def writing(self) -> bool:
    """Whether a checkpoint write is in flight (orbax's temporary step directory exists)."""
    try:
      return any(TMP_MARKER in name for name in os.listdir(self.run_dir / "checkpoints"))
    except FileNotFoundError:
      return False

  def catches(self, sig: int) -> bool:
    """Whether the process has a handler installed for ``sig`` (Linux: the SigCgt mask of /proc/<pid>/status)."""
    try:
      status = Path(f"/proc/{self.proc.pid}/status").read_text()
    except FileNotFoundError:
      return False
    mask = int(re.search(r"^SigCgt:\s*([0-9a-f]+)", status, re.M).group(1), 16)
    return bool(mask >> (sig - 1) & 1)

  def signal(self, sig: int) -> None:
    self.proc.send_signal(sig)

  def finish(self, timeout: float = 300.0) -> int:
    self.proc.wait(timeout=timeout)
    self._reader.join(timeout=10)
    return self.proc.returncode


def finished_checkpoints(run_dir: Path) -> list[int]:
  return sorted(int(p.name) for p in (Path(run_dir) / "checkpoints").iterdir() if p.name.isdigit())


def uninterrupted_losses(run_dir: Path) -> dict[int, float]:
  """The loss at every step of :data:`RUN` trained without interruption in ``run_dir`` (what faulted runs must
  reproduce)."""
  run = Run(run_dir)
  assert run.finish() == 0, run.output[-3000:]
  return losses_by_step(run_dir)


def losses_by_step(run_dir: Path) -> dict[int, float]:
  """``{step: loss}`` of a run's ``metrics.jsonl``; a step logged twice is an error (a resume must truncate)."""
  import json

  records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL}
