#!/usr/bin/env bash
# Train one jaxshare run on every worker of a TPU VM pod slice (or of several slices) at once, through
# `gcloud ... ssh --worker=all`. --dry-run prints the gcloud command instead. Usage: --help.
set -euo pipefail

prog=${0##*/}
repo_root=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd)

usage() {
  cat <<EOF
usage: $prog [options] [-- train.py overrides...]

Runs the same train.py command on every worker of a TPU VM pod (gcloud compute tpus tpu-vm ssh --worker=all); with
distributed.initialize=on JAX finds the coordinator and each worker's index from the TPU metadata. The run
directory is on a bucket, the one place every worker can write to.

  --tpu NAME            TPU VM name; with --num-slices > 1 the queued resource's name (default jaxshare-v5e-256)
  --zone ZONE           zone of the TPU (default us-west4-a)
  --project PROJECT     Google Cloud project (default: gcloud's configured one)
  --bucket gs://B/PATH  parent of the run directory; required unless --dry-run (default there gs://my-bucket/jaxshare)
  --run-name NAME       run name: the run directory is <bucket>/<name>; re-running resumes it
                        (default: the config's file name)
  --config PATH         experiment YAML, relative to the repo dir (default configs/experiments/pod_cla2.yaml)
  --repo-dir DIR        jaxshare checkout on every worker, relative to the worker's home or absolute; quote a
                        '~/...' path so that it expands on the worker (default jaxshare)
  --venv DIR            virtual environment on the workers, relative to the repo dir (default .venv)
  --setup               first create the venv and pip install -e '.[tpu]' in it, on every worker
  --python PY           interpreter --setup builds the venv from; jaxshare needs Python >= 3.11, newer than some
                        TPU VM images ship (default python3)
  --num-slices N        multi-slice: N slices of one queued resource (see below); adds mesh.dcn_data=N (default 1)
  --detach              start training under nohup with its output in <repo dir>/logs/<name>.log on each worker
                        and return; without it, closing the ssh session stops the run
  --dry-run             print the gcloud command; run nothing (gcloud need not be installed)
  -h, --help            this help
  -- OVERRIDES...       passed to train.py after the launcher's own, so they win (e.g. train.steps=500
                        "schedule.lisa.layers=[1,2]")

Mesh: mesh.fsdp=-1, every chip of a slice in one FSDP axis (override after --, e.g. mesh.data=16 mesh.fsdp=16).
Multi-slice (--num-slices N): create the slices as one queued resource, which is how Cloud TPU multislice is
provisioned and which sets MEGASCALE_* (coordinator, slice count and id) in every worker's TPU metadata, where libtpu
and JAX read them:
  gcloud compute tpus queued-resources create NAME --zone ZONE --accelerator-type v5litepod-256 \\
      --runtime-version v2-alpha-tpuv5-lite --node-count N --node-prefix NAME
The launcher then uses gcloud compute tpus queued-resources ssh NAME --node=all --worker=all and adds
mesh.dcn_data=N: data parallel across slices over the data-centre network, FSDP inside each slice.

Example, on a corpus prepared once into the bucket (python -m jaxshare.data prepare --out gs://my-bucket/data/web ...):
  $prog --bucket gs://my-bucket/jaxshare --run-name cla2_v5e --setup -- train.steps=20000 \\
      data.source=prepared data.path=gs://my-bucket/data/web
EOF
}

# shellcheck source=launch_common.sh
source "$repo_root/scripts/launch_common.sh"

# One word quoted for the local shell, readably: bare when safe, else in single quotes (the printed command is
# meant to be copied; %q's backslashes around a whole remote command would not be readable).
quote_local() {
  if [[ $1 =~ ^[A-Za-z0-9_@%+=:,./-]+$ ]]; then
    printf '%s' "$1"
  else
    printf "'%s'" "${1//\'/\'\"\'\"\'}"
  fi
}

# A directory for the worker's shell: a leading ~/ must stay unquoted to expand there.
remote_dir() {
  if [[ $1 == "~" ]]; then printf '~'
  elif [[ $1 == "~/"* ]]; then printf '~/%s' "$(printf '%q' "${1#"~/"}")"
  else printf '%q' "$1"
  fi
}

tpu=jaxshare-v5e-256
zone=us-west4-a
project=""
bucket=""
run_name=""
config=configs/experiments/pod_cla2.yaml
repo_dir=jaxshare
venv=.venv
setup=0
python=python3
num_slices=1
detach=0
dry_run=0

valued_flags=" --tpu --zone --project --bucket --run-name --config --repo-dir --venv --python --num-slices "
switch_flags=" --setup --detach --dry-run --help "

set_opt() {  # flag value
  case $1 in
    --tpu) tpu=$2 ;;
    --zone) zone=$2 ;;
    --project) project=$2 ;;
    --bucket) bucket=$2 ;;
    --run-name) run_name=$2 ;;
    --config) config=$2 ;;
    --repo-dir) repo_dir=$2 ;;
    --venv) venv=$2 ;;
    --python) python=$2 ;;
    --num-slices) num_slices=$2 ;;
  esac
}

