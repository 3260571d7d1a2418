"""A search's results: ``results.csv`` (every candidate), ``frontier.md`` (the Pareto frontiers of loss against KV
bytes and against FLOPs, the presets beside them, the finals over seeds and how well stage 1 ranked stage 2),
``frontier.png`` / ``frontier_flops.png``, and each frontier schedule as a config file ``train.py --config`` and
``convert uptrain --config`` take as is."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path

import yaml
from scipy import stats

from jaxshare.analysis.pareto import pareto
from jaxshare.config import Config, to_yaml
from jaxshare.files import write_atomic
from jaxshare.search.budget import Footprint
from jaxshare.sweep.results import mean_std

COLUMNS = ("name", "schedule", "families", "preset", "kv_bytes_per_token_bf16", "kv_fraction", "flops_per_token",
           "flops_fraction", "params", "stage1_loss", "stage1_kl")


def candidate_rows(costs: dict[str, tuple[str, tuple[str, ...], bool, Footprint]], source: Footprint,
                   stage1: dict, rungs: Sequence[dict[str, float]], rung_steps: Sequence[int],
                   finals: dict[str, list[float]]) -> list[dict]:
  """One row per candidate: its schedule and costs, stage 1's scores, its loss at each rung it reached and its
  finals' losses over seeds."""
  rows = []
  for name, (schedule, families, preset, cost) in costs.items():
    t = stage1.get(name)
    row = {"name": name, "schedule": schedule, "families": "+".join(families), "preset": preset,
           "kv_bytes_per_token_bf16": cost.kv_bytes, "kv_fraction": cost.kv_bytes / source.kv_bytes,
           "flops_per_token": cost.flops, "flops_fraction": cost.flops / source.flops, "params": cost.params,
           "stage1_loss": None if t is None else t.value, "stage1_kl": None if t is None else t.user_attrs["kl"]}
    for r, (scores, steps) in enumerate(zip(rungs, rung_steps)):
      row[f"rung{r}_loss_{steps}_steps"] = scores.get(name)
    if name in finals:
      row["final_losses"] = " ".join(f"{v:.5f}" for v in finals[name])
    rows.append(row)
  return rows


def write_csv(path: Path, rows: Sequence[dict]) -> None:
  columns = list(dict.fromkeys([c for r in rows for c in r]))
  buf = io.StringIO()
  writer = csv.DictWriter(buf, fieldnames=columns, restval="", lineterminator="\n")
  writer.writeheader()
  writer.writerows([{k: ("" if v is None else v) for k, v in r.items()} for r in rows])
  write_atomic(path, buf.getvalue())


def rank_correlation(rows: Sequence[dict], rung_key: str) -> tuple[float, int] | None:
  """Spearman's rank correlation of stage 1's loss with the loss at ``rung_key`` over the candidates that have
  both, and their number (None under three)."""
  both = [(r["stage1_loss"], r[rung_key]) for r in rows if r.get("stage1_loss") is not None
          and r.get(rung_key) is not None]
  if len(both) < 3:
    return None
  rho = stats.spearmanr([a for a, _ in both], [b for _, b in both]).statistic
  return float(rho), len(both)


def _table(rows: Sequence[dict], loss: str, cost: str, cost_label: str) -> list[str]:
  lines = [f"| schedule | preset | {cost_label} | loss |", "|---|---|---|---|"]
  for r in pareto(rows, cost, loss):
    lines.append(f"| `{r['name']}` | {'yes' if r['preset'] else ''} | {r[cost]:,.0f} | {r[loss]:.4f} |")
  return lines


def frontier_markdown(title: str, rows: Sequence[dict], rung_keys: Sequence[str],
                      finals: dict[str, list[float]], winner: str | None, best_preset: str | None,
                      failed: dict[str, str]) -> str:
  """``frontier.md``: per loss measured (stage 1, each rung), the frontier against KV bytes and FLOPs; the finals;
  stage 1's rank correlation with the first rung; the trials that failed (``{study/point: error}``)."""
  out = [f"# {title}", ""]
  for key, what in [("stage1_loss", "after conversion (stage 1, calibration batches)")] + [
      (k, f"after uptraining ({k.split('_', 2)[2].replace('_', ' ')}, stage 2)") for k in rung_keys]:
    scored = [r for r in rows if r.get(key) is not None]
    if not scored:
      continue
    out += [f"## Loss {what}: {len(scored)} candidates", "", "Frontier against KV bytes:", "",
            *_table(scored, key, "kv_bytes_per_token_bf16", "KV B/token (bf16)"), "", "Frontier against FLOPs:", "",
            *_table(scored, key, "flops_per_token", "FLOPs/token"), ""]
    presets = [r for r in scored if r["preset"]]
    if presets:
      best = min(presets, key=lambda r: r[key])
      out += [f"Best preset: `{best['name']}` {best[key]:.4f} (KV {best['kv_bytes_per_token_bf16']:,} B/token).", ""]
  if finals:
    out += ["## Finals (validation loss, mean ± std over seeds)", "", "| schedule | role | seeds | loss |",
            "|---|---|---|---|"]
    for name, losses in finals.items():
      role = " and ".join(r for r, n in (("search winner", winner), ("best preset", best_preset)) if n == name)
      out.append(f"| `{name}` | {role} | {len(losses)} | {mean_std(losses)} |")
    out.append("")
  if rung_keys:
    rc = rank_correlation(rows, rung_keys[0])
    out += ["## Did stage 1 predict stage 2?", "",
            ("too few candidates reached stage 2 to tell" if rc is None else
             f"Spearman's rank correlation of the stage-1 loss with the first rung's: {rc[0]:+.3f} over {rc[1]} "
             "candidates."), ""]
  if failed:
    out += ["## Failed trials", "", *(f"- `{k}`: {v}" for k, v in failed.items()), ""]
  return "\n".join(out)


