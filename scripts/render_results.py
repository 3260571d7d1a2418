#!/usr/bin/env python
"""Render the published tables from the committed result files (results/<experiment>/) into the pages that show
them, between markers of the form

  <!-- rendered from results/<experiment>: begin -->
  ...
  <!-- rendered from results/<experiment>: end -->

(``results/<experiment>#<view>`` marks another table of the same files, as uptrain#paired does), so that every
number in those tables comes from a file that records its command, commit, versions, date and measure. Usage:
  python scripts/render_results.py           # rewrite every marked table; redraw each published sweep's plots
  python scripts/render_results.py --check   # exit 1 naming each table that differs from its files (the test)

A published sweep's plots (results/<experiment>/loss_vs_kv.png, loss_vs_params.png) are drawn from the same files;
--check does not compare images.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent


def _uptrain_module():
  spec = importlib.util.spec_from_file_location("uptrain_experiment", REPO / "scripts" / "uptrain_experiment.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _uptrain() -> Callable[[Path], list[str]]:
  return _uptrain_module().render


def _uptrain_paired() -> Callable[[Path], list[str]]:
  return _uptrain_module().render_paired


SEARCH_ORDER = ("kv50", "kv25", "flops90")  # the README's searches, in its order; others after, by name


def _search() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.search.report import SUMMARY_HEADER, summary_row
  from jaxshare.sweep.provenance import read_result, short_version

  def render(root: Path) -> list[str]:
    files = sorted(root.glob("*.json"), key=lambda f: (SEARCH_ORDER.index(f.stem) if f.stem in SEARCH_ORDER else
                                                      len(SEARCH_ORDER), f.stem))
    summaries = [read_result(f) for f in files]
    versions = sorted({short_version(s["provenance"]) for s in summaries})
    return [*SUMMARY_HEADER, *(summary_row(s) for s in summaries), "",
            f"Rendered by scripts/render_results.py from results/search/ ({', '.join(f.name for f in files)}), "
            f"measured at commit{'s' if len(versions) > 1 else ''} {', '.join(versions)}; each file holds the "
            "command that made it."]
  return render


def _sweep() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.sweep.publish import render
  return render


def _fit() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.aot.fit_results import render
  return render


def _fit_against_dense() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.aot.fit_results import render_against_dense
  return render_against_dense


def _fit_policies() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.aot.fit_results import render_policies
  return render_policies


def _table() -> Callable[[Path], list[str]]:
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.sweep.provenance import render_table
  return lambda root: render_table(root, REPO)


# experiment -> its renderer (the result directory -> the table's lines); experiment#view: another table of the same
# directory (results/experiment)
RENDERERS: dict[str, Callable[[], Callable[[Path], list[str]]]] = {
  "uptrain": _uptrain, "uptrain#paired": _uptrain_paired, "search": _search,
  # issue 61 part 5: each schedule's peak against dense's
  "fit_parity": _fit_against_dense, "fit_parity_policies": _fit_against_dense,
  "fit_policies": _fit_policies,  # fit_table.py --policies: memory and FLOPs of every policy, dense alone
}
# the file a script's --results writes -> the renderer of a directory holding it: a sweep's rows (scripts/sweep.py),
# a fit table (scripts/fit_table.py), a benchmark's printed table (bench_compile.py, bench_train.py)
PUBLISHED: dict[str, Callable[[], Callable[[Path], list[str]]]] = {"sweep.json": _sweep, "fit.json": _fit,
                                                                    "table.json": _table}


def _block(experiment: str) -> re.Pattern:
  return re.compile(rf"(<!-- rendered from results/{experiment}: begin -->\n)(.*?)(<!-- rendered from "
                    rf"results/{experiment}: end -->)", re.S)


def pages() -> list[Path]:
  return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def rendered(text: str, tables: dict[str, str]) -> str:
  """``text`` with every marked table replaced by its rendering (``tables``: experiment -> markdown).

  Raises:
    SystemExit: a marker of an experiment that has no result files.
  """
  for experiment in set(re.findall(r"<!-- rendered from results/([\w#-]+): begin -->", text)):
    if experiment not in tables:
      raise SystemExit(f"a page marks a table rendered from results/{experiment}, which has no result files or no "
                       f"renderer (renderers: {', '.join(RENDERERS)}, and the --results directories of sweeps, fit tables and benchmarks)")
    text = _block(experiment).sub(lambda m: m.group(1) + tables[experiment] + m.group(3), text)
  return text


def render_all(results: Path) -> dict[str, str]:
  """Every experiment's table rendered from ``results/<experiment>`` (those that have result files)."""
  makers = {**{f.parent.name: make for marker, make in PUBLISHED.items()
               for f in sorted(results.glob(f"*/{marker}"))}, **RENDERERS}
  return {name: "\n".join(make()(results / name.split("#")[0])) + "\n" for name, make in makers.items()
          if (results / name.split("#")[0]).is_dir()}


def redraw_plots(results: Path) -> list[Path]:
  """Every published sweep's plots drawn again from its result files (:func:`jaxshare.sweep.publish.plot`)."""
  if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
  from jaxshare.sweep.publish import plot
  return [path for f in sorted(results.glob("*/sweep.json")) for path in plot(f.parent)]


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a page differs from its files")
  args = parser.parse_args(argv)
  tables = render_all(REPO / "results")
  stale = []
  for page in pages():
    text = page.read_text()
    new = rendered(text, tables)
    if new != text:
      stale.append(str(page.relative_to(REPO)))
      if not args.check:
        page.write_text(new)
  if args.check and stale:
    print(f"these pages' tables differ from results/: {', '.join(stale)}; run python scripts/render_results.py",
          file=sys.stderr)
    return 1
  print(("rewrote " + ", ".join(stale)) if stale else "every rendered table matches its result files")
  if not args.check:
    print("drew " + ", ".join(str(p.relative_to(REPO)) for p in redraw_plots(REPO / "results")))
  return 0


if __name__ == "__main__":
  sys.exit(main())
