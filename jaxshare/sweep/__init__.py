"""Sweeps of config variants x seeds through train.py and eval.py (``python scripts/sweep.py`` or
``python -m jaxshare.sweep``).

:mod:`~jaxshare.sweep.spec` reads the sweep file into runs, :mod:`~jaxshare.sweep.devices` splits the local devices
among concurrent runs, :mod:`~jaxshare.sweep.runner` trains and evaluates them, :mod:`~jaxshare.sweep.results`
merges, tabulates and plots their rows, :mod:`~jaxshare.sweep.launch` submits them through the cluster launchers
instead, and ``__main__`` is the command line.
"""
