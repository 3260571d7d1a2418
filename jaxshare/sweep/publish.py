"""A sweep's published results: with ``--results DIR`` every run that finishes in an invocation is also written to
``DIR/rows/<variant>[-seed<S>].json`` with its provenance (the train.py and eval.py commands, the commit, versions,
date and measure), and ``DIR/sweep.json`` records the sweep's variants in order, so that scripts/render_results.py
renders the table a page shows from committed files (:func:`render`)."""

from __future__ import annotations

from pathlib import Path

from jaxshare.config import REPO_ROOT
from jaxshare.sweep import results
from jaxshare.sweep.provenance import provenance, read_result, short_version, write_result
from jaxshare.sweep.spec import Sweep, SweepError, Trial, load_sweep, rel

KEPT = ("val_loss", "bits_per_byte", "kv_bytes_per_token_bf16", "num_params", "step", "schedule")


def measure(run: Trial) -> str:
  """What a row's ``val_loss`` is: eval.py's, on the batches its flags name."""
  where = f"the validation batches {' '.join(run.eval_flags)} names" if run.eval_flags else "the whole validation split"
  return f"eval.py --json val_loss: next-token cross-entropy in nats per token, mean over every scored token of {where}"


class Published:
  """The committed result files of one sweep under ``root``.

  Raises:
    SweepError: ``root`` holds results of another experiment or base overrides, or a variant whose overrides
      changed since its rows were written (naming what to delete).
  """

  def __init__(self, root: Path, sweep: Sweep):
    self.root, self.sweep = root, sweep
    recorded = read_result(root / "sweep.json") or {}
    settings = {"sweep": rel(sweep.path), "experiment": sweep.experiment, "base": list(sweep.base)}
    for key, value in list(settings.items())[1:]:  # (the sweep file may move)
      if key in recorded and recorded[key] != value:
        raise SweepError(f"--results {root}: its results are of {key} {recorded[key]!r}, this sweep's is {value!r}; "
                         "name another directory, or delete that one to publish this sweep's")
    variants = dict(recorded.get("variants", []))  # [[name, overrides], ...]: in order (result files sort keys)
    for name, overrides in sweep.variants.items():
      if name in variants and variants[name] != overrides and any(root.glob(f"rows/{name}*.json")):
        raise SweepError(f"--results {root}: variant {name}'s rows were made with {variants[name]}, the sweep now "
                         f"gives {overrides}; delete {root}/rows/{name}*.json to publish the new ones")
      variants[name] = list(overrides)
    order = [*sweep.variants, *(n for n in variants if n not in sweep.variants)]
    write_result(root / "sweep.json", {**settings, "variants": [[n, variants[n]] for n in order]})

  def add(self, run: Trial, row: dict) -> None:
    """Write ``row`` (the runner's result row of ``run``) if the run finished and was evaluated."""
    if row.get("status") != "ok":
      return
    name = run.variant if run.seed is None else f"{run.variant}-seed{run.seed}"
    kept = {k: row[k] for k in KEPT if k in row}
    write_result(self.root / "rows" / f"{name}.json",
                 {"variant": run.variant, "seed": run.seed, **kept,
                  "provenance": provenance([run.train_command(self.sweep.experiment), run.eval_command()],
                                            measure(run), REPO_ROOT)})


def load(root: Path) -> tuple[dict, list[dict]]:
  """``(sweep.json, rows in its variant order then by seed)``.

  Raises:
    ValueError: a row of a variant sweep.json does not list (naming the file).
  """
  settings = read_result(root / "sweep.json")
  if settings is None:
    raise ValueError(f"{root} has no sweep.json: a sweep run with --results {root} writes it")
  rank = {name: i for i, (name, _) in enumerate(settings["variants"])}
  rows = []
  for path in sorted((root / "rows").glob("*.json")):
    row = read_result(path)
    if row["variant"] not in rank:
      raise ValueError(f"{path}: variant {row['variant']!r} is not one of {root}/sweep.json's ({', '.join(rank)})")
    rows.append(row)
  return settings, sorted(rows, key=lambda r: (rank[r["variant"]], r["seed"] if r["seed"] is not None else -1))


def render(root: Path) -> list[str]:
  """The markdown table of a published sweep: one line per variant, the loss as mean ± sample std over its seeds,
  then a line naming the sweep and the commits the rows were measured at."""
  settings, rows = load(root)
  lines = ["| variant | overrides | seeds | val loss (nats/token) | KV cache, bytes/token (bf16) | params |",
           "|---|---|---|---|---|---|"]
  for name, overrides in settings["variants"]:
    mine = [r for r in rows if r["variant"] == name]
    if not mine:
      continue
    seeds = ", ".join("—" if r["seed"] is None else str(r["seed"]) for r in mine)
    cell = " ".join(overrides).replace("|", "\\|")
    lines.append(f"| {name} | {f'`{cell}`' if cell else '(the experiment as it is)'} | {seeds} | "
                 f"{results.mean_std([r['val_loss'] for r in mine])} | {mine[0]['kv_bytes_per_token_bf16']:,} | "
                 f"{mine[0]['num_params']:,} |")
  versions = sorted({short_version(r["provenance"]) for r in rows})
  return [*lines, "", f"Rendered by scripts/render_results.py from {rel(root)}/ (`python scripts/sweep.py "
          f"{settings['sweep']} --results {rel(root)}`, {len(rows)} runs), measured at "
          f"commit{'s' if len(versions) > 1 else ''} {', '.join(versions)}; each row's file holds the commands that "
          "made it."]


def plot(root: Path) -> list[Path]:
  """Draw a published sweep's plots from its result files, as the sweep draws them from its runs: ``root``/
  loss_vs_kv.png and loss_vs_params.png, one point per variant at its mean loss over the seeds, error bars the sample
  std, the Pareto front (scripts/render_results.py redraws them with the tables).

  Raises:
    ValueError: as :func:`load`. SweepError: the sweep file sweep.json names is gone or invalid.
  """
  settings, rows = load(root)
  summary = results.summarize([{**r, "status": "ok"} for r in rows], [name for name, _ in settings["variants"]])
  return results.plot(summary, load_sweep(REPO_ROOT / settings["sweep"]), root)
