#!/usr/bin/env bash
# The GPU measurements in one command (issues 30, 44 and 61, at most 10.5 minutes): the Triton kernels' and cuDNN's values
# and gradients against the XLA reference (cuDNN's with Q/K wider than V too, as a bf16 LISA_plus chain); the
# attention kernels timed per role (full / K/V consumer / probability reuse, fwd and fwd+bwd) for Pallas, cuDNN (one
# document per row, as training runs it; at 16k also with the packed layout and jax's public cuDNN attention) and XLA
# at T = 1k, 4k, 16k and d = 64, 128; and the train step of the ~1.2B Llama and its CLA2 / MLKV / UniAttn / LISA_plus
# variants (LISA_plus's chain in float32 and in bf16, attention.chain_dtype=compute) with attention.impl=auto (cuDNN)
# at T = 2048 and T = 8192, and dense with pallas at both for the ratio; the long-context step at T = 32k of dense and
# CLA2 with model.remat=full and the LM loss over 8 vocabulary tiles (one sequence, as
# configs/experiments/llama_1b_long_context.yaml trains). Each part has a time limit so that one slow
# part leaves the others' figures (on an H200 a correctness check and its timings did not fit in 130 s together).
# Logs go to $1 (default runs/bench_gpu).
#   bash scripts/bench_gpu.sh [OUT_DIR]
set -u
out=${1:-runs/bench_gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
quiet() { grep -v "^W1\|^WARNING\|Warning\|fragmentation\|allocation summary"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
$py -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, jax.devices())" \
  | tee -a "$out/device.txt"
timeout "${CHECK_LIMIT:-120}" $py scripts/bench_attention.py --check-only 2>&1 | quiet | tee "$out/check.txt"
timeout "${ATTN_LIMIT:-80}" $py scripts/bench_attention.py --lengths 1024 4096 --widths 64 128 --repeats 3 \
  --impls pallas cudnn xla_reference --no-check 2>&1 | quiet | tee "$out/attention.txt"
timeout "${ATTN_LONG_LIMIT:-50}" $py scripts/bench_attention.py --lengths 16384 --widths 64 128 --repeats 2 \
  --impls pallas cudnn cudnn_packed cudnn_unpacked --no-check 2>&1 | quiet | tee "$out/attention_16k.txt"
timeout "${MFU_LIMIT:-140}" $py scripts/bench_mfu.py --schedules dense lisa_plus_bf16 uniattn mlkv cla2 lisa_plus \
  --impls auto --steps 3 --batch 8 --seq-len 2048 2>&1 | quiet | tee "$out/mfu_2k.txt"
timeout "${MFU_LONG_LIMIT:-110}" $py scripts/bench_mfu.py --schedules dense uniattn mlkv lisa_plus_bf16 cla2 \
  --impls auto --steps 3 --batch 2 --seq-len 8192 2>&1 | quiet | tee "$out/mfu_8k.txt"
timeout "${MFU_PALLAS_LIMIT:-40}" $py scripts/bench_mfu.py --schedules dense --impls pallas --steps 3 --batch 8 \
  --seq-len 2048 2>&1 | quiet | tee "$out/mfu_pallas.txt"
timeout "${MFU_32K_LIMIT:-90}" $py scripts/bench_mfu.py --schedules dense cla2 --impls auto --steps 3 --batch 1 \
  --seq-len 32768 model.remat=full train.num_vocab_tiling=8 2>&1 | quiet | tee "$out/mfu_32k_remat.txt"
