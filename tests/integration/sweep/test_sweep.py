"""The sweep tool: spec parsing, grid and seed expansion, tables, launch commands (pure), and one tiny sweep end to end
(trains, evaluates, tabulates, plots; skips finished runs; records failures; keeps results it does not own)."""

import csv
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import REPO
from jaxshare.sweep.__main__ import main
from jaxshare.sweep import publish
from jaxshare.sweep.devices import DeviceGroup, device_groups, split_devices
from jaxshare.sweep.launch import LAUNCHERS
from jaxshare.sweep.results import markdown_table, mean_std, merge_rows, read_results, summarize
from jaxshare.sweep.spec import SweepError, check_config, grid_variants, load_sweep


TINY = ["model.num_layers=2", "model.d_model=32", "model.mlp_dim=64", "data.seq_len=32", "train.batch_size=8",
        "train.steps=2", "train.warmup_steps=1", "train.eval_every=2", "train.eval_batches=1", "train.log_every=1",
        "train.progress_bar=false", "data.val_fraction=0.01"]


def _spec(tmp_path: Path, body: str, name: str = "sweep.yaml") -> Path:
  path = tmp_path / name
  path.write_text(f"experiment: configs/experiments/sharing_base.yaml\nrun_root: {tmp_path / 'runs'}\n{body}")
  return path


# ------------------------------------------------------------------------------------------------ pure: the spec


def test_grid_expands_the_cross_product_with_readable_names():
  variants = grid_variants({"schedule.factor": [1, 2], "schedule.kv_heads": [1, 4],
                            "schedule.lisa.layers": [[1, 2]]})
  assert list(variants) == ["factor=1,kv_heads=1,layers=1-2", "factor=1,kv_heads=4,layers=1-2",
                            "factor=2,kv_heads=1,layers=1-2", "factor=2,kv_heads=4,layers=1-2"]
  assert variants["factor=2,kv_heads=1,layers=1-2"] == ["schedule.factor=2", "schedule.kv_heads=1",
                                                        "schedule.lisa.layers=[1,2]"]
  # keys with the same last part keep their whole name
  assert list(grid_variants({"schedule.sa.start": [1], "schedule.uniattn.start": [2]})) == [
    "schedule.sa.start=1,schedule.uniattn.start=2"]


def test_seeds_give_one_run_each_in_its_own_directory(tmp_path):
  spec = load_sweep(_spec(tmp_path, "base: [train.steps=3]\nseeds: [0, 7]\nvariants:\n  dense: []\n"
                          "grid:\n  schedule.kv_heads: [1, 2]\n"))
  runs = spec.runs()
  assert [(r.variant, r.seed) for r in runs] == [("dense", 0), ("dense", 7), ("kv_heads=1", 0), ("kv_heads=1", 7),
                                                 ("kv_heads=2", 0), ("kv_heads=2", 7)]
  assert runs[3].run_dir == tmp_path / "runs" / "kv_heads=1" / "seed7"
  assert runs[3].train_overrides() == ["train.steps=3", "schedule.kv_heads=1", "train.seed=7",
                                       f"train.run_dir={tmp_path / 'runs' / 'kv_heads=1' / 'seed7'}"]
  # without seeds: one run per variant at the experiment's seed, in <run_root>/<variant>
  plain = load_sweep(_spec(tmp_path, "variants:\n  dense: []\n", "plain.yaml")).runs()
  assert [(r.seed, r.run_dir) for r in plain] == [(None, tmp_path / "runs" / "dense")]


