"""Exit codes of the command lines that other programs act on (sweeps resume an interrupted run, launchers report a
diverged one), and the one way a command line reports bad input: :class:`InputError`, printed as one line and
:data:`BAD_INPUT`."""

from __future__ import annotations

import sys
from typing import Callable

BAD_INPUT = 2  # invalid config, data, run directory, checkpoint, HF directory or sweep file: nothing was done
DIVERGED = 3  # a non-finite step under train.nan_policy=stop
# the run directory's bucket stayed unreachable longer than train.storage_patience_s: resumable like an interruption
STORAGE_UNAVAILABLE = 4
# stopped on a signal after saving its checkpoint (128 + SIGINT, the shell's own code for Ctrl-C), whichever signal
INTERRUPTED = 130


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
