#!/usr/bin/env bash
# GPU: the long-context decode programs through the HTTP server. A preset server (Llama-3.1-8B shapes,
# random weights, fp8 + LM head, 8 slots, 4 steps per launch) with --long-context-decode on, then off;
# `bench serve` sends one request at a time (INPUT_LEN-token prompts, 64 tokens out) and reports TPOT.
# Each run writes $OUT/served_<on|off>.json and $OUT/served_<on|off>.log (the server's log).
#
#   INPUT_LEN=4096 NUM_PROMPTS=4 bash notebooks/gpu_long_context_served.sh
set -u
OUT=${OUT:-/tmp/out}
LEN=${INPUT_LEN:-4096}
PORT=${PORT:-8123}
mkdir -p "$OUT"
for mode in ${MODES:-on off}; do
  log="$OUT/served_$mode.log"
  python -m atlasjax.bench.preset_server --preset llama-3.1-8b --port "$PORT" --max-num-seqs 8 \
    --max-model-len $((LEN + 128)) --quantization fp8 --quantize-lm-head --num-scheduler-steps 4 \
    --long-context-decode "$mode" --compilation-cache /tmp/atlasjax_cc > "$log" 2>&1 &
  server=$!
  t0=$SECONDS
  until grep -q "ready on" "$log"; do
    kill -0 $server 2>/dev/null || { echo "server ($mode) exited:"; tail -20 "$log"; break; }
    sleep 1
  done
  echo "== served, long-context-decode=$mode: ready after $((SECONDS - t0)) s"
  python -m atlasjax.bench serve --base-url "http://127.0.0.1:$PORT" --preset llama-3.1-8b --no-ceilings \
    --input-len "$LEN" --output-len 64 --num-prompts "${NUM_PROMPTS:-4}" --max-concurrency 1 --num-warmups 1 \
    --no-warmup-buckets --output "$OUT/served_$mode.json" 2>&1 | grep -E "TPOT|TTFT|ITL|failed|Error|error" | head -8
  kill $server; wait $server 2>/dev/null
done