def summary(budget: str, candidates: Sequence[dict], rung_keys: Sequence[str], finals: dict[str, list[float]],
            winner: str | None, best_preset: str | None) -> dict:
  """What the README's search table shows of one search (:func:`summary_row`): the budget, the candidates (presets,
  KVSharer's), the best at conversion, the first rung's entrants, the finals of the winner and the best preset, and
  how well stage 1 ranked the first rung; ``candidates`` are :func:`candidate_rows`."""
  scored = [r for r in candidates if r.get("stage1_loss") is not None]
  best = min(scored, key=lambda r: r["stage1_loss"]) if scored else None
  first = rung_keys[0] if rung_keys else None
  rc = rank_correlation(candidates, first) if first else None
  kv = {r["name"]: r["kv_bytes_per_token_bf16"] for r in candidates}
  return {"budget": budget, "candidates": len(candidates), "presets": sum(bool(r["preset"]) for r in candidates),
          "kvsharer": sum(r["name"].startswith("kvsharer") for r in candidates),
          "stage1_best": None if best is None else [best["name"], best["stage1_loss"]],
          "rung0_steps": int(first.split("_")[2]) if first else None,
          "rung0": {r["name"]: r[first] for r in candidates if first and r.get(first) is not None},
          "final_steps": int(rung_keys[-1].split("_")[2]) if rung_keys else None,
          "finals": {n: list(v) for n, v in finals.items()}, "winner": winner, "best_preset": best_preset,
          "kv_bytes_per_token_bf16": {n: kv[n] for n in finals}, "rho": None if rc is None else list(rc)}


SUMMARY_HEADER = ("| budget | candidates | best at conversion (stage 1) | first rung | winner (finals) | best preset "
                  "(finals) | ρ(stage 1, rung 0) |", "|---|---|---|---|---|---|---|")


def summary_row(s: dict) -> str:
  """One search's line of the README's search table, from its :func:`summary`."""
  def final(name: str | None) -> str:
    if name is None or name not in s["finals"]:
      return "—"
    return (f"`{name}` {mean_std(s['finals'][name])} ({s['kv_bytes_per_token_bf16'][name]:,} B/token, "
            f"{len(s['finals'][name])} seeds × {s['final_steps']} steps)")

  best = "—" if s["stage1_best"] is None else f"`{s['stage1_best'][0]}` {s['stage1_best'][1]:.3f}"
  rung = ", ".join(f"`{n}` {v:.3f}" for n, v in sorted(s["rung0"].items(), key=lambda kv: kv[1]))
  preset = "(the winner)" if s["best_preset"] == s["winner"] else final(s["best_preset"])
  rho = "—" if s["rho"] is None else f"{s['rho'][0]:+.2f} ({s['rho'][1]} candidates)"
  return (f"| {s['budget']} | {s['candidates']} ({s['presets']} presets, {s['kvsharer']} KVSharer) | {best} | "
          f"{s['rung0_steps']} steps: {rung} | {final(s['winner'])} | {preset} | {rho} |")


def plot(rows: Sequence[dict], loss: str, out: Path, title: str) -> list[Path]:
  """``frontier.png`` (loss against KV bytes) and ``frontier_flops.png`` (against FLOPs), presets and found schedules
  in two colours, each with its Pareto front."""
  from jaxshare.analysis.plots import loss_vs_flops, loss_vs_kv  # matplotlib: loaded only to plot

  points = [{**r, "val_loss": r[loss], "series": "preset" if r["preset"] else "searched"} for r in rows
            if r.get(loss) is not None]
  if not points:
    return []
  label = loss.replace("_", " ")
  paths = [out / "frontier.png", out / "frontier_flops.png"]
  loss_vs_kv(points, paths[0], kv_key="kv_bytes_per_token_bf16", kv_label="KV cache, bytes per token (bf16)",
             loss_label=label, title=title)
  loss_vs_flops(points, paths[1], flops_key="flops_per_token", flops_label="forward FLOPs per token",
                loss_label=label, title=title)
  return paths


def write_config(path: Path, cfg: Config, wc_fit: str = "") -> None:
  """A candidate's full config (``train.init_from`` the source): ``train.py --config PATH`` uptrains it, ``convert
  uptrain --config PATH`` converts into its schedule; a first comment names the ``--wc-fit`` it was converted with
  (``wc_fit``, where it has a W_c), which no config field holds."""
  text = (f"# converted with: convert uptrain --wc-fit {wc_fit}\n" if wc_fit else "") + to_yaml(cfg)
  yaml.safe_load(text)  # what train.py --config will read back
  write_atomic(path, text)
