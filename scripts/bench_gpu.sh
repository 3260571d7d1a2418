#!/usr/bin/env bash
# The GPU measurements in one command (issues 30 and 44, at most 9 minutes): the Triton kernels' values and gradients
# against the XLA reference, the attention kernels timed (Pallas vs cuDNN, packed and unpacked, vs XLA, fwd and
# fwd+bwd, full / K/V consumer / probability reuse, cuDNN's as attention over the source's Q and K) and the train-step
# MFU of the ~1B Llama and its CLA2 / MLKV / UniAttn variants with Pallas and with cuDNN (attention.impl=cudnn). Each
# part has a time limit so that one slow part leaves the others' figures. Logs go to $1 (default runs/bench_gpu).
#   bash scripts/bench_gpu.sh [OUT_DIR]
set -u
out=${1:-runs/bench_gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" \
  | tee -a "$out/device.txt"
timeout "${ATTN_LIMIT:-120}" $py scripts/bench_attention.py --lengths 1024 4096 --widths 64 128 --repeats 5 \
  2>&1 | grep -v "^WARNING\|Warning" | tee "$out/attention.txt"
timeout "${ATTN_LONG_LIMIT:-60}" $py scripts/bench_attention.py --lengths 16384 --widths 64 128 --repeats 3 \
  --impls pallas cudnn cudnn_unpacked --no-check 2>&1 | grep -v "^WARNING\|Warning" | tee "$out/attention_16k.txt"
timeout "${MFU_LIMIT:-300}" $py scripts/bench_mfu.py --schedules dense cla2 mlkv uniattn --impls pallas cudnn \
  2>&1 | grep -v "^WARNING\|Warning" | tee "$out/mfu.txt"
timeout "${MFU_XLA_LIMIT:-60}" $py scripts/bench_mfu.py --schedules dense --impls xla \
  2>&1 | grep -v "^WARNING\|Warning" | tee -a "$out/mfu.txt"
