"""Every script in scripts/ imports: a name moved or removed elsewhere breaks a script no other test runs end to end
(uptrain_experiment.py imported three names that the sweep rewrite had removed); and the benchmarks run end to end at
toy sizes, their printed figures consistent with what they measure (scripts/bench_attention.py's CPU check takes
minutes and is the kernels' own tests; scripts/bench_loop.py trains the default experiment)."""

import json
import re
import subprocess
import sys

import pytest

from conftest import REPO
from jaxshare.sweep.provenance import render_table

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


def test_data_benchmark_prints_its_tables_and_publishes_what_it_printed(tmp_path):
  """scripts/bench_data.py end to end at toy sizes, two rounds: both preparations agree on the token count (it
  asserts so), every table prints, each ratio is a median inside its range over the rounds, and --results keeps
  the printed tables with the command, which renders them back."""
  command = ["scripts/bench_data.py", "--size-mb", "1", "--tokenizers", "byte", "--rounds", "2", "--startup-gb",
             "0.01", "--skip", "loader", "--results", str(tmp_path / "data")]
  out = _run_script(*command)
  rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| byte")]
  assert [r[1] for r in rows] == ["1", "2"], out
  for row in rows:
    for cell in row[5:7]:  # jaxshare / peer, and against the peer's 1-worker speed: "1.23x (1.10-1.40)"
      median, low, high = map(float, re.fullmatch(r"([\d.]+)x \(([\d.]+)-([\d.]+)\)", cell).groups())
      assert low <= median <= high
  assert any(ln.startswith("| 0.01 GB | 1 |") for ln in out.splitlines()), out
  published = json.loads((tmp_path / "data" / "table.json").read_text())
  assert published["provenance"]["commands"] == [["python", *command]]
  start = out.splitlines().index(published["lines"][0])
  assert out.splitlines()[start:] == published["lines"] == render_table(tmp_path / "data", REPO)[:-2]