@pytest.mark.parametrize("body, message", [
  ("variants: [a, b]\n", "'variants' must be a mapping"),
  ("variants:\n  dense: schedule.kind=cla\n", "variants.dense must be a list of key=value"),
  ("seeds: 3\nvariants:\n  dense: []\n", "'seeds' must be a non-empty list of distinct integers"),
  ("grid:\n  schedule.factor: 2\n", "grid.schedule.factor must map a dotted config key to a non-empty list"),
  ("variant:\n  dense: []\n", "unknown key(s) variant; allowed: experiment"),
  ("", "needs 'variants'"),
  ("variants:\n  a/b: []\n", "variant name 'a/b' is invalid"),
  ("variants:\n  dense: []\nseries:\n  MHA: [dens]\n", "series.MHA names 'dens', which is not a variant"),
])
def test_malformed_sweep_files_name_the_key(tmp_path, capsys, body, message):
  assert main([str(_spec(tmp_path, body))]) == 2
  err = capsys.readouterr().err
  assert message in err and "sweep.yaml" in err


def test_missing_keys_and_non_yaml_exit_2(tmp_path, capsys):
  (tmp_path / "no_root.yaml").write_text("experiment: configs/experiments/sharing_base.yaml\nvariants: {a: []}\n")
  (tmp_path / "bad.yaml").write_text("variants: [unclosed\n")
  assert main([str(tmp_path / "no_root.yaml")]) == 2
  assert "'run_root' is missing" in capsys.readouterr().err
  assert main([str(tmp_path / "bad.yaml")]) == 2
  assert "is not valid YAML" in capsys.readouterr().err
  assert main([str(tmp_path / "absent.yaml")]) == 2
  assert "cannot read sweep file" in capsys.readouterr().err


def test_every_shipped_sweep_run_has_a_valid_config():
  """Each variant of configs/sweeps/*.yaml composes, validates and compiles its schedule (no training)."""
  files = sorted((REPO / "configs" / "sweeps").glob("*.yaml"))
  assert {"mlkv_ladder", "cla_design_space", "uniattn_blocks", "lisa_rank"} <= {f.stem for f in files}
  for f in files:
    spec = load_sweep(f)
    for run in {r.variant: r for r in spec.runs()}.values():  # a seed changes no shape
      cfg, _ = check_config(spec, run)
      assert cfg.train.run_dir == str(run.run_dir)


def test_the_docs_count_each_shipped_sweeps_runs():
  """docs/sweeps.md's table of the shipped sweeps gives each file's number of runs (variants x seeds); it said 14 for
  the MLKV ladder after the ladder went to four seeds (28)."""
  rows = {}
  for line in (REPO / "docs" / "sweeps.md").read_text().splitlines():
    m = re.match(r"\| `(\w+)\.yaml` \|.*\| (\d+) \|$", line)
    if m:
      rows[m.group(1)] = int(m.group(2))
  files = {f.stem: f for f in (REPO / "configs" / "sweeps").glob("*.yaml")}
  assert set(rows) == set(files)
  assert rows == {name: len(load_sweep(f).runs()) for name, f in files.items()}


def test_check_reports_an_invalid_override(tmp_path, capsys):
  spec = _spec(tmp_path, "variants:\n  ok: []\n  bad: [schedule.kind=cla, schedule.factor=9]\n")
  assert main([str(spec), "--check"]) == 2
  out = capsys.readouterr().out
  assert "INVALID bad: schedule.factor=9 is invalid" in out and "ok ok:" in out


# ----------------------------------------------------------------------------------------------- pure: the table


def test_mean_std_formatting():
  assert mean_std([]) == "—"
  assert mean_std([1.23456]) == "1.2346"
  assert mean_std([1.0, 2.0]) == "1.5000 ± 0.7071"  # sample std (n - 1)
  assert mean_std([2.0, 2.0, 2.0], digits=2) == "2.00 ± 0.00"


