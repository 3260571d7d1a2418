#!/usr/bin/env bash
# Train one jaxshare run on a Slurm GPU cluster, one process per GPU across nodes: writes a batch script and submits
# it with sbatch. --dry-run prints the script and the sbatch command instead. Usage: --help.
set -euo pipefail

prog=${0##*/}
repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  cat <<EOF
usage: $prog [options] [-- train.py overrides...]

Writes a Slurm batch script that starts one train.py process per GPU (srun, distributed.initialize=on: JAX's
Slurm detection finds the coordinator, the process index and the GPU of each task) and submits it with sbatch.

  --nodes N             nodes (default 4)
  --gpus-per-node G     GPUs per node = tasks per node (default 8)
  --partition P         Slurm partition (default: the cluster's)
  --account A           Slurm account (default: yours)
  --time T              time limit, e.g. 24:00:00 or 2-00:00:00 (default: the partition's)
  --cpus-per-task C     CPUs per process, for the input pipeline (default: Slurm's)
  --sbatch-arg ARG      extra #SBATCH line, e.g. --sbatch-arg=--qos=high (repeatable)
  --config PATH         experiment YAML, relative to the repo dir (default configs/experiments/pod_cla2.yaml)
  --run-name NAME       run name: job name and last part of the run directory (default: the config's file name)
  --run-root DIR        parent of the run directory, relative to the repo dir or absolute or gs://...; every
                        node must see it (default runs)
  --repo-dir DIR        jaxshare checkout on the cluster's shared filesystem (default $repo_root)
  --venv DIR            virtual environment with jaxshare and jax[cuda12], relative to the repo dir (default .venv)
  --log-dir DIR         where the batch script and the job's output file go (default <repo dir>/runs/slurm)
  --dry-run             print the batch script and the sbatch command; write and run nothing
  -h, --help            this help
  -- OVERRIDES...       passed to train.py after the launcher's own, so they win (e.g. train.steps=500
                        "schedule.lisa.layers=[1,2]")

Mesh: mesh.fsdp = GPUs per node (FSDP inside a node's NVLink domain) and mesh.data = nodes (data parallel across
nodes). Each process drives one GPU, so make_mesh sees one slice of nodes x GPUs devices, ordered by process and so
node by node; mesh.dcn_* would count processes (one per GPU), not nodes. Override after -- (e.g. mesh.fsdp=-1).

Example: $prog --nodes 4 --gpus-per-node 8 --partition gpu --time 24:00:00 --run-name cla2_h100 -- train.steps=20000
EOF
}

# shellcheck source=launch_common.sh
source "$repo_root/scripts/launch_common.sh"

nodes=4
gpus=8
partition=""
account=""
time_limit=""
cpus=""
sbatch_args=()
config=configs/experiments/pod_cla2.yaml
run_name=""
run_root=runs
repo_dir=$repo_root
venv=.venv
log_dir=""
dry_run=0

valued_flags=" --nodes --gpus-per-node --partition --account --time --cpus-per-task --sbatch-arg --config --run-name
  --run-root --repo-dir --venv --log-dir "
switch_flags=" --dry-run --help "

set_opt() {  # flag value
  case $1 in
    --nodes) nodes=$2 ;;
    --gpus-per-node) gpus=$2 ;;
    --partition) partition=$2 ;;
    --account) account=$2 ;;
    --time) time_limit=$2 ;;
    --cpus-per-task) cpus=$2 ;;
    --sbatch-arg) sbatch_args+=("$2") ;;
    --config) config=$2 ;;
    --run-name) run_name=$2 ;;
    --run-root) run_root=$2 ;;
    --repo-dir) repo_dir=$2 ;;
    --venv) venv=$2 ;;
    --log-dir) log_dir=$2 ;;
  esac
}

set_switch() {
  dry_run=1  # the only switch
}

parse_args "$@"

[[ $nodes =~ ^[1-9][0-9]*$ ]] || die "--nodes must be a positive integer, got '$nodes'"
[[ $gpus =~ ^[1-9][0-9]*$ ]] || die "--gpus-per-node must be a positive integer, got '$gpus'"
[[ -z $cpus || $cpus =~ ^[1-9][0-9]*$ ]] || die "--cpus-per-task must be a positive integer, got '$cpus'"
# Slurm's time formats: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or no limit.
[[ -z $time_limit || $time_limit =~ ^([0-9]+-)?[0-9]+(:[0-9]+){0,2}$|^(UNLIMITED|INFINITE)$ ]] ||
  die "--time must be a Slurm time such as 24:00:00 or 2-00:00:00, got '$time_limit'"
# #SBATCH lines end at whitespace: names with spaces would silently lose their tail.
[[ -z $partition || $partition =~ ^[A-Za-z0-9_.,+-]+$ ]] || die "--partition has characters Slurm does not take: '$partition'"
[[ -z $account || $account =~ ^[A-Za-z0-9_.+-]+$ ]] || die "--account has characters Slurm does not take: '$account'"
for a in ${sbatch_args[@]+"${sbatch_args[@]}"}; do
  [[ $a == -* && $a != *[[:space:]]* ]] || die "--sbatch-arg must be one sbatch option without spaces, e.g. --qos=high, got '$a'"
