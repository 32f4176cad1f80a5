#!/usr/bin/env bash
# Session 48, third call: the decode kernel rotating the new K and writing fp8 rows itself (the RoPE
# entry over fp8 pools), natively; then the int4 8B decode step over bf16 and fp8 KV caches at 64
# sequences of 1,024-token prompts and at one sequence, one machine.
# Run from the repo root on the device: bash notebooks/gpu_session48_fp8_write.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== native tests"
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv_cache.py 2>&1 | tail -3
bench() {  # name, then the bench's flags
  local name=$1; shift
  echo "== $name"
  timeout 150 python3 -m atlasjax.bench latency --preset llama-3.1-8b --num-scheduler-steps 4 --quantize-lm-head \
    --quantization int4 --output "$OUT/$name.json" "$@" 2>&1 | grep -E "TPOT \(per|decode tok/s|Error|error" | head -3
}
bench kv_auto_bs64 --batch-size 64 --input-len 1024 --output-len 64 --num-iters 2
bench kv_fp8_bs64 --batch-size 64 --input-len 1024 --output-len 64 --num-iters 2 --kv-cache-dtype fp8
bench kv_auto_bs1 --batch-size 1 --input-len 1024 --output-len 128 --num-iters 2
bench kv_fp8_bs1 --batch-size 1 --input-len 1024 --output-len 128 --num-iters 2 --kv-cache-dtype fp8
