#!/bin/bash
# Session 67, last device run: LoRA (tests/test_lora.py in float32, and `bench latency` 8B bf16 with and without LoRA
# slots), then notebooks/gpu_spec_equality.py. It ran on a variant, since reverted, that stacked each projection
# kind's LoRA arrays over the layers (docs/performance.md, session 67); main keeps them per layer.
#   bash notebooks/gpu_session67_final.sh     # on nvidia-h200
set -u
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=${PYTHONPATH:-}:/tmp/site; fi
export JAX_PLATFORMS=cuda PYTHONPATH=.:${PYTHONPATH:-} PYTHONUNBUFFERED=1
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "mixes or per_adapter or beam" 2>&1 | grep -E "passed|failed|Error|assert" | tail -8
for run in "bs1_base 1" "bs1_lora1 1 --enable-lora" "bs1_lora4 1 --enable-lora --max-loras 4" "bs8_lora4 8 --enable-lora --max-loras 4"; do
    set -- $run
    name=lora_$1; bs=$2; shift 2
    timeout 110 python3 -m atlasjax.bench latency --preset llama-3.1-8b --batch-size $bs --input-len 128 --output-len 128 \
        --num-iters 3 --num-warmup 1 "$@" > /tmp/$name.log 2>&1
    echo "== $name rc=$?"; grep -E "^TPOT|host work|waiting for" /tmp/$name.log
done
timeout 150 python3 notebooks/gpu_spec_equality.py 2>&1 | grep -E "equal|Error" | tail -6
