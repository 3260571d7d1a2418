"""The fit check (``train.py --compile-only``): the report of the train step compiled for a TPU topology
(:mod:`jaxshare.aot.report`), or with ``--max-batch`` the search for the largest global batch that fits.

Exit codes of ``train.py --compile-only``: 0 fits (with ``--max-batch``: some batch fits); :data:`EXIT_NO_FIT` (3)
does not fit, with what to change on stderr; 2 bad flags or config.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable

from jaxshare import smoke
from jaxshare.aot import topology
from jaxshare.aot.report import Fit, advice, batch_unit, check, format_report
from jaxshare.aot.units import gib
from jaxshare.config import Config

EXIT_NO_FIT = 3
_MAX_BATCH_UNITS = 2 ** 16  # --max-batch stops doubling here (a safeguard: the compiler refuses long before)


def _with_batch(cfg: Config, batch: int) -> Config:
  return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, batch_size=batch))


def max_batch(cfg: Config, target: str, num_slices: int | None = None,
              log: Callable[[Fit], None] = lambda fit: None) -> tuple[Fit | None, list[Fit]]:
  """The largest global batch (a multiple of :func:`~jaxshare.aot.report.batch_unit`) whose train step fits, by
  compiling: from ``train.batch_size`` (rounded down to the unit) doubling while it fits, or halving while it does
  not, then bisecting between the last fit and the first no-fit (which takes fitting to shrink with the batch: the
  compiler's verdict did, in every series we compiled).

  Returns:
    ``(largest fitting compile or None when even one unit does not fit, every compile in order)``; ``log`` sees each
    compile as it finishes.
  """
  probes: list[Fit] = []

  def probe(batch: int) -> Fit:
    fit = check(_with_batch(cfg, batch), target, num_slices)
    probes.append(fit)
    log(fit)
    return fit

  sliced = topology.with_slices(cfg, num_slices)
  unit = batch_unit(sliced, topology.topology_mesh(topology.topology_name(target), sliced.mesh))
  batch = max(unit, cfg.train.batch_size // unit * unit)
  good: Fit | None = None
  bad: int | None = None
  fit = probe(batch)
  if fit.fits:
    good = fit
    most = batch if smoke.enabled() else _MAX_BATCH_UNITS * unit  # JAXSHARE_SMOKE: the configured batch alone
    while bad is None and good.batch < most:
      fit = probe(good.batch * 2)
      good, bad = (fit, None) if fit.fits else (good, fit.batch)
    if bad is None:
      return good, probes
  else:
    bad = batch
    while good is None and bad > unit:
      fit = probe(max(unit, bad // 2 // unit * unit))
      good, bad = (fit, bad) if fit.fits else (None, fit.batch)
    if good is None:
      return None, probes
  while bad - good.batch > unit:
    fit = probe(good.batch + (bad - good.batch) // unit // 2 * unit)
    good, bad = (fit, bad) if fit.fits else (good, fit.batch)
  return good, probes


def probe_line(fit: Fit) -> str:
  """One line per compile: batch, HBM per chip, verdict, time."""
  verdict = "fits" if fit.fits else "does NOT fit"
  return (f"  batch {fit.batch:>6} ({fit.batch // (fit.batch_unit or 1)} per unit of {fit.batch_unit}): "
          f"{gib(fit.hbm)} per chip of {gib(fit.limit)}: {verdict}  ({fit.compile_s:.0f} s)")


def main(cfg: Config, target: str, num_slices: int | None = None, find_max_batch: bool = False) -> int:
  """``train.py --compile-only``: print the fit report (and with ``find_max_batch`` each compile and the largest
  global batch that fits); the advice on stderr when nothing fits. Returns the exit code (0 or :data:`EXIT_NO_FIT`).

  Raises:
    ConfigError: see :func:`~jaxshare.aot.report.check`.
  """
  if not find_max_batch:
    fit = check(cfg, target, num_slices)
    print(format_report(fit, target), flush=True)
    if fit.fits:
      return 0
    print(f"error: {advice(fit, cfg)}", file=sys.stderr)
    return EXIT_NO_FIT
  print(f"largest global batch on {target}: compiling (doubling, then bisecting)", flush=True)
  best, probes = max_batch(cfg, target, num_slices, log=lambda fit: print(probe_line(fit), flush=True))
  if best is None:
    print(format_report(probes[-1], target), flush=True)
    print(f"error: even the smallest batch does not fit; {advice(probes[-1], cfg)}", file=sys.stderr)
    return EXIT_NO_FIT
  print(format_report(best, target))
  print(f"largest global batch that fits: {best.batch} ({best.batch // best.batch_unit} x {best.batch_unit}; "
        f"{gib(best.hbm)} per chip of {gib(best.limit)}; {len(probes)} compiles, "
        f"{sum(p.compile_s for p in probes):.0f} s)", flush=True)
  return 0
