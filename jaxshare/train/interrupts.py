"""Ctrl-C and preemption: SIGINT and SIGTERM become a request to stop cleanly, with a checkpoint, at a step every
process agrees on."""

from __future__ import annotations

import logging
import os
import signal
import sys

_outside_loop: list[str] = []  # signals raised as KeyboardInterrupt outside the loop, for Interrupts to raise again


def interrupt_outside_loop() -> None:
  """Make SIGTERM outside the training loop (loading, compiling, the final evaluation) raise ``KeyboardInterrupt``,
  as Ctrl-C does, instead of killing the process (train.py then exits 130). Call it from the main thread.

  The exception is raised wherever the main thread is, and that can be code that swallows it: inside JAX's gc
  callback it was reported as "Exception ignored" with a traceback, and start-up went on. The signal is therefore
  also recorded, the training loop raises it again on entry (:class:`Interrupts`), and such reports of it are
  dropped.
  """
  def handler(signum: int, frame) -> None:
    name = signal.Signals(signum).name
    _outside_loop.append(name)
    raise KeyboardInterrupt(name)

  previous = sys.unraisablehook

  def hook(unraisable) -> None:
    if not (isinstance(unraisable.exc_value, KeyboardInterrupt) and str(unraisable.exc_value) in _outside_loop):
      previous(unraisable)

  signal.signal(signal.SIGTERM, handler)
  sys.unraisablehook = hook


class Interrupts:
  """SIGINT (Ctrl-C) and SIGTERM (a TPU VM's preemption notice, Slurm's time limit or ``scancel``, Kubernetes'
  eviction) while training, as a context manager around the training loop and its last checkpoint write.

  - The first signal asks the loop to stop after the current step and save a checkpoint
    (:meth:`should_stop`).
  - A second one changes nothing: the checkpoint of the stop step is written and waited for, so that the
    probe's "second Ctrl-C during the write" leaves a finished checkpoint, not a temporary directory.
  - A third raises ``KeyboardInterrupt`` at once. A write cut short that way never counts (orbax renames a
    checkpoint into place only when it is complete), so the last finished checkpoint is what the run resumes from.

  A signal that arrived before the loop (see :func:`interrupt_outside_loop`) raises ``KeyboardInterrupt`` on entry.

  In a multi-process run every process must stop at the same step (the checkpoint is written collectively). SIGTERM
  is left to JAX's preemption service, which ``jax.distributed`` starts: it hears the signal on any process and
  :func:`jax.experimental.multihost_utils.reached_preemption_sync_point` then names the same step on all of them.
  Ctrl-C is routed the same way (the handler sends this process SIGTERM).

  Attributes:
    received: names of the signals received, in order (empty: none).
  """

  def __init__(self):
    self.received: list[str] = []
    self._previous: dict[int, object] = {}
    import jax  # here, not at the top: the sweep tool reads the exit code without importing JAX

    self._multi_process = jax.process_count() > 1

  def _handler(self, signum: int, frame) -> None:
    name = signal.Signals(signum).name
    self.received.append(name)
    if self._multi_process:
      os.kill(os.getpid(), signal.SIGTERM)  # JAX's preemption notifier propagates it to every process
    if len(self.received) == 1:
      _say(f"{name} received: stopping after the current step and saving a checkpoint")
    elif len(self.received) == 2:
      _say(f"{name} again: still stopping; the checkpoint is being written and waited for (a third signal abandons "
           "it, keeping the previous finished checkpoint)")
    elif not self._multi_process:
      abort = KeyboardInterrupt(f"aborted by a third signal ({name})")
      # orbax's wait_until_finished catches it to log "Save Finalize thread failed" with a traceback, then re-raises:
      # the abort is the caller's to report (train.py: one line), not a library failure
      logging.getLogger("absl").addFilter(lambda record: not (record.exc_info and record.exc_info[1] is abort))
      raise abort

  def __enter__(self) -> "Interrupts":
    if _outside_loop:  # a signal before the loop whose KeyboardInterrupt was swallowed: stop before training
      name = _outside_loop[-1]
      _outside_loop.clear()
      raise KeyboardInterrupt(name)
    # Under the preemption service SIGTERM belongs to JAX; only the main thread may set handlers.
    signals = (signal.SIGINT,) if self._multi_process else (signal.SIGINT, signal.SIGTERM)
    try:
      self._previous = {s: signal.signal(s, self._handler) for s in signals}
    except ValueError:  # not the main thread (some test runners): leave the defaults
      self._previous = {}
    return self

  def __exit__(self, *exc) -> None:
    for s, handler in self._previous.items():
      signal.signal(s, handler)

  def should_stop(self, step: int) -> bool:
    """Whether to stop after ``step`` (collective in a multi-process run: call it after every step on every process)."""
    if not self._multi_process:
      return bool(self.received)
    from jax.experimental import multihost_utils

    if multihost_utils.reached_preemption_sync_point(step):
      self.received = self.received or ["SIGTERM"]
      return True
    return False


def _say(message: str) -> None:
  # os.write, not print: the handler may run while the main thread is inside a print to the same stream, and a
  # buffered stream refuses reentrant writes.
  os.write(1, (message + "\n").encode())
