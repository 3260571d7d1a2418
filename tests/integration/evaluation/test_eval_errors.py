"""eval.py's errors are one line and change nothing (issue 43): a run whose checkpoints were deleted printed its error,
then a 40-line orbax traceback at interpreter exit ("cannot schedule new futures after interpreter shutdown", 3 of 3
times), and re-created an empty checkpoints/ directory; a checkpoint step that is not kept did not say which are."""

import subprocess
import sys

import pytest

from conftest import REPO, cpu_env, tiny_config
from jaxshare.store.checkpoint import Checkpointer
from jaxshare.store.runs import write_run
from jaxshare.train.state import init_state, setup_training
from support.runs import as_run


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  """A tiny run with checkpoints at steps 0, 5 and 10."""
  cfg = tiny_config()
  root = tmp_path_factory.mktemp("eval_errors") / "run"
  setup = setup_training(cfg)
  state = init_state(setup)
  write_run(root, as_run(cfg, state.params))
  ckpt = Checkpointer(root / "checkpoints", keep=3)
  for step in (5, 10):
    ckpt.save(step, state.as_dict(), None, {"step": step})
  ckpt.wait()
  ckpt.close()
  return root


def _eval(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(REPO / "eval.py"), *argv], capture_output=True, text=True,
                        env=cpu_env(1), timeout=300)


def test_a_run_without_checkpoints_is_one_line_and_nothing_is_created(tmp_path, run):
  import shutil

  bare = tmp_path / "bare"
  shutil.copytree(run, bare, ignore=shutil.ignore_patterns("checkpoints"))
  done = _eval(str(bare), "--json")
  assert done.returncode == 2 and done.stdout == ""
  assert done.stderr.strip().splitlines() == [
    f"error: run directory '{bare}' has no checkpoint: no finished step in '{bare / 'checkpoints'}' (deleted, or the "
    "run has not saved one yet)"]
  assert sorted(p.name for p in bare.iterdir()) == ["config.yaml"]


def test_a_step_that_is_not_kept_names_the_steps_there_are(run):
  done = _eval(str(run / "checkpoints" / "400"), "--json")
  assert done.returncode == 2 and done.stderr.strip().splitlines() == [
    f"error: run '{run}' has no checkpoint at step 400: its checkpoints are at steps 0, 5, 10 (a run keeps its last "
    "train.keep_checkpoints=2)"]
  assert not (run / "checkpoints" / "400").exists()
