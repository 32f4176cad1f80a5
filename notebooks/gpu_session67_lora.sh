#!/bin/bash
# Session 67, LoRA adapters: tests/test_lora.py on the GPU, then `bench latency` on Llama-3.1-8B shapes (bf16,
# random weights, random 128-token prompts, 128 out) at batch 1 and 8: without LoRA, and with LoRA slots
# (--enable-lora: every step computes each slot's LoRA term, masked per token, so base-model requests cost what
# adapters cost) for 1 and 4 slots of rank 16.
#   bash notebooks/gpu_session67_lora.sh     # on nvidia-h200 -> $OUT/lora_*.json
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mixes or per_adapter" 2>&1 | tail -4
runs=("bs1_base 1" "bs1_lora1 1 --enable-lora" "bs1_lora4 1 --enable-lora --max-loras 4"
      "bs8_base 8" "bs8_lora1 8 --enable-lora" "bs8_lora4 8 --enable-lora --max-loras 4")
for run in "${runs[@]}"; do
    set -- $run
    name=lora_$1; bs=$2; shift 2
    timeout 150 python3 -m atlasjax.bench latency --preset llama-3.1-8b --batch-size $bs --input-len 128 --output-len 128 \
        --num-iters 3 --num-warmup 1 "$@" --output $OUT/$name.json > $OUT/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^TTFT|^TPOT|host work|waiting for" $OUT/$name.log
done
