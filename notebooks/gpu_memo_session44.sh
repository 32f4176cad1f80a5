#!/usr/bin/env bash
# Session 44: is the kernel lowering memo safe and what does it buy? (one device call)
# 1. greedy fingerprints of a 1B preset, int4 and bf16, memo off and on (must match);
# 2. an int4 8B server started twice on one compilation cache with the memo on (ready times);
# 3. every memo answer of an int4 8B warm-up against a fresh lowering (notebooks/gpu_lowering_memo_check.py).
# Run from the repo root on the device: bash notebooks/gpu_memo_session44.sh  (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=${PYTHONPATH:-}:.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/fingerprints.log"
python3 -c 'import jax, flax; print("jax", jax.__version__, "flax", flax.__version__)' | tee -a "$OUT/fingerprints.log"
for q in int4 ""; do
  for memo in off on; do
    echo "== QUANT=${q:-bf16} memo=$memo" | tee -a "$OUT/fingerprints.log"
    ATLASJAX_KERNEL_LOWERING_MEMO=$memo QUANT=$q timeout 120 python3 notebooks/gpu_greedy_fingerprint.py 2>&1 \
      | grep -E "fingerprint|Error|error" | tee -a "$OUT/fingerprints.log"
  done
done
ATLASJAX_KERNEL_LOWERING_MEMO=on TAG=memo_ PRESET=llama-3.1-8b QUANT=int4 STARTS=2 \
  timeout 330 python3 notebooks/serve_restart.py 2>&1 | tail -5
PRESET=llama-3.1-8b QUANT=int4 timeout 150 python3 notebooks/gpu_lowering_memo_check.py > "$OUT/memo_check.log" 2>&1
tail -30 "$OUT/memo_check.log"
