"""Fault injection: ``train.py`` killed with SIGKILL at random steps, during checkpoint writes and during start-up,
interrupted by SIGTERM and SIGINT (once, twice, three times), ends on exactly the losses of an uninterrupted run.
Corrupted checkpoints: tests/integration/test_checkpoint_integrity.py; divergence:
tests/integration/train/test_divergence.py."""

import random
import re
import time

import pytest

from support.faults import SIGNALS, TMP_MARKER, Run, finished_checkpoints, losses_by_step, uninterrupted_losses

INTERRUPTED = 130  # train.py's exit code for a run stopped by a signal after saving (or aborted by a third one)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
  """The uninterrupted run's loss at every step."""
  return uninterrupted_losses(tmp_path_factory.mktemp("reference"))


def _resume_to_the_end(run_dir, reference, expect_resumed_at: int | None = None) -> str:
  run = Run(run_dir)
  assert run.finish() == 0, run.output[-3000:]
  if expect_resumed_at is not None:
    assert f"resumed at step {expect_resumed_at}" in run.output
  assert losses_by_step(run_dir) == reference  # bit-exact, every step logged once
  return run.output


@pytest.mark.slow
def test_sigkill_anywhere_never_changes_the_curve(reference, tmp_path):
  """6 SIGKILLs, two of each kind: at a random step, the moment a checkpoint write starts, or a random time into
  start-up (loading, restoring, compiling); every restart resumes from the last finished checkpoint and the curve is
  unchanged."""
  rng = random.Random(0)
  modes = ["write", "step", "startup"] * 2
  rng.shuffle(modes)
  during_write, cleaned = 0, 0
  previous_left_tmp = False
  for i, mode in enumerate(modes):
    resumed_from = max(finished_checkpoints(tmp_path), default=0) if (tmp_path / "checkpoints").exists() else 0
    run = Run(tmp_path)
    if mode == "write":  # a checkpoint write after the resumed step
      hit = run.wait_until(lambda: run.last_step > resumed_from and run.writing())
    elif mode == "step":
      target = resumed_from + rng.randint(1, 6)
      hit = run.wait_until(lambda: run.last_step >= target)
    else:  # a random time into start-up, or its end (the first step) if that comes first: a warm compilation
      deadline = time.time() + rng.uniform(0.3, 4.0)  # cache leaves a resumed run only seconds from its last step
      hit = run.wait_until(lambda: time.time() >= deadline or run.last_step > resumed_from)
    assert hit, f"kill {i} ({mode}): the run ended before it could be killed\n{run.output[-2000:]}"
    writing = run.writing()
    run.signal(SIGNALS["SIGKILL"])
    run.finish()
    assert run.proc.returncode == -9
    during_write += writing
    if previous_left_tmp:
      cleaned += "unfinished checkpoint write(s) an interrupted run left" in run.output
    previous_left_tmp = any(TMP_MARKER in p.name for p in (tmp_path / "checkpoints").iterdir()) if (
      tmp_path / "checkpoints").exists() else False
  out = _resume_to_the_end(tmp_path, reference)
  print(f"\n{len(modes)} SIGKILLs ({modes.count('step')} at a step, {modes.count('write')} at a write's start, "
        f"{modes.count('startup')} in start-up), {during_write} with a write in flight; every restart resumed; "
        f"the 60 logged losses equal the uninterrupted run's bit for bit")
  assert during_write >= 2  # the "write" kills really landed during writes
  assert not any(TMP_MARKER in p.name for p in (tmp_path / "checkpoints").iterdir())
  assert "Traceback" not in out


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM"])
def test_a_signal_saves_a_checkpoint_and_the_rerun_continues_the_curve(reference, tmp_path, sig):
  run = Run(tmp_path)
  assert run.wait_until(lambda: run.last_step >= 6)
  run.signal(SIGNALS[sig])
  assert run.finish() == INTERRUPTED, run.output[-3000:]
  stopped = int(re.search(rf"interrupted by {sig} at step (\d+); checkpoint \1 saved", run.output).group(1))
  assert stopped >= 6 and stopped in finished_checkpoints(tmp_path)
  assert '"interrupted": "' + sig + '"' in run.output  # the training summary says so
  _resume_to_the_end(tmp_path, reference, expect_resumed_at=stopped)


@pytest.mark.parametrize("when", ["during the write", "0.05 s after the first"])
def test_a_second_signal_waits_for_the_checkpoint_write(reference, tmp_path, when):
  """The probe's failure: a second Ctrl-C 0.05 s after the first, during the write, left only a temporary
  directory and the re-run started afresh."""
  run = Run(tmp_path)
  assert run.wait_until(lambda: run.last_step >= 6)
  run.signal(SIGNALS["SIGINT"])
  if when == "during the write":  # the first handled (pending signals of one kind coalesce), then a write in flight
    assert run.wait_until(lambda: "SIGINT received: stopping" in run.output and run.writing(), timeout=60)
  else:
    time.sleep(0.05)
  run.signal(SIGNALS["SIGINT"])
  assert run.finish() == INTERRUPTED, run.output[-3000:]
  if when == "during the write":
    assert "SIGINT again: still stopping" in run.output
  stopped = int(re.search(r"interrupted by SIGINT at step (\d+); checkpoint \1 saved", run.output).group(1))
  assert stopped in finished_checkpoints(tmp_path)
  assert not any(TMP_MARKER in p.name for p in (tmp_path / "checkpoints").iterdir())
  _resume_to_the_end(tmp_path, reference, expect_resumed_at=stopped)


