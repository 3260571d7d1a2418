"""Running the sweep here: each run trained (or resumed) with train.py and evaluated with eval.py in its device group,
its output in <run_dir>/sweep.log, as many runs at once as there are groups."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, TextIO

from jaxshare.config import REPO_ROOT
from jaxshare.sweep.devices import DeviceGroup
from jaxshare.store.checkpoint import finished_steps
from jaxshare.files import is_remote, write_atomic
from jaxshare.sweep.results import Results, result_row
from jaxshare.sweep.spec import Sweep, Trial, rel
from jaxshare import exit_codes

if TYPE_CHECKING:
  from jaxshare.sweep.publish import Published

_PRINT = threading.Lock()


def say(*lines: str, file=None) -> None:
  """Print whole lines: concurrent runs report from threads, and print() may interleave text and newline."""
  with _PRINT:
    out = file or sys.stdout
    out.write("".join(f"{ln}\n" for ln in lines))
    out.flush()


def latest_step(run_dir: Path) -> int | None:
  """The run's newest finished checkpoint (on a bucket too: :func:`~jaxshare.store.checkpoint.finished_steps`)."""
  steps = finished_steps(run_dir / "checkpoints")
  return steps[-1] if steps else None


@contextlib.contextmanager
def appending(log) -> Iterator[TextIO]:
  """``log`` open for appending, as a real file (a child process writes to it). An object on a bucket cannot be
  appended to: there the text goes to a local temporary file, after what the log held, and replaces the object in
  one upload on exit (``tail -f`` follows a local log only)."""
  if not is_remote(log):
    with open(log, "a") as f:
      yield f
    return
  with tempfile.NamedTemporaryFile("w+", prefix="sweep-log-", suffix=".log") as f:
    f.write(log.read_text() if log.exists() else "")
    f.flush()
    try:
      yield f
    finally:
      f.flush()
      f.seek(0)
      write_atomic(log, f.read())


def cached_eval(run_dir: Path, steps: int) -> dict | None:
  """``<run_dir>/eval.json`` if it evaluates the checkpoint at ``steps``."""
  try:
    report = json.loads((run_dir / "eval.json").read_text())
  except (OSError, ValueError):
    return None
  return report if report.get("step") == steps and latest_step(run_dir) == steps else None


def _tail(path: Path, lines: int) -> list[str]:
  try:
    text = path.read_bytes().decode(errors="replace")  # (epath's read_text on a bucket takes no errors=)
  except OSError:
    return []
  return [ln for ln in text.splitlines() if ln.strip()][-lines:]


def command(group: DeviceGroup, args: list[str]) -> str:
  """``args`` as a shell line run in ``group``: its variables, its prefix, then the command."""
  env = [f"{k}={shlex.quote(v)}" for k, v in group.env]
  return " ".join(env + [shlex.join([*group.prefix, *args])])


def call(group: DeviceGroup, args: list[str], log: Path, capture: bool = False) -> tuple[int, str]:
  """Run a command with the group's devices, appending its output to ``log`` as it comes (``tail -f`` follows a
  run); with ``capture`` stdout is returned instead and appended at the end. ``(exit code, stdout)``.

  Raises:
    KeyboardInterrupt: Ctrl-C while the command ran, raised once the command has exited. The terminal sent it to
      the command too (one process group), and train.py stops after its step and saves a checkpoint: it is waited
      for, through further Ctrl-Cs (train.py's third one abandons the write). subprocess.run waits 0.25 s, then
      SIGKILLs the command, mid-save.
  """
  env = {**os.environ, **dict(group.env), "PYTHONUNBUFFERED": "1"}
  with appending(log) as f:
    f.write(f"\n== {time.strftime('%Y-%m-%d %H:%M:%S')} {command(group, args)}\n")
    f.flush()
    proc = subprocess.Popen([*group.prefix, *args], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE if capture else f,
                            stderr=f, text=True)
    interrupted = False
    while True:
      try:
        stdout, _ = proc.communicate()
        break
      except KeyboardInterrupt:
        interrupted = True
    if capture:
      f.write(stdout)
  if interrupted:
    raise KeyboardInterrupt
  return proc.returncode, stdout or ""


