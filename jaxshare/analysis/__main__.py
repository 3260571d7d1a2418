"""Cross-layer attention similarity of a trained run: CSV tables, PNG heatmaps and a suggested sharing schedule.

Samples --samples windows of --seq-len tokens at deterministic random offsets of a text file, runs the model with
attention capture, and writes into --out:
  js_divergence.csv/.png      L x L JS divergence of head-averaged attention, nats (LISA Fig. 2)
  cosine.csv/.png             L x L cosine of head-averaged attention (SA Fig. 2/3)
  head_matching.csv/.png      direct / random / best head pairing of adjacent layers, nats (LISA Fig. 3)
  adjacent_cosine.csv         Sim(i) = cos(s_i, s_{i-1}) on per-head maps (UniAttn Fig. 2)
  weight_similarity.csv/.png  L*H x L*H cosine of W_q||W_k per head (head-wise sharing Eq. 3); only when every
                              layer projects its own Q and as many K heads (multi-head attention)

Examples:
  python -m jaxshare.analysis runs/dense --text ../shared/data/tinyshakespeare.txt --out analysis/dense
  python -m jaxshare.analysis runs/dense/checkpoints/400 --text t.txt --out a --samples 32 --seq-len 256 \\
      --suggest --threshold 0.9 --max-block 4
"""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Sequence

import jax
import numpy as np
from flax import nnx

from jaxshare.analysis import plots, similarity
from jaxshare.data.documents import read_text_file
from jaxshare.exit_codes import InputError, report_input_errors
from jaxshare.model.params import layer_params
from jaxshare.schedule import Schedule
from jaxshare.store.runs import Run, load_run


class AnalysisError(InputError):
  """Bad analysis input (text file, window size); reported on stderr with exit status 2."""


def read_text(path: Path) -> str:
  """The UTF-8 text of ``--text``.

  Raises:
    DataError: missing, unreadable, empty, binary or non-UTF-8 file (:func:`~jaxshare.data.documents.read_text_file`).
  """
  return read_text_file(path, "--text")


def sample_windows(ids: Sequence[int], num: int, length: int, seed: int) -> np.ndarray:
  """``[num, length]`` int32 token windows at offsets drawn uniformly (with replacement) from ``seed``.

  Raises:
    AnalysisError: fewer than ``length`` tokens.
  """
  if len(ids) < length:
    raise AnalysisError(f"--text has {len(ids)} tokens, shorter than one window of --seq-len {length}; "
                        "use a longer text or a smaller --seq-len")
  starts = np.random.default_rng(seed).integers(0, len(ids) - length + 1, size=num)
  ids = np.asarray(ids, np.int32)
  return np.stack([ids[s:s + length] for s in starts])


def attention_probs(run: Run, tokens: np.ndarray) -> np.ndarray:
  """``[L, B, H, T, T]`` float32 causal attention probabilities of every layer of ``run``'s model for
  ``tokens [B, T]``."""
  @jax.jit
  def captured_logits(params, tokens):
    return nnx.merge(run.graphdef, params).capture_logits(tokens)[1]

  return similarity.causal_softmax(np.asarray(captured_logits(run.params, tokens)), run.cfg.model.sliding_window)


def query_key_kernels(params: dict, schedule: Schedule) -> tuple[np.ndarray, np.ndarray] | None:
  """``(W_q, W_k)`` kernels, each ``[L, D, H, d]``, or None when a layer has no W_q / W_k or fewer K than Q heads.

  Head-wise sharing's Eq. 3 pairs each query head with its own key head, which needs multi-head attention in every
  layer (the paper covers no GQA model).
  """
  wq, wk = [], []
  for layer in range(len(schedule.layers)):
    attn = layer_params(params, schedule, layer)["attn"]
    q, k = attn.get("q_proj"), attn.get("k_proj")
    if q is None or k is None or np.shape(k["kernel"]) != np.shape(q["kernel"]):
      return None
    wq.append(np.asarray(q["kernel"]))
    wk.append(np.asarray(k["kernel"]))
  return np.stack(wq), np.stack(wk)


def write_matrix_csv(path: Path, matrix: np.ndarray, labels: Sequence[str]) -> None:
  """A square matrix with ``labels`` as the header row and first column."""
  with path.open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow([""] + list(labels))
    for label, row in zip(labels, matrix):
      w.writerow([label] + [f"{v:.6g}" for v in row])


def write_layer_csv(path: Path, columns: dict[str, np.ndarray]) -> None:
  """One row per layer ``1..L-1`` (adjacent-pair metrics), one column per metric."""
  with path.open("w", newline="") as f:
    w = csv.writer(f)
    w.writerow(["layer"] + list(columns))
    for i, values in enumerate(zip(*columns.values())):
      w.writerow([i + 1] + [f"{v:.6g}" for v in values])


def fmt(values: np.ndarray) -> str:
  """Values to 4 significant digits, space-separated (summary lines)."""
  return " ".join(f"{v:.4g}" for v in values)


