#!/usr/bin/env bash
# Session 45: the program store on a GPU (one device call).
# 1. int4 and bf16 1B greedy fingerprints: a start that compiles and stores its programs, a restart that loads
#    them, and a restart with the store off (jax's cache only); the first two must agree bit for bit;
# 2. an int4 8B server started three times on one cache: cold, restarted with the store, restarted without.
# Run from the repo root on the device: bash notebooks/gpu_program_store_session45.sh  (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=${PYTHONPATH:-}:.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/fingerprints.log"
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)' | tee -a "$OUT/fingerprints.log"
for q in int4 ""; do
  cache=$(mktemp -d)
  for store in on on off; do
    echo "== QUANT=${q:-bf16} store=$store" | tee -a "$OUT/fingerprints.log"
    /usr/bin/time -f "wall %e s" env ATLASJAX_PROGRAM_STORE=$store CACHE=$cache QUANT=$q STEPS=4 \
      timeout 150 python3 notebooks/gpu_greedy_fingerprint.py 2>&1 \
      | grep -E "^fingerprint|^programs|Error|error|^wall" | tee -a "$OUT/fingerprints.log"
  done
done
PRESET=llama-3.1-8b QUANT=int4 STARTS=3 STORE_OFF_STARTS=2 TAG=store_ \
  timeout 420 python3 notebooks/serve_restart.py 2>&1 | tail -5
