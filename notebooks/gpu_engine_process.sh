#!/usr/bin/env bash
# Session 46: the engine in a process of its own (`serve --engine-process`) against the engine thread. An int4 8B
# server (64 slots) started three times on one compilation cache (thread, process, thread: only the first
# compiles), `bench serve` at concurrency 1, 16 and 64 (128 in / 128 out) against each start.
# Run from the repo root on the device: bash notebooks/gpu_engine_process.sh [server flags]  (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:. JAX_PLATFORMS=cuda
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
PRESET=llama-3.1-8b QUANT=int4 ORDER=${ORDER:-thread,process,thread} C=${C:-1,16,64} \
  timeout ${LIMIT:-540} python3 notebooks/serve_engine_process.py "$@" 2>&1 | tail -40
