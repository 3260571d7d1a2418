"""Ctrl-C and preemption: SIGINT and SIGTERM become a request to stop cleanly, with a checkpoint, at a step every
process agrees on."""

from __future__ import annotations

import os
import signal

# train.py's exit code for a run that stopped on a signal after saving its checkpoint (128 + SIGINT, the shell's own
# code for Ctrl-C), whichever signal it was.
INTERRUPTED_EXIT_CODE = 130


class Interrupts:
  """SIGINT (Ctrl-C) and SIGTERM (a TPU VM's preemption notice, Slurm's time limit or ``scancel``, Kubernetes'
  eviction) while training, as a context manager around the training loop and its last checkpoint write.

  - The first signal asks the loop to stop after the current step and save a checkpoint
    (:meth:`should_stop`).
  - A second one changes nothing: the checkpoint of the stop step is written and waited for, so that the
    probe's "second Ctrl-C during the write" leaves a finished checkpoint, not a temporary directory.
  - A third raises ``KeyboardInterrupt`` at once. A write cut short that way never counts (orbax renames a
    checkpoint into place only when it is complete), so the last finished checkpoint is what the run resumes from.

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
      raise KeyboardInterrupt(f"aborted by a third signal ({name})")

  def __enter__(self) -> "Interrupts":
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
