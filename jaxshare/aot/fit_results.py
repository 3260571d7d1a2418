"""The published fit tables: the rows ``scripts/fit_table.py --results DIR`` writes to ``DIR/fit.json`` (one per
compile search, each with its command's provenance; several invocations fill one table) and their rendering as a table with one column per schedule
(:func:`render`, what scripts/render_results.py puts in the pages). Bytes are per chip; FLOPs-derived times per
step."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from jaxshare.aot.units import GIB, gib, ms
from jaxshare.config import REPO_ROOT
from jaxshare.sweep.provenance import read_result, short_version, write_result

if TYPE_CHECKING:  # (this module renders without JAX; a Fit comes from the compile)
  from jaxshare.aot.report import Fit

MEASURE = ("the train step compiled on this host for the target (no device): HBM per chip is the compiler's peak "
           "memory_analysis (jaxlib's sum where it gives none); the largest global batch is the largest whose step "
           "fits the memory jax may use; K/V moved is the attention K/V bytes of the step's collectives per chip")


def fit_row(model: str, target: str, schedule: str, remat: str, seq_len: int, context: int, ring: bool,
            best: Fit | None, probes: list[Fit], decode_cache: int) -> dict:
  """A table row of one compile search: ``best`` the largest batch that fits (None: one sequence per batch shard
  does not), ``probes`` every compile it made (the last is reported when none fits), ``decode_cache`` the bytes of
  one sequence's decode KV cache."""
  fit = best or probes[-1]
  moved = fit.traffic if fit.chips > 1 else None
  return {"model": model, "target": target, "schedule": schedule, "remat": remat, "seq_len": seq_len,
          "context": context, "ring": ring, "chips": fit.chips, "batch": best.batch if best else None,
          "hbm": fit.hbm, "kv_moved": int(moved.kv) if moved else None, "moved": int(moved.total) if moved else None,
          "step_time_bound_s": fit.step_time_bound, "decode_kv_cache": decode_cache, "compiles": len(probes),
          "model_flops": fit.model_flops, "executed_flops": fit.executed_flops, "compile_s": fit.compile_s}


def publish(root: Path, row: dict, provenance: dict) -> None:
  """Add ``row`` (:func:`fit_row`) with its ``provenance`` to ``root``/fit.json, replacing the row of the same case
  and schedule."""
  rows = [r for r in (read_result(root / "fit.json") or {"rows": []})["rows"]
          if (_case(r), r["schedule"]) != (_case(row), row["schedule"])]
  write_result(root / "fit.json", {"rows": [*rows, {**row, "provenance": provenance}]})


def _case(row: dict) -> str:
  where = f"{row['target']}" + (f", mesh.context={row['context']}" if row["context"] > 1 else "")
  where += " round the ring (`attention.context_strategy=ring`)" if row["ring"] else ""
  return f"{row['model']}, {row['seq_len']:,} tokens, {where}, `model.remat={row['remat']}`"


def _kv_moved(row: dict) -> str:
  """The K/V bytes of a step, and per sequence where a batch fits (the reported compile is at that batch)."""
  if row["kv_moved"] is None:
    return "—"
  return gib(row["kv_moved"]) + (f" ({gib(row['kv_moved'] // row['batch'])} per sequence)" if row["batch"] else "")


def render(root: Path) -> list[str]:
  """``root``/fit.json as a table: one column per schedule; per case (model, target, length, context axis, ring,
  policy) the largest batch with its HBM per chip, the step-time bound of the compile reported (its FLOPs at the
  chips' peak), and where K/V moved between chips the bytes per chip per step (and per sequence, at that batch); the
  decode KV cache per sequence once per length and model; then the command and commit that compiled it.

  Raises:
    ValueError: ``root`` has no fit.json.
  """
  rows = _rows(root)
  schedules = list(dict.fromkeys(r["schedule"] for r in rows))
  cell = {(_case(r), r["schedule"]): r for r in rows}
  lines = [f"| case | {' | '.join(schedules)} |", "|---" * (1 + len(schedules)) + "|"]

  def line(label: str, case: str, value) -> str:
    return f"| {label} | " + " | ".join(value(cell[case, s]) if (case, s) in cell else "—" for s in schedules) + " |"

  models = {r["model"] for r in rows}
  caches_shown = set()
  for case in dict.fromkeys(_case(r) for r in rows):
    lines.append(line(f"{case}: largest batch (HBM per chip)", case, lambda r: (
      f"{r['batch']} ({gib(r['hbm'])})" if r["batch"] else f"none ({gib(r['hbm'])} for one sequence per shard)")))
    lines.append(line(f"{case}: step-time bound at that batch", case, lambda r: ms(r["step_time_bound_s"])))
    if any(cell[case, s]["kv_moved"] for s in schedules if (case, s) in cell):  # no context axis: no K/V moves
      lines.append(line(f"{case}: K/V bytes moved per chip per step", case, _kv_moved))
      lines.append(line(f"{case}: all collectives' bytes per chip per step", case,
                        lambda r: "—" if r["moved"] is None else gib(r["moved"])))
    model, length = next((r["model"], r["seq_len"]) for r in rows if _case(r) == case)
    if (model, length) not in caches_shown:  # the cache is the model's and the length's, whatever the case
      caches_shown.add((model, length))
      whose = f" of {model}" if len(models) > 1 else ""
      lines.append(line(f"decode KV cache per {length:,}-token sequence{whose}", case,
                        lambda r: gib(r["decode_kv_cache"])))
  return [*lines, "", _made_by(root, rows)]


