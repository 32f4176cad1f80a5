#!/usr/bin/env bash
# Session 48, last call: over fp8 pools the RoPE decode entry converts q to f16 in the kernel (no XLA
# conversion of the projections before it): native tests, then the int4 8B decode step at one
# sequence (bf16 and fp8 KV) and at 64 sequences (fp8 KV), 1,024-token prompts.
# Run from the repo root on the device: bash notebooks/gpu_session48_q_in_kernel.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "== native tests"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_fp8_kv_cache.py \
  "tests/test_paged_attention.py::test_rope_write_kernel_gpu" 2>&1 | tail -3
bench() {  # name, then the bench's flags
  local name=$1; shift
  echo "== $name"
  timeout 100 python3 -m atlasjax.bench latency --preset llama-3.1-8b --num-scheduler-steps 4 --quantize-lm-head \
    --quantization int4 --output "$OUT/$name.json" "$@" 2>&1 | grep -E "TPOT \(per|decode tok/s|Error|error" | head -3
}
bench kv_auto_bs1 --batch-size 1 --input-len 1024 --output-len 128 --num-iters 2
bench kv_fp8_bs1 --batch-size 1 --input-len 1024 --output-len 128 --num-iters 2 --kv-cache-dtype fp8
bench kv_fp8_bs64 --batch-size 64 --input-len 1024 --output-len 64 --num-iters 2 --kv-cache-dtype fp8
