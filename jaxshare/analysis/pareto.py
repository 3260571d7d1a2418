"""The Pareto front of a loss against a cost: what the search's frontier lists and the sweeps' and search's plots
draw, one rule for both."""

from __future__ import annotations

from collections.abc import Sequence


def pareto(rows: Sequence[dict], cost: str, loss: str) -> list[dict]:
  """The rows no other row beats on both ``cost`` and ``loss`` (lower is better on both), by increasing cost; rows
  whose ``loss`` is None are left out. Of rows with equal cost only the lowest loss can be on the front."""
  ranked = sorted((r for r in rows if r.get(loss) is not None), key=lambda r: (r[cost], r[loss]))
  front, best = [], float("inf")
  for r in ranked:
    if r[loss] < best:
      front.append(r)
      best = r[loss]
  return front
