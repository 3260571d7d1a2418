"""The multi-host launchers (scripts/launch_tpu_pod.sh, scripts/launch_slurm.sh): what their dry runs print, that
the commands they build reach train.py word for word through the shells in between (fake gcloud/sbatch/srun on PATH
run them), and a real two-process training run started by the Slurm launcher's own batch script."""

import json
import os
import re
import shlex
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cpu_env
TPU = REPO / "scripts" / "launch_tpu_pod.sh"
SLURM = REPO / "scripts" / "launch_slurm.sh"

# Overrides a shell would mangle if any quoting step were missing: spaces, brackets, quotes, $, globs, backslashes.
NASTY = ["schedule.lisa.layers=[1,2]", "data.path=my corpus/it's here.txt", "data.document_separator=$HOME *?~\\n",
         'train.init_from="quoted" & ; | (x)']


def run(script: Path, *args: str, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
  return subprocess.run([str(script), *args], capture_output=True, text=True, env=env, cwd=cwd, timeout=60)


def fake_tool(bin_dir: Path, name: str, body: str) -> None:
  bin_dir.mkdir(parents=True, exist_ok=True)
  path = bin_dir / name
  path.write_text(body)
  path.chmod(path.stat().st_mode | stat.S_IEXEC)


def argv_recorder(path: Path, out: str) -> None:
  """An executable that writes its arguments and working directory as JSON to ``out``."""
  fake_tool(path.parent, path.name, f"#!{sys.executable}\nimport json, os, sys\n"
            f"json.dump({{'argv': sys.argv[1:], 'cwd': os.getcwd()}}, open({out!r}, 'w'))\n")


def remote_command(line: str) -> list[str]:
  """The words of the worker command inside a printed gcloud line."""
  argv = shlex.split(line)
  (command,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
  return shlex.split(command)


def batch_script(dry_run_output: str) -> str:
  """The batch script between the dry run's delimiter lines."""
  return re.search(r"^# ---- .*? \(--dry-run: not written\) ----\n(.*?)^# ---- end of ", dry_run_output,
                   re.S | re.M).group(1)


# --- TPU pod ---------------------------------------------------------------------------------------------------------


def test_tpu_dry_run_defaults_prints_the_gcloud_command():
  r = run(TPU, "--dry-run")
  assert r.returncode == 0, r.stderr
  (line,) = r.stdout.splitlines()
  argv = shlex.split(line)
  assert argv[:8] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "jaxshare-v5e-256", "--zone=us-west4-a",
                      "--worker=all"]
  assert remote_command(line) == [
    "cd", "jaxshare", "&&", ".venv/bin/python", "train.py", "--config", "configs/experiments/pod_cla2.yaml",
    "train.run_dir=gs://my-bucket/jaxshare/pod_cla2", "distributed.initialize=on", "mesh.fsdp=-1"]


def test_tpu_options_and_overrides_survive_quoting():
  r = run(TPU, "--dry-run", "--tpu", "my-pod", "--zone=europe-west4-b", "--project", "my-proj", "--bucket",
          "gs://bkt/runs/", "--run-name", "lisa.v1", "--config", "configs/experiments/shakespeare_cla2.yaml",
          "--venv", "/opt/venv", "--", *NASTY)
  assert r.returncode == 0, r.stderr
  argv = shlex.split(r.stdout)
  assert argv[:9] == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "my-pod", "--zone=europe-west4-b",
                      "--project=my-proj", "--worker=all"]
  words = remote_command(r.stdout)
  assert words[3:10] == ["/opt/venv/bin/python", "train.py", "--config", "configs/experiments/shakespeare_cla2.yaml",
                         "train.run_dir=gs://bkt/runs/lisa.v1", "distributed.initialize=on", "mesh.fsdp=-1"]
  assert words[10:] == NASTY


