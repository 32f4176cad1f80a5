#!/usr/bin/env bash
# Session 47: what keeps a served int4 8B step at C = 64 above the latency bench's step at 64 rows? The
# prediction is the prefills of arriving requests. One server (64 slots, 4 steps per launch), `bench serve` at
# concurrency 64 with 128-token and 8-token prompts (128 out); then the latency bench at 64 rows on the
# same machine. Run from the repo root on the device: bash notebooks/gpu_served_prefill_cost.sh (writes $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PRESET=llama-3.1-8b QUANT=int4 ORDER=thread C=64 INPUT_LEN=128,8 ROUNDS=${ROUNDS:-4} \
  timeout ${LIMIT:-330} python3 notebooks/serve_engine_process.py 2>&1 | tail -12
timeout ${BENCH_LIMIT:-200} python3 -m atlasjax.bench latency --preset llama-3.1-8b --input-len 128 --output-len 32 \
  --num-iters 2 --num-scheduler-steps 4 --batch-size 64 --quantization int4 2>&1 | tail -8