def test_table_rows_merge_by_variant_and_seed(tmp_path):
  legacy = tmp_path / "results.csv"  # written by the sweep script before seeds: a name column, one run each
  legacy.write_text("name,val_loss,bits_per_byte,kv_bytes_per_token_bf16,num_params\ndense,1.7,2.4,3072,99\n")
  assert read_results(legacy)[0] == [{"variant": "dense", "seed": "", "status": "ok", "val_loss": "1.7",
                                      "bits_per_byte": "2.4", "kv_bytes_per_token_bf16": "3072",
                                      "num_params": "99"}]
  old = [{"variant": "a", "seed": "0", "status": "ok"}, {"variant": "b", "seed": "0", "status": "ok"}]
  new = [{"variant": "a", "seed": 0, "status": "failed"}, {"variant": "a", "seed": 1, "status": "ok"}]
  assert [(r["variant"], str(r["seed"]), r["status"]) for r in merge_rows(old, new)] == [
    ("a", "0", "failed"), ("b", "0", "ok"), ("a", "1", "ok")]
  rows = [{"variant": "a", "seed": s, "status": "ok", "val_loss": v, "bits_per_byte": v, "num_params": 10,
           "kv_bytes_per_token_bf16": 512} for s, v in ((0, 2.0), (1, 2.2))]
  rows.append({"variant": "a", "seed": 2, "status": "failed"})
  table = markdown_table(summarize(rows, ["a"]))
  assert "| a | 2/3 (failed) | 2.1000 ± 0.1414 | 2.1000 ± 0.1414 | 512 | 10 |" in table


# ------------------------------------------------------------------------------------- pure: devices and launching


