"""The search's bookkeeping in Optuna: a killed stage resumes without re-running finished trials, and two worker
processes sharing one study split its points, each point run once."""

import multiprocessing
import os
import shutil
import subprocess
import tempfile
import time

import pytest

from jaxshare.search.study import failures, open_storage, run_grid

POINTS = [f"p{i}" for i in range(6)]


def _log(path, point):
  with open(path, "a") as f:
    f.write(point + "\n")


def test_a_killed_stage_resumes_without_rerunning_finished_trials(tmp_path):
  url, log = f"sqlite:///{tmp_path / 'study.db'}", tmp_path / "calls"

  def dies_at_the_third(point):
    _log(log, point)
    if len(log.read_text().split()) == 3:
      raise KeyboardInterrupt  # the worker is stopped mid-trial
    return float(point[1:]), {"twice": 2 * int(point[1:])}

  with pytest.raises(KeyboardInterrupt):
    run_grid(open_storage(url), "stage", POINTS, dies_at_the_third)
  before = log.read_text().split()
  assert len(before) == 3
  done = run_grid(open_storage(url), "stage", POINTS, lambda p: (_log(log, p), (float(p[1:]), {}))[1])
  after = log.read_text().split()[3:]
  assert sorted(done) == POINTS and {p: t.value for p, t in done.items()} == {p: float(p[1:]) for p in POINTS}
  assert sorted(after) == sorted(set(POINTS) - set(before[:2]))  # the two finished are not run again
  assert done[before[0]].user_attrs == {"twice": 2 * int(before[0][1:])}
  assert failures(open_storage(url), "stage") == {}


def test_a_failing_point_is_recorded_and_the_stage_goes_on(tmp_path):
  storage = open_storage(f"sqlite:///{tmp_path / 'study.db'}")

  def objective(point):
    if point == "p2":
      raise ValueError("no such schedule")
    return 1.0, {}

  done = run_grid(storage, "stage", POINTS, objective)
  assert sorted(done) == [p for p in POINTS if p != "p2"]
  assert failures(storage, "stage") == {"p2": "ValueError: no such schedule"}


def _worker(url, log, name):
  open(f"{log}.{name}", "w").close()  # started

  def objective(point):
    deadline = time.monotonic() + 60
    while not all(os.path.exists(f"{log}.{w}") for w in "ab") and time.monotonic() < deadline:
      time.sleep(0.05)  # a trial waits for the other worker to start: both must find the study half done
    _log(log, f"{name}:{point}")
    time.sleep(0.3)
    return 0.0, {}
  run_grid(open_storage(url), "stage", POINTS, objective, poll_s=0.2)


@pytest.fixture
def postgres_url():
  """A PostgreSQL server of this machine's (as several hosts would share one), started in a scratch cluster for the
  test: a URL of its socket. PostgreSQL refuses to run as root, so the cluster belongs to the postgres user."""
  if not (shutil.which("initdb") and shutil.which("pg_ctl")):
    pytest.fail("PostgreSQL's initdb and pg_ctl are missing: the multi-host storage cannot be tested")
  root = tempfile.mkdtemp(prefix="pg")  # short: a socket path has at most 107 characters
  as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
  if as_user:
    shutil.chown(root, "postgres")
  subprocess.run([*as_user, "initdb", "-D", f"{root}/data", "-A", "trust", "-U", "postgres"], check=True,
                 capture_output=True)
  subprocess.run([*as_user, "pg_ctl", "-D", f"{root}/data", "-o", f"-k {root} -p 54329 -c listen_addresses=''",
                  "-l", f"{root}/log", "-w", "start"], check=True, capture_output=True)
  try:
    yield f"postgresql://postgres@/postgres?host={root}&port=54329"
  finally:
    subprocess.run([*as_user, "pg_ctl", "-D", f"{root}/data", "-m", "fast", "stop"], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("storage", ["sqlite", "postgresql"])
def test_two_worker_processes_split_one_study(tmp_path, storage, request):
  url = f"sqlite:///{tmp_path / 'study.db'}" if storage == "sqlite" else request.getfixturevalue("postgres_url")
  log = tmp_path / "calls"
  open_storage(url)  # create the schema once, before two processes race to
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_worker, args=(url, str(log), name)) for name in ("a", "b")]
  for p in procs:
    p.start()
  for p in procs:
    p.join(120)
    assert p.exitcode == 0
  calls = [line.split(":") for line in log.read_text().split()]
  assert sorted(point for _, point in calls) == POINTS  # every point once
  assert {name for name, _ in calls} == {"a", "b"}  # both worked


def _claim(url, out):
  import optuna

  study = optuna.load_study(study_name="claims", storage=open_storage(url))
  claimed = []
  while (trial_id := study._pop_waiting_trial_id()) is not None:  # what each worker's optimize does first
    claimed.append(trial_id)
  with open(out, "w") as f:
    f.write(" ".join(map(str, claimed)))


def test_each_queued_trial_is_claimed_by_one_worker_only(tmp_path):
  """Four processes take 200 queued trials from one SQLite study at once: each trial is taken once. Without
  SQLite transactions that lock on begin, two workers read the same trial as waiting and both ran it (227 claims
  for 200 trials measured; in the suite: "Cannot tell a COMPLETE trial", and a search that never ended)."""
  import optuna

  url = f"sqlite:///{tmp_path / 'claims.db'}"
  study = optuna.create_study(study_name="claims", storage=open_storage(url))
  for i in range(200):
    study.enqueue_trial({"point": f"p{i}"})
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_claim, args=(url, str(tmp_path / f"claims.{i}"))) for i in range(4)]
  for p in procs:
    p.start()
  for p in procs:
    p.join(300)
    assert p.exitcode == 0
  claimed = [int(t) for i in range(4) for t in (tmp_path / f"claims.{i}").read_text().split()]
  assert len(claimed) == 200 and len(set(claimed)) == 200