done
[[ -n $config ]] || die "--config must name an experiment YAML"
[[ -n $run_name ]] || run_name=$(config_run_name "$config")
[[ $run_name =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
  die "--run-name must be letters, digits, '.', '_' or '-' (it names a directory and the job), got '$run_name'"
[[ -n $run_root && $run_root != *$'\n'* ]] || die "--run-root must be a directory or gs:// path, got '$run_root'"
[[ -n $venv && $venv != *$'\n'* ]] || die "--venv must be a directory, got '$venv'"
[[ -n $repo_dir && $repo_dir != *$'\n'* ]] || die "--repo-dir must be a directory, got '$repo_dir'"
[[ $repo_dir == /* ]] || repo_dir=$PWD/$repo_dir  # the job starts in sbatch's directory, not necessarily this one
[[ -n $log_dir ]] || log_dir=$repo_dir/runs/slurm
[[ $log_dir == /* ]] || log_dir=$PWD/$log_dir
# --output names a file pattern (%j, %x) and ends at whitespace.
[[ $log_dir != *[[:space:]%]* ]] || die "--log-dir must not contain whitespace or '%', got '$log_dir'"
# The config is read on the cluster from the repo dir; check it here (or in this checkout when the repo dir is not
# mounted on this host) rather than after the job waited in the queue.
check_dir=$repo_dir
[[ -d $check_dir ]] || check_dir=$repo_root
if [[ $config == /* ]]; then config_file=$config; else config_file=$check_dir/$config; fi
[[ -f $config_file ]] || die "--config: no such file: $config_file"

run_root=${run_root%/}
run_dir=$run_root/$run_name
script_path=$log_dir/$run_name.sbatch
python=${venv%/}/bin/python

train_cmd=("$python" train.py --config "$config" "train.run_dir=$run_dir" distributed.initialize=on
  "mesh.data=$nodes" "mesh.fsdp=$gpus" ${overrides[@]+"${overrides[@]}"})
# --kill-on-bad-exit: one crashed process would leave the others blocked in a collective until the time limit.
# --cpus-per-task again on srun: since Slurm 22.05 srun no longer inherits it from the allocation.
srun_cmd=(srun --kill-on-bad-exit=1)
[[ -z $cpus ]] || srun_cmd+=("--cpus-per-task=$cpus")

batch_script() {
  printf '#!/bin/bash\n'
  printf '# jaxshare run %s: %s node(s) x %s GPU(s), one process per GPU. Written by scripts/launch_slurm.sh.\n' \
    "$run_name" "$nodes" "$gpus"
  printf '#SBATCH --job-name=%s\n' "$run_name"
  printf '#SBATCH --nodes=%s\n' "$nodes"
  printf '#SBATCH --ntasks-per-node=%s\n' "$gpus"
  printf '#SBATCH --gpus-per-node=%s\n' "$gpus"
  [[ -z $cpus ]] || printf '#SBATCH --cpus-per-task=%s\n' "$cpus"
  [[ -z $partition ]] || printf '#SBATCH --partition=%s\n' "$partition"
  [[ -z $account ]] || printf '#SBATCH --account=%s\n' "$account"
  [[ -z $time_limit ]] || printf '#SBATCH --time=%s\n' "$time_limit"
  printf '#SBATCH --output=%s/%%x-%%j.out\n' "$log_dir"
  for a in ${sbatch_args[@]+"${sbatch_args[@]}"}; do printf '#SBATCH %s\n' "$a"; done
  printf 'set -euo pipefail\n'
  printf 'cd %s\n' "$(printf '%q' "$repo_dir")"
  printf '# Log lines reach the output file as they are printed, not when a buffer fills.\n'
  printf 'export PYTHONUNBUFFERED=1\n'
  printf '# Every task sees all GPUs of its node; distributed.initialize=on lets JAX read the job step (coordinator on\n'
  printf '# the first node of SLURM_STEP_NODELIST, process SLURM_PROCID of SLURM_NTASKS) and drive GPU SLURM_LOCALID.\n'
  printf '%s\n' "$(join_q "${srun_cmd[@]}" "${train_cmd[@]}")"
}

submit_cmd=(sbatch "$script_path")
if ((dry_run)); then
  printf '# ---- %s (--dry-run: not written) ----\n' "$script_path"
  batch_script
  printf '# ---- end of %s ----\n' "$script_path"
  printf '%s\n' "$(join_q "${submit_cmd[@]}")"
  exit 0
fi

command -v sbatch >/dev/null || die "sbatch not found on PATH: run this on the cluster's login node (or use --dry-run)"
# A job that queued for hours should not fail at once for want of its interpreter.
if [[ -d $repo_dir ]]; then
  if [[ $python == /* ]]; then python_file=$python; else python_file=$repo_dir/$python; fi
  [[ -x $python_file ]] || die "--venv: no Python at $python_file (create the venv, or name it with --venv)"
fi
# Slurm opens the output file on the first node before the script runs: its directory must exist.
mkdir -p -- "$log_dir"
batch_script >"$script_path"
printf 'wrote %s\n' "$script_path"
exec "${submit_cmd[@]}"