set_switch() {
  case $1 in
    --setup) setup=1 ;;
    --detach) detach=1 ;;
    --dry-run) dry_run=1 ;;
  esac
}

parse_args "$@"

# gcloud resource names: lowercase letters, digits and hyphens.
[[ $tpu =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ ]] || die "--tpu must be a TPU name (lowercase letters, digits, '-'), got '$tpu'"
[[ $zone =~ ^[a-z]+-[a-z]+[0-9]+-[a-z]$ ]] || die "--zone must be a zone such as us-west4-a, got '$zone'"
[[ -z $project || $project =~ ^[a-z][-a-z0-9:.]*[a-z0-9]$ ]] || die "--project must be a project id, got '$project'"
[[ $num_slices =~ ^[1-9][0-9]*$ ]] || die "--num-slices must be a positive integer, got '$num_slices'"
if [[ -z $bucket ]]; then
  ((dry_run)) || die "--bucket is required: the run directory's parent on Cloud Storage, e.g. gs://my-bucket/jaxshare"
  bucket=gs://my-bucket/jaxshare
fi
# Each worker would write its own local directory: checkpoints need one place that every worker writes to.
[[ $bucket =~ ^gs://[a-z0-9][-a-z0-9_.]{1,220}[a-z0-9](/[^[:space:]]*)?$ ]] ||
  die "--bucket must be a gs://BUCKET[/PATH] that every worker can write to, got '$bucket'"
[[ -n $config ]] || die "--config must name an experiment YAML"
[[ -n $run_name ]] || run_name=$(config_run_name "$config")
[[ $run_name =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] ||
  die "--run-name must be letters, digits, '.', '_' or '-' (it names a directory), got '$run_name'"
[[ -n $repo_dir && $repo_dir != *$'\n'* ]] || die "--repo-dir must be a directory, got '$repo_dir'"
[[ -n $venv && $venv != *$'\n'* ]] || die "--venv must be a directory, got '$venv'"
[[ -n $python && $python != *[[:space:]]* ]] || die "--python must be an interpreter name or path, got '$python'"
# The workers hold a checkout of this repository; a config missing here is missing there, found before 64 ssh
# sessions start.
if [[ $config == /* ]]; then config_file=$config; else config_file=$repo_root/$config; fi
[[ -f $config_file ]] || die "--config: no such file: $config_file"

run_dir=${bucket%/}/$run_name
venv=${venv%/}
if [[ $venv == /* || $venv == "~/"* ]]; then venv_q=$(remote_dir "$venv"); else venv_q=$(printf '%q' "$venv"); fi

train_args=(train.py --config "$config" "train.run_dir=$run_dir" distributed.initialize=on mesh.fsdp=-1)
((num_slices == 1)) || train_args+=("mesh.dcn_data=$num_slices")
train_args+=(${overrides[@]+"${overrides[@]}"})

# The remote command, for the worker's login shell. distributed.initialize=on rather than auto: a TPU VM worker's ssh
# session has no TPU_WORKER_HOSTNAMES (GKE sets it); JAX's GCE detection reads the TPU metadata instead.
remote="cd $(remote_dir "$repo_dir")"
if ((setup)); then
  remote+=" && $(printf '%q' "$python") -m venv $venv_q && $venv_q/bin/pip install -q --upgrade pip"
  remote+=" && $venv_q/bin/pip install -q -e '.[tpu]'"
fi
run_train="$venv_q/bin/python $(join_q "${train_args[@]}")"
if ((detach)); then
  log=logs/$run_name.log
  remote+=" && mkdir -p logs && { nohup $run_train > $(printf '%q' "$log") 2>&1 < /dev/null & }"
  remote+=" && echo \"\$(hostname): training in the background, log $(printf '%q' "$log")\""
else
  remote+=" && $run_train"
fi

if ((num_slices == 1)); then
  cmd=(gcloud compute tpus tpu-vm ssh "$tpu" "--zone=$zone")
  [[ -z $project ]] || cmd+=("--project=$project")
  cmd+=(--worker=all "--command=$remote")
else
  # Every worker waits for all the others in jax.distributed.initialize, so all must run at once: gcloud's default
  # batch of 64 ssh sessions would hang with more workers (2 x v5e-256 has 128).
  cmd=(gcloud compute tpus queued-resources ssh "$tpu" "--zone=$zone")
  [[ -z $project ]] || cmd+=("--project=$project")
  cmd+=(--node=all --worker=all --batch-size=4096 "--command=$remote")
fi

if ((dry_run)); then
  line=""
  for w in "${cmd[@]}"; do
    if [[ $w =~ ^(--[a-z-]+=)(.*)$ ]]; then  # --command='...' reads better than '--command=...'
      line+="${line:+ }${BASH_REMATCH[1]}$(quote_local "${BASH_REMATCH[2]}")"
    else
      line+="${line:+ }$(quote_local "$w")"
    fi
  done
  printf '%s\n' "$line"
  exit 0
fi
command -v gcloud >/dev/null || die "gcloud not found on PATH: install the Google Cloud CLI (or use --dry-run)"
exec "${cmd[@]}"
