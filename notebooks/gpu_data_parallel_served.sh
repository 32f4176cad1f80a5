#!/usr/bin/env bash
# GPU (2 devices): data parallelism through the HTTP server. A preset server (Llama-3.1-8B shapes, random
# bf16 weights, 64 slots per replica, 4 steps per launch) with one replica, then with two
# (`--data-parallel-size 2`, one GPU each); `bench serve` sends 256 prompts per replica at 64 in flight per
# replica (IN in / OUT_LEN out), then 8 prompts one at a time. Writes $OUT/dp<N>_<load>.json and the server
# logs $OUT/dp<N>.log.
#
#   IN=512 OUT_LEN=512 bash notebooks/gpu_data_parallel_served.sh
set -u
OUT=${OUT:-/tmp/out}
IN=${IN:-512}
OUT_LEN=${OUT_LEN:-512}
PORT=${PORT:-8124}
mkdir -p "$OUT"
for dp in ${SIZES:-1 2}; do
  log="$OUT/dp$dp.log"
  python -m atlasjax.bench.preset_server --preset llama-3.1-8b --port "$PORT" --max-num-seqs 64 \
    --max-model-len $((IN + OUT_LEN + 64)) --num-scheduler-steps 4 --data-parallel-size "$dp" \
    --compilation-cache /tmp/atlasjax_cc > "$log" 2>&1 &
  server=$!
  t0=$SECONDS
  until grep -q "ready on" "$log"; do
    kill -0 $server 2>/dev/null || { echo "server (dp=$dp) exited:"; tail -20 "$log"; break; }
    sleep 1
  done
  echo "== data-parallel-size $dp: ready after $((SECONDS - t0)) s"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader
  python -m atlasjax.bench serve --base-url "http://127.0.0.1:$PORT" --preset llama-3.1-8b --no-ceilings \
    --input-len "$IN" --output-len "$OUT_LEN" --num-prompts $((256 * dp)) --max-concurrency $((64 * dp)) \
    --num-warmups 2 --output "$OUT/dp${dp}_load.json" 2>&1 | grep -E "TPOT|TTFT|throughput|failed|Error|error" | head -8
  python -m atlasjax.bench serve --base-url "http://127.0.0.1:$PORT" --preset llama-3.1-8b --no-ceilings \
    --input-len "$IN" --output-len 128 --num-prompts 8 --max-concurrency 1 --num-warmups 1 --no-warmup-buckets \
    --output "$OUT/dp${dp}_single.json" 2>&1 | grep -E "TPOT|TTFT|failed|Error|error" | head -4
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^atlasjax_engine_generation_tokens_total' || true
  kill $server; wait $server 2>/dev/null
done
