#!/usr/bin/env bash
# GPU (2 devices): what prefix-affinity routing is for. Two replicas of the 8B preset (bf16, random weights,
# `--data-parallel-size 2`), once per routing rule; `bench serve` sends prompts behind NUM_PREFIXES shared
# prefixes of PREFIX_LEN tokens (each prompt's drawn at random). Writes $OUT/routing_<rule>.json and the server
# logs (SERVER_FLAGS=-v logs the KV pool's size among every compile).
#
#   [PREFIX_LEN=4096 NUM_PREFIXES=200 NUM_PROMPTS=800] bash notebooks/gpu_data_parallel_routing.sh
set -u
OUT=${OUT:-/tmp/out}
P=${PREFIX_LEN:-4096}
G=${NUM_PREFIXES:-200}
PORT=${PORT:-8126}
mkdir -p "$OUT"
for rule in ${RULES:-prefix least-loaded}; do
  log="$OUT/routing_$rule.log"
  python -m atlasjax.bench.preset_server --preset llama-3.1-8b --port "$PORT" --max-num-seqs 64 \
    --max-model-len $((P + 256)) --num-scheduler-steps 4 --data-parallel-size 2 --data-parallel-routing "$rule" \
    --compilation-cache /tmp/atlasjax_cc ${SERVER_FLAGS:-} > "$log" 2>&1 &
  server=$!
  t0=$SECONDS
  until grep -q "ready on" "$log"; do
    kill -0 $server 2>/dev/null || { echo "server ($rule) exited:"; tail -20 "$log"; break; }
    sleep 1
  done
  echo "== routing $rule: ready after $((SECONDS - t0)) s"
  python -m atlasjax.bench serve --base-url "http://127.0.0.1:$PORT" --preset llama-3.1-8b --no-ceilings \
    --prefix-len "$P" --num-prefixes "$G" --input-len 64 --output-len 64 --num-prompts "${NUM_PROMPTS:-800}" \
    --max-concurrency 128 --num-warmups 2 --output "$OUT/routing_$rule.json" 2>&1 \
    | grep -E "TPOT|TTFT|throughput|failed|duration|Error|error" | head -8
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^atlasjax_(prefix_cache_hit_rate|num_preemptions_total|engine_generation_tokens_total)' || true
  kill $server; wait $server 2>/dev/null
done
