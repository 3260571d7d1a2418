"""The sweep's results: one row per run merged by (variant, seed) into <run_root>/results.csv, results.md (mean ±
sample std over seeds per variant) and the loss plots, all rewritten from the merged table."""

from __future__ import annotations

import csv
import fcntl
import hashlib
import io
import math
import os
import tempfile
import threading
from pathlib import Path

from jaxshare.files import is_remote, write_atomic
from jaxshare.sweep.spec import Sweep, Trial, rel

FIELDS = ("variant", "seed", "status", "val_loss", "bits_per_byte", "perplexity", "kv_bytes_per_token_bf16",
          "kv_bytes_per_token", "num_params", "step", "schedule", "run_dir", "error")


def result_row(run: Trial, status: str, report: dict | None = None, error: str = "") -> dict:
  """The table's row of ``run``: its status and error, and the FIELDS of its evaluation ``report``."""
  row = {"variant": run.variant, "seed": run.seed_key, "status": status, "run_dir": rel(run.run_dir), "error": error}
  for key in FIELDS:
    if report and key in report and key not in ("run_dir",):
      row[key] = report[key]
  return row


def _stats(values: list[float]) -> tuple[float, float]:
  mean = sum(values) / len(values)
  std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0
  return mean, std


def mean_std(values: list[float], digits: int = 4) -> str:
  """``mean ± sample std`` (n - 1 in the denominator); the value alone for one seed, ``—`` for none."""
  if not values:
    return "—"
  mean, std = _stats(values)
  if len(values) == 1:
    return f"{mean:.{digits}f}"
  return f"{mean:.{digits}f} ± {std:.{digits}f}"


def read_results(path: Path) -> tuple[list[dict], list[str]]:
  """Rows and column names of an existing results.csv (none if absent)."""
  if not path.exists():
    return [], []
  reader = csv.DictReader(io.StringIO(path.read_text(), newline=""))  # (a bucket's files open without newline=)
  rows, columns = list(reader), list(reader.fieldnames or [])
  if "variant" not in columns and "name" in columns:  # the table of the sweep script before seeds: one run each
    rows = [{"variant": r["name"], "seed": "", "status": "ok", **{k: v for k, v in r.items() if k != "name"}}
            for r in rows]
    columns = [c for c in columns if c != "name"]
  return rows, columns


def merge_rows(existing: list[dict], new: list[dict], order: list[str] | None = None) -> list[dict]:
  """``existing`` with rows of the same (variant, seed) replaced by ``new``'s, new keys appended; with ``order``
  (the sweep's variants) those variants' rows come first in that order, by seed, the others after as they were."""
  fresh = {(r["variant"], str(r["seed"])): r for r in new}
  merged = [fresh.pop((r["variant"], str(r["seed"])), r) for r in existing] + list(fresh.values())
  if order:
    rank = {name: i for i, name in enumerate(order)}

    def key(r):
      seed = str(r["seed"])
      return rank.get(r["variant"], len(rank)), int(seed) if seed.lstrip("-").isdigit() else 0

    merged.sort(key=key)  # stable: rows of other variants keep their order
  return merged


def summarize(rows: list[dict], order: list[str]) -> list[dict]:
  """One entry per variant (sweep order first, then others in table order): ok seeds, loss mean/std, KV, params."""
  names = list(dict.fromkeys([n for n in order if any(r["variant"] == n for r in rows)] +
                             [r["variant"] for r in rows]))
  out = []
  for name in names:
    mine = [r for r in rows if r["variant"] == name]
    ok = [r for r in mine if r["status"] == "ok"]
    entry = {"name": name, "runs": len(mine), "ok": len(ok), "statuses": sorted({r["status"] for r in mine}),
             "losses": [float(r["val_loss"]) for r in ok], "bpb": [float(r["bits_per_byte"]) for r in ok]}
    if ok:
      entry["val_loss"], entry["val_loss_std"] = _stats(entry["losses"])
      entry["kv_bytes_per_token_bf16"] = int(float(ok[0]["kv_bytes_per_token_bf16"]))
      entry["num_params"] = int(float(ok[0]["num_params"]))
    out.append(entry)
  return out


def markdown_table(summary: list[dict]) -> str:
  lines = ["| variant | seeds ok | val loss (nats/token) | bits/byte | KV bytes/token (bf16) | params |",
           "|---|---|---|---|---|---|"]
  for s in summary:
    seeds = f"{s['ok']}/{s['runs']}"
    if s["ok"] < s["runs"]:
      seeds += " (" + ", ".join(st for st in s["statuses"] if st != "ok") + ")"
    kv = f"{s['kv_bytes_per_token_bf16']:,}" if s["ok"] else "—"
    params = f"{s['num_params']:,}" if s["ok"] else "—"
    lines.append(f"| {s['name']} | {seeds} | {mean_std(s['losses'])} | {mean_std(s['bpb'])} | {kv} | {params} |")
  return "\n".join(lines) + "\n"


def plot(summary: list[dict], sweep: Sweep, root: Path) -> list[Path]:
  """Loss against KV bytes and against parameters, one point per variant, error bars = std over seeds."""
  from jaxshare.analysis.plots import loss_vs_kv, loss_vs_params  # matplotlib: only a sweep that plots loads it

  points = [{**s, "series": sweep.series.get(s["name"], "")} for s in summary if s["ok"]]
  if not points:
    return []
  paths = [root / "loss_vs_kv.png", root / "loss_vs_params.png"]
  label = "validation loss (nats/token)"
  title = f"{sweep.path.stem}" + (f", mean ± std over {len(sweep.seeds)} seeds" if sweep.seeds else "")
  kv = [p["kv_bytes_per_token_bf16"] for p in points]
  loss_vs_kv(points, paths[0], kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label=label, err_key="val_loss_std", title=title, log_x=min(kv) > 0 and max(kv) >= 8 * min(kv))
  loss_vs_params(points, paths[1], loss_label=label, err_key="val_loss_std", title=title)
  return paths


def _lock_file(root) -> str:
  """The file whose lock serialises merges into ``root``'s table: beside it locally (sweeps on every machine that
  mounts it); for a bucket, which has no locks, in this machine's temporary directory, so that two sweeps over one
  gs:// run_root must run on one machine (docs/sweeps.md)."""
  if not is_remote(root):
    return str(root / ".results.lock")
  return os.path.join(tempfile.gettempdir(), f"jaxshare-sweep-{hashlib.sha256(str(root).encode()).hexdigest()[:16]}"
                      ".lock")


class Results:
  """The sweep's table: rows merged into <run_root>/results.csv under a file lock (two sweeps over one run_root
  never drop each other's rows), written atomically, and results.md regenerated from the merged table."""

  def __init__(self, sweep: Sweep):
    self.sweep, self.root = sweep, sweep.run_root
    self.lock = threading.Lock()

  def add(self, rows: list[dict]) -> list[dict]:
    """Merge ``rows`` in; returns the whole merged table."""
    self.root.mkdir(parents=True, exist_ok=True)
    with self.lock, open(_lock_file(self.root), "w") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      existing, columns = read_results(self.root / "results.csv")
      merged = merge_rows(existing, rows, list(self.sweep.variants))
      fields = list(FIELDS) + [c for c in columns if c not in FIELDS]
      buf = io.StringIO()
      writer = csv.DictWriter(buf, fieldnames=fields, restval="", extrasaction="ignore", lineterminator="\n")
      writer.writeheader()
      writer.writerows(merged)
      write_atomic(self.root / "results.csv", buf.getvalue())
      write_atomic(self.root / "results.md", markdown_table(summarize(merged, list(self.sweep.variants))))
      return merged
