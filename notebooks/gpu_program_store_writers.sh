#!/usr/bin/env bash
# Session 45, third call: do programs written by two processes load together on a GPU? An int4 1B preset:
# process 1 compiles and stores every step program; two entries are deleted; process 2 loads the rest and
# compiles (and stores) those two; process 3 loads all of them, from both writers. The three greedy
# fingerprints must agree. Then the same with one step per launch. Run from the repo root on the device.
set -u
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda PYTHONPATH=${PYTHONPATH:-}:.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for steps in 4 1; do
  cache=$(mktemp -d)
  for p in 1 2 3; do
    echo "== STEPS=$steps process $p" | tee -a "$OUT/writers.log"
    CACHE=$cache QUANT=int4 STEPS=$steps timeout 150 python3 notebooks/gpu_greedy_fingerprint.py 2>&1 \
      | grep -E "^fingerprint|^programs|Error|error" | cut -c1-160 | tee -a "$OUT/writers.log"
    if [ $p = 1 ]; then ls -t $cache/programs/*.program | head -2 | xargs rm -v | tee -a "$OUT/writers.log"; fi
  done
done
