#!/bin/bash
# Session 51: int8 activations (W8A8 int8) on an H100. The product at decode-batch and prefill row
# counts (int8 x int8 on the int8 tensor cores, against the bf16 dot and the engine's W8A16 int8 path),
# then the 8B's 2,048-token prefill (TTFT) with int8 weights and int8 activations against bf16, and
# int8 weights alone against bf16, each pair in one process.
#   bash notebooks/gpu_session51_w8a8_int8.sh     # -> $OUT/*.json, $OUT/*.log
set -u
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
FORMAT=int8 ROWS=${ROWS:-64,128,256,2048} VARIANTS=bf16,engine_auto,w8a8_lib,w8a8_mma \
    timeout 220 python notebooks/gpu_w8a8_probe.py 2>&1 | grep -v "^W\|^I0" | tail -20
B="python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 8 --batch-size 1 --num-iters 3"
for acts in "--activation-quantization int8" ""; do
    tag=$([ -n "$acts" ] && echo w8a8 || echo w8a16)
    timeout 180 $B --quantization int8 $acts --compare-quantization none --output $OUT/ttft_int8_$tag.json \
        > $OUT/ttft_int8_$tag.log 2>&1
    echo "== $tag rc=$?"; grep -A8 "quantization" $OUT/ttft_int8_$tag.log | tail -12
done
