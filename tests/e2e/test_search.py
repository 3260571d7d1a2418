"""``python -m jaxshare.search`` end to end on a tiny trained dense run: stage 1 scores every candidate within the
budget, successive halving uptrains the best through train.py and eval.py, the finals run the winner and the best
preset, selected on the first validation batches and reported on the rest; the
report, the plots and the frontier configs are written; run again, it resumes and runs nothing; a
frontier config is what train.py and convert uptrain take."""

from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import re
import signal
import subprocess
import sys
import time

import optuna
import pytest

from conftest import REPO, tiny_config
from jaxshare.config import load_config
from jaxshare.convert.__main__ import main as convert_main
from jaxshare.train.config import load_train_config
from jaxshare.store.runs import load_run
from jaxshare.search.__main__ import main

pytestmark = pytest.mark.usefixtures("keep_signal_handlers")


def search(*argv: str) -> str:
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert main(list(argv)) == 0
  return out.getvalue()


def test_a_search_reports_its_frontier_resumes_and_its_configs_train(tmp_path):
  from jaxshare.train.loop import train

  src = tmp_path / "dense"
  train(tiny_config(f"train.run_dir={src}"))
  out = tmp_path / "search"
  argv = (str(src), "--kv-budget", "0.5", "--families", "kv", "--trials", "3", "--steps", "2", "--seeds", "1",
          "--calibration-batches", "1", "--set", "train.eval_batches=1", "train.log_every=1", "--out", str(out),
          "--results", str(tmp_path / "summary.json"))
  log = search(*argv)
  with (out / "results.csv").open() as f:
    rows = {r["name"]: r for r in csv.DictReader(f)}
  stage1 = [line for line in log.splitlines() if line.startswith("[stage 1 ")]
  assert len(stage1) == len(rows) >= 5 and {"cla2-own", "gqa2", "mlkv2-mean"} <= set(rows)
  assert any(name.startswith("kvsharer") for name in rows)  # KVSharer's proposals beside the enumerated space
  assert all(float(r["kv_fraction"]) <= 0.5 and float(r["stage1_loss"]) > 0 for r in rows.values())
  rung0 = [n for n, r in rows.items() if r["rung0_loss_2_steps"]]
  rung1 = [n for n, r in rows.items() if r["rung1_loss_4_steps"]]
  assert len(rung0) == 2 and len(rung1) == 1 and set(rung1) <= set(rung0)
  assert rung1[0] == min(rung0, key=lambda n: float(rows[n]["rung0_loss_2_steps"]))  # the better half goes on
  assert rows[rung1[0]]["final_losses"]  # the winner's finals
  # the rungs select on the first validation batch (--calibration-batches 1), the finals report on the rest: the
  # winner's seed-0 run, trained by the last rung, evaluated on both
  selected = json.loads((out / "rung1" / rung1[0] / "eval_max-batches_1.json").read_text())["val_loss"]
  reported = json.loads((out / "rung1" / rung1[0] / "eval_skip-batches_1.json").read_text())["val_loss"]
  assert float(rows[rung1[0]]["rung1_loss_4_steps"]) == pytest.approx(selected, rel=1e-6)
  assert float(rows[rung1[0]]["final_losses"].split()[0]) == pytest.approx(reported, abs=1e-5)
  assert abs(selected - reported) > 1e-6
  ranked = sorted(rows, key=lambda n: float(rows[n]["stage1_loss"]))
  presets = [n for n in ranked if rows[n]["preset"] == "True"]
  assert set(rung0) == {ranked[0], presets[0]} or set(rung0) == set(ranked[:2])  # the best preset always enters
  report = (out / "frontier.md").read_text()
  for needle in ("Frontier against KV bytes", "Frontier against FLOPs", "## Finals", "Best preset",
                 "Did stage 1 predict stage 2?"):
    assert needle in report
  assert (out / "frontier.png").stat().st_size > 0 and (out / "frontier_flops.png").stat().st_size > 0
  # the published table's row: the same candidates, rung and finals, with the command that made them
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert (summary["candidates"], summary["winner"]) == (len(rows), rung1[0])
  assert summary["rung0"] == {n: pytest.approx(float(rows[n]["rung0_loss_2_steps"])) for n in rung0}
  assert summary["finals"][rung1[0]] == [pytest.approx(float(v)) for v in rows[rung1[0]]["final_losses"].split()]
  assert summary["stage1_best"][0] == ranked[0]
  assert summary["provenance"]["commands"] == [["python", "-m", "jaxshare.search", *argv]]
  from jaxshare.search.report import summary_row
  assert summary_row(summary).startswith(f"| {summary['budget']} | {len(rows)} (")

  again = search(*argv)  # resumed: every trial finished, nothing runs again
  assert not [line for line in again.splitlines() if line.startswith("[")]
  for name in ("stage1", "rung0", "rung1", "finals"):
    study = optuna.load_study(study_name=name, storage=f"sqlite:///{out / 'study.db'}")
    points = [t.params["point"] for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(points) == len(set(points))

  configs = sorted((out / "frontier").glob("*.yaml"))
  assert configs
  name = configs[0].stem
  cfg = load_train_config(configs[0], [])  # what train.py --config runs: the source's model, the schedule found
  assert cfg.train.init_from == str(src) and cfg.model == load_run(src).cfg.model
  assert cfg.train.run_dir == str(out / "uptrained" / name)  # never the source's own directory
  assert cfg.schedule == load_config(configs[0], []).schedule
  with contextlib.redirect_stdout(io.StringIO()):
    assert convert_main(["uptrain", str(src), str(tmp_path / "again"), "--config", str(configs[0]),
                         "--calibration-batches", "0"]) == 0
  assert load_run(tmp_path / "again").cfg.schedule == load_run(out / "converted" / name).cfg.schedule


def test_ctrl_c_stops_the_search_and_its_run_however_it_was_started(tmp_path):
  """Ctrl-C to the search's process group stops the uptraining run in flight (it saves a checkpoint) and the search
  with it: exit 130 and one line saying how to resume. The search starts with SIGINT ignored, as a shell without job
  control starts `make test &`: it kept the inherited SIG_IGN, so train.py stopped but the search failed that trial
  and started the next candidate (the sweep's bug of 4742e02)."""
  from jaxshare.train.loop import train

  src = tmp_path / "dense"
  train(tiny_config(f"train.run_dir={src}"))
  out = tmp_path / "search"
  proc = subprocess.Popen([sys.executable, "-m", "jaxshare.search", str(src), "--kv-budget", "0.25", "--families",
                           "kv", "--trials", "3", "--steps", "100000", "--seeds", "1", "--calibration-batches", "1",
                           "--set", "train.eval_batches=1", "train.log_every=1", "train.progress_bar=false",
                           "--out", str(out)], cwd=REPO, text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))

  def logs() -> list:
    return sorted((out / "rung0").glob("*/sweep.log")) if (out / "rung0").is_dir() else []

  try:
    deadline = time.time() + 240
    while not any(re.search(r"^step +3/", log.read_text(), re.M) for log in logs()) and time.time() < deadline:
      time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    output, _ = proc.communicate(timeout=180)
  finally:  # a search that did not stop trains its next candidate for 100000 steps: end it and its run
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert proc.returncode == 130, output[-3000:]
  assert output.strip().splitlines()[-1].startswith("interrupted: the finished trials are kept in the study")
  (log,) = logs()  # no second candidate was started
  stopped = int(re.search(r"interrupted by SIGINT at step (\d+); checkpoint \1 saved", log.read_text()).group(1))
  assert (log.parent / "checkpoints" / str(stopped) / "commit_success.txt").exists()