def execute(experiment: str, run: Trial, steps: int, group: DeviceGroup, evaluate_only: bool = False) -> dict:
  """Train (or resume) and evaluate one run of the experiment config ``experiment``; a result row with status ok or
  failed (never raises for the run's own errors: their output is in <run_dir>/sweep.log)."""
  run.run_dir.mkdir(parents=True, exist_ok=True)
  log = run.run_dir / "sweep.log"

  def failed(what: str) -> dict:
    tail = _tail(log, 1)
    return result_row(run, "failed", error=f"{what}: {tail[-1] if tail else 'no output'}"[:300])

  if not evaluate_only:
    code, _ = call(group, run.train_command(experiment), log)
    if code == exit_codes.INTERRUPTED:  # Ctrl-C or preemption: the run saved a checkpoint and resumes next time
      return result_row(run, "interrupted", error=f"stopped by a signal at step {latest_step(run.run_dir)} with a "
                        "checkpoint; run the sweep again to resume it")
    if code == exit_codes.STORAGE_UNAVAILABLE:  # the bucket went away: its committed checkpoints resume next time
      return result_row(run, "interrupted", error=f"its bucket was unreachable; stopped after checkpoint "
                        f"{latest_step(run.run_dir)}; run the sweep again to resume it")
    if code != 0:
      return failed(f"train.py exit {code}")
    reached = latest_step(run.run_dir)
    if reached != steps:
      return result_row(run, "failed", error=f"training stopped at step {reached} of {steps}")
  code, out = call(group, run.eval_command(), log, capture=True)
  lines = [ln for ln in out.splitlines() if ln.startswith("{")]
  if code != 0 or not lines:
    return failed(f"eval.py exit {code}")
  report = json.loads(lines[-1])
  # named by the batches it read where they are not the whole split (a search's run is scored on two splits)
  name = "eval.json" if not run.eval_flags else "eval_" + "_".join(f.lstrip("-") for f in run.eval_flags) + ".json"
  write_atomic(run.run_dir / name, json.dumps(report, indent=1) + "\n")
  return result_row(run, "ok", report)


def train_all(sweep: Sweep, todo: list[tuple[Trial, int]], groups: list[DeviceGroup], results: Results,
              done: list[dict], published: Published | None = None) -> int:
  """Train and evaluate ``todo``, as many at once as there are device groups; rows are merged into the table (and
  written to ``published``'s files) as each run ends. Returns the number of failed runs."""
  free: queue.Queue[DeviceGroup] = queue.Queue()
  for g in groups:
    free.put(g)
  total, failures = len(todo), 0

  def work(i: int, run: Trial, steps: int) -> dict:
    group = free.get()
    try:
      where = f" on {group.label}" if group.label else ""
      say(f"[{i}/{total}] {run.label}: training to step {steps}{where} (log: {rel(run.run_dir / 'sweep.log')})")
      start = time.monotonic()
      row = execute(sweep.experiment, run, steps, group)
      took = time.monotonic() - start
      if row["status"] == "ok":
        say(f"[{i}/{total}] {run.label}: val_loss {float(row['val_loss']):.4f} ({took:.0f} s)")
      else:
        say(f"[{i}/{total}] {run.label}: FAILED ({row['error']})",
            *(f"    {line}" for line in _tail(run.run_dir / "sweep.log", 15)))
      results.add([row])
      if published:
        published.add(run, row)
      return row
    finally:
      free.put(group)

  pool = concurrent.futures.ThreadPoolExecutor(max_workers=len(groups))
  try:
    futures = [pool.submit(work, i, run, steps) for i, (run, steps) in enumerate(todo, 1)]
    for f in futures:
      row = f.result()
      done.append(row)
      failures += row["status"] != "ok"
  finally:
    # On Ctrl-C the runs in flight got the SIGINT too and save a checkpoint; start no queued one meanwhile.
    pool.shutdown(wait=True, cancel_futures=True)
  return failures
