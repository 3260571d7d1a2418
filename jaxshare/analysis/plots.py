"""PNG figures of the similarity metrics (matplotlib, Agg canvas: no display, no global pyplot state), written whole
to a local path or a bucket (gs://)."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter

from jaxshare.analysis.pareto import pareto
from jaxshare.files import write_atomic


def _save(fig: Figure, path: str | Path) -> None:
  FigureCanvasAgg(fig)  # attaches the Agg canvas to the figure
  png = io.BytesIO()
  fig.savefig(png, format="png", dpi=120, bbox_inches="tight")
  write_atomic(path, png.getvalue())


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


def loss_vs_kv(rows: list[dict], path: str | Path, *, kv_key: str, kv_label: str,
               loss_label: str = "validation loss", err_key: str | None = None, title: str = "",
               log_x: bool = False) -> None:
  """Validation loss against KV-cache bytes per token, one point per run, with the Pareto front (the lowest loss
  at each KV budget).

  Args:
    rows: dicts with ``name``, ``val_loss`` and ``kv_key``; an optional ``series`` colours the points by group.
    path: output ``.png``.
    kv_key / kv_label: the rows' KV-bytes field and its axis label (which dtype's bytes).
    loss_label: the loss axis label (its unit).
    err_key: optional field of each row with the loss's error bar (e.g. the std over seeds).
    title: appended to the figure title.
    log_x: a base-2 logarithmic x axis (ladders that halve the cache).
  """
  _loss_against(rows, path, x_key=kv_key, x_label=kv_label, loss_label=loss_label, err_key=err_key,
                title="Loss vs KV cache" + (f" ({title})" if title else ""), log_x=log_x)


def loss_vs_params(rows: list[dict], path: str | Path, *, params_key: str = "num_params",
                   params_label: str = "parameters", loss_label: str = "validation loss",
                   err_key: str | None = None, title: str = "", log_x: bool = False) -> None:
  """Validation loss against parameter count, one point per run, with the Pareto front (the lowest loss at each
  size); arguments as :func:`loss_vs_kv`, ``params_key`` naming the rows' parameter-count field."""
  _loss_against(rows, path, x_key=params_key, x_label=params_label, loss_label=loss_label, err_key=err_key,
                title="Loss vs parameters" + (f" ({title})" if title else ""), log_x=log_x)


def loss_vs_flops(rows: list[dict], path: str | Path, *, flops_key: str, flops_label: str,
                  loss_label: str = "validation loss", title: str = "") -> None:
  """Loss against FLOPs per token, one point per row, with the Pareto front; arguments as :func:`loss_vs_kv`."""
  _loss_against(rows, path, x_key=flops_key, x_label=flops_label, loss_label=loss_label, err_key=None,
                title="Loss vs FLOPs" + (f" ({title})" if title else ""))


def _loss_against(rows: list[dict], path: str | Path, *, x_key: str, x_label: str, loss_label: str,
                  err_key: str | None, title: str, log_x: bool = False) -> None:
  """The scatter behind :func:`loss_vs_kv` and :func:`loss_vs_params`: points labelled by name, coloured by series,
  with optional loss error bars and the Pareto front over ``x_key``."""
  fig = Figure(figsize=(6, 4))
  ax = fig.add_subplot()
  series = list(dict.fromkeys(r.get("series", "") for r in rows))
  for r in rows:
    color = f"C{series.index(r.get('series', ''))}"
    ax.scatter(r[x_key], r["val_loss"], color=color, label=r.get("series") or None)
    if err_key and r.get(err_key):
      ax.errorbar(r[x_key], r["val_loss"], yerr=r[err_key], fmt="none", ecolor=color, capsize=3, linewidth=1)
    ax.annotate(r["name"], (r[x_key], r["val_loss"]), fontsize=7, xytext=(3, 3), textcoords="offset points")
  front = [(r[x_key], r["val_loss"]) for r in pareto(rows, x_key, "val_loss")]
  if front:
    ax.plot(*zip(*front), "--", color="gray", label="Pareto front")
  if log_x:
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
  ax.set_xlabel(x_label)
  ax.set_ylabel(loss_label)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  handles, labels = ax.get_legend_handles_labels()
  unique = dict(zip(labels, handles))
  ax.legend(unique.values(), unique.keys(), fontsize=8)
  _save(fig, path)