def analyze(args: argparse.Namespace) -> list[str]:
  """Run the analysis of ``args`` and write its files; returns the summary lines.

  Raises:
    AnalysisError / ConfigError / DataError / CheckpointError: bad text file, run path, config or checkpoint.
  """
  text = read_text(args.text)
  run = load_run(args.run)
  cfg = run.cfg
  if cfg.model.num_layers < 2:
    raise AnalysisError(f"{args.run!r} has model.num_layers={cfg.model.num_layers}: cross-layer analysis needs >= 2")
  length = args.seq_len or cfg.data.seq_len
  tokens = sample_windows(run.tokenizer().encode(text), args.samples, length, args.seed)
  probs = attention_probs(run, tokens)

  out: Path = args.out
  out.mkdir(parents=True, exist_ok=True)
  layers = [str(i) for i in range(cfg.model.num_layers)]
  js = similarity.js_divergence_matrix(probs)
  cos = similarity.cosine_matrix(probs)
  matching = similarity.head_matching(probs, seed=args.seed)
  adjacent = similarity.adjacent_cosine(probs)
  write_matrix_csv(out / "js_divergence.csv", js, layers)
  write_matrix_csv(out / "cosine.csv", cos, layers)
  write_layer_csv(out / "head_matching.csv", matching)
  write_layer_csv(out / "adjacent_cosine.csv", {"cosine": adjacent})
  plots.heatmap(js, out / "js_divergence.png", title="JS divergence of head-averaged attention",
                label="JS divergence (nats)")
  plots.heatmap(cos, out / "cosine.png", title="cosine of head-averaged attention", label="cosine similarity")
  plots.head_matching_plot(matching, out / "head_matching.png")

  lines = [f"analysis of {args.run} at step {run.step}: {args.samples} windows of {length} tokens (seed {args.seed})",
           f"  schedule          {run.schedule.describe()}",
           f"  adjacent JS       {fmt(np.diagonal(js, 1))} (layers 1..L-1 vs the one before, nats)",
           f"  adjacent cosine   {fmt(adjacent)} (Sim(i), per-head maps)",
           f"  head matching     direct {fmt(matching['direct'])}",
           f"                    random {fmt(matching['random'])}",
           f"                    best   {fmt(matching['best'])}"]
  lines += weight_similarity(run.params, run.schedule, out)
  if args.suggest:
    lines += suggestion_lines(adjacent, args.threshold, args.max_block)
  lines.append(f"  files in          {out}")
  return lines


def weight_similarity(params: dict, schedule: Schedule, out: Path) -> list[str]:
  """Write the head-wise weight similarity files when the model has per-head W_q and W_k; summary lines."""
  kernels = query_key_kernels(params, schedule)
  if kernels is None:
    return ["  weight similarity skipped: needs W_q and as many W_k heads in every layer (multi-head attention)"]
  num_layers, _, heads, _ = kernels[0].shape
  sim = similarity.weight_head_similarity(*kernels)
  labels = [f"L{layer}H{h}" for layer in range(num_layers) for h in range(heads)]
  write_matrix_csv(out / "weight_similarity.csv", sim, labels)
  plots.heatmap(sim, out / "weight_similarity.png", title="cosine of W_q||W_k per head", label="cosine similarity",
                group=heads)
  match, score = similarity.best_earlier_match(sim, num_layers, heads)
  i = np.unravel_index(np.argmax(score), score.shape)
  return [f"  weight similarity best earlier-layer match per layer (mean) {fmt(score.mean(axis=1))}; "
          f"top: {labels[(i[0] + 1) * heads + i[1]]} ~ {labels[match[i]]} ({score[i]:.3f})"]


def suggestion_lines(adjacent: np.ndarray, threshold: float, max_block: int) -> list[str]:
  """The suggested schedule (:func:`~jaxshare.analysis.similarity.suggest_schedule`) as summary lines."""
  s = similarity.suggest_schedule(adjacent, threshold, max_block)
  head = f"  suggested schedule (Sim >= {threshold:g}, blocks of <= {max_block} layers)"
  if not s.groups:
    return [f"{head}: no adjacent layers are similar enough; nothing to share"]
  groups = ", ".join(f"{bottom} <- {' '.join(map(str, reusers))}" for bottom, reusers in s.groups)
  uniattn = " ".join(s.uniattn) if s.uniattn else "(not expressible: groups are not contiguous equal-size blocks)"
  return [f"{head}: groups (bottom <- reusers) {groups}",
          f"    uniattn: {uniattn}",
          f"    sa:      {' '.join(s.sa)}"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(prog="python -m jaxshare.analysis", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("run", help="run directory (latest checkpoint) or <run_dir>/checkpoints/<step>")
  parser.add_argument("--text", type=Path, required=True, help="UTF-8 text file to sample windows from")
  parser.add_argument("--out", type=Path, required=True, help="output directory (created if missing)")
  parser.add_argument("--samples", type=int, default=16, help="number of windows N (default 16)")
  parser.add_argument("--seq-len", type=int, default=0, help="tokens per window T (default: the run's data.seq_len)")
  parser.add_argument("--seed", type=int, default=0, help="seed of the window offsets and random head pairing")
  parser.add_argument("--suggest", action="store_true", help="also print a suggested sharing schedule")
  parser.add_argument("--threshold", type=float, default=0.9,
                      help="--suggest: minimum adjacent cosine Sim(i) to share (default 0.9, UniAttn's level)")
  parser.add_argument("--max-block", type=int, default=4,
                      help="--suggest: maximum layers per superblock (default 4, UniAttn's b)")
  args = parser.parse_args(argv)
  if args.samples < 1:
    parser.error(f"--samples={args.samples} is invalid: must be >= 1")
  if args.seq_len < 0 or args.seq_len == 1:
    parser.error(f"--seq-len={args.seq_len} is invalid: must be >= 2 (or 0 for the run's data.seq_len)")
  if not math.isfinite(args.threshold):
    parser.error(f"--threshold={args.threshold} is invalid: must be a finite number")
  if args.max_block < 2:
    parser.error(f"--max-block={args.max_block} is invalid: must be >= 2")
  if args.out.exists() and not args.out.is_dir():
    parser.error(f"--out={str(args.out)!r} is a file: it must be a directory (created if missing)")
  return args


def main(argv: list[str] | None = None) -> int:
  args = parse_args(argv)

  def run() -> int:
    print("\n".join(analyze(args)))
    return 0

  return report_input_errors(run)


if __name__ == "__main__":
  sys.exit(main())