def test_data_benchmark_reads_the_same_data_from_a_bucket_and_from_disk():
  """scripts/bench_data.py --remote local: a real GCS server on loopback; both rows print with a loader speed."""
  proc = subprocess.run([sys.executable, "scripts/bench_data.py", "--remote", "local", "--skip", "prepare", "startup",
                         "loader"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [ln.split("|") for ln in proc.stdout.splitlines() if ln.startswith(("| local disk", "| bucket"))]
  assert [r[1].strip().split()[0] for r in rows] == ["local", "bucket"], proc.stdout
  assert all(float(r[4].replace(",", "")) > 0 for r in rows)


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


def _run_script(*argv: str, timeout: int = 600) -> str:
  proc = subprocess.run([sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=timeout)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def test_compile_benchmark_tables_each_preset_with_its_ratio(tmp_path):
  """scripts/bench_compile.py at two toy depths: one row per preset, its ratio the deeper compile over the
  shallower, under a remat policy given as an override; --results keeps the printed table with the command, which
  renders it back."""
  command = ["scripts/bench_compile.py", "--layers", "2", "4", "--only", "dense", "cla2", "--override",
             "model.remat=full", "--results", str(tmp_path / "compile")]
  out = _run_script(*command)
  published = json.loads((tmp_path / "compile" / "table.json").read_text())
  assert published["provenance"]["commands"] == [["python", *command]]
  rendered = render_table(tmp_path / "compile", REPO)
  assert rendered[:-2] == published["lines"] == out.splitlines()[-4:]
  assert rendered[-1].startswith(f"Rendered by scripts/render_results.py from {tmp_path / 'compile'}/table.json: "
                                 f"`python {' '.join(command)}` at commit ")
  rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in out.splitlines() if ln.startswith("| dense")
          or ln.startswith("| cla2")]
  assert [r[0] for r in rows] == ["dense", "cla2"], out
  for _, shallow, deep, ratio in rows:
    # the table rounds the seconds to 10 ms and the ratio to 0.01: the ratio is of the unrounded times, within the
    # bounds the rounding leaves (0.26 s and 0.29 s print 1.15x: a relative tolerance failed on that)
    shallow, deep, ratio = float(shallow), float(deep), float(ratio.rstrip("x"))
    assert shallow > 0 and (deep - 0.005) / (shallow + 0.005) - 0.005 <= ratio <= (deep + 0.005) / (shallow - 0.005) + 0.005


def test_decode_benchmark_measures_the_cache_the_accounting_predicts(tmp_path):
  """scripts/bench_decode.py on two schedules: the live cache's bytes per token equal the accounting's, CLA2 halves
  dense's, and the largest batch is the budget over one row's cache at that context."""
  out = tmp_path / "decode"
  _run_script("scripts/bench_decode.py", "--schedules", "dense", "cla2", "--contexts", "32", "--batch", "2",
              "--steps", "2", "--prefill", "16", "--budget-gib", "0.001", "--max-batch-context", "64",
              "--no-max-batch-timing", "--out", str(out))
  rows = {r["name"]: r for r in json.loads((out / "decode.json").read_text())["rows"]}
  for r in rows.values():
    assert r["kv_bytes_per_token_measured"] == r["kv_bytes_per_token"]
    assert r["max_batch"] == int(0.001 * 2 ** 30) // (r["kv_bytes_per_token"] * 64)
    assert r["decode"][0]["tokens_per_s"] > 0
  assert rows["cla2"]["kv_bytes_per_token"] * 2 == rows["dense"]["kv_bytes_per_token"]
  assert "| cla2 |" in (out / "decode.md").read_text()


def test_decode_benchmark_in_pytorch_measures_the_cache_the_accounting_predicts(tmp_path):
  """scripts/bench_decode.py --torch at toy sizes: the exported models run by PyTorch alone hold the cache bytes the
  accounting predicts (CLA2 half of dense's), and --results keeps the printed table with the command."""
  command = ["scripts/bench_decode.py", "--torch", "--schedules", "dense", "cla2", "--torch-batch", "2",
             "--torch-context", "16", "--torch-new-tokens", "2", "--out", str(tmp_path / "out"), "--results",
             str(tmp_path / "decode_torch")]
  out = _run_script(*command)
  rows = {r["name"]: r for r in json.loads((tmp_path / "out" / "decode_torch.json").read_text())["rows"]}
  assert {n: (r["cache_bytes_per_token"], r["accounting_bytes_per_token"]) for n, r in rows.items()} == {
    "dense": (8192, 8192), "cla2": (4096, 4096)}
  published = json.loads((tmp_path / "decode_torch" / "table.json").read_text())
  assert published["provenance"]["commands"] == [["python", *command]]
  assert out.splitlines()[-len(published["lines"]):] == published["lines"]
  assert published["lines"][-1] == "Measured cache bytes equal the accounting's for every schedule: True"


def test_full_lisa_benchmark_reports_both_paths_and_their_ratios():
  """scripts/bench_full_lisa.py at one short length: both score-sharing paths compile and run, and the printed
  ratios are those of the printed figures."""
  out = _run_script("scripts/bench_full_lisa.py", "--lengths", "128", "--repeats", "1")
  m = re.search(r"materialize\s+([\d.]+) MiB\s+(\d+) ms \| recompute\s+([\d.]+) MiB\s+(\d+) ms \| "
                r"memory ([\d.]+)x less, time ([\d.]+)x", out)
  assert m, out
  mem_m, ms_m, mem_r, ms_r, less, slower = map(float, m.groups())
  assert less == pytest.approx(mem_m / mem_r, abs=0.06) and slower == pytest.approx(ms_r / ms_m, rel=0.05, abs=0.02)


def test_convert_benchmark_reports_import_and_export_memory():
  """scripts/bench_convert.py on a toy checkpoint: the checkpoint's size, the baseline, and a peak-memory line for
  each conversion, as multiples of the weights."""
  out = _run_script("scripts/bench_convert.py", "--layers", "2", "--d-model", "64", "--vocab", "256")
  assert re.search(r"checkpoint: [\d.]+M parameters", out) and "baseline (import jax)" in out, out
  for name in ("import", "export"):
    assert re.search(rf"^{name}\s+peak RSS [\d.]+ GiB = baseline \+ -?[\d.]+ x weights", out, re.M), out


def test_loop_benchmark_refuses_a_round_too_short_to_time():
  """scripts/bench_loop.py times the loop after its first logging interval; fewer steps than two intervals is refused
  by name before anything trains (it raised an IndexError after training)."""
  proc = subprocess.run([sys.executable, "scripts/bench_loop.py", "--steps", "4"], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 2 and "--steps 4" in proc.stderr and "train.log_every" in proc.stderr, proc.stderr[-2000:]


def test_main_job_publishes_what_eval_reports_and_the_curve_it_logged(tmp_path):
  """scripts/main_job.py on a short run of the default experiment: the published row is eval.py's report of the run
  (run again here), the line under it the validation curve of its metrics.jsonl, and the file names the command; a
  run directory that exists is refused before anything trains (a resumed run's time is not the job's)."""
  run, results = tmp_path / "run", tmp_path / "main_job"
  command = ["scripts/main_job.py", "train.steps=4", "train.warmup_steps=1", "train.eval_every=2", "train.log_every=1",
             "train.eval_batches=2", "train.batch_size=8", "data.seq_len=32", f"train.run_dir={run}",
             "--results", str(results)]
  _run_script(*command)
  published = json.loads((results / "table.json").read_text())
  assert published["provenance"]["commands"] == [["python", *command]]
  report = json.loads(_run_script("eval.py", "report", str(run), "--json", "--sample-tokens", "0").splitlines()[-1])
  cells = [c.strip() for c in published["lines"][2].strip("|").split("|")]
  assert cells[0] == "`shakespeare_cla2`" and cells[1] == report["schedule"].split(" | ")[0]
  assert cells[2:] == [f"{report['num_params']:,}", f"{report['kv_bytes_per_token']:,} B/token (float32)",
                       "4 × 256", f"{report['val_loss']:.4f} nats/token", f"{report['bits_per_byte']:.4f}"]
  curve = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines() if "val_loss" in ln]
  assert published["lines"][4].startswith(f"Validation during training (2 batches) at steps 2/4: "
                                          f"{curve[0]['val_loss']:.3f} / {curve[1]['val_loss']:.3f}. train.py took ")
  again = subprocess.run([sys.executable, *command], cwd=REPO, capture_output=True, text=True, timeout=300)
  assert again.returncode == 2 and f"train.run_dir {run} exists" in again.stderr