def test_device_groups_split_devices_per_platform():
  assert split_devices(["0", "1", "2", "3"], 2, "gpu") == [["0", "1"], ["2", "3"]]
  assert split_devices(["0", "1", "2"], 2, "cpu") == [["0", "1"], ["2"]]
  with pytest.raises(SweepError, match="must divide the 3 gpu devices"):
    split_devices(["0", "1", "2"], 2, "gpu")
  gpu = device_groups(2, "4,5,6,7", "gpu")
  assert [dict(g.env) for g in gpu] == [{"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "6,7"}]
  tpu = [dict(g.env) for g in device_groups(2, "0,1,2,3", "tpu")]
  assert tpu[1]["TPU_VISIBLE_CHIPS"] == "2,3" and tpu[1]["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
  assert tpu[0]["TPU_PROCESS_BOUNDS"] == "1,1,1" and tpu[0]["TPU_PROCESS_PORT"] != tpu[1]["TPU_PROCESS_PORT"]
  assert device_groups(2, "0,1", "cpu")[1].prefix == ("taskset", "-c", "1")
  assert device_groups(1, None, "cpu") == [DeviceGroup()]  # no confinement by default


def test_launch_slurm_dry_run_prints_one_launcher_command_per_run(tmp_path, capsys):
  spec = _spec(tmp_path, "seeds: [0, 1]\nvariants:\n  dense: []\ngrid:\n  schedule.factor: [2]\n")
  assert main([str(spec), "--launch", "slurm", "--dry-run", "--launcher-args",
               "--nodes 1 --gpus-per-node 8"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 4
  for line, (variant, seed) in zip(lines, [("dense", 0), ("dense", 1), ("factor=2", 0), ("factor=2", 1)]):
    args = shlex.split(line)
    assert args[0].endswith("scripts/launch_slurm.sh")
    assert args[args.index("--run-name") + 1] == f"sweep-{variant.replace('=', '_')}-s{seed}"
    assert args[args.index("--nodes") + 1] == "1" and args[args.index("--gpus-per-node") + 1] == "8"
    overrides = args[args.index("--") + 1:]
    run_dir = tmp_path / "runs" / variant / f"seed{seed}"
    assert f"train.seed={seed}" in overrides and overrides[-1] == f"train.run_dir={run_dir}"
  assert not (tmp_path / "runs").exists()  # nothing ran, nothing written
  launcher = REPO / LAUNCHERS["slurm"]
  if launcher.is_file():  # the launcher takes the command: its batch script trains in the sweep's run directory
    args = shlex.split(lines[-1])
    out = subprocess.run(["bash", args[0], "--dry-run", *args[1:]], capture_output=True, text=True, check=True).stdout
    assert f"train.run_dir={run_dir}" in out.replace("\\", "")
  assert main([str(spec), "--launch", "slurm", "--launcher-args", "--run-name x"]) == 2
  assert "--run-name is not allowed (the sweep names each run)" in capsys.readouterr().err


def test_launch_slurm_submits_one_job_per_run(tmp_path, monkeypatch, capsys):
  if not (REPO / LAUNCHERS["slurm"]).is_file():
    pytest.skip("scripts/launch_slurm.sh is not there")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "sbatch").write_text(f"#!/bin/sh\necho \"$1\" >> {tmp_path / 'submitted'}\necho Submitted batch job 1\n")
  (bin_dir / "sbatch").chmod(0o755)
  monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
  spec = _spec(tmp_path, "seeds: [3]\nvariants:\n  dense: []\n  cla2: [schedule.kind=cla]\n")
  assert main([str(spec), "--launch", "slurm", "--launcher-args",
               f"--nodes 1 --gpus-per-node 1 --log-dir {tmp_path / 'slurm'}"]) == 0
  scripts = (tmp_path / "submitted").read_text().split()
  assert [Path(p).name for p in scripts] == ["sweep-dense-s3.sbatch", "sweep-cla2-s3.sbatch"]
  assert f"train.run_dir={tmp_path / 'runs' / 'cla2' / 'seed3'}" in Path(scripts[1]).read_text()
  assert "--collect" in capsys.readouterr().out
  assert not (tmp_path / "runs" / "results.csv").exists()  # nothing finished yet: no rows


# ------------------------------------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def swept(tmp_path_factory):
  """dense and cla2 trained for 2 steps, two at a time, published to <tmp>/published; `broken` (a missing corpus:
  train.py exits 2) not yet run."""
  tmp = tmp_path_factory.mktemp("sweep")
  spec = _spec(tmp, f"base: {TINY}\nseeds: [0]\nvariants:\n  dense: []\n  cla2: [schedule.kind=cla]\n"
                    "  broken: [data.path=no_such_corpus.txt]\n")
  code = main([str(spec), "--only", "dense", "cla2", "--parallel", "2", "--results", str(tmp / "published")])
  return spec, tmp / "runs", code


def test_sweep_trains_evaluates_tabulates_and_plots(swept):
  spec, root, code = swept
  assert code == 0
  rows = list(csv.DictReader((root / "results.csv").open()))[:2]  # (a later test may add broken's row)
  assert [(r["variant"], r["seed"], r["status"]) for r in rows] == [("dense", "0", "ok"), ("cla2", "0", "ok")]
  assert int(rows[1]["kv_bytes_per_token_bf16"]) * 2 == int(rows[0]["kv_bytes_per_token_bf16"])
  assert all(r["step"] == "2" and float(r["val_loss"]) > 0 for r in rows)
  assert (root / "dense" / "seed0" / "eval.json").is_file()
  md = (root / "results.md").read_text()
  assert "| cla2 | 1/1 |" in md and "| dense | 1/1 |" in md
  assert (root / "loss_vs_kv.png").stat().st_size > 0 and (root / "loss_vs_params.png").stat().st_size > 0


def test_second_invocation_skips_finished_runs(swept, capsys):
  spec, root, _ = swept
  ckpt = root / "dense" / "seed0" / "checkpoints" / "2"
  stamps = [p.stat().st_mtime_ns for p in (ckpt, root / "dense" / "seed0" / "eval.json")]
  capsys.readouterr()
  assert main([str(spec), "--only", "dense", "cla2"]) == 0
  out = capsys.readouterr().out
  assert out.count("skipped (finished at step 2") == 2 and "training" not in out
  assert [p.stat().st_mtime_ns for p in (ckpt, root / "dense" / "seed0" / "eval.json")] == stamps


def test_published_rows_carry_their_commands_and_render_the_table(swept, capsys):
  """--results: each finished run's file holds its row and the commands that re-make it (relative to the
  repository, the interpreter as python), the commit and the measure; the table renders from the files alone, in the
  sweep's order; a skipped run's file is not rewritten, a failed run writes none, and a changed variant is refused."""
  spec, root, _ = swept
  published = root.parent / "published"
  assert sorted(p.name for p in (published / "rows").iterdir()) == ["cla2-seed0.json", "dense-seed0.json"]
  table = {r["variant"]: r for r in csv.DictReader((root / "results.csv").open())}
  dense = json.loads((published / "rows" / "dense-seed0.json").read_text())
  assert dense["val_loss"] == float(table["dense"]["val_loss"]) and dense["step"] == 2 and dense["seed"] == 0
  train, evaluate = dense["provenance"]["commands"]
  assert train[:4] == ["python", "train.py", "--config", "configs/experiments/sharing_base.yaml"]
  assert train[-1] == f"train.run_dir={root / 'dense' / 'seed0'}" and "train.seed=0" in train
  assert evaluate == ["python", "eval.py", str(root / "dense" / "seed0"), "--json", "--sample-tokens", "0"]
  assert dense["provenance"]["commit"] == subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                         capture_output=True, text=True).stdout.strip()
  assert "whole validation split" in dense["provenance"]["measure"]
  lines = publish.render(published)
  cla2 = json.loads((published / "rows" / "cla2-seed0.json").read_text())
  assert lines[2:4] == [
    f"| dense | (the experiment as it is) | 0 | {dense['val_loss']:.4f} | {dense['kv_bytes_per_token_bf16']:,} | "
    f"{dense['num_params']:,} |",
    f"| cla2 | `schedule.kind=cla` | 0 | {cla2['val_loss']:.4f} | {cla2['kv_bytes_per_token_bf16']:,} | "
    f"{cla2['num_params']:,} |"]
  stamp = (published / "rows" / "dense-seed0.json").stat().st_mtime_ns
  assert main([str(spec), "--only", "dense", "broken", "--results", str(published)]) == 1  # broken fails
  assert (published / "rows" / "dense-seed0.json").stat().st_mtime_ns == stamp
  assert not (published / "rows" / "broken-seed0.json").exists()
  changed = spec.parent / "changed.yaml"
  changed.write_text(spec.read_text().replace("[schedule.kind=cla]", "[schedule.kind=cla, schedule.factor=3]"))
  capsys.readouterr()
  assert main([str(changed), "--only", "cla2", "--results", str(published)]) == 2
  assert "variant cla2's rows were made with ['schedule.kind=cla']" in capsys.readouterr().err


def test_only_with_an_unknown_name_exits_2_and_leaves_results(swept, capsys):
  spec, root, _ = swept
  before = (root / "results.csv").read_bytes(), (root / "results.csv").stat().st_mtime_ns
  assert main([str(spec), "--only", "dense", "cla3"]) == 2
  err = capsys.readouterr().err
  assert "--only cla3: no such variant" in err and "known: dense, cla2, broken" in err
  assert ((root / "results.csv").read_bytes(), (root / "results.csv").stat().st_mtime_ns) == before


def test_a_failing_run_is_recorded_and_the_others_kept(swept, capsys):
  spec, root, _ = swept
  assert main([str(spec), "--only", "broken", "dense"]) == 1  # dense is skipped, broken fails
  rows = {r["variant"]: r for r in csv.DictReader((root / "results.csv").open())}
  assert [rows[v]["status"] for v in ("dense", "cla2", "broken")] == ["ok", "ok", "failed"]  # cla2 kept
  assert rows["broken"]["error"].startswith("train.py exit 2: error:") and "no_such_corpus" in rows["broken"]["error"]
  assert "no_such_corpus" in (root / "broken" / "seed0" / "sweep.log").read_text()
  md = (root / "results.md").read_text()
  assert "| broken | 0/1 (failed) | — |" in md and "| cla2 | 1/1 |" in md
  assert "FAILED" in capsys.readouterr().out


def test_collect_evaluates_finished_runs_and_trains_nothing(swept, tmp_path, capsys):
  spec, root, _ = swept
  shutil.copytree(root, tmp_path / "runs")  # a copy: the other tests keep their state
  (tmp_path / "runs" / "dense" / "seed0" / "eval.json").unlink()  # trained (e.g. on a cluster), not evaluated
  copy = tmp_path / "sweep.yaml"
  copy.write_text(spec.read_text().replace(str(root), str(tmp_path / "runs")))
  capsys.readouterr()
  assert main([str(copy), "--collect"]) == 1  # broken never trained: incomplete
  out = capsys.readouterr().out
  assert "dense/seed0: evaluating (step 2)" in out and "cla2/seed0: skipped" in out
  assert "broken/seed0: not finished (step None of 2)" in out
  rows = {r["variant"]: r for r in csv.DictReader((tmp_path / "runs" / "results.csv").open())}
  assert [rows[v]["status"] for v in ("dense", "cla2", "broken")] == ["ok", "ok", "incomplete"]
  assert (tmp_path / "runs" / "dense" / "seed0" / "eval.json").is_file()
  assert not (tmp_path / "runs" / "broken" / "seed0" / "checkpoints").exists()


def test_ctrl_c_saves_the_running_run_and_records_it_as_interrupted(tmp_path):
  """Ctrl-C reaches the sweep and its train.py together (one process group): the run saves a checkpoint, and the
  table says interrupted (it said failed, with the run's summary line as the error); the next sweep resumes it.

  The sweep starts with SIGINT ignored, as a shell without job control starts `make test &` and everything under
  it: train.py set its own handler and stopped, but the sweep, keeping the inherited SIG_IGN, went on to its
  table (exit 1) and would have started the next run."""
  spec = _spec(tmp_path, "base: [" + ", ".join(TINY + ["train.steps=100000", "train.checkpoint_every=100000"])
               + "]\nvariants:\n  dense: []\n")
  proc = subprocess.Popen([os.sys.executable, "-m", "jaxshare.sweep", str(spec)], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
  log = tmp_path / "runs" / "dense" / "sweep.log"
  deadline = time.time() + 180
  while not (log.exists() and re.search(r"^step +3/", log.read_text(), re.M)) and time.time() < deadline:
    time.sleep(0.1)
  os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
  out, _ = proc.communicate(timeout=180)
  assert proc.returncode == 130, out
  stopped = int(re.search(r"interrupted by SIGINT at step (\d+); checkpoint \1 saved", log.read_text()).group(1))
  assert (tmp_path / "runs" / "dense" / "checkpoints" / str(stopped) / "commit_success.txt").exists()
  row = read_results(tmp_path / "runs" / "results.csv")[0][0]
  assert row["status"] == "interrupted" and row["error"] == (
    f"stopped by a signal at step {stopped} with a checkpoint; run the sweep again to resume it")


_SLOW_TO_STOP = """
import signal, sys, time
def stop(signum, frame):
  time.sleep(1.5)  # a run finishing its step and writing its checkpoint
  print("checkpoint saved", flush=True)
  sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("training", flush=True)
time.sleep(120)
"""

_CALLER = """
import sys
from pathlib import Path
from jaxshare import exit_codes
from jaxshare.sweep.devices import DeviceGroup
from jaxshare.sweep.runner import call

exit_codes.interrupt_on_ctrl_c()
try:
  call(DeviceGroup(), [sys.executable, "-c", sys.argv[2]], Path(sys.argv[1]))
except KeyboardInterrupt:
  print("caller interrupted", flush=True)
  sys.exit(130)
"""


def test_ctrl_c_in_the_thread_that_started_a_run_waits_for_its_checkpoint(tmp_path):
  """A run started from the main thread (the search's trials, n_jobs=1) gets the terminal's Ctrl-C alongside its
  caller: the caller waits for it to save and exit before it stops. subprocess.run waited 0.25 s, then SIGKILLed the
  run mid-save (CI, under load: no checkpoint, no "interrupted at step" line)."""
  log = tmp_path / "sweep.log"
  proc = subprocess.Popen([os.sys.executable, "-c", _CALLER, str(log), _SLOW_TO_STOP], cwd=REPO, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
  try:
    deadline = time.time() + 180  # the caller imports jaxshare first: seconds alone, longer under the suite's load
    while not (log.exists() and "\ntraining\n" in log.read_text()):
      assert time.time() < deadline, "the run never started"
      time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
    out, _ = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      os.killpg(proc.pid, signal.SIGKILL)
  assert (proc.returncode, out.strip()) == (130, "caller interrupted"), out
  assert log.read_text().rstrip().endswith("training\ncheckpoint saved")


def test_a_sweep_whose_run_root_is_on_a_bucket_trains_tabulates_and_resumes_there(gcs, tmp_path, capsys):
  """run_root on gs:// (a real GCS server: the gcs fixture): the runs, their sweep.log and eval.json, results.csv,
  results.md and the plots are objects on the bucket; a failing run's log is there too; run again, nothing reruns."""
  spec = tmp_path / "sweep.yaml"
  spec.write_text(f"experiment: configs/experiments/sharing_base.yaml\nrun_root: gs://runs/sweep\nbase: {TINY}\n"
                  "variants:\n  dense: []\n  broken: [data.path=no_such_corpus.txt]\n")
  assert main([str(spec)]) == 1  # broken fails
  names = set(gcs.objects("runs", "sweep/"))
  assert {"sweep/results.csv", "sweep/results.md", "sweep/loss_vs_kv.png", "sweep/loss_vs_params.png",
          "sweep/dense/eval.json", "sweep/dense/sweep.log", "sweep/dense/config.yaml",
          "sweep/dense/checkpoints/2/commit_success.txt", "sweep/broken/sweep.log"} <= names
  from etils import epath

  rows = list(csv.DictReader(io.StringIO(epath.Path("gs://runs/sweep/results.csv").read_text())))
  assert [(r["variant"], r["status"]) for r in rows] == [("dense", "ok"), ("broken", "failed")]
  assert "no_such_corpus.txt" in rows[1]["error"]
  log = epath.Path("gs://runs/sweep/dense/sweep.log").read_text()
  assert "train.py" in log and "eval.py" in log and "step      2/2" in log
  capsys.readouterr()
  assert main([str(spec), "--only", "dense"]) == 0
  assert "skipped (finished at step 2" in capsys.readouterr().out
  assert epath.Path("gs://runs/sweep/dense/sweep.log").read_text() == log  # nothing ran


def test_published_plots_are_drawn_from_the_row_files(swept, monkeypatch):
  """publish.plot (what scripts/render_results.py redraws): one point per variant at its row's loss and KV bytes,
  both images written into the results directory."""
  from jaxshare.analysis import plots

  published = swept[1].parent / "published"
  drawn, save = [], plots._save
  monkeypatch.setattr(plots, "_save", lambda fig, path: (drawn.append(fig), save(fig, path)))
  paths = publish.plot(published)
  assert [p.name for p in paths] == ["loss_vs_kv.png", "loss_vs_params.png"] and all(p.stat().st_size for p in paths)
  rows = {r["variant"]: r for r in publish.load(published)[1]}
  points = sorted(tuple(map(float, c.get_offsets()[0])) for c in drawn[0].axes[0].collections if len(c.get_offsets()))
  assert points == sorted((float(r["kv_bytes_per_token_bf16"]), r["val_loss"]) for r in rows.values())
