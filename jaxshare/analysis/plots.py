"""PNG figures of the similarity metrics (matplotlib, Agg canvas: no display, no global pyplot state)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def _save(fig: Figure, path: str | Path) -> None:
  FigureCanvasAgg(fig)  # attaches the Agg canvas to the figure
  fig.savefig(path, dpi=120, bbox_inches="tight")


def heatmap(matrix: np.ndarray, path: str | Path, *, title: str, label: str, group: int = 1) -> None:
  """Write a square matrix as a heatmap with its layer indices on both axes.

  Args:
    matrix: ``[N, N]`` float, e.g. ``[L, L]`` (LISA Fig. 2) or ``[L*H, L*H]`` with ``group=H``.
    path: output ``.png``.
    title: figure title.
    label: colour bar label (the metric and its unit).
    group: rows per layer; with ``group > 1`` lines separate the layers and each layer's tick is centred on its heads.
  """
  matrix = np.asarray(matrix)
  if matrix.ndim != 2 or matrix.shape[0] != matrix.shape[1]:
    raise ValueError(f"matrix has shape {matrix.shape}: expected a square [N, N] array")
  if group < 1 or matrix.shape[0] % group:
    raise ValueError(f"group={group!r} is invalid: must be >= 1 and divide the matrix size {matrix.shape[0]}")
  size = 4 + 0.25 * min(matrix.shape[0], 32)
  fig = Figure(figsize=(size + 1, size))
  ax = fig.add_subplot()
  im = ax.imshow(matrix, cmap="viridis", interpolation="nearest")
  fig.colorbar(im, ax=ax, label=label)
  starts = np.arange(0, matrix.shape[0], group)
  centers, labels = starts + (group - 1) / 2, [str(i) for i in range(starts.size)]
  ax.set_xticks(centers, labels)
  ax.set_yticks(centers, labels)
  if group > 1:
    for edge in starts[1:] - 0.5:
      ax.axhline(edge, color="white", linewidth=0.5)
      ax.axvline(edge, color="white", linewidth=0.5)
  ax.set_xlabel("layer")
  ax.set_ylabel("layer")
  ax.set_title(title)
  _save(fig, path)


def head_matching_plot(result: dict[str, np.ndarray], path: str | Path) -> None:
  """Write the direct / random / best head-matching divergences per layer as lines (LISA Fig. 3b-d).

  Args:
    result: :func:`~jaxshare.analysis.similarity.head_matching` output, ``[L-1]`` arrays for layers 1..L-1.
    path: output ``.png``.
  """
  fig = Figure(figsize=(6, 4))
  ax = fig.add_subplot()
  for name, marker in (("direct", "o"), ("random", "s"), ("best", "^")):
    values = np.asarray(result[name])
    ax.plot(np.arange(1, values.size + 1), values, marker=marker, label=name)
  ax.set_xticks(np.arange(1, np.asarray(result["direct"]).size + 1))
  ax.set_xlabel("layer n (matched against layer n-1)")
  ax.set_ylabel("mean JS divergence (nats)")
  ax.set_title("head matching of adjacent layers")
  ax.legend()
  ax.grid(alpha=0.3)
  _save(fig, path)
