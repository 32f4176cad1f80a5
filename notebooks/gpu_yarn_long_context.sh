#!/usr/bin/env bash
# GPU: yarn (through --hf-overrides) on the kernels against HF (notebooks/gpu_yarn_check.py), then a lone
# request's decode at long contexts: Qwen3-8B shapes, bf16, random weights, yarn factor 4 over 32k (the model
# card's setting), prefill in 8k chunks. Each length writes $OUT/qwen3_yarn_<len>.json.
#
#   LENS="32768 65536 130944" bash notebooks/gpu_yarn_long_context.sh
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ "${CHECK:-1}" = 1 ] && timeout 240 python notebooks/gpu_yarn_check.py 2>&1 | grep -E "^(yarn|no yarn)|Error|error" | head -8
YARN='{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}'
for len in ${LENS:-32768 65536 130944}; do
  echo "== qwen3-8b yarn bs=1 input=$len"
  timeout 300 python -m atlasjax.bench latency --preset qwen3-8b --hf-overrides "$YARN" --input-len "$len" \
    --output-len 64 --num-iters 1 --batch-size 1 --max-model-len $((len + 128)) --max-num-batched-tokens 8192 \
    --compilation-cache /tmp/atlasjax_cc --output "$OUT/qwen3_yarn_${len}.json" 2>&1 \
    | grep -E "TPOT|TTFT|prefill: time|tok/s|rror" | head -8
done
