"""The schedule search (``python -m jaxshare.search``): the sharing schedule that loses least under a KV-byte or FLOP
budget, from a trained dense run.

:mod:`~jaxshare.search.budget` prices a schedule and parses budgets, :mod:`~jaxshare.search.space` enumerates the
candidates within one, :mod:`~jaxshare.search.kvsharer` adds KVSharer's proposals, :mod:`~jaxshare.search.calibration`
scores a conversion without training (stage 1), :mod:`~jaxshare.search.study` keeps each stage in an Optuna study,
:mod:`~jaxshare.search.stages` runs stage 1, successive halving and the finals, :mod:`~jaxshare.search.report`
writes the tables, plots and frontier configs, :mod:`~jaxshare.search.run` puts them together, and ``__main__`` is
the command line.
"""
