#!/usr/bin/env bash
# Session 45, second call: the program store's loads in the warm-up threads. An int4 8B server started twice
# on one cache (cold, then restarted on the store); the restart answers a short load (bench serve). Also
# prints where `python -m atlasjax` puts its compilation cache on this GPU machine by default.
# Run from the repo root on the device: bash notebooks/gpu_program_store_loads.sh  (writes under $OUT)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -c 'from atlasjax import compile_cache as c; print("gpu expected:", c.gpu_expected(), "default cache:", c.resolve(None, default_on_gpu=True))'
export JAX_PLATFORMS=cuda
PRESET=llama-3.1-8b QUANT=int4 STARTS=2 TAG=loads_ timeout 330 python3 notebooks/serve_restart.py 2>&1 | tail -3
