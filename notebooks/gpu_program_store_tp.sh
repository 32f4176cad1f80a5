#!/usr/bin/env bash
# Session 45, fourth call (2 GPUs): a tensor-parallel engine restarted on the program store. A bf16 1B preset
# at TP=2: process 1 compiles and stores, process 2 loads; their greedy fingerprints must agree.
# Run from the repo root on a 2-GPU device: bash notebooks/gpu_program_store_tp.sh  (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=${PYTHONPATH:-}:.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/tp.log"
cache=$(mktemp -d)
for p in 1 2; do
  echo "== TP=2 process $p" | tee -a "$OUT/tp.log"
  /usr/bin/time -f "wall %e s" env CACHE=$cache TP=2 STEPS=4 timeout 200 python3 notebooks/gpu_greedy_fingerprint.py 2>&1 \
    | grep -E "^fingerprint|^programs|Error|error|^wall" | cut -c1-160 | tee -a "$OUT/tp.log"
done