def test_tpu_command_runs_on_the_worker_shell_word_for_word(tmp_path):
  """Not dry: a fake gcloud runs --command through bash in a fake worker home; train.py's stand-in records argv."""
  home, bin_dir = tmp_path / "home", tmp_path / "bin"
  argv_recorder(home / "my repo" / ".venv" / "bin" / "python", str(tmp_path / "argv.json"))
  fake_tool(bin_dir, "gcloud", "#!/usr/bin/env bash\nset -eu\nprintf '%s\\n' \"$@\" > \"$HOME/gcloud_args\"\n"
            "for a in \"$@\"; do case $a in --command=*) cmd=${a#--command=} ;; esac; done\n"
            "cd \"$HOME\" && exec bash -c \"$cmd\"\n")
  env = {**os.environ, "HOME": str(home), "PATH": f"{bin_dir}:{os.environ['PATH']}"}
  r = run(TPU, "--bucket", "gs://bkt/x", "--run-name", "r1", "--repo-dir", "~/my repo", "--", *NASTY, env=env)
  assert r.returncode == 0, r.stderr
  rec = json.loads((tmp_path / "argv.json").read_text())
  assert rec["cwd"] == str(home / "my repo")
  assert rec["argv"] == ["train.py", "--config", "configs/experiments/pod_cla2.yaml",
                         "train.run_dir=gs://bkt/x/r1", "distributed.initialize=on", "mesh.fsdp=-1", *NASTY]
  assert (home / "gcloud_args").read_text().splitlines()[:7] == ["compute", "tpus", "tpu-vm", "ssh",
                                                                 "jaxshare-v5e-256", "--zone=us-west4-a", "--worker=all"]


def test_tpu_multislice_setup_and_detach():
  r = run(TPU, "--dry-run", "--num-slices", "2", "--setup", "--python", "python3.11", "--detach", "--",
          "train.steps=5")
  assert r.returncode == 0, r.stderr
  argv = shlex.split(r.stdout)
  assert argv[:6] == ["gcloud", "compute", "tpus", "queued-resources", "ssh", "jaxshare-v5e-256"]
  assert {"--node=all", "--worker=all", "--batch-size=4096"} <= set(argv)
  words = remote_command(r.stdout)
  nohup = words.index("nohup")
  assert " ".join(words[:nohup + 1]) == (
    "cd jaxshare && python3.11 -m venv .venv && .venv/bin/pip install -q --upgrade pip && .venv/bin/pip install -q -e "
    ".[tpu] && mkdir -p logs && { nohup")
  redirect = words.index(">")
  assert words[nohup + 1:nohup + 3] == [".venv/bin/python", "train.py"]
  assert words[redirect - 3:redirect + 2] == ["mesh.fsdp=-1", "mesh.dcn_data=2", "train.steps=5", ">",
                                              "logs/pod_cla2.log"]
  (command,) = [a[len("--command="):] for a in argv if a.startswith("--command=")]
  assert subprocess.run(["bash", "-n", "-c", command]).returncode == 0  # the background group parses


# --- Slurm -----------------------------------------------------------------------------------------------------------


def test_slurm_dry_run_defaults_prints_script_and_sbatch(tmp_path):
  r = run(SLURM, "--dry-run")
  assert r.returncode == 0, r.stderr
  script = batch_script(r.stdout)
  lines = script.splitlines()
  assert lines[0] == "#!/bin/bash"
  assert [ln for ln in lines if ln.startswith("#SBATCH")] == [
    "#SBATCH --job-name=pod_cla2", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
    f"#SBATCH --output={REPO}/runs/slurm/%x-%j.out"]
  assert f"cd {shlex.quote(str(REPO))}" in lines
  (srun,) = [shlex.split(ln) for ln in lines if ln.startswith("srun ")]
  assert srun == ["srun", "--kill-on-bad-exit=1", ".venv/bin/python", "train.py", "--config",
                  "configs/experiments/pod_cla2.yaml", "train.run_dir=runs/pod_cla2",
                  "distributed.initialize=on", "mesh.data=4", "mesh.fsdp=8"]
  assert r.stdout.splitlines()[-1] == f"sbatch {REPO}/runs/slurm/pod_cla2.sbatch"
  (tmp_path / "job.sbatch").write_text(script)
  assert subprocess.run(["bash", "-n", str(tmp_path / "job.sbatch")], capture_output=True).returncode == 0


