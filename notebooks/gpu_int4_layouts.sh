#!/usr/bin/env bash
# Session 47: int4 quantized at load with other groups or without zero points (--quantization-group-size,
# --quantization-symmetric), bs=1 decode step on the Llama-3.1-8B preset, one process per layout.
# Run from the repo root on the device: bash notebooks/gpu_int4_layouts.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; i=0
for flags in "" "--quantization-group-size 64" "--quantization-group-size 32" "--quantization-symmetric" \
             "--quantization-group-size 32 --quantization-symmetric"; do
  i=$((i + 1))
  echo "== int4 $flags"
  timeout 150 python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 128 --output-len 128 --num-iters 2 \
    --batch-size 1 --num-scheduler-steps 4 --quantize-lm-head --quantization int4 $flags --output "$OUT/int4_$i.json" \
    2>&1 | grep -E "TPOT \(per" | head -2
  python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['settings']['weights'])" "$OUT/int4_$i.json" 2>&1 | tail -1
done
