"""Exit codes of ``train.py`` and ``eval.py`` that other programs act on (sweeps resume an interrupted run, launchers
report a diverged one)."""

BAD_INPUT = 2  # invalid config, data, run directory or checkpoint: nothing was trained
DIVERGED = 3  # a non-finite step under train.nan_policy=stop
# stopped on a signal after saving its checkpoint (128 + SIGINT, the shell's own code for Ctrl-C), whichever signal
INTERRUPTED = 130