def test_slurm_options_in_directives_and_srun():
  r = run(SLURM, "--dry-run", "--nodes", "2", "--gpus-per-node=4", "--partition", "gpu", "--account", "proj",
          "--time", "2-00:00:00", "--cpus-per-task", "12", "--sbatch-arg", "--qos=high", "--run-root", "gs://bkt/runs/",
          "--run-name", "r2", "--venv", "/opt/venv", "--log-dir", "/tmp/logs", "--", *NASTY)
  assert r.returncode == 0, r.stderr
  lines = batch_script(r.stdout).splitlines()
  assert [ln for ln in lines if ln.startswith("#SBATCH")] == [
    "#SBATCH --job-name=r2", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
    "#SBATCH --cpus-per-task=12", "#SBATCH --partition=gpu", "#SBATCH --account=proj", "#SBATCH --time=2-00:00:00",
    "#SBATCH --output=/tmp/logs/%x-%j.out", "#SBATCH --qos=high"]
  (srun,) = [shlex.split(ln) for ln in lines if ln.startswith("srun ")]
  assert srun[:3] == ["srun", "--kill-on-bad-exit=1", "--cpus-per-task=12"]
  assert srun[3:] == ["/opt/venv/bin/python", "train.py", "--config", "configs/experiments/pod_cla2.yaml",
                      "train.run_dir=gs://bkt/runs/r2", "distributed.initialize=on", "mesh.data=2", "mesh.fsdp=4",
                      *NASTY]
  assert r.stdout.splitlines()[-1] == "sbatch /tmp/logs/r2.sbatch"


def test_slurm_submits_the_script_it_prints(tmp_path):
  """Not dry: the written script equals the dry run's, a fake sbatch runs it, and srun gets the overrides intact."""
  bin_dir, logs = tmp_path / "bin", tmp_path / "logs"
  fake_tool(bin_dir, "sbatch", "#!/usr/bin/env bash\nset -eu\nexec bash \"$1\"\n")
  argv_recorder(bin_dir / "srun", str(tmp_path / "srun.json"))
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
  # The environment running this test, whatever it is: the default (.venv under the repo) may not exist.
  args = ["--log-dir", str(logs), "--run-name", "r3", "--venv", sys.prefix, "--", *NASTY]
  r = run(SLURM, *args, env=env)
  assert r.returncode == 0, r.stderr
  assert r.stdout.splitlines()[0] == f"wrote {logs}/r3.sbatch"
  assert (logs / "r3.sbatch").read_text() == batch_script(run(SLURM, "--dry-run", *args).stdout)
  rec = json.loads((tmp_path / "srun.json").read_text())
  assert rec["cwd"] == str(REPO)
  assert rec["argv"] == ["--kill-on-bad-exit=1", f"{sys.prefix}/bin/python", "train.py", "--config",
                         "configs/experiments/pod_cla2.yaml",
                         "train.run_dir=runs/r3", "distributed.initialize=on", "mesh.data=4", "mesh.fsdp=8", *NASTY]


def test_slurm_refuses_a_missing_venv_before_submitting(tmp_path):
  bin_dir = tmp_path / "bin"
  fake_tool(bin_dir, "sbatch", f"#!/usr/bin/env bash\ntouch {tmp_path / 'submitted'}\n")
  env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
  r = run(SLURM, "--venv", str(tmp_path / "no-venv"), "--log-dir", str(tmp_path / "logs"), env=env)
  assert r.returncode == 2 and "--venv: no Python at" in r.stderr
  assert not (tmp_path / "submitted").exists()


# --- usage errors ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("script,args,flag", [
  (TPU, ["--bogus"], "--bogus"),
  (TPU, ["--zone"], "--zone"),
  (TPU, ["--zone", "--dry-run"], "--zone"),
  (TPU, ["--dry-run=1"], "--dry-run"),
  (TPU, [], "--bucket"),
  (TPU, ["--dry-run", "--bucket", "/local/dir"], "--bucket"),
  (TPU, ["--dry-run", "--num-slices", "0"], "--num-slices"),
  (TPU, ["--dry-run", "--config", "configs/nope.yaml"], "--config"),
  (TPU, ["--dry-run", "stray"], "stray"),
  (TPU, ["--dry-run", "--", "train.steps"], "train.steps"),
  (SLURM, ["--nodes", "x"], "--nodes"),
  (SLURM, ["--gpus-per-node", "0"], "--gpus-per-node"),
  (SLURM, ["--time", "tomorrow"], "--time"),
  (SLURM, ["--partition", "a b"], "--partition"),
  (SLURM, ["--run-name", "a/b"], "--run-name"),
  (SLURM, ["--config"], "--config"),
  (SLURM, ["--frobnicate=1"], "--frobnicate"),
])
def test_bad_arguments_exit_2_naming_the_flag(script, args, flag):
  r = run(script, *args)
  assert r.returncode == 2
  (line,) = r.stderr.splitlines()
  assert line.startswith(f"{script.name}: error: ") and flag in line
  assert r.stdout == ""


