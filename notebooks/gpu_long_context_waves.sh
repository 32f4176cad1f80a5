#!/usr/bin/env bash
# GPU: the long-context decode tiers of session 70 (more than one wave of context splits at 16k+ / 32k+ /
# 64k+ tokens, atlasjax/long_context_decode.py) against session 59's tiers, in the latency bench: Qwen3-8B
# shapes, bf16, random weights, yarn factor 4 (so 128k positions), prefill in 8k chunks. RUNS lists
# "batch:length:tiers" (tiers: new | old); each writes $OUT/waves_<tiers>_bs<B>_<len>.json.
#
#   RUNS="1:65536:new 4:65536:old 4:65536:new" bash notebooks/gpu_long_context_waves.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
YARN='{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
OLD_TIERS="((1, 1, 4096, 1), (1, 4, 1024, 2), (5, 6, 1024, 4), (7, 7, 2048, 5), (9, 10, 2048, 8), (17, 20, 2048, 8))"
for run in ${RUNS:-1:65536:new 1:130944:new 2:130944:old 2:130944:new 4:65536:old 4:65536:new}; do
  IFS=: read -r bs len tiers <<< "$run"
  echo "== qwen3-8b yarn bs=$bs input=$len tiers=$tiers"
  patch=""
  [ "$tiers" = old ] && patch="from atlasjax import long_context_decode as lcd; lcd.TIERS = $OLD_TIERS; "
  timeout 240 python -c "import sys; ${patch}from atlasjax.bench.__main__ import main; sys.exit(main(sys.argv[1:]))" \
    latency --preset qwen3-8b --hf-overrides "$YARN" --input-len "$len" --output-len 64 --num-iters 1 \
    --batch-size "$bs" --max-model-len $((len + 128)) --max-num-batched-tokens 8192 \
    --compilation-cache /tmp/atlasjax_cc --output "$OUT/waves_${tiers}_bs${bs}_${len}.json" 2>&1 \
    | grep -E "TPOT \(|TTFT  |rror" | head -4
done
