"""Exit codes of the command lines that other programs act on (sweeps resume an interrupted run, launchers report a
diverged one), and the one way a command line reports bad input: :class:`InputError`, printed as one line and
:data:`BAD_INPUT`."""

from __future__ import annotations

import signal
import sys
from typing import Callable

BAD_INPUT = 2  # invalid config, data, run directory, checkpoint, HF directory or sweep file: nothing was done
DIVERGED = 3  # a non-finite step under train.nan_policy=stop
# the run directory's bucket stayed unreachable longer than train.storage_patience_s: resumable like an interruption
STORAGE_UNAVAILABLE = 4
# stopped on a signal after saving its checkpoint (128 + SIGINT, the shell's own code for Ctrl-C), whichever signal
INTERRUPTED = 130


def interrupt_on_ctrl_c() -> None:
  """Make SIGINT raise ``KeyboardInterrupt`` in this process however it was started. Python leaves SIGINT ignored
  when the process inherits SIG_IGN (a shell without job control starts ``cmd &`` so), while train.py sets its own
  handler: a Ctrl-C to the process group would then stop a run but not the command that started it, which goes on
  to the next. Call it from the main thread of a command that runs train.py and exits :data:`INTERRUPTED` on Ctrl-C.
  """
  signal.signal(signal.SIGINT, signal.default_int_handler)


class InputError(Exception):
  """Input a user can fix: the message names the field, file or value at fault and what is allowed. The base of every
  such error (ConfigError, DataError, CheckpointError, the converters', the sweep's and the analysis's)."""


def report_input_errors(body: Callable[[], int], also: tuple[type[BaseException], ...] = ()) -> int:
  """``body()``'s exit code, or :data:`BAD_INPUT` after printing ``error: <message>`` on stderr when it raises an
  :class:`InputError` (or one of ``also``, e.g. ``FileExistsError`` for a command that refuses to overwrite)."""
  try:
    return body()
  except (InputError, *also) as e:
    print(f"error: {e}", file=sys.stderr, flush=True)
    return BAD_INPUT