@pytest.mark.parametrize("script", [TPU, SLURM])
def test_help(script):
  r = run(script, "--help")
  assert r.returncode == 0 and r.stdout.startswith(f"usage: {script.name} [options] [-- train.py overrides...]")
  assert "--dry-run" in r.stdout


# --- a real two-process run ------------------------------------------------------------------------------------------

TINY = ["model.num_layers=4", "model.d_model=32", "model.num_heads=4", "model.mlp_dim=64", "data.seq_len=32",
        "train.batch_size=8", "train.steps=2", "train.warmup_steps=1", "train.log_every=1", "train.eval_every=0",
        "train.eval_batches=1", "train.checkpoint_every=2", "train.progress_bar=false", "train.peak_tflops=1"]

# sbatch and srun as Slurm would run them on one node: sbatch sets the job's environment from the #SBATCH lines and
# runs the script; srun starts its tasks with the step's environment (jax/_src/clusters/slurm_cluster.py reads
# SLURM_JOB_ID for the port, SLURM_STEP_NODELIST for the coordinator, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID).
FAKE_SBATCH = """#!/usr/bin/env bash
set -eu
nodes=$(sed -n 's/^#SBATCH --nodes=//p' "$1")
per_node=$(sed -n 's/^#SBATCH --ntasks-per-node=//p' "$1")
export SLURM_JOB_ID=$FAKE_JOB_ID SLURM_JOB_NAME=$(sed -n 's/^#SBATCH --job-name=//p' "$1")
export SLURM_NNODES=$nodes SLURM_JOB_NUM_NODES=$nodes SLURM_NTASKS=$((nodes * per_node)) SLURM_NTASKS_PER_NODE=$per_node
export SLURM_JOB_NODELIST=localhost SLURM_NODELIST=localhost SLURM_SUBMIT_DIR=$PWD
exec bash "$1"
"""
FAKE_SRUN = """#!/usr/bin/env bash
set -u
while [[ $# -gt 0 && $1 == -* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_STEP_ID=0 SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 SLURM_STEP_NUM_TASKS=$SLURM_NTASKS \\
    SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_NODEID=0 "$@" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""


def _free_slurm_port() -> int:
  """A free port in the range JAX derives Slurm's coordinator port from (SLURM_JOB_ID % 4096 + 61440)."""
  for port in range(61440 + os.getpid() % 4096, 61440 + 4096):
    with socket.socket() as s:
      try:
        s.bind(("localhost", port))
      except OSError:
        continue
      return port
  pytest.skip("no free port in 61440-65535 for the Slurm coordinator")


@pytest.mark.slow  # ~40 s on 2 busy cores: two processes each compile the model
def test_slurm_launcher_starts_a_two_process_run(tmp_path, corpus):
  """launch_slurm.sh -> its batch script -> srun -> two train.py processes on one CPU device each, joined by JAX's
  Slurm detection into one 2-device mesh: two steps, one checkpoint with both processes' data iterators."""
  bin_dir, logs, runs = tmp_path / "bin", tmp_path / "logs", tmp_path / "runs"
  fake_tool(bin_dir, "sbatch", FAKE_SBATCH)
  fake_tool(bin_dir, "srun", FAKE_SRUN)
  env = {**cpu_env(1, xla_cache=False), "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_JOB_ID": str(_free_slurm_port() - 61440)}
  cmd = [str(SLURM), "--nodes", "1", "--gpus-per-node", "2", "--run-root", str(runs), "--run-name", "two",
         "--log-dir", str(logs), "--venv", sys.prefix, "--config", "configs/experiments/shakespeare_cla2.yaml", "--",
         *TINY]
  proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=150)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"the two processes did not finish:\n{out[-4000:]}")
  assert proc.returncode == 0, out[-4000:]
  # one mesh over both processes
  assert re.search(r"mesh \{'data': 1, 'fsdp': 2, 'context': 1, 'tensor': 1\} \(2 cpu\)", out)
  assert "training summary: " in out
  run_dir = runs / "two"
  steps = [json.loads(ln)["step"] for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
  assert steps == [1, 2]  # written by process 0 only
  assert sorted(p.name for p in (run_dir / "checkpoints" / "2" / "data").glob("process_*.json")) == [
    "process_0-of-2.json", "process_1-of-2.json"]
