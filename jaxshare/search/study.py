"""A search's bookkeeping in Optuna: each stage a study of a fixed grid of points (candidate names, or
candidate@seed), split among the workers that share its storage, resumed from it after a kill.

Each pending point is a queued trial that one worker takes; a worker that dies leaves its trial RUNNING, its
heartbeat stops, and the next worker to look marks it failed and queues its point again. The storage is SQLite in
the search directory by default (one host, any number of worker processes); a PostgreSQL URL lets workers on
several hosts run one search.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence

import optuna
from optuna.storages import RDBStorage
from optuna.trial import TrialState

HEARTBEAT_S = 10  # a worker's trials report alive this often ...
GRACE_S = 30  # ... and are taken as dead (failed, queued again) after this long without a report


def open_storage(url: str) -> RDBStorage:
  """The search's storage at ``url`` (``sqlite:///path`` or ``postgresql://...``), with heartbeats so that a dead
  worker's trial is run again."""
  optuna.logging.set_verbosity(optuna.logging.WARNING)
  # heartbeats have been "experimental" since Optuna 2.8; they are what lets a search outlive its workers
  warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
  # SQLite serialises writers: under load a worker may wait for another's write longer than SQLite's default 5 s
  engine = {"connect_args": {"timeout": 120}} if url.startswith("sqlite") else {}
  storage = RDBStorage(url, engine_kwargs=engine, heartbeat_interval=HEARTBEAT_S, grace_period=GRACE_S)
  if url.startswith("sqlite"):
    _immediate_transactions(storage.engine)
  return storage


def _immediate_transactions(engine) -> None:
  """Every transaction on ``engine`` takes SQLite's write lock when it begins (SQLAlchemy's pysqlite recipe).

  Optuna claims a queued trial by reading that it is waiting and then marking it running, relying on ``SELECT ... FOR
  UPDATE``, which SQLite ignores; pysqlite also reads outside any transaction. Two workers could then both claim one
  trial, run its point twice and fail to report it ("Cannot tell a COMPLETE trial"): seen in the suite under load.
  """
  from sqlalchemy import event

  @event.listens_for(engine, "connect")
  def _no_implicit_transactions(dbapi_connection, _record):
    dbapi_connection.isolation_level = None  # pysqlite's own BEGIN (deferred, before writes only) is off

  @event.listens_for(engine, "begin")
  def _begin_immediate(connection):
    connection.exec_driver_sql("BEGIN IMMEDIATE")

  engine.dispose()  # connections opened before the listeners (the schema's) are not reused


def _study(storage: RDBStorage, name: str) -> optuna.Study:
  return optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                             sampler=optuna.samplers.RandomSampler(seed=0))


def finished(storage: RDBStorage, name: str) -> dict[str, optuna.trial.FrozenTrial]:
  """The completed trials of study ``name`` by point (the newest where a point ran twice); {} before it exists."""
  try:
    study = optuna.load_study(study_name=name, storage=storage)
  except KeyError:
    return {}
  return {t.params["point"]: t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}


def run_grid(storage: RDBStorage, name: str, points: Sequence[str],
             objective: Callable[[str], tuple[float, dict]], workers: int = 1,
             wait: bool = True, poll_s: float = 2.0) -> dict[str, optuna.trial.FrozenTrial]:
  """Run every point of ``points`` not yet completed in study ``name`` through ``objective(point) -> (value,
  attributes)``, ``workers`` at a time in this process, alongside any other process working on the same study.

  Each pending point is queued as a trial (``enqueue_trial``) that one worker takes; a point whose trial failed in
  an earlier invocation (an error, a kill) is queued again, once per invocation. An objective that raises fails its
  trial (the error is kept as its ``error`` attribute: :func:`failures`) and the study goes on; a
  ``KeyboardInterrupt`` stops this worker, its trial failed. With ``wait``, returns once no point is left running or
  queued, whichever worker runs it.

  Returns:
    The completed trials by point.
  """
  study = _study(storage, name)
  first = len(study.get_trials(deepcopy=False))  # trials failed from here on failed in this invocation

  def trial_fn(trial: optuna.Trial) -> float:
    point = trial.suggest_categorical("point", list(points))  # the queued one (else, the queue ran dry: any)
    others = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.RUNNING))
    if any(t.params.get("point") == point and t.number != trial.number for t in others):
      raise optuna.TrialPruned(f"{point} is done or running in another trial")  # queued twice by two workers
    try:
      value, attrs = objective(point)
    except Exception as e:
      trial.set_user_attr("error", f"{type(e).__name__}: {e}"[:500])
      raise
    for k, v in attrs.items():
      trial.set_user_attr(k, v)
    return value

  while True:
    optuna.storages.fail_stale_trials(study)  # a dead worker's trial: failed, and queued again
    trials = study.get_trials(deepcopy=False)
    busy = {_point(t) for t in trials if t.state in (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)
            or (t.state == TrialState.FAIL and t.number >= first and "error" in t.user_attrs)}
    for point in points:
      if point not in busy:
        study.enqueue_trial({"point": point})
    queued = len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))
    if queued:
      study.optimize(trial_fn, n_jobs=workers, catch=(Exception,), n_trials=queued)
    elif wait and study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
      time.sleep(poll_s)
    else:
      return finished(storage, name)


def _point(trial: optuna.trial.FrozenTrial) -> str | None:
  """The point a trial runs (a queued trial has it only as its fixed parameter)."""
  return trial.params.get("point", trial.system_attrs.get("fixed_params", {}).get("point"))


def failures(storage: RDBStorage, name: str) -> dict[str, str]:
  """The points of study ``name`` that have no completed trial, only failed ones, and why the last failed (the
  objective's error, or a worker that died)."""
  try:
    study = optuna.load_study(study_name=name, storage=storage)
  except KeyError:
    return {}
  done = finished(storage, name)
  return {_point(t): t.user_attrs.get("error", "its worker stopped (interrupted, or no heartbeat)")
          for t in study.get_trials(deepcopy=False, states=(TrialState.FAIL,)) if _point(t) not in done}
