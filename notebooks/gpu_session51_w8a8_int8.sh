#!/bin/bash
# Session 51: int8 activations (W8A8 int8) on an H100.
#   STAGE=probe: the product at decode-batch and prefill row counts (int8 x int8 on the int8 tensor
#     cores, against the bf16 dot and the engine's W8A16 int8 path);
#   STAGE=ttft: the 8B's 2,048-token prefill (TTFT) with int8 weights and int8 activations against
#     bf16, and int8 weights alone against bf16, each pair in one process;
#   STAGE=throughput: offline throughput, 1,024 x 128 in / 128 out, 256 sequences, int8 + LM head W8A8.
#   STAGE=ttft bash notebooks/gpu_session51_w8a8_int8.sh     # -> $OUT/*.json, $OUT/*.log
# (notebooks/gpu_int8_gemm_probe.py measured the forms of the int8 product itself.)
set -u
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
case ${STAGE:-ttft} in
probe)
    FORMAT=int8 ROWS=${ROWS:-64,128,256,2048} VARIANTS=bf16,engine_auto,w8a8_lib,w8a8_mma \
        timeout 220 python notebooks/gpu_w8a8_probe.py 2>&1 | grep -v "^W\|^I0" | tail -20 ;;
ttft)
    B="python -m atlasjax.bench latency --preset llama-3.1-8b --input-len 2048 --output-len 8 --batch-size 1 --num-iters 3"
    for acts in "--activation-quantization int8" ""; do
        tag=$([ -n "$acts" ] && echo w8a8 || echo w8a16)
        timeout 180 $B --quantization int8 $acts --compare-quantization none --output $OUT/ttft_int8_$tag.json \
            > $OUT/ttft_int8_$tag.log 2>&1
        echo "== $tag rc=$?"; grep -A5 "weight formats" $OUT/ttft_int8_$tag.log
    done ;;
throughput)
    timeout 560 python -m atlasjax.bench throughput --preset llama-3.1-8b --num-prompts 1024 --input-len 128 \
        --output-len 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --quantization int8 --quantize-lm-head \
        --activation-quantization int8 --output $OUT/throughput_int8_w8a8.json > $OUT/throughput_int8_w8a8.log 2>&1
    echo "== rc=$?"; grep -v "^W\|^I0" $OUT/throughput_int8_w8a8.log | tail -25 ;;
esac
