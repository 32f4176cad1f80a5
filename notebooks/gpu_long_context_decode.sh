#!/usr/bin/env bash
# GPU: the long-context decode program (atlasjax/long_context_decode.py) against the default one, in
# the latency bench: Llama-3.1-8B shapes, random weights, 4 steps per launch, LM head quantized.
# For each batch size and prompt length, one run with --long-context-decode off, one with on; each
# writes $OUT/<quant>_bs<B>_<len>_<off|on>.json. A shared compilation cache lets the second run load
# the programs both have.
#
#   QUANT=fp8 BATCHES="1 2" LENS="4096" OUTPUT_LEN=64 [MAX_NUM_SEQS=16] bash notebooks/gpu_long_context_decode.sh
# (MAX_NUM_SEQS: the engine's slots, so its decode buckets are a server's: 8, 16, ...; default the batch size)
set -u
OUT=${OUT:-/tmp/out}
QUANT=${QUANT:-fp8}
mkdir -p "$OUT"
quant_args="--quantization $QUANT --quantize-lm-head"
[ "$QUANT" = none ] && quant_args=""
for len in ${LENS:-4096}; do
  for bs in ${BATCHES:-1 2}; do
    for mode in off on; do
      echo "== $QUANT bs=$bs input=$len long-context-decode=$mode"
      python -m atlasjax.bench latency --preset llama-3.1-8b --input-len "$len" --output-len "${OUTPUT_LEN:-64}" \
        --num-iters 2 --batch-size "$bs" --num-scheduler-steps 4 $quant_args \
        --max-model-len $((len + 128)) --long-context-decode "$mode" --compilation-cache /tmp/atlasjax_cc \
        ${MAX_NUM_SEQS:+--max-num-seqs $MAX_NUM_SEQS} \
        --output "$OUT/${QUANT}_bs${bs}_${len}_${mode}.json" 2>&1 | grep -E "TPOT|TTFT|tok/s|Error|error" | head -8
    done
  done
done
