"""Every script in scripts/ imports: a name moved or removed elsewhere breaks a script no other test runs end to end
(uptrain_experiment.py imported three names that the sweep rewrite had removed)."""

import subprocess
import sys

from conftest import REPO

_IMPORT_ALL = """
import importlib.util, pathlib, sys
sys.path.insert(0, "scripts")
for path in sorted(pathlib.Path("scripts").glob("*.py")):
  spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
  spec.loader.exec_module(importlib.util.module_from_spec(spec))  # main() stays behind its __main__ guard
  print(path.name)
"""


def test_every_script_imports():
  proc = subprocess.run([sys.executable, "-c", _IMPORT_ALL], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert set(proc.stdout.split()) == {p.name for p in (REPO / "scripts").glob("*.py")}


def test_data_benchmark_prints_its_tables():
  """scripts/bench_data.py end to end at toy sizes: both preparations agree on the token count (it asserts so) and
  every table prints."""
  proc = subprocess.run([sys.executable, "scripts/bench_data.py", "--size-mb", "1", "--tokenizers", "byte",
                         "--startup-gb", "0.01", "--skip", "loader"], cwd=REPO, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| byte") or ln.startswith("| 0.01 GB")]
  assert len(rows) == 3, proc.stdout


def test_mfu_benchmark_measures_every_schedule(capsys):
  """scripts/bench_mfu.py on a toy config (CPU): a row with tokens/s, MFU and a finite loss, and a failing schedule
  reported on its own line without stopping the others."""
  sys.path.insert(0, str(REPO / "scripts"))
  import bench_mfu
  bench_mfu.main(["--config", str(REPO / "configs/experiments/shakespeare_dense.yaml"), "--schedules", "uniattn",
                  "dense", "--impls", "xla", "--batch", "8", "--seq-len", "32", "--steps", "1"])
  rows = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
  assert "FAILED ScheduleError" in rows["uniattn"]  # the 1B superblock placement does not fit 4 layers
  assert "tok/s" in rows["dense"] and "MFU" in rows["dense"], rows
  assert 0 < float(rows["dense"].split("loss")[1]) < 10, rows


def test_attention_tuning_sweeps_and_names_the_best_launch(capsys):
  """scripts/tune_attention.py without a GPU: the tile sweep in interpret mode against XLA attention, a timing line
  per configuration and the best per phase (the GPU figures it produced are in docs/gpu.md)."""
  sys.path.insert(0, str(REPO / "scripts"))
  import tune_attention
  tune_attention.main(["--lengths", "64", "--widths", "32", "--blocks", "32", "64", "--warps", "4", "--stages", "2",
                       "--batch", "1", "--heads", "2", "--repeats", "1"])
  out = capsys.readouterr().out
  assert len([ln for ln in out.splitlines() if ln.strip().startswith("bq=")]) == 4, out
  assert "best forward: bq=" in out and "x xla" in out, out