def test_three_signals_lose_nothing(reference, tmp_path):
  """Each signal handled before the next (pending signals of one kind coalesce): the third aborts a write still in
  flight, or finds the run already stopped; either way exit 130 and the last finished checkpoint resumes the curve."""
  run = Run(tmp_path)
  assert run.wait_until(lambda: run.last_step >= 6)
  for ack in ("SIGTERM received", "SIGTERM again", None):
    run.signal(SIGNALS["SIGTERM"])
    if ack:
      run.wait_until(lambda: ack in run.output, timeout=60)
  assert run.finish() == INTERRUPTED, run.output[-3000:]
  assert "Traceback" not in run.output
  finished = finished_checkpoints(tmp_path) if (tmp_path / "checkpoints").exists() else []
  aborted = "aborted by a third signal (SIGTERM)" in run.output
  assert aborted or f"checkpoint {max(finished)} saved" in run.output
  out = _resume_to_the_end(tmp_path, reference, expect_resumed_at=max(finished) if finished else None)
  assert finished or "fresh start" in out  # aborted before any write finished: nothing existed to lose


def test_interrupt_handler_counts_signals_and_aborts_on_the_third():
  import os
  import signal

  from jaxshare.train.interrupts import Interrupts

  with pytest.raises(KeyboardInterrupt, match=r"aborted by a third signal \(SIGINT\)"):
    with Interrupts() as interrupts:
      for expected in (["SIGTERM"], ["SIGTERM", "SIGINT"]):
        os.kill(os.getpid(), signal.SIGTERM if len(expected) == 1 else signal.SIGINT)
        time.sleep(0.01)  # the handler runs between bytecodes
        assert interrupts.received == expected and interrupts.should_stop(1)
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.01)
  assert signal.getsignal(signal.SIGTERM) is not interrupts._handler  # the previous handlers are back


def test_the_third_signal_is_not_logged_as_a_library_failure(caplog):
  """The third signal's KeyboardInterrupt can land in orbax's wait_until_finished, which catches it, logs "Save
  Finalize thread failed" with a traceback (absl logging) and re-raises: the abort came with a library traceback. The
  abort is train.py's to report; orbax's record of it is dropped, other records are kept."""
  import os
  import signal

  from absl import logging as absl_logging

  from jaxshare.train.interrupts import Interrupts

  with pytest.raises(KeyboardInterrupt, match="aborted by a third signal"):
    with Interrupts():
      try:  # as orbax's CheckpointManager.wait_until_finished does around its join
        for _ in range(3):
          os.kill(os.getpid(), signal.SIGTERM)
          time.sleep(0.01)
      except BaseException:
        absl_logging.exception("[wait_until_finished] Save Finalize thread (save_finalize) failed.")
        absl_logging.error("an unrelated error")
        raise
  assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == ["an unrelated error"]


def test_a_signal_before_the_loop_that_a_library_swallowed_still_interrupts():
  """Outside the loop SIGTERM raises KeyboardInterrupt wherever the main thread is, and that can be code that swallows
  it: JAX's gc callback reported it as "Exception ignored" with a traceback and the run trained to the end, exit 0
  (1 in 20 signals during start-up). The loop now raises it again on entry, and the report is dropped."""
  import gc
  import os
  import signal
  import sys

  from jaxshare.train.interrupts import Interrupts, interrupt_outside_loop

  def swallowing_callback(phase, info):  # as jax._src.lib._xla_gc_callback runs, inside gc
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)  # the handler runs here, between bytecodes

  reports, previous_hook, previous_handler = [], sys.unraisablehook, signal.getsignal(signal.SIGTERM)
  sys.unraisablehook = reports.append
  try:
    interrupt_outside_loop()
    gc.callbacks.append(swallowing_callback)
    try:
      gc.collect()
    finally:
      gc.callbacks.remove(swallowing_callback)
  finally:
    signal.signal(signal.SIGTERM, previous_handler)
    sys.unraisablehook = previous_hook
  assert reports == []
  with pytest.raises(KeyboardInterrupt, match="^SIGTERM$"):
    with Interrupts():
      pytest.fail("the loop started after a SIGTERM")
  with Interrupts() as interrupts:  # raised once: the next loop of this process starts
    assert interrupts.received == []


def test_sigterm_before_training_exits_as_interrupted(tmp_path):
  run = Run(tmp_path)
  # train.py re-executes itself first (allocator), and Python's default for SIGTERM is to die: wait for its handler
  assert run.wait_until(lambda: run.catches(SIGNALS["SIGTERM"]), timeout=120)
  # at once: between the handler and the loop lie reading the config and the corpus, building the model and compiling,
  # about a second with the suite's compilation cache warm (half a second later was once too late)
  assert run.last_step == 0
  run.signal(SIGNALS["SIGTERM"])
  assert run.finish() == INTERRUPTED, run.output[-3000:]
  assert "interrupted (SIGTERM): re-run the same command" in run.output and "Traceback" not in run.output
