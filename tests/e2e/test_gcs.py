"""Runs on a bucket, against a real GCS server process (fake-gcs-server, tests/support/gcs.py): a run directory on
gs:// (config, metrics, TensorBoard events, checkpoints, the iterator state) written, resumed and evaluated; SIGKILLs
during checkpoint writes to the bucket and the server going away mid-run lose nothing (the curve equals a local,
uninterrupted run's bit for bit); a bucket that does not exist is refused before any compile."""

import subprocess
import sys
import time

import pytest

from conftest import REPO, cpu_env
from jaxshare import exit_codes
from support.faults import SIGNALS, Run, losses_by_step, uninterrupted_losses
from support.runs import as_run

BUCKET = "runs"  # the gcs fixture's bucket (conftest.py)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
  """The uninterrupted run on local disk: its loss at every step."""
  return uninterrupted_losses(tmp_path_factory.mktemp("reference"))


def _eval(path: str, env: dict) -> str:
  r = subprocess.run([sys.executable, "eval.py", path, "--max-batches", "2", "--sample-tokens", "0"], cwd=REPO,
                     env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  return r.stdout


def _steps(gcs, prefix: str) -> tuple[set[int], set[int]]:
  """(every step directory under ``prefix`` on the server, those with orbax's commit marker)."""
  names = gcs.objects(BUCKET, prefix)
  started = {int(n[len(prefix):].split("/")[0]) for n in names}
  committed = {int(n[len(prefix):].split("/")[0]) for n in names if n.count("/") == prefix.count("/") + 1
               and n.endswith("/commit_success.txt")}
  return started, committed


@pytest.mark.slow
def test_a_run_on_a_bucket_survives_sigkills_during_writes_and_ends_on_the_local_curve(gcs, reference, tmp_path):
  """Three SIGKILLs, each once the run has committed a checkpoint to the bucket and while it writes a newer one:
  every restart resumes from the newest committed checkpoint and removes the half-written one; the logged curve
  equals the local run's bit for bit, and every file of the run directory is an object on the server. eval.py reads
  the run from the bucket and reports what it reports for the same run on local disk."""
  run_dir, env, prefix = f"gs://{BUCKET}/killed", gcs.env(), "killed/checkpoints/"
  half_written, resumed, in_flight, killed_during = set(), [], [], []
  for i in range(3):
    run = Run(run_dir, env=env)
    before = _steps(gcs, prefix)[1]

    def newer_commit_and_a_write_in_flight() -> bool:
      started, committed = _steps(gcs, prefix)
      in_flight[:] = sorted(started - committed)
      return bool(committed - before) and bool(in_flight)

    assert run.wait_until(newer_commit_and_a_write_in_flight, poll=0.005), run.output[-3000:]
    run.signal(SIGNALS["SIGKILL"])
    run.finish()
    assert run.proc.returncode == -9, f"kill {i}: {run.output[-2000:]}"
    killed_during.append(in_flight[:])  # step directories without a commit marker: a write (or a deletion) in flight
    started, committed = _steps(gcs, prefix)
    if before:
      assert f"resumed at step {max(before)}" in run.output
      resumed.append(max(before))
    half_written |= started - committed
    if i > 0:
      assert "unfinished checkpoint write(s) an interrupted run left" in run.output
  assert half_written  # the kills really landed during writes to the bucket
  resumed.append(max(_steps(gcs, prefix)[1]))
  run = Run(run_dir, env=env)
  assert run.finish() == 0, run.output[-3000:]
  assert f"resumed at step {resumed[-1]}" in run.output and "Traceback" not in run.output
  names = gcs.objects(BUCKET, "killed/")
  assert {"killed/config.yaml", "killed/metrics.jsonl"} <= set(names)
  assert any(n.startswith("killed/tensorboard/events.out.tfevents") for n in names)
  started, committed = _steps(gcs, prefix)
  assert started == committed and committed  # no half-written step is left
  assert all(f"{prefix}{s}/data/process_0-of-1.json" in names for s in committed)  # the iterator state
  assert not any(".jaxshare-write-probe" in n for n in names)
  assert _losses_on_bucket(gcs, "killed") == reference
  print(f"\n3 SIGKILLs with uncommitted step directories on the bucket {killed_during}; the restarts resumed at "
        f"steps {resumed}; the 60 logged losses equal the local run's bit for bit")
  local = tmp_path / "local"
  assert Run(local).finish() == 0
  env_local = cpu_env(1)
  bucket_report = _eval(run_dir, {**env_local, **env})
  assert _metric(bucket_report, "val loss") == _metric(_eval(str(local), env_local), "val loss")


def _losses_on_bucket(gcs, run: str) -> dict[int, float]:
  import json
  import urllib.request

  with urllib.request.urlopen(f"{gcs.url}/storage/v1/b/{BUCKET}/o/{run}%2Fmetrics.jsonl?alt=media") as r:
    records = [json.loads(line) for line in r.read().decode().splitlines()]
  steps = [r["step"] for r in records]
  assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
  return {r["step"]: r["loss"] for r in records}


def _metric(report: str, name: str) -> str:
  return next(line for line in report.splitlines() if line.strip().startswith(name))


def test_a_bucket_that_does_not_exist_is_refused_before_any_compile(gcs):
  run = Run("gs://no-such-bucket/run", env=gcs.env())
  assert run.finish() == 2
  lines = run.output.strip().splitlines()
  assert lines == ["error: train.run_dir=gs://no-such-bucket/run: cannot write there (the bucket does not exist)."]


@pytest.mark.slow
def test_a_short_outage_of_the_server_is_retried_and_the_run_goes_on(gcs, reference):
  """The server stopped for 5 s mid-run (during steps and, likely, a checkpoint write) and started again: the
  clients' retries carry the run through; it ends on the uninterrupted curve."""
  run = Run(f"gs://{BUCKET}/short-outage", env=gcs.env())
  assert run.wait_until(lambda: run.last_step >= 10), run.output[-3000:]
  gcs.stop()
  time.sleep(5)
  gcs.start()
  assert run.finish() == 0, run.output[-3000:]
  assert "Traceback" not in run.output
  assert _losses_on_bucket(gcs, "short-outage") == reference


@pytest.mark.slow
def test_an_outage_longer_than_the_patience_stops_the_run_with_one_line_and_it_resumes(gcs, reference):
  """The server stopped mid-run and kept down: the run stops with exit code 4 and one line naming the bucket and
  the patience, no traceback; with the server back, the same command resumes from the last committed checkpoint and
  ends on the uninterrupted curve."""
  run = Run(f"gs://{BUCKET}/long-outage", "train.storage_patience_s=2", env=gcs.env())
  assert run.wait_until(lambda: run.last_step >= 10), run.output[-3000:]
  gcs.stop()
  try:
    assert run.finish() == exit_codes.STORAGE_UNAVAILABLE, run.output[-3000:]
  finally:
    gcs.start()
  assert "Traceback" not in run.output and "ERROR" not in run.output
  last = run.output.strip().splitlines()[-1]
  assert last.startswith("error: ") and f"gs://{BUCKET}/long-outage" in last and "train.storage_patience_s" in last
  committed = _steps(gcs, "long-outage/checkpoints/")[1]
  run = Run(f"gs://{BUCKET}/long-outage", env=gcs.env())
  assert run.finish() == 0, run.output[-3000:]
  assert f"resumed at step {max(committed)}" in run.output
  assert _losses_on_bucket(gcs, "long-outage") == reference


def _cli(*args: str, env: dict) -> str:
  r = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
  return r.stdout


@pytest.mark.slow
def test_prepare_train_export_and_import_on_a_bucket_as_on_local_disk(gcs, corpus, tmp_path):
  """The pod workflow with every path on the bucket — prepare two corpora to gs://, train on their mixture into a
  gs:// run, export it to a gs:// HF directory and import that into a gs:// run — gives what the same commands give
  on local disk: the same shards, the same losses, the same HF files, the same evaluations of the run and of the
  re-imported model."""
  env = {**cpu_env(1), **gcs.env()}
  digits = tmp_path / "digits.txt"
  digits.write_text("\n\n".join(" ".join(str((i * 7919 + j * 104729) % 10**6) for j in range(200))
                                for i in range(300)))
  roots = {"local": str(tmp_path / "local"), "bucket": f"gs://{BUCKET}/pod"}
  evals = {}
  for where, root in roots.items():
    _cli("-m", "jaxshare.data", "prepare", "--out", f"{root}/data/play", str(corpus), "--val-fraction", "0.1",
         "--no-progress", env=env)
    _cli("-m", "jaxshare.data", "prepare", "--out", f"{root}/data/digits", str(digits), "--document-separator", "\n\n",
         "--val-docs", "30", "--no-progress", env=env)
    mixture = f"[{{path: {root}/data/play, weight: 0.7}}, {{path: {root}/data/digits, weight: 0.3}}]"
    run = Run(f"{root}/run", "train.steps=8", "data.source=prepared", f"data.mixture={mixture}", env=env)
    assert run.finish() == 0, run.output[-3000:]
    _cli("-m", "jaxshare.convert", "export", f"{root}/run", f"{root}/hf", env=env)
    _cli("-m", "jaxshare.convert", "import", f"{root}/hf", f"{root}/imported", env=env)
    evals[where] = (_metric(_eval(f"{root}/run", env), "val loss"), _metric(_eval(f"{root}/imported", env), "val loss"))
  local_data = tmp_path / "local" / "data"
  local_files = sorted(str(p.relative_to(local_data)) for p in local_data.rglob("*") if p.is_file())
  assert sorted(n.removeprefix("pod/data/") for n in gcs.objects(BUCKET, "pod/data/")) == local_files
  assert _losses_on_bucket(gcs, "pod/run") == losses_by_step(tmp_path / "local" / "run")
  hf = sorted(n.removeprefix("pod/hf/") for n in gcs.objects(BUCKET, "pod/hf/"))
  assert hf == sorted(p.name for p in (tmp_path / "local" / "hf").iterdir())
  assert evals["bucket"] == evals["local"]  # (an export's round trip itself: tests/equivalence/test_hf_*.py)


@pytest.mark.slow
def test_a_checkpoint_changed_on_the_bucket_is_detected_set_aside_and_the_run_resumes_before_it(gcs, reference):
  """The array objects of the last committed checkpoint cut short on the bucket: the rerun finds it corrupt, moves it to
  corrupt_checkpoints/ (on the bucket), resumes from the one before and ends on the uninterrupted curve."""
  run_dir, prefix = f"gs://{BUCKET}/damaged", "damaged/checkpoints/"
  run = Run(run_dir, env=gcs.env())
  assert run.finish() == 0, run.output[-3000:]
  steps = sorted(_steps(gcs, prefix)[1])
  from etils import epath

  for name in gcs.objects(BUCKET, f"{prefix}{steps[-1]}/state/"):
    if "/d/" in name:  # OCDBT's data files
      obj = epath.Path(f"gs://{BUCKET}/{name}")
      obj.write_bytes(obj.read_bytes()[:16])
  run = Run(run_dir, env=gcs.env())
  assert run.finish() == 0, run.output[-3000:]
  assert f"Resuming from checkpoint {steps[-2]}" in run.output and f"resumed at step {steps[-2]}" in run.output
  assert "Traceback" not in run.output, run.output[run.output.index("Traceback") - 1000:][:6000]
  assert any(n.startswith(f"damaged/corrupt_checkpoints/{steps[-1]}/") for n in gcs.objects(BUCKET, "damaged/"))
  assert _losses_on_bucket(gcs, "damaged") == reference


@pytest.mark.slow
def test_a_run_with_its_own_tokenizer_on_a_bucket_trains_from_it_evaluates_and_exports(gcs, tmp_path, corpus):
  """A converted run with a BPE tokenizer written to gs:// (as convert import writes one), a run initialised from it
  on gs://, evaluated and exported to gs://: transformers reads the bucket's tokenizer through a local copy, and the
  export carries the same tokenizer files."""
  from conftest import TINY, tiny_config, write_bpe_tokenizer
  from jaxshare.store.runs import write_run
  from jaxshare.train.state import init_state, setup_training

  tokenizer = write_bpe_tokenizer(tmp_path / "tk", corpus.read_text()[:20000])
  cfg = tiny_config("model.vocab_size=300")
  write_run(f"gs://{BUCKET}/bpe", as_run(cfg, init_state(setup_training(cfg), seed=0).params),
            tokenizer_files=sorted(tokenizer.iterdir()))
  env = {**cpu_env(1), **gcs.env(), "JAXSHARE_CACHE_DIR": str(tmp_path / "cache")}
  not_model = [o for o in TINY if not o.startswith("model.")]
  _cli("train.py", "--no-eval", *not_model, "train.steps=3", f"train.init_from=gs://{BUCKET}/bpe",
       f"train.run_dir=gs://{BUCKET}/bpe-up", env=env)
  assert "val loss" in _eval(f"gs://{BUCKET}/bpe-up", env)
  _cli("-m", "jaxshare.convert", "export", f"gs://{BUCKET}/bpe-up", f"gs://{BUCKET}/bpe-hf", env=env)
  from etils import epath

  assert epath.Path(f"gs://{BUCKET}/bpe-hf/tokenizer.json").read_bytes() == (tokenizer / "tokenizer.json").read_bytes()


@pytest.mark.slow
def test_head_wise_ties_and_postshare_pairs_are_written_to_the_bucket_and_read_back_on_resume(gcs, tmp_path):
  """The run files beside the config: head-wise sharing's ties and PostShare's pairs, chosen once when the run
  starts, are objects on the bucket equal to a local run's, and a resumed run reads them back from there."""
  from etils import epath

  runs = {"headwise": ("schedule.kind=headwise", "schedule.headwise.ratio=0.3"),
          "postshare": ("train.postshare_gamma=0.5", "train.postshare_ratio=0.3")}
  files = {"headwise": "head_ties.json", "postshare": "postshare_pairs.json"}
  for name, overrides in runs.items():
    for run_dir in (f"gs://{BUCKET}/{name}", tmp_path / name):
      env = gcs.env() if isinstance(run_dir, str) else None
      assert Run(run_dir, *overrides, "train.steps=8", env=env).finish() == 0
    assert epath.Path(f"gs://{BUCKET}/{name}/{files[name]}").read_text() == (tmp_path / name / files[name]).read_text()
    run = Run(f"gs://{BUCKET}/{name}", *overrides, "train.steps=8", env=gcs.env())  # the same command again
    assert run.finish() == 0, run.output[-3000:]
    assert "resumed at step 8" in run.output  # with the ties/pairs read from the bucket
    assert _losses_on_bucket(gcs, name) == losses_by_step(tmp_path / name)
