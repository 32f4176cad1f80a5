#!/bin/bash
# Session 65: `bench embed` (a pooling runner) on Qwen3-Embedding-0.6B and Qwen3-8B shapes at 512 inputs of
# 512 +- 50% tokens with 8,192 (the default), 16,384 and 32,768 tokens per batch; then a served pooling
# runner's start: its embedding batch sizes compiled at start (0.6B shapes, max_model_len 8,192).
#   bash notebooks/gpu_session65_embed_budget.sh     # on nvidia-h200 -> $OUT/budget_*.json
#   SERVED_ONLY=1 [EXTRA=--engine-process] bash notebooks/gpu_session65_embed_budget.sh     # the served runner alone
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
[ -n "${SERVED_ONLY:-}" ] || for run in "qwen3-embedding-0.6b 8192" "qwen3-embedding-0.6b 16384" "qwen3-embedding-0.6b 32768" "qwen3-8b 8192" "qwen3-8b 16384"; do
    set -- $run
    name=budget_$1_$2
    timeout 120 python3 -m atlasjax.bench embed --preset $1 --num-prompts 512 --input-len 512 --range-ratio 0.5 \
        --max-model-len 2048 --max-num-batched-tokens $2 --num-iters 3 --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "tokens/s|pass \(|batches per|first pass|achieved FLOP" $OUT/$name.log
done
# a served pooling runner (0.6B shapes): time to ready, then concurrent single-input requests
t0=$(date +%s)
python3 -m atlasjax.bench.preset_server --preset qwen3-embedding-0.6b --runner pooling --max-model-len 8192 \
    --port 8123 ${EXTRA:-} > $OUT/served.log 2>&1 &
for i in $(seq 1 240); do grep -q "ready on" $OUT/served.log && break; sleep 0.5; done
echo "== served pooling runner ready after $(( $(date +%s) - t0 )) s"; tail -3 $OUT/served.log
for c in 1 16 64; do
    timeout 120 python3 notebooks/gpu_embed_served.py http://127.0.0.1:8123 --concurrency $c --requests $((c * 16 + 32)) \
        --input-len 256 --output $OUT/served_c$c.json | grep -E "requests_per_s|tokens_per_s|latency_ms_p50|latency_ms_p99"
done
# per-request cost apart: base64 answers, and 16 inputs per request
timeout 120 python3 notebooks/gpu_embed_served.py http://127.0.0.1:8123 --concurrency 64 --requests 1056 \
    --input-len 256 --encoding-format base64 --output $OUT/served_c64_b64.json | grep -E "requests_per_s|tokens_per_s|latency_ms_p50"
timeout 120 python3 notebooks/gpu_embed_served.py http://127.0.0.1:8123 --concurrency 16 --requests 96 --inputs 16 \
    --input-len 256 --output $OUT/served_c16_x16.json | grep -E "requests_per_s|tokens_per_s|latency_ms_p50"
kill %1; wait
