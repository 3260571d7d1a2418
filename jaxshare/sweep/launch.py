"""Launching the sweep's runs through the cluster launchers (scripts/launch_slurm.sh, scripts/launch_tpu_pod.sh)
instead of training them here."""

from __future__ import annotations

import re
import shlex
import subprocess

from jaxshare.config import REPO_ROOT
from jaxshare.sweep.runner import say
from jaxshare.sweep.spec import Sweep, SweepError, Trial, rel

LAUNCHERS = {"slurm": "scripts/launch_slurm.sh", "tpu": "scripts/launch_tpu_pod.sh"}

# Launcher flags the sweep sets itself (the run's name, place and experiment) or that would break a sweep: --detach
# would start every run at once on the same TPU VM (without it each launch returns when its run ends, so the runs
# go through the pod one after another), and the launchers' own --dry-run is the sweep's --dry-run.
RESERVED_LAUNCHER_FLAGS = {
  "--run-name": "the sweep names each run", "--run-root": "the sweep places each run",
  "--config": "the sweep file's experiment is passed", "--dry-run": "use the sweep's own --dry-run",
  "--detach": "it would start every run at once on the same TPU VM",
}


def job_name(sweep: Sweep, run: Trial) -> str:
  """The launcher's --run-name: ``<sweep>-<variant>-s<seed>`` in the characters the launchers take (letters,
  digits, '.', '_', '-'); it names the Slurm job, and on TPU the run's directory in the bucket."""
  name = f"{sweep.path.stem}-{run.variant}" + ("" if run.seed is None else f"-s{run.seed}")
  return re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._-")


def launcher_command(kind: str, sweep: Sweep, run: Trial, launcher_args: list[str]) -> list[str]:
  """The launcher invocation that trains ``run`` remotely (scripts/launch_slurm.sh, scripts/launch_tpu_pod.sh).

  slurm: the run directory stays at the sweep's layout on the cluster's shared filesystem: overrides after ``--``
  win over the launcher's own, so ``train.run_dir`` sets it (``--run-root`` is the sweep's run_root for the
  launcher's default). tpu: the run directory is ``<bucket>/<job name>`` (every worker must write to it); copy it
  back into the layout to --collect it.
  """
  script = str(REPO_ROOT / LAUNCHERS[kind])
  name = job_name(sweep, run)
  if kind == "slurm":
    return [script, "--run-name", name, "--run-root", str(sweep.run_root), *launcher_args,
            "--config", sweep.experiment, "--", *run.train_overrides()]
  return [script, "--run-name", name, *launcher_args, "--config", sweep.experiment, "--", *run.overrides]


def check_launcher_args(launcher_args: list[str]) -> None:
  """Raises SweepError for a flag in RESERVED_LAUNCHER_FLAGS."""
  for a in launcher_args:
    flag = a.split("=", 1)[0]
    if flag in RESERVED_LAUNCHER_FLAGS:
      raise SweepError(f"--launcher-args: {flag} is not allowed ({RESERVED_LAUNCHER_FLAGS[flag]}); refused: "
                       f"{', '.join(RESERVED_LAUNCHER_FLAGS)}")


def _bucket(launcher_args: list[str]) -> str | None:
  for i, a in enumerate(launcher_args):
    if a == "--bucket" and i + 1 < len(launcher_args):
      return launcher_args[i + 1]
    if a.startswith("--bucket="):
      return a.split("=", 1)[1]
  return None


def launch(kind: str, sweep_file: str, sweep: Sweep, runs: list[Trial], launcher_args: list[str]) -> int:
  """Submit ``runs`` one launcher call each; returns the number of calls that failed."""
  failed = 0
  for run in runs:
    cmd = launcher_command(kind, sweep, run, launcher_args)
    say(shlex.join(cmd))
    if subprocess.run(cmd, cwd=REPO_ROOT).returncode != 0:
      say(f"{run.label}: FAILED to submit")
      failed += 1
  if runs:
    say(f"launched {len(runs) - failed} of {len(runs)} runs; when they have finished: "
        f"python scripts/sweep.py {sweep_file} --collect")
  if runs and kind == "tpu":
    bucket = (_bucket(launcher_args) or "gs://BUCKET/PATH").rstrip("/")
    say("first copy each TPU run from the bucket into the sweep's layout:",
        *(f"  gcloud storage rsync -r {bucket}/{job_name(sweep, run)} {rel(run.run_dir)}" for run in runs))
  return failed