def render_policies(root: Path) -> list[str]:
  """``root``/fit.json (``scripts/fit_table.py --policies --results``) as the policy table: a line per compile in
  the order made (topology, length, policy), its HBM per chip (a compile over the chip's memory says so), the
  executed FLOPs of the step (recomputation included) and their ratio to the model's, and the seconds to trace and
  compile it on this host. Then the command and commit.

  Raises:
    ValueError: ``root`` has no fit.json.
  """
  rows = _rows(root)
  lines = ["| topology | T | model.remat | HBM per chip | executed FLOPs per step | executed / model FLOPs | compile s |",
           "|---|---|---|---|---|---|---|"]
  lines += [f"| {r['target']} | {r['seq_len']:,} | {r['remat']} | {_fits(r, gib(r['hbm']))} | "
            f"{r['executed_flops']:.3e} | {r['executed_flops'] / r['model_flops']:.3f} | {r['compile_s']:.0f} |"
            for r in rows]
  return [*lines, "", _made_by(root, rows)]


def render_against_dense(root: Path) -> list[str]:
  """``root``/fit.json as a parity table (issue 61 part 5: a shared schedule needs no more memory than dense): one
  line per (topology, length, policy), dense's HBM per chip, then every other schedule's HBM minus dense's (GiB,
  signed) at the same batch; a compile that does not fit its chip says so. Then the command and commit.

  Raises:
    ValueError: ``root`` has no fit.json, or a line has no dense row to compare with.
  """
  rows = _rows(root)
  hbm = {(r["target"], r["seq_len"], r["remat"], r["schedule"]): r for r in rows}
  cases = list(dict.fromkeys(key[:3] for key in hbm))
  names = [n for n in dict.fromkeys(key[3] for key in hbm) if n != "dense"]
  lines = [f"| topology | T | model.remat | dense | {' | '.join(names)} |", "|---" * (4 + len(names)) + "|"]
  for case in cases:
    if (*case, "dense") not in hbm:
      raise ValueError(f"{root}/fit.json has no dense row for {case}: the table compares each schedule with dense's")
    dense = hbm[(*case, "dense")]
    batches = {r["batch"] for r in rows if (r["target"], r["seq_len"], r["remat"]) == case} - {None}
    if len(batches) > 1:
      raise ValueError(f"{root}/fit.json compares batches {sorted(batches)} at {case}: compile one batch (--no-search)")
    target, length, policy = case
    lines.append(f"| {target} | {length:,} | {policy} | {_fits(dense, gib(dense['hbm']))} | " + " | ".join(
      _fits(hbm[(*case, n)], f"{(hbm[(*case, n)]['hbm'] - dense['hbm']) / GIB:+.2f}") if (*case, n) in hbm
      else "—" for n in names) + " |")
  return [*lines, "", _made_by(root, rows)]


def _fits(row: dict, value: str) -> str:
  """``value`` as a parity cell: a compile with no batch that fits its chip says so."""
  return value + ("" if row["batch"] else " (does not fit)")


def _rows(root: Path) -> list[dict]:
  data = read_result(root / "fit.json")
  if data is None:
    raise ValueError(f"{root} has no fit.json: scripts/fit_table.py --results {root} writes it")
  return data["rows"]


def _made_by(root: Path, rows: list[dict]) -> str:
  """The rendering's last line: the commands, commits and jax versions that compiled ``rows``."""
  made = [r["provenance"] for r in rows]
  commands = list(dict.fromkeys(" ".join(p["commands"][0]) for p in made))
  versions = sorted({short_version(p) for p in made})
  jax = sorted({p["jax"] for p in made})
  return (f"Rendered by scripts/render_results.py from {_where(root)}/fit.json, made by "
          + ", ".join(f"`{c}`" for c in commands) + f"; compiled at commit{'s' if len(versions) > 1 else ''} "
          f"{', '.join(versions)} with jax {', '.join(jax)}.")


def _where(root: Path) -> str:
  return str(root.relative_to(REPO_ROOT)) if root.is_relative_to(REPO_ROOT) else str(root)
