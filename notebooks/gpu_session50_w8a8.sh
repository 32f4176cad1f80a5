#!/bin/bash
# Session 50: fp8 activations (W8A8) on an H100. The product at decode-batch and prefill row counts,
# then the 8B's 2,048-token prefill (TTFT) with fp8 weights and fp8 activations against bf16, and fp8
# weights alone against bf16, each pair in one process.
#   bash notebooks/gpu_session50_w8a8.sh     # -> $OUT/*.json, $OUT/*.log
set -u
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
ROWS=${ROWS:-64,128,256,1024} VARIANTS=bf16,engine_auto,w8a8_bf16 timeout 200 python notebooks/gpu_w8a8_probe.py \
    2>&1 | grep -v "^W\|^I0" | tail -20
B="python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 8 --batch-size 1 --num-iters 3"
for acts in "--activation-quantization fp8" ""; do
    tag=$([ -n "$acts" ] && echo w8a8 || echo w8a16)
    timeout 200 $B --quantization fp8 $acts --compare-quantization none --output $OUT/ttft_$tag.json \
        > $OUT/ttft_$tag.log 2>&1
    echo "== $tag rc=$?"; grep -A8 "quantization" $OUT/ttft_$tag.log | tail -12
done
